"""The policy's learning-rate schedule (train.lr_schedule.lr_at), worked by hand: peak 1.0, floor 0.1,
warmup 2 steps, the decay ending at step 6. Its use in a run (the rate each step's optimizer used, and a
resumed run taking the schedule up where it was) is tests/test_loop.py's, whose runs decay linearly."""

import math

import pytest
from conftest import ROOT

from moe_rl.config import ConfigError, load_config
from moe_rl.train.lr_schedule import lr_at


@pytest.mark.parametrize("schedule, expected", [
    # warmup (s + 1) / 2, then from step 2: t = (s - 2) / 4, held at the floor from step 6
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),  # 0.1 + 0.9 (1 - t)
    ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55,
                0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4)), 0.1, 0.1]),  # 0.1 + 0.9 (1 + cos(pi t)) / 2
])
def test_warmup_then_decay_to_the_floor(schedule, expected):
    got = [lr_at(s, 1.0, schedule, warmup_steps=2, decay_steps=6, lr_min=0.1) for s in range(8)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_no_warmup_starts_at_the_peak():
    assert lr_at(0, 3e-4, "cosine", 0, 10, 0.0) == 3e-4
    assert lr_at(5, 3e-4, "linear", 0, 10, 0.0) == pytest.approx(1.5e-4)


def test_a_decay_with_no_room_after_the_warmup_is_refused():
    quickstart = ROOT / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"trainer.lr_decay_steps: the decay ends at step 480 "
                                          r"\(run.steps\), not after the trainer.lr_warmup_steps=480"):
        load_config(quickstart, ["trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=480"])
    with pytest.raises(ConfigError, match="trainer.lr_min: 0.01 is outside the allowed range"):
        load_config(quickstart, ["trainer.lr_schedule=cosine", "trainer.lr_min=0.01"])  # above trainer.lr
    cfg = load_config(quickstart, ["trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=10",
                                   "trainer.lr_decay_steps=100", "trainer.lr_min=1e-4"])
    assert (cfg.trainer.lr_decay_steps, cfg.trainer.lr_min) == (100, 1e-4)
