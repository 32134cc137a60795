"""When rollouts and evaluations run, and on which weights.

    evaluation = Evaluation(cfg, out, rollouts, log, summary, results)
    schedule = RolloutSchedule(cfg, models, rollouts, log, evaluation, first, resumed)
    batch, figures = schedule.next_batch(step)   # step's rollout, waited for
    ckpt.save(step + 1, schedule.in_flight())    # the rollouts running now, finished (asynchronous), or []
    schedule.step_done(step)                     # synchronous: step + 1's rollout starts

Synchronous (rollout.async_mode false): step s's rollout starts after step s - 1 has ended (weights
synced, checkpoint written) and samples with its weights. Asynchronous: once step s's batch is in, the
rollouts of steps s + 1 .. s + rollout.async_depth run (those not running yet start) and generate while
step s trains, so step s + k's samples are up to k syncs behind; a checkpoint holds them, finished, and
the resumed run trains on them first. Colocated (cluster.offload, rollout.sleep_engines): the
trainer steps aside before a rollout starts (offload, the engines wake) and comes back once its batch is
in (the engines sleep, onload). The held-out evaluation runs on the weights the next rollout samples
with: synchronous, just before that rollout; asynchronous, beside it once the step has ended.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from moe_rl.batch import Batch
from moe_rl.config import RunConfig
from moe_rl.driver.contracts import RolloutSource, SteppingAside
from moe_rl.driver.report import say, write_summary
from moe_rl.driver.rollout_manager import Collected, InFlight
from moe_rl.samples import SampleLog


class Evaluation:
    """The held-out evaluation: when it is due (`due`), and its figures by step (`results`); summary.json
    is written after each. `summary`: the figures before RL (the warm start's) it is written with."""

    def __init__(self, cfg: RunConfig, out: Path, rollouts: RolloutSource, log, summary: dict,
                 results: dict[int, dict],
                 sample_log: SampleLog | None = None):
        self.out, self.rollouts, self.log, self.summary, self.results = out, rollouts, log, summary, results
        self.sample_log = sample_log  # a few of its episodes as text (logging.samples)
        tr = cfg.trainer
        self.prompts, self.every, self.samples = tr.eval_prompts, tr.eval_every, tr.eval_samples
        self.steps = cfg.run.steps

    def due(self, step: int) -> bool:
        """On the weights of `step`: before RL (step 0) and every trainer.eval_every steps, short of
        run.steps (that one is `final`'s), once (a resumed run has the earlier try's up to its checkpoint)."""
        return bool(self.prompts) and (step == 0 or bool(self.every) and step % self.every == 0) \
            and step < self.steps and step not in self.results

    def run(self, step: int) -> None:
        prompts = len(self.rollouts.eval_prompts)
        say(f"evaluating on {prompts} held-out prompts x {self.samples} (step {step})")
        with self.log.timeline.span("evaluate", step):
            self.results[step], episodes = self.rollouts.evaluate()
        self.log.metrics.log(step, self.results[step], advance=False)
        if self.sample_log is not None:
            self.sample_log.write("eval", step, episodes)
        write_summary(self.out, self.summary, self.results)

    def final(self, step: int) -> None:
        """After RL, on the last weights (the engines awake)."""
        if self.prompts:
            self.rollouts.wake()
            self.run(step)


class RolloutSchedule:
    """Which rollout each step trains on, and when it runs (the module's docstring has the rules). The
    rollouts running or waiting to be trained on, oldest first: at most one synchronous, up to
    rollout.async_depth asynchronous; none after the last step's."""

    def __init__(self, cfg: RunConfig, models: SteppingAside, rollouts: RolloutSource, log,
                 evaluation: Evaluation, first: int,
                 resumed: list[Collected], sample_log: SampleLog | None = None):
        self.models, self.rollouts, self.log, self.evaluation = models, rollouts, log, evaluation
        self.sample_log = sample_log  # a few of a step's episodes as text, every logging.samples_every
        self.steps, self.overlap = cfg.run.steps, cfg.rollout.async_mode
        self.depth = cfg.rollout.async_depth if self.overlap else 0
        self.queue: deque[InFlight] = deque(InFlight(first + i, done=c) for i, c in enumerate(resumed))
        if not self.queue and first < self.steps:
            self.queue.append(self._start(first))

    def _start(self, step: int) -> InFlight:
        """Step's rollout, after the trainer has stepped aside and the evaluation due on these weights."""
        with self.log.timer("offload", step):
            self.log.add(self.models.offload())
            self.rollouts.wake()
        if self.evaluation.due(step):
            self.evaluation.run(step)
        return self._generate(step)

    def _generate(self, step: int) -> InFlight:
        self.log.timeline.mark("generate", step)
        return self.rollouts.generate(step)

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Step's batch and its rollout's figures, waited for; the trainer back (colocated); asynchronous:
        the rollouts of the next async_depth steps running, to generate while this batch trains."""
        if not self.queue or self.queue[0].step != step:
            raise RuntimeError(f"step {step}: the rollouts in flight are {list(self.queue)}")
        with self.log.timeline.span("wait", step):
            batch, figures, episodes = self.rollouts.wait(self.queue.popleft())
        if self.sample_log is not None and self.sample_log.due(step + 1):  # as the step's figures: step + 1
            self.sample_log.write("train", step + 1, episodes)
        with self.log.timer("onload", step):
            self.rollouts.sleep()
            self.models.onload()
        ahead = self.queue[-1].step if self.queue else step
        for later in range(ahead + 1, min(step + self.depth, self.steps - 1) + 1):
            self.queue.append(self._generate(later))
        return batch, figures

    def in_flight(self) -> list[InFlight]:
        """The rollouts started for later steps, finished (a checkpoint keeps them), oldest first."""
        for rollout in self.queue:
            with self.log.timeline.span("finish", rollout.step):
                self.rollouts.finish(rollout)
        return list(self.queue)

    def step_done(self, step: int) -> None:
        """After step's update and checkpoint. Synchronous: step + 1's rollout starts; asynchronous: the
        evaluation due on the new weights runs, beside the rollouts in flight."""
        if not self.overlap and step + 1 < self.steps:
            self.queue.append(self._start(step + 1))
        elif self.evaluation.due(step + 1):
            self.evaluation.run(step + 1)
