"""The driver's ordering rules, in seconds: loop.steps with the real RolloutSchedule, Evaluation and StepLog
over recorders of what they ask of the trainer groups, the engines and the checkpoints (the calls the
schedule makes, in order), and the timeline the driver writes of them. What those calls do is
tests/test_loop.py's: full runs on real Ray, vLLM and Megatron, in each mode, whose timeline.json must show
the order these tests show for the same settings (cli_runs.SMALL_ORDER)."""

from pathlib import Path

import pytest
from cli_runs import SMALL, SMALL_ORDER, schedule_order
from conftest import ROOT

from moe_rl.config import load_config
from moe_rl.driver.loop import steps
from moe_rl.driver.rollout_manager import Collected, InFlight
from moe_rl.driver.schedule import Evaluation, RolloutSchedule
from moe_rl.metrics import StepLog


class Recorder:
    """Models, Rollouts and Checkpoints as the schedule and the step loop call them: every call an event."""

    def __init__(self, saves: set[int]):
        self.events: list[str] = []
        self.saves = saves
        self.eval_prompts = [{"prompt": "p"}] * 4

    # Models
    def offload(self) -> dict:
        self.events.append("offload")
        return {}

    def onload(self) -> None:
        self.events.append("onload")

    # Rollouts
    def wake(self, part=None) -> None:
        self.events.append("wake")

    def sleep(self) -> None:
        self.events.append("sleep")

    def generate(self, step: int) -> InFlight:
        self.events.append(f"generate {step}")
        return InFlight(step)

    def finish(self, rollout: InFlight) -> Collected:
        if rollout.done is None:
            self.events.append(f"finish {rollout.step}")
            rollout.done = Collected([])
        return rollout.done

    def wait(self, rollout: InFlight):
        self.events.append(f"wait {rollout.step}")
        return None, {}

    def evaluate(self) -> dict:
        self.events.append("evaluate")
        return {"eval/reward_mean": 0.5}

    # the step's update (train_step: score, targets, fit, sync)
    def update(self, batch, step: int) -> list[dict]:
        self.events.append(f"train {step}")
        return []

    # Checkpoints
    def due(self, step: int) -> bool:
        return step in self.saves

    def save(self, step: int, in_flight: InFlight | None) -> None:
        finished = in_flight is not None and in_flight.done is not None
        held = f" holding rollout {in_flight.step}" if finished else ""
        self.events.append(f"save {step}{held}")


class Saves(Recorder):
    """The recorders, with the run's own checkpoint rule (checkpoint.every, checkpoint.at_end)."""

    def __init__(self, cfg):
        super().__init__(set())
        self.cfg = cfg

    def due(self, step: int) -> bool:
        from moe_rl.driver.run_checkpoints import Checkpoints

        return Checkpoints.due(self, step)


