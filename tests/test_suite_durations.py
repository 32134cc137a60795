"""tools/suite_durations.py, which measures the test files for `make test`'s order (tests/durations.json),
on a report written by hand, and the order tests/conftest.py gives the collected files."""

import subprocess
import sys

import conftest
from conftest import ROOT

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_batch" name="a" time="2.5"/>
<testcase classname="tests.test_batch" name="b" time="1.0"/>
<testcase classname="tests.train.test_models" name="c" time="30.0"/>
<testcase classname="tests.test_config" name="d" time="20.0"/>
<testcase classname="tests.test_plan" name="e" time="10.0"/>
</testsuite></testsuites>"""


def test_a_report_gives_each_files_seconds_and_the_two_workers_finish(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import suite_durations
    finally:
        sys.path.pop(0)
    (tmp_path / "r.xml").write_text(REPORT)
    seconds = suite_durations.file_durations(tmp_path / "r.xml")
    assert list(seconds.items()) == [("tests/train/test_models.py", 30.0), ("tests/test_config.py", 20.0),
                                     ("tests/test_plan.py", 10.0), ("tests/test_batch.py", 3.5)]
    # longest first, each to the worker free first: 30 | 20, then 10 -> 30 | 30, then 3.5 -> 33.5 | 30
    assert suite_durations.finish_times(list(seconds.values())) == [30.0, 33.5]
    out = subprocess.run([sys.executable, "tools/suite_durations.py", str(tmp_path / "r.xml")], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == (
        "1.1 worker-minutes in 4 files; two workers handed the longest first would finish at 0.5 and 0.6 min")
    missing = subprocess.run([sys.executable, "tools/suite_durations.py", str(tmp_path / "none.xml")],
                             cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 \
        and missing.stderr.strip() == f"suite_durations: {tmp_path}/none.xml is not a file"


def test_the_collected_files_come_longest_first(request):
    """This run's own collection, as conftest ordered it: each file's measured seconds never rise."""
    files = list(dict.fromkeys(item.path for item in request.session.items))
    seconds = [conftest.file_seconds(f) for f in files]
    assert len(files) > 1 and seconds == sorted(seconds, reverse=True)
    assert set(conftest.DURATIONS) <= {p.relative_to(ROOT).as_posix()
                                       for p in (ROOT / "tests").rglob("test_*.py")}
