"""The test files' measured durations, which `make test` uses to hand the longest files out first.

    .venv/bin/python tools/suite_durations.py JUNIT.xml [--write]

JUNIT.xml: a run's report (`make test PYTEST_ARGS=--junitxml=JUNIT.xml`, as CI runs it). Prints each
file's seconds (the sum of its tests' setup, call and teardown), the total, and when each of the two
workers would finish if the files were handed out longest first, each to the worker free first (what
pytest-xdist's --dist loadfile does with the order tests/conftest.py gives it). --write stores the
seconds in tests/durations.json, which tests/conftest.py reads.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"


def test_file(classname: str, root: Path) -> str:
    """'tests.train.test_models' or 'tests.test_x.TestClass' -> 'tests/train/test_models.py'."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (root / path).is_file():
            return path
    raise ValueError(f"no test file under {root} for the junit class {classname!r}")


def file_durations(junit: Path, root: Path = ROOT) -> dict[str, float]:
    """{test file: seconds}, longest first."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = test_file(case.get("classname", ""), root)
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0.0))
    return {p: round(s, 1) for p, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def finish_times(seconds: list[float], workers: int = 2) -> list[float]:
    """When each worker finishes when the durations are handed out in this order, each to the worker
    free first."""
    free = [0.0] * workers
    for s in seconds:
        heapq.heapreplace(free, free[0] + s)
    return sorted(free)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path, help="a pytest --junitxml report")
    parser.add_argument("--write", action="store_true",
                        help=f"store the seconds in {DURATIONS.relative_to(ROOT)}")
    args = parser.parse_args()
    if not args.junit.is_file():
        print(f"suite_durations: {args.junit} is not a file", file=sys.stderr)
        return 2
    seconds = file_durations(args.junit)
    for path, s in seconds.items():
        print(f"{s:8.1f} s  {path}")
    ends = finish_times(list(seconds.values()))
    print(f"{sum(seconds.values()) / 60:.1f} worker-minutes in {len(seconds)} files; two workers handed the "
          f"longest first would finish at {ends[0] / 60:.1f} and {ends[1] / 60:.1f} min")
    if args.write:
        DURATIONS.write_text(json.dumps(seconds, indent=1) + "\n")
        print(f"wrote {DURATIONS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
