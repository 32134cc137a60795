"""The RL driver: `run` is the algorithm, one step after another; `train_step` is one step's update.

    rollout (RolloutSchedule) -> score (routes replayed) -> targets (checklist, advantages, corrections)
    -> fit (critic, then policy: epochs x minibatches) -> sync weights -> log -> checkpoint

When rollouts and evaluations run (synchronous, asynchronous, colocated) is driver/schedule.py's; where
each piece lives: docs/architecture.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.algos.targets import TargetSpec, targets
from moe_rl.batch import Batch
from moe_rl.config import RunConfig
from moe_rl.driver.contracts import StepCheckpoints
from moe_rl.driver.preflight import preflight
from moe_rl.driver.report import CONFIG_FILE, TIMELINE_FILE, earlier_summary, report, say
from moe_rl.driver.run_checkpoints import Checkpoints
from moe_rl.driver.schedule import Evaluation, RolloutSchedule
from moe_rl.driver.specs import RunSpecs, run_specs
from moe_rl.driver.startup import model_dir, start
from moe_rl.driver.updates import fit
from moe_rl.metrics import StepLog, step_figures
from moe_rl.samples import SampleLog
from moe_rl.trackers import open_writers


def main(cfg: RunConfig, resume_with_changes: bool = False) -> int:
    """The run; `resume_with_changes`: resume a run directory whose config.yaml differs from `cfg` beyond
    run_checkpoints.RESUMABLE_CHANGES (`moe-rl train --resume-with-changes`)."""
    from moe_rl.driver import session

    out = Path(cfg.run.output_dir)
    spec = run_specs(cfg, model_dir(cfg, out))  # every worker's and the math's inputs, built once
    prompts, eval_prompts = preflight(cfg, out, spec.env, resume_with_changes)
    try:  # every exit path (done, an error, an interrupt) stops the run's actors and the Ray it started
        return run(cfg, spec, out, prompts, eval_prompts)
    finally:
        session.shutdown()


def run(cfg: RunConfig, spec: RunSpecs, out: Path, prompts: list[dict], eval_prompts: list[dict]) -> int:
    from moe_rl.driver import session
    from moe_rl.driver.remote import round_trips

    models, rollouts = start(cfg, spec, out, prompts, eval_prompts)
    checkpoints, params = Checkpoints(cfg, out, models, rollouts), spec.targets
    first = checkpoints.resume()
    if first is None:
        first, summary, evals = 0, prepare(cfg, models, rollouts), {}
    else:  # the warm start's figures and the evaluations up to the checkpoint, as the earlier try wrote them
        summary, evals = earlier_summary(out, first)
        done = "" if first < cfg.run.steps else (
            f"; the earlier try reached run.steps={cfg.run.steps}: what it left undone after its last step "
            "(the evaluation, the summary) follows")
        say(f"resumed at step {first}{done}")
    baselines = rollouts.baselines()  # the reference policies on the held-out prompts, before RL
    lg = cfg.logging
    log = StepLog(None, False, cfg.run.steps, lg.progress_bar, lg.log_every, lg.heatmap_every,
                  writers=open_writers(cfg, out))  # logging.backends
    # the config as run: with every default
    log.metrics.text("config", f"```\n{(out / CONFIG_FILE).read_text()}```")
    if summary:  # the warm start, at step 0
        log.metrics.log(0, summary, advance=False)
    diag = cfg.logging.routing_diagnostics_every

    def update(batch: Batch, step: int) -> list[dict[str, float]]:  # free routing on logged steps N, 2N, ...
        return train_step(models, rollouts, batch, step, params, log, bool(diag) and (step + 1) % diag == 0)

    samples = SampleLog(out, rollouts.model_path, lg.samples, lg.samples_every, log.metrics)
    evaluation = Evaluation(cfg, out, rollouts, log, summary, evals, samples)
    checkpoints.evals = evals  # the evaluations as they come: the best one's checkpoint is kept
    try:
        trips = round_trips()  # the first rollout's start (and evaluation) counts in the first step's
        schedule = RolloutSchedule(cfg, models, rollouts, log, evaluation, first, checkpoints.in_flight,
                                   samples)
        steps(first, cfg.run.steps, schedule, update, checkpoints, log, trips)
        session.check_interrupted()
        last = max(first, cfg.run.steps)
        evaluation.final(last)
    finally:
        log.close()
        log.timeline.write(out / TIMELINE_FILE)
    torch.save(log.history, out / "history.pt")
    report(out, summary, evals, log.history, last, baselines)
    return 0


def steps(first: int, end: int, schedule: RolloutSchedule, update, checkpoints: StepCheckpoints,
          log: StepLog, trips: int = 0) -> None:
    """Steps first .. end - 1, each on the batch `schedule` hands it: `update(batch, step)` (train_step)
    gives its figures, logged with the rollout's; then its checkpoint where due (holding the rollouts in
    flight) and the schedule's turn (`step_done`). timing/round_trips: the driver's waits on remote calls
    since the step before's log (the first step's: since `trips`, remote.round_trips() before its rollout)."""
    from moe_rl.driver.remote import round_trips
    from moe_rl.driver.session import check_interrupted

    for step in range(first, end):
        check_interrupted()  # a signal whose KeyboardInterrupt was swallowed stops the run here
        with log.timer("step", step):
            batch, rollout_figures = schedule.next_batch(step)
            with log.timeline.span("update", step):
                figures = update(batch, step)
        trips, before = round_trips(), trips
        log.step(step + 1, rollout_figures, *figures, {"timing/round_trips": trips - before})
        if checkpoints.due(step + 1):  # asynchronous: with the next rollouts, finished
            in_flight = schedule.in_flight()
            with log.timeline.span("save", step + 1):
                checkpoints.save(step + 1, in_flight)
        schedule.step_done(step)


def train_step(models, rollouts, batch: Batch, step: int, params: TargetSpec, log: StepLog,
               diagnostics: bool = False) -> list[dict[str, float]]:
    """One update on step's batch: score it (routes replayed; `diagnostics`: free routing too), its
    targets (the pre-update checklist, advantages, corrections), fit the critic then the policy, and
    sync the new weights into the engines as version step + 1. The step's figures, in logging order."""
    with log.timer("score", step):
        scores = models.score(batch, diagnostics=diagnostics)
    with log.timer("advantages", step):
        tgt = targets(batch, scores, params)
    fit_figures, logp_policy = fit(models, batch, tgt, step)
    scores = scores.with_policy(logp_policy)  # one update per step: pi_old from its own forward
    with log.timer("sync", step):
        log.add(rollouts.sync(models.policy, step + 1))
    return [step_figures(batch, scores, tgt, rollouts.num_experts), fit_figures, models.route_figures(),
            models.balance_figures()]


def prepare(cfg: RunConfig, models, rollouts) -> dict[str, float]:
    """A fresh run before RL: the supervised warm start (its figures returned), the EWMA anchor."""
    summary = {}
    tr = cfg.trainer
    if tr.warm_start_steps:
        say(f"supervised warm start: {tr.warm_start_steps} steps on "
            f"{repr(tr.warm_start_policy) if tr.warm_start_policy else 'scripted-expert'} episodes")
        demos = rollouts.demonstrations(tr.warm_start_steps, tr.warm_start_batch, tr.warm_start_policy)
        summary |= models.policy.warm_start(demos, tr.warm_start_lr)
        rollouts.sync(models.policy, 0)
    models.policy.init_anchor()  # RL starts here: theta_bar_0 = theta_0 (after any warm start)
    return summary