def run_steps(tmp_path: Path, *overrides: str, first: int = 0, resumed: Collected | None = None,
              evals: dict | None = None, saves=None, base=("trainer.eval_prompts=4", "trainer.eval_every=2")):
    """What run does from the first rollout to the last evaluation, on recorders: (events, evaluated
    steps, the timeline's order). `saves`: the steps checkpointed (None: the config's rule)."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"run.output_dir={tmp_path}", "run.steps=3", *base, *overrides])
    rec = Saves(cfg) if saves is None else Recorder(set(saves))
    log = StepLog(tmp_path / "tb", False, cfg.run.steps, False, 1)
    evaluation = Evaluation(cfg, tmp_path, rec, log, {}, dict(evals or {}))
    schedule = RolloutSchedule(cfg, rec, rec, log, evaluation, first, resumed)
    steps(first, cfg.run.steps, schedule, rec.update, rec, log)
    evaluation.final(cfg.run.steps)
    log.close()
    return rec.events, sorted(evaluation.results), schedule_order(log.timeline.names())


def test_synchronous_each_rollout_starts_after_the_step_before_and_evaluates_first(tmp_path):
    events, evaluated, order = run_steps(tmp_path, saves={2})
    assert events == [
        "offload", "wake", "evaluate", "generate 0",  # before RL: the evaluation on the rollout's weights
        "wait 0", "sleep", "onload", "train 0",
        "offload", "wake", "generate 1",
        "wait 1", "sleep", "onload", "train 1", "save 2",  # nothing in flight to hold
        "offload", "wake", "evaluate", "generate 2",  # eval_every=2: on step 2's weights, before its rollout
        "wait 2", "sleep", "onload", "train 2",
        "wake", "evaluate"]  # after RL
    assert evaluated == [0, 2, 3]
    assert order == ["offload 0", "evaluate 0", "generate 0", "wait 0", "onload 0", "update 0",
                     "offload 1", "generate 1", "wait 1", "onload 1", "update 1", "save 2",
                     "offload 2", "evaluate 2", "generate 2", "wait 2", "onload 2", "update 2", "evaluate 3"]


def test_asynchronous_the_next_rollout_runs_while_a_step_trains_and_a_checkpoint_holds_it(tmp_path):
    events, evaluated, order = run_steps(tmp_path, "rollout.async_mode=true", saves={2})
    assert events == [
        "offload", "wake", "evaluate", "generate 0",
        "wait 0", "sleep", "onload", "generate 1", "train 0",  # step 1's rollout runs while step 0 trains
        "wait 1", "sleep", "onload", "generate 2", "train 1",
        "finish 2", "save 2 holding rollout 2",  # the checkpoint holds step 2's rollout, finished
        "evaluate",  # step 2's weights, beside the rollout in flight
        "wait 2", "sleep", "onload", "train 2",  # the last step starts no rollout
        "wake", "evaluate"]
    assert evaluated == [0, 2, 3]
    assert order == ["offload 0", "evaluate 0", "generate 0", "wait 0", "onload 0", "generate 1", "update 0",
                     "wait 1", "onload 1", "generate 2", "update 1", "finish 2", "save 2", "evaluate 2",
                     "wait 2", "onload 2", "update 2", "evaluate 3"]


def test_a_resumed_asynchronous_run_trains_first_on_the_rollout_its_checkpoint_held(tmp_path):
    events, evaluated, _ = run_steps(tmp_path, "rollout.async_mode=true", first=2, resumed=Collected([]),
                                     evals={0: {"eval/reward_mean": 0.1}, 2: {"eval/reward_mean": 0.2}},
                                     saves={})
    assert events == ["wait 2", "sleep", "onload", "train 2", "wake", "evaluate"]
    assert evaluated == [0, 2, 3]


def test_a_resumed_synchronous_run_does_not_evaluate_a_step_the_earlier_try_evaluated(tmp_path):
    evals = {0: {"eval/reward_mean": 0.1}, 2: {"eval/reward_mean": 0.2}}
    events, _, _ = run_steps(tmp_path, first=2, evals=evals, saves={})
    assert events == ["offload", "wake", "generate 2", "wait 2", "sleep", "onload", "train 2",
                      "wake", "evaluate"]


def test_without_held_out_prompts_nothing_is_evaluated(tmp_path):
    events, evaluated, _ = run_steps(tmp_path, "trainer.eval_prompts=0", "trainer.eval_every=0", saves={})
    assert "evaluate" not in events and evaluated == []


def test_a_step_asked_for_another_steps_rollout_is_refused(tmp_path):
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"run.output_dir={tmp_path}", "run.steps=3"])
    rec = Recorder(set())
    log = StepLog(tmp_path / "tb", False, 3, False, 1)
    schedule = RolloutSchedule(cfg, rec, rec, log, Evaluation(cfg, tmp_path, rec, log, {}, {}), 0, None)
    with pytest.raises(RuntimeError, match=r"step 1: the rollout in flight is InFlight\(step=0, 0 calls\)"):
        schedule.next_batch(1)


@pytest.mark.parametrize("mode", ["sync", "async", "async resumed at 2"])
def test_the_small_runs_order_is_the_one_their_real_runs_show(tmp_path, mode):
    """test_loop's small runs (cli_runs.SMALL) check their timeline.json against the same order."""
    overrides = [*SMALL, *(["rollout.async_mode=true"] if "async" in mode else [])]
    resumed = dict(first=2, resumed=Collected([])) if "resumed" in mode else {}
    _, evaluated, order = run_steps(tmp_path, *overrides, base=(), **resumed)
    assert order == SMALL_ORDER[mode] and evaluated == []
