"""driver/contracts.py: the run's parts (trainer_groups.Models, rollout_manager.Rollouts,
run_checkpoints.Checkpoints) implement what the schedule and the step loop ask of them, each method with
the protocol's parameters, and so do the recorders tests/test_schedule.py runs the real schedule over."""

import inspect

import pytest
from test_schedule import Recorder

from moe_rl.driver.contracts import RolloutSource, StepCheckpoints, SteppingAside
from moe_rl.driver.rollout_manager import Rollouts
from moe_rl.driver.run_checkpoints import Checkpoints
from moe_rl.driver.trainer_groups import Models

PROTOCOLS = (SteppingAside, RolloutSource, StepCheckpoints)


def methods(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items()
            if inspect.isfunction(value) and not name.startswith("_")]


@pytest.mark.parametrize("protocol, part", [(SteppingAside, Models), (RolloutSource, Rollouts),
                                            (StepCheckpoints, Checkpoints)])
def test_the_run_parts_implement_the_protocols(protocol, part):
    assert methods(protocol)
    for name in methods(protocol):
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        assert list(inspect.signature(getattr(part, name)).parameters) == want, (part.__name__, name)


def test_the_schedule_tests_recorder_implements_them():
    recorder = Recorder(set())
    for protocol in PROTOCOLS:
        assert isinstance(recorder, protocol), protocol.__name__
    del recorder.eval_prompts  # a member missing: no longer a RolloutSource
    assert not isinstance(recorder, RolloutSource)
