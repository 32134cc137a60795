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
        return None, {}, []

    def evaluate(self) -> tuple[dict, list]:
        self.events.append("evaluate")
        return {"eval/reward_mean": 0.5}, []

    # the step's update (train_step: score, targets, fit, sync)
    def update(self, batch, step: int) -> list[dict]:
        self.events.append(f"train {step}")
        return []

    # Checkpoints
    def due(self, step: int) -> bool:
        return step in self.saves

    def save(self, step: int, in_flight: list[InFlight]) -> None:
        assert all(r.done is not None for r in in_flight), "a checkpoint holds finished rollouts only"
        held = f" holding rollout {' '.join(str(r.step) for r in in_flight)}" if in_flight else ""
        self.events.append(f"save {step}{held}")


class Saves(Recorder):
    """The recorders, with the run's own checkpoint rule (checkpoint.every, checkpoint.at_end)."""

    def __init__(self, cfg):
        super().__init__(set())
        self.cfg = cfg

    def due(self, step: int) -> bool:
        from moe_rl.driver.run_checkpoints import Checkpoints

        return Checkpoints.due(self, step)


def run_steps(tmp_path: Path, *overrides: str, first: int = 0, resumed: list[Collected] = (),
              evals: dict | None = None, saves=None, base=("trainer.eval_prompts=4", "trainer.eval_every=2")):
    """What run does from the first rollout to the last evaluation, on recorders: (events, evaluated
    steps, the timeline's order). `saves`: the steps checkpointed (None: the config's rule)."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"run.output_dir={tmp_path}", "run.steps=3", *base, *overrides])
    resumed = list(resumed)
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
    events, evaluated, _ = run_steps(tmp_path, "rollout.async_mode=true", first=2, resumed=[Collected([])],
                                     evals={0: {"eval/reward_mean": 0.1}, 2: {"eval/reward_mean": 0.2}},
                                     saves={})
    assert events == ["wait 2", "sleep", "onload", "train 2", "wake", "evaluate"]
    assert evaluated == [0, 2, 3]


def test_async_depth_keeps_that_many_rollouts_running_ahead_and_a_checkpoint_holds_them_all(tmp_path):
    """rollout.async_depth=2: once step s's batch is in, the rollouts of s + 1 and s + 2 run; none past
    the last step."""
    events, _, _ = run_steps(tmp_path, "rollout.async_mode=true", "rollout.async_depth=2",
                             "rollout.max_staleness=2", "run.steps=4", saves={1, 3})
    assert events == [
        "offload", "wake", "evaluate", "generate 0",
        "wait 0", "sleep", "onload", "generate 1", "generate 2", "train 0",  # both start at once
        "finish 1", "finish 2", "save 1 holding rollout 1 2",
        "wait 1", "sleep", "onload", "generate 3", "train 1",  # one more keeps two ahead
        "evaluate",  # eval_every=2: step 2's weights
        "wait 2", "sleep", "onload", "train 2",  # step 4 is past the run
        "finish 3", "save 3 holding rollout 3",
        "wait 3", "sleep", "onload", "train 3",
        "wake", "evaluate"]


def test_a_resumed_run_trains_on_every_rollout_its_checkpoint_held_then_keeps_its_depth(tmp_path):
    events, _, _ = run_steps(tmp_path, "rollout.async_mode=true", "rollout.async_depth=2",
                             "rollout.max_staleness=2", "run.steps=5", first=1,
                             resumed=[Collected([]), Collected([])], evals={0: {}}, saves={},
                             base=("trainer.eval_prompts=0", "trainer.eval_every=0"))
    assert events == ["wait 1", "sleep", "onload", "generate 3", "train 1",
                      "wait 2", "sleep", "onload", "generate 4", "train 2",
                      "wait 3", "sleep", "onload", "train 3", "wait 4", "sleep", "onload", "train 4"]


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
    schedule = RolloutSchedule(cfg, rec, rec, log, Evaluation(cfg, tmp_path, rec, log, {}, {}), 0, [])
    with pytest.raises(RuntimeError,
                       match=r"step 1: the rollouts in flight are \[InFlight\(step=0, 0 calls\)\]"):
        schedule.next_batch(1)


@pytest.mark.parametrize("mode", ["sync", "async", "async resumed at 2", "async depth 2",
                                  "async depth 2 resumed at 1"])
def test_the_small_runs_order_is_the_one_their_real_runs_show(tmp_path, mode):
    """test_loop's small runs (cli_runs.SMALL) check their timeline.json against the same order."""
    depth = ["rollout.async_depth=2", "rollout.max_staleness=2"] if "depth 2" in mode else []
    overrides = [*SMALL, *(["rollout.async_mode=true"] if "async" in mode else []), *depth]
    first = int(mode.rsplit(" ", 1)[1]) if "resumed" in mode else 0
    resumed = dict(first=first, resumed=[Collected([])] * (3 - first)) if first else {}
    _, evaluated, order = run_steps(tmp_path, *overrides, base=(), **resumed)
    assert order == SMALL_ORDER[mode] and evaluated == []
