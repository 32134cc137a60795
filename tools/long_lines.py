"""Lines over the declared line length (pyproject.toml: 110), per file, as ruff counts them (E501).

    python tools/long_lines.py            # the counts, as JSON
    python tools/long_lines.py --write    # into tests/long_lines.json, the ratchet tests/test_style.py holds

The codebase predates the limit's enforcement; the ratchet lets no file gain a long line and records each
one it loses (the file is rewritten by --write after lines are shortened)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "long_lines.json"


def counts() -> dict[str, int]:
    """{file: lines over the limit} for every Python file ruff checks."""
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "check", "--select", "E501", "--output-format", "concise", "--no-cache",
                          "."], cwd=ROOT, capture_output=True, text=True).stdout
    files = Counter(line.split(":", 1)[0] for line in out.splitlines() if ":" in line and "E501" in line)
    return dict(sorted(files.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write the counts to {BASELINE.relative_to(ROOT)}")
    args = ap.parse_args()
    found = counts()
    text = json.dumps(found, indent=1) + "\n"
    if args.write:
        BASELINE.write_text(text)
        print(f"{sum(found.values())} long lines in {len(found)} files -> {BASELINE.relative_to(ROOT)}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
