"""The RL driver: `run` is the algorithm, one step after another.

    generate -> score (routes replayed) -> targets (checklist, advantages, corrections) -> fit (critic,
    then policy: epochs x minibatches) -> sync weights -> log -> checkpoint

Colocated (cluster.offload, rollout.sleep_engines), the trainer and the engines take turns on the
GPUs: the trainer offloads before each rollout and the engines wake; after it the engines sleep and
the trainer comes back.

Synchronous mode generates each step's rollout with the weights of the step before. Asynchronous mode
starts the next rollout before training on the current batch (the engines keep generating while the
trainer trains), syncs weights into the running engines between their steps, and drops samples older
than `rollout.max_staleness` versions. Where each piece lives: docs/architecture.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from moe_rl import settings
from moe_rl.algos.targets import targets
from moe_rl.checkpoints import Checkpoints
from moe_rl.config import RunConfig, dump_yaml
from moe_rl.metrics import StepLog, step_figures

CONFIG_FILE = "config.yaml"  # the resolved config of the run, in run.output_dir


def say(msg: str) -> None:
    print(f"[moe-rl] {msg}", flush=True)


def main(cfg: RunConfig) -> int:
    out = Path(cfg.run.output_dir)
    prompts = preflight(cfg, out)
    models, rollouts = start(cfg, out, prompts)
    checkpoints, params = Checkpoints(cfg, out, models, rollouts), settings.target_params(cfg)
    first, summary = checkpoints.resume(), {}
    if first is None:
        first, summary = 0, prepare(cfg, models, rollouts)
    else:
        say(f"resumed at step {first}" + ("" if first < cfg.run.steps else f"; this run already reached run.steps="
            f"{cfg.run.steps}: raise run.steps to continue, or start over in a new run.output_dir"))
    log = StepLog(out / "tensorboard" / cfg.run.name, cfg.logging.tensorboard, cfg.run.steps, cfg.logging.progress_bar,
                  cfg.logging.log_every, cfg.logging.heatmap_every)
    log.metrics.text("config", f"```\n{(out / CONFIG_FILE).read_text()}```")  # as run: every default filled in
    if summary:  # the warm start and the evaluation before RL, at step 0
        log.metrics.log(0, {k.removesuffix("_before"): v for k, v in summary.items()}, advance=False)
    diag = cfg.logging.routing_diagnostics_every

    def rollout(step: int) -> list:  # colocated: the trainer steps aside, the engines wake, they generate
        with log.timer("offload"):
            log.add(models.offload())
            rollouts.wake()
        return rollouts.generate(step)

    # an asynchronous run's checkpoint holds the rollout it had in flight: resumed, the next step trains on it
    pending = checkpoints.in_flight or (rollout(first) if first < cfg.run.steps else None)
    try:
        for step in range(first, cfg.run.steps):
            with log.timer("step"):
                batch, rollout_figures = rollouts.wait(pending)
                with log.timer("onload"):  # colocated: the engines sleep, the trainer comes back
                    rollouts.sleep()
                    models.onload()
                # asynchronous: the next rollout runs while this batch trains
                pending = rollouts.generate(step + 1) if cfg.rollout.async_mode and step + 1 < cfg.run.steps else None
                with log.timer("score"):  # the free-routing diagnostics on logged steps N, 2N, ...
                    scores = models.score(batch, diagnostics=bool(diag) and (step + 1) % diag == 0)
                with log.timer("advantages"):
                    tgt = targets(batch, scores, params)
                fit_figures = models.fit(batch, tgt, step)
                with log.timer("sync"):
                    rollouts.sync(models.policy, step + 1)
                figures = [rollout_figures, step_figures(batch, scores, tgt, rollouts.num_experts), fit_figures, models.route_figures()]
            log.step(step + 1, *figures)
            if checkpoints.due(step + 1):
                if pending:  # asynchronous: the next rollout, finished, goes into the checkpoint
                    pending = rollouts.finish(pending)
                checkpoints.save(step + 1, pending)
            if not cfg.rollout.async_mode and step + 1 < cfg.run.steps:
                pending = rollout(step + 1)
        last = max(first, cfg.run.steps)
        if cfg.trainer.eval_prompts:
            rollouts.wake()
            after = rollouts.evaluate()
            summary.update({f"{k}_after": v for k, v in after.items()})
            log.metrics.log(last, after, advance=False)
    finally:
        log.close()
    torch.save(log.history, out / "history.pt")
    report(out, summary, log.history, last)
    return 0


def preflight(cfg: RunConfig, out: Path) -> list[dict]:
    """What a user can get wrong in files, checked before Ray and vLLM start (which takes 20-45 s): the
    output directory, the model, the prompts (returned), the checkpoint to resume from."""
    from moe_rl.checkpoints import check_resumable, resume_dir
    from moe_rl.config_rules import check_layout_fits_hf_config
    from moe_rl.rollouts import training_prompts
    from moe_rl.weights.hf import CheckpointError, check_model_dir

    if out.exists() and not out.is_dir():
        raise CheckpointError(f"run.output_dir: '{out}' is a file, not a directory")
    if cfg.model.path:
        check_layout_fits_hf_config(cfg.parallel, check_model_dir(cfg.model.path))
    prompts = training_prompts(cfg)
    resume = resume_dir(cfg, out / "checkpoints")
    if resume is not None:
        check_resumable(resume, ["policy", "critic"] if cfg.critic_enabled else ["policy"])
    return prompts


def start(cfg: RunConfig, out: Path, prompts: list[dict]):
    """Ray, the placement, the trainer groups and the engines, on the run's model."""
    from moe_rl import cluster
    from moe_rl.algos.gae import prepare_kernel
    from moe_rl.rollouts import Rollouts
    from moe_rl.trainers import Models

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.run.seed)
    t = time.perf_counter()
    say("preparing the fused GAE kernel (compiled once per machine, then cached)")
    say(f"GAE kernel {'ready' if prepare_kernel() else 'unavailable: the tensor path runs instead'} "
        f"({time.perf_counter() - t:.1f} s)")
    path = cfg.model.path
    if not path:
        from moe_rl.tiny import build_tiny_checkpoint

        path = str(build_tiny_checkpoint(out / "base_model", cfg.model.tiny, seed=cfg.run.seed))
    say(f"starting Ray, {cfg.parallel.world_size} policy rank(s){' + critic' if cfg.critic_enabled else ''} and "
        f"{cfg.rollout.num_engines} vLLM engine(s)")
    cluster.start_ray(cfg)
    place = cluster.Placement(cfg, cfg.actors)
    models, rollouts = Models(cfg, place, path), Rollouts(cfg, place, path, prompts)
    say("placement: " + "; ".join([f"{k} ranks on {', '.join(g.nodes)}" for k, g in models.groups().items()]
                                  + [f"engines on {', '.join(rollouts.nodes)}"]))
    rollouts.connect(models.policy)
    say(f"weight sync: {cfg.rollout.weight_transfer}")
    return models, rollouts


