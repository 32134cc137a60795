"""tools/quickstart_sweep.py's results table (the README's quickstart table comes from it), from rows as
run_one returns them; and a bad variant name is refused before anything runs."""

import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from quickstart_sweep import table  # noqa: E402


def test_the_table_has_a_row_per_run_and_a_column_per_baseline():
    ok = {"variant": "config", "seed": 1, "rc": 0, "wall_s": 301.4, "success_before": 0.34375,
          "success_after": 0.8125, "success_best": 0.8125,
          "baselines": {"random guesses": 0.34375, "binary search": 1.0}}
    failed = {"variant": "config", "seed": 2, "rc": 1, "wall_s": 12.0}
    lines = table([ok, failed]).splitlines()
    assert lines[0] == ("| variant | seed | held-out success: before RL -> after | best evaluation "
                        "| binary search | random guesses | wall clock |")
    assert lines[2] == "| config | 1 | 0.344 -> 0.812 | 0.812 | 1.000 | 0.344 | 5 min 1 s |"
    assert lines[3] == "| config | 2 | failed (exit 1) | | | | |"
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_an_unknown_variant_is_refused():
    proc = subprocess.run([sys.executable, "tools/quickstart_sweep.py", "--variant", "nope"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
