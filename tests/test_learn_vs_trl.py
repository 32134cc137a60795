"""tools/bench/learn_vs_trl.py's arithmetic, without training: the reward function it writes, steps to a
level, the medians and verdicts, and the progress lines read from each system's output."""

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))
try:
    import learn_vs_trl as bench
finally:
    sys.path.pop(0)


def test_the_reward_is_the_fraction_of_lowercase_letters(tmp_path):
    reward, prompts = bench.write_task(tmp_path, seed=0, steps=3)
    scope = {}
    exec(reward.read_text(), scope)
    fn = scope[bench.REWARD_FN]
    assert fn({}, "") == 0.0 and fn({}, "abcd") == 1.0 and fn({}, "aB1 ") == 0.25 and fn({}, "\ufffd") == 0.0
    rows = prompts.read_text().splitlines()
    assert len(rows) == bench.PROMPTS * 3
    assert bench.write_task(tmp_path, seed=0, steps=3)[1].read_text().splitlines() == rows  # the seed's order


def test_steps_to_a_level_is_the_first_full_window_reaching_it():
    curve = [0.1, 0.9, 0.2, 0.5, 0.6, 0.7, 0.95, 0.95, 0.95]
    assert bench.steps_to(curve, 0.5, window=1) == 2
    assert bench.steps_to(curve, 0.5, window=3) == 4  # (0.9 + 0.2 + 0.5) / 3; (0.1 + 0.9 + 0.2) / 3 < 0.5
    assert bench.steps_to(curve, 0.9, window=3) == 9
    assert bench.steps_to(curve, 0.99, window=3) is None
    assert bench.steps_to([0.9, 0.9], 0.5, window=3) is None  # a window never filled


def test_medians_count_an_unreached_level_as_slowest():
    assert bench.median_steps([10, 20, None]) == 20
    assert bench.median_steps([10, None, None]) is None
    assert bench.median_steps([10, 14]) == 12


@pytest.mark.parametrize(("ours", "theirs", "verdict"), [
    (10, 12, True), (12, 12, True), (13, 12, False), (None, 12, False), (30, None, True), (None, None, None)])
def test_verdict(ours, theirs, verdict):
    assert bench.compare(ours, theirs) is verdict


def test_summary_of_runs():
    runs = {0: {"curve": [0.1, 0.6, 0.6, 0.6], "step_s": [2.0, 0.2, 0.3], "wall_s": 5.0},
            1: {"curve": [0.1, 0.1, 0.1, 0.1], "step_s": [2.0, 0.4], "wall_s": 6.0}}
    out = bench.summarise(runs, window=2)
    assert out["steps_to_50%"] == {"0": 3, "1": None} and out["median_steps_to_50%"] is None
    assert out["max_steps_to_50%"] is None and out["auc"] == {"0": 0.475, "1": 0.1}
    assert out["median_auc"] == pytest.approx(0.2875) and out["step_s"] == 0.3


def test_progress_lines_come_from_each_systems_output(capsys):
    bar = ("RL steps:  90%|█████████ | 36/40 [00:20<00:02,  1.77step/s, len=8, reward=0.084]"
           "\rRL steps:  90%|█████████ | 36/40 [00:20<00:02,  1.77step/s, len=8, reward=0.219]")
    progress = bench.Progress("moe_rl seed 0")
    for part in bar.split("\r"):
        m = bench.OURS_PROGRESS.search(part)
        progress.see(int(m.group(1)), int(m.group(2)), m.group(3))
    progress.see(37, 40, "0.3")
    progress.finish(0.5)
    m = bench.TRL_PROGRESS.search("@learn_vs_trl step 3/40 reward 0.125")
    assert m.groups() == ("3", "40", "0.125")
    assert capsys.readouterr().out.splitlines() == ["  moe_rl seed 0: step 36/40  reward 0.219",
                                                    "  moe_rl seed 0: step 37/40  reward 0.500"]
