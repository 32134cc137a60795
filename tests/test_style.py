"""The code's style as pyproject.toml declares it, held by the test run (and so by CI): ruff's lint rules
pass; no file gains a line over the 110 columns (tests/long_lines.json counts the ones that predate
the limit's enforcement, and may only go down: tools/long_lines.py --write records a file's progress);
no module of moe_rl is over 500 lines."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from long_lines import BASELINE, counts  # noqa: E402

RUFF = Path(sys.executable).parent / "ruff"


def test_ruff_lint_rules_pass():
    proc = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_file_gains_a_line_over_110_columns():
    now, allowed = counts(), json.loads(BASELINE.read_text())
    grown = {f: f"{n} (allowed {allowed.get(f, 0)})" for f, n in now.items() if n > allowed.get(f, 0)}
    assert not grown, f"lines over 110 columns: {grown}; shorten them (ruff check --select E501 FILE)"
    shrunk = {f: f"{now.get(f, 0)} (recorded {n})" for f, n in allowed.items() if now.get(f, 0) < n}
    assert not shrunk, f"fewer long lines than recorded in {shrunk}: python tools/long_lines.py --write"


def test_no_module_is_over_500_lines():
    long = {str(f.relative_to(ROOT)): n for f in sorted((ROOT / "moe_rl").rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 500}
    assert not long, f"split these modules: {long}"