def prepare(cfg: RunConfig, models, rollouts) -> dict[str, float]:
    """A fresh run before RL: the supervised warm start, the EWMA anchor, the evaluation before."""
    summary = {}
    tr = cfg.trainer
    if tr.warm_start_steps:
        say(f"supervised warm start: {tr.warm_start_steps} steps on scripted-expert episodes")
        summary |= models.policy.warm_start(rollouts.demonstrations(tr.warm_start_steps, tr.warm_start_batch), tr.warm_start_lr)
        rollouts.sync(models.policy, 0)
    models.policy.init_anchor()  # RL starts here: theta_bar_0 = theta_0 (after any warm start)
    if tr.eval_prompts:
        say(f"evaluating on {tr.eval_prompts} held-out prompts")
        summary.update({f"{k}_before": v for k, v in rollouts.evaluate().items()})
    return summary


def report(out: Path, summary: dict, history: list[dict], steps: int) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"run finished: {steps} steps, output in {out}"]
    if "eval/reward_mean_before" in summary and "eval/reward_mean_after" in summary:
        lines.append(f"held-out reward: {summary['eval/reward_mean_before']:.3f} -> {summary['eval/reward_mean_after']:.3f}"
                     f"   success rate: {summary['eval/success_rate_before']:.3f} -> {summary['eval/success_rate_after']:.3f}")
    if history:
        lines.append(f"training reward: first step {history[0].get('reward/mean', float('nan')):.3f}, "
                     f"last step {history[-1].get('reward/mean', float('nan')):.3f}")
    print("\n".join(lines), flush=True)
