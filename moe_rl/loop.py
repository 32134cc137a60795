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
import os
import time
from pathlib import Path

import torch

from moe_rl import settings
from moe_rl.algos.targets import targets
from moe_rl.checkpoints import Checkpoints
from moe_rl.config import RunConfig, dump_yaml
from moe_rl.metrics import StepLog, step_figures
from moe_rl.schema import ConfigError

CONFIG_FILE = "config.yaml"  # the resolved config of the run, in run.output_dir


def say(msg: str) -> None:
    print(f"[moe-rl] {msg}", flush=True)


def main(cfg: RunConfig, resume_with_changes: bool = False) -> int:
    """The run; `resume_with_changes`: resume a run directory whose config.yaml differs from `cfg` beyond
    checkpoints.RESUMABLE_CHANGES (`moe-rl train --resume-with-changes`)."""
    from moe_rl import cluster

    out = Path(cfg.run.output_dir)
    prompts, eval_prompts = preflight(cfg, out, resume_with_changes)
    try:  # every exit path (done, an error, an interrupt) stops the run's actors and the Ray it started
        return run(cfg, out, prompts, eval_prompts)
    finally:
        cluster.shutdown()


def run(cfg: RunConfig, out: Path, prompts: list[dict], eval_prompts: list[dict]) -> int:
    from moe_rl.cluster import check_interrupted, round_trips

    tr = cfg.trainer
    models, rollouts = start(cfg, out, prompts, eval_prompts)
    checkpoints, params = Checkpoints(cfg, out, models, rollouts), settings.target_params(cfg)
    first = checkpoints.resume()
    if first is None:
        first, summary, evals = 0, prepare(cfg, models, rollouts), {}
    else:  # the warm start's figures and the evaluations up to the checkpoint, as the earlier try wrote them
        summary, evals = earlier_summary(out, first)
        say(f"resumed at step {first}" + ("" if first < cfg.run.steps else f"; the earlier try reached run.steps="
            f"{cfg.run.steps}: what it left undone after its last step (the evaluation, the summary) follows"))
    log = StepLog(out / "tensorboard" / cfg.run.name, cfg.logging.tensorboard, cfg.run.steps, cfg.logging.progress_bar,
                  cfg.logging.log_every, cfg.logging.heatmap_every)
    log.metrics.text("config", f"```\n{(out / CONFIG_FILE).read_text()}```")  # as run: every default filled in
    if summary:  # the warm start, at step 0
        log.metrics.log(0, summary, advance=False)
    diag = cfg.logging.routing_diagnostics_every

    def evaluate(step: int) -> None:  # the held-out prompts with the weights of `step`: eval/, summary.json
        say(f"evaluating on {len(eval_prompts)} held-out prompts x {tr.eval_samples} (step {step})")
        evals[step] = rollouts.evaluate()
        log.metrics.log(step, evals[step], advance=False)
        write_summary(out, summary, evals)

    def evaluating(step: int) -> bool:  # before RL, every trainer.eval_every steps (the last: after the loop)
        return bool(tr.eval_prompts) and (step == 0 or bool(tr.eval_every) and step % tr.eval_every == 0) \
            and step < cfg.run.steps

    def rollout(step: int) -> list:  # colocated: the trainer steps aside, the engines wake, they generate
        with log.timer("offload"):
            log.add(models.offload())
            rollouts.wake()
        if evaluating(step) and step not in evals:  # synchronous: first, on the weights the rollout samples with
            evaluate(step)
        return rollouts.generate(step)

    # an asynchronous run's checkpoint holds the rollout it had in flight: resumed, the next step trains on it
    trips = round_trips()  # the driver's waits on remote calls, counted from one step's log to the next
    pending = checkpoints.in_flight or (rollout(first) if first < cfg.run.steps else None)
    try:
        for step in range(first, cfg.run.steps):
            check_interrupted()  # a signal whose KeyboardInterrupt was swallowed stops the run here
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
                fit_figures, logp_policy = models.fit(batch, tgt, step)
                scores = scores.with_policy(logp_policy)  # one update per step: pi_old from its own forward
                with log.timer("sync"):
                    log.add(rollouts.sync(models.policy, step + 1))
                figures = [rollout_figures, step_figures(batch, scores, tgt, rollouts.num_experts), fit_figures, models.route_figures()]
            trips, before = round_trips(), trips
            log.step(step + 1, *figures, {"timing/round_trips": trips - before})
            if checkpoints.due(step + 1):
                if pending:  # asynchronous: the next rollout, finished, goes into the checkpoint
                    pending = rollouts.finish(pending)
                checkpoints.save(step + 1, pending)
            if not cfg.rollout.async_mode and step + 1 < cfg.run.steps:
                pending = rollout(step + 1)
            elif evaluating(step + 1):  # asynchronous: on engine 0, beside the rollout in flight (older weights)
                evaluate(step + 1)
        check_interrupted()
        last = max(first, cfg.run.steps)
        if tr.eval_prompts:  # after RL
            rollouts.wake()
            evaluate(last)
    finally:
        log.close()
    torch.save(log.history, out / "history.pt")
    report(out, summary, evals, log.history, last)
    return 0


def preflight(cfg: RunConfig, out: Path, resume_with_changes: bool = False) -> tuple[list[dict], list[dict]]:
    """What a user can get wrong, checked before Ray and vLLM start (which takes 20-45 s): the output
    directory (given, a directory, writable), the model (and a context vLLM would refuse), the training
    and held-out prompts (returned) with the environment tried on the first one, the checkpoint to resume
    from (`check_resume_point`), and whether the actors fit the local Ray cluster the run will start."""
    from moe_rl.config_rules import check_layout_fits_hf_config
    from moe_rl.rollout.envs import try_first_prompt
    from moe_rl.rollouts import evaluation_prompts, training_prompts
    from moe_rl.weights.hf import CheckpointError, check_model_dir, check_reward_model_dir

    if not cfg.run.output_dir.strip():
        raise ConfigError("run.output_dir", "is empty: the run would write into the current directory; give it a "
                          "directory of its own, e.g. run.output_dir=runs/NAME")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"run.output_dir: '{out}' is a file, not a directory")
    hf = check_model_dir(cfg.model.path) if cfg.model.path else None
    if hf is not None:
        check_layout_fits_hf_config(cfg.parallel, hf)
    check_context_length(cfg, hf)
    if cfg.reward_model.path:  # placed like the policy: the same layout must fit it
        check_layout_fits_hf_config(cfg.parallel, check_reward_model_dir(cfg.reward_model.path))
    prompts, eval_prompts = training_prompts(cfg), evaluation_prompts(cfg)
    env, spec = cfg.environment, settings.env_spec(cfg)
    try_first_prompt(spec, prompts[0], f"the first row of {env.dataset}" if env.dataset else
                     f"the first prompt {env.name} generated")
    if cfg.trainer.eval_dataset and eval_prompts:
        try_first_prompt(spec, eval_prompts[0], f"the first row of {cfg.trainer.eval_dataset}")
    check_resume_point(cfg, out, resume_with_changes)
    check_fits_locally(cfg)
    check_writable(out)
    return prompts, eval_prompts


def check_resume_point(cfg: RunConfig, out: Path, resume_with_changes: bool) -> None:
    """The checkpoint the run will resume from, if any: the run directory's config.yaml against `cfg`
    (only checkpoints.RESUMABLE_CHANGES may differ, unless `resume_with_changes`; every change is said),
    its files whole (`checkpoints.check_resume`), and steps left to take (a launcher's retry of a run
    that reached run.steps finishes what came after its last step)."""
    import yaml

    from moe_rl.checkpoints import (
        check_resume,
        config_changes,
        resumable_change,
        resume_dir,
        show_changes,
        written_by_this_try,
    )

    resume = resume_dir(cfg, out / "checkpoints")
    if resume is None:
        return
    try:
        stored = yaml.safe_load((out / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        stored = None  # no record of the config it ran with (a checkpoint copied in): nothing to compare
    changes = config_changes(stored, yaml.safe_load(dump_yaml(cfg))) if isinstance(stored, dict) else []
    refused = [c for c in changes if not resumable_change(c[0])]
    if refused and not resume_with_changes:
        raise ConfigError("run.output_dir", f"'{out}' holds a run of another config, to be resumed from {resume.name}: "
                          f"{show_changes(refused)} (its {CONFIG_FILE} against this one). Start a new run in another "
                          "run.output_dir, put these settings back, or resume with them changed: moe-rl train "
                          "--resume-with-changes (run.steps, logging.*, checkpoint.every/keep/at_end/resume and "
                          "cluster addresses, threads and timeouts may change without it)")
    roles = ["policy", "critic"] if cfg.critic_enabled else ["policy"]
    st = check_resume(resume, roles, auto=cfg.checkpoint.resume == "auto" and resume.parent == out / "checkpoints")
    if st["step"] >= cfg.run.steps and not written_by_this_try(resume):
        raise ConfigError("run.steps", f"{cfg.run.steps}: this run already reached it ({resume} is step {st['step']}); "
                          "raise run.steps to continue it, or start over in a new run.output_dir")
    if changes:
        say(f"resuming from {resume} with settings changed since {CONFIG_FILE}: {show_changes(changes, len(changes))}")


def check_context_length(cfg: RunConfig, hf: dict | None) -> None:
    """rollout.max_model_len within the positions the policy has (max_position_embeddings, times its RoPE
    scaling factor where it has one; `hf`: model.path's config, None for the tiny model): vLLM refuses
    a longer context when an engine starts, after the whole start-up. Unchecked where vLLM is told to
    allow it (VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return
    want = cfg.rollout.max_model_len
    if hf is None:
        limit, source, fix = cfg.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings", \
            ", or raise model.tiny.max_position_embeddings"
    else:
        limit, source, fix = hf.get("max_position_embeddings"), f"max_position_embeddings in {cfg.model.path}/config.json", ""
        if not isinstance(limit, int) or isinstance(limit, bool):
            return  # vLLM reads other keys then
        rope = hf.get("rope_scaling") or hf.get("rope_parameters")
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if isinstance(factor, (int, float)) and factor > 1:  # an upper bound: vLLM scales by it for most RoPE types
            limit, source = int(limit * factor), f"{source}, times its RoPE factor {factor:g}"
    if want > limit:
        raise ConfigError("rollout.max_model_len", f"{want} is above the {limit} positions the model has ({source}); "
                          f"vLLM refuses such an engine: lower rollout.max_model_len{fix}")


def check_fits_locally(cfg: RunConfig) -> None:
    """The run's actors against the Ray cluster the driver will start on this machine (cluster.num_cpus,
    else the CPUs this process may use; the GPUs torch sees), as cluster.Placement counts them: one CPU
    per actor placed separately (a hundredth colocated), and RunConfig.gpus GPUs. PlacementError if they
    do not fit. A run on an existing Ray cluster (cluster.address, RAY_ADDRESS) is sized once connected."""
    import ray

    from moe_rl.cluster import PlacementError

    if cfg.cluster.address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        return
    counts = {role: n for role, n in cfg.actors.items() if n}
    actors, per_actor = sum(counts.values()), 0.01 if cfg.cluster.colocate else 1.0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = {"GPU": cfg.gpus, "CPU": cfg.gpus * per_actor} if gpus else {"CPU": actors * per_actor}
    have = {"GPU": gpus, "CPU": cfg.cluster.num_cpus or len(os.sched_getaffinity(0))}
    for kind in ("GPU", "CPU"):
        if need.get(kind, 0) > have[kind] + 1e-9:
            given = f"cluster.num_cpus={cfg.cluster.num_cpus}" if kind == "CPU" and cfg.cluster.num_cpus else \
                "the CPUs this process may use" if kind == "CPU" else "the GPUs this machine shows"
            raise PlacementError(f"the run needs {need[kind]:g} {kind} for {actors} actors ({counts}), the local Ray "
                                 f"cluster would have {have[kind]:g} ({given}); use cluster.colocate=true, fewer ranks "
                                 "or engines, or a larger cluster")


def check_writable(out: Path) -> None:
    """run.output_dir made (with its parents) and written to: ConfigError naming it if it cannot be."""
    probe = out / f".moe_rl_write_test_{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError("run.output_dir", f"cannot write to '{out}' ({err.strerror or err}); give a directory "
                          "this user can create and write") from None


def start(cfg: RunConfig, out: Path, prompts: list[dict], eval_prompts: list[dict]):
    """Ray, the placement, the trainer groups and the engines, on the run's model."""
    import ray

    from moe_rl import cluster
    from moe_rl.algos.gae import prepare_kernel
    from moe_rl.rollouts import Rollouts
    from moe_rl.trainers import Models

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.run.seed)
    t0 = t = time.perf_counter()
    took = {}  # the start-up's phases, in seconds

    def phase(name: str) -> None:
        nonlocal t
        took[name], t = time.perf_counter() - t, time.perf_counter()

    # The driver imports on its main thread alone (tests/test_exit_paths.py): a model built in a thread
    # beside Ray's start raced this thread's imports (setuptools' sys.meta_path edits made the other miss a
    # module; a SIGINT inside an import lock here left the other waiting forever).
    path = model_path(cfg, out)
    if cfg.reward_model.path:  # its tokenizer must be the policy's: checked before anything starts
        check_same_tokens(path, cfg.reward_model.path)
    phase("model")
    say("preparing the fused GAE kernel (compiled once per machine, then cached)")
    say(f"GAE kernel {'ready' if prepare_kernel() else 'unavailable: the tensor path runs instead'} "
        f"({time.perf_counter() - t:.1f} s)")
    phase("GAE kernel")
    say(f"{'on the Ray this process started' if ray.is_initialized() else 'starting Ray'}, "
        f"{cfg.parallel.world_size} policy rank(s){' + critic' if cfg.critic_enabled else ''} and "
        f"{cfg.rollout.num_engines} vLLM engine(s)")
    cluster.start_ray(cfg)
    phase("Ray")
    cluster.check_interrupted()
    place = cluster.Placement(cfg, cfg.actors)
    cluster.RUN_PARTS.append(place)  # its placement group is removed on every exit path (cluster.shutdown)
    if place.engines_first:  # colocated on GPUs: each engine profiles its GPUs' memory alone (cluster.engines_first)
        rollouts = Rollouts(cfg, place, path, prompts, eval_prompts)
        cluster.RUN_PARTS.append(rollouts)  # stopped on every exit path (cluster.shutdown)
        rollouts.started()
        phase("engines")
        models = Models(cfg, place, path)
        cluster.RUN_PARTS.append(models)
        models.started()
        phase("trainer ranks (after the engines)")
    else:
        models, rollouts = Models(cfg, place, path), Rollouts(cfg, place, path, prompts, eval_prompts)
        cluster.RUN_PARTS.extend([models, rollouts])  # stopped on every exit path (cluster.shutdown)
        models.started()  # the trainer ranks and the engines start side by side: wait for them all
        phase("trainer ranks")
        rollouts.started()
        phase("engines (beyond the ranks)")
    say("placement: " + "; ".join([f"{k} ranks on {', '.join(g.nodes)} ({threads(g.threads)})" for k, g in models.groups().items()]
                                  + [f"engines on {', '.join(rollouts.nodes)} ({threads(rollouts.threads)})"]))
    cluster.check_interrupted()
    rollouts.connect(models.policy)
    phase("weight-sync connect")
    say(f"weight sync: {cfg.rollout.weight_transfer}")
    say(f"start-up: {time.perf_counter() - t0:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()) + ")")
    return models, rollouts


def model_path(cfg: RunConfig, out: Path) -> str:
    """The run's model: model.path, or a tiny one built from model.tiny in run.output_dir."""
    path = cfg.model.path
    if not path:
        from moe_rl.tiny import build_tiny_checkpoint

        path = str(build_tiny_checkpoint(out / "base_model", cfg.model.tiny, seed=cfg.run.seed))
    return path


def threads(counts: list[int]) -> str:
    """'2 threads each', or each process's count where they differ."""
    if len(set(counts)) == 1:
        return f"{counts[0]} thread{'s' if counts[0] > 1 else ''}{' each' if len(counts) > 1 else ''}"
    return "threads " + ", ".join(map(str, counts))


def check_same_tokens(policy_path: str, reward_model_path: str) -> None:
    """The reward model reads the policy's token ids: its tokenizer must be the policy's (the same
    vocabulary, where it has one; else the same vocabulary size). CheckpointError otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    from moe_rl.weights.hf import CheckpointError

    try:
        same = AutoTokenizer.from_pretrained(reward_model_path).get_vocab() == AutoTokenizer.from_pretrained(policy_path).get_vocab()
    except (OSError, ValueError):  # no tokenizer beside the reward model: its embedding table must fit at least
        same = AutoConfig.from_pretrained(reward_model_path).vocab_size == AutoConfig.from_pretrained(policy_path).vocab_size
    if not same:
        raise CheckpointError(f"reward_model.path: '{reward_model_path}' has another tokenizer than the policy's "
                              f"({policy_path}); it would score token ids it does not know")


def prepare(cfg: RunConfig, models, rollouts) -> dict[str, float]:
    """A fresh run before RL: the supervised warm start (its figures returned), the EWMA anchor."""
    summary = {}
    tr = cfg.trainer
    if tr.warm_start_steps:
        say(f"supervised warm start: {tr.warm_start_steps} steps on scripted-expert episodes")
        summary |= models.policy.warm_start(rollouts.demonstrations(tr.warm_start_steps, tr.warm_start_batch), tr.warm_start_lr)
        rollouts.sync(models.policy, 0)
    models.policy.init_anchor()  # RL starts here: theta_bar_0 = theta_0 (after any warm start)
    return summary


SUMMARY_FILE = "summary.json"


def write_summary(out: Path, summary: dict, evals: dict[int, dict]) -> dict:
    """summary.json: the warm start's figures, every evaluation by step, the first's and the last's as
    eval/KEY_before and _after, and the best step after RL began (by eval/reward_mean). Written after
    every evaluation, so a run that stops keeps them. Returns what it wrote."""
    out_summary = dict(summary)
    if evals:
        first, last = min(evals), max(evals)
        out_summary |= {f"{k}_before": v for k, v in evals[first].items()} if first == 0 else {}
        out_summary |= {f"{k}_after": v for k, v in evals[last].items()}
        out_summary["evaluations"] = {str(k): v for k, v in sorted(evals.items())}
        scored = [k for k in evals if k > 0 and evals[k]["eval/reward_mean"] == evals[k]["eval/reward_mean"]]  # not NaN
        if scored:
            out_summary["best_eval_step"] = max(scored, key=lambda k: evals[k]["eval/reward_mean"])
    (out / SUMMARY_FILE).write_text(json.dumps(out_summary, indent=1))
    return out_summary


def earlier_summary(out: Path, step: int) -> tuple[dict, dict[int, dict]]:
    """What a resumed run keeps of the earlier tries' summary.json: the warm start's figures and the
    evaluations up to `step` (its checkpoint); nothing if there is none."""
    try:
        saved = json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}, {}
    evals = {int(k): v for k, v in saved.get("evaluations", {}).items() if int(k) <= step}
    return {k: v for k, v in saved.items() if k.startswith("warm_start/")}, evals


def report(out: Path, summary: dict, evals: dict[int, dict], history: list[dict], steps: int) -> None:
    """summary.json (`write_summary`) and the closing lines."""
    summary = write_summary(out, summary, evals)
    lines = [f"run finished: {steps} steps, output in {out}"]
    if "best_eval_step" in summary:
        best = summary["best_eval_step"]
        ckpt = out / "checkpoints" / f"step_{best:06d}"
        reward, before = evals[best]["eval/reward_mean"], evals.get(0, {}).get("eval/reward_mean", float("-inf"))
        lines.append(f"best evaluation: step {best} (held-out reward {reward:.3f}"
                     + (f", below the {before:.3f} before RL" if before > reward else "")
                     + f"; checkpoint {ckpt if ckpt.is_dir() else 'not kept'})")
    if "eval/reward_mean_before" in summary and "eval/reward_mean_after" in summary:
        lines.append(f"held-out reward: {summary['eval/reward_mean_before']:.3f} -> {summary['eval/reward_mean_after']:.3f}"
                     f"   success rate: {summary['eval/success_rate_before']:.3f} -> {summary['eval/success_rate_after']:.3f}")
    if history:
        lines.append(f"training reward: first step {history[0].get('reward/mean', float('nan')):.3f}, "
                     f"last step {history[-1].get('reward/mean', float('nan')):.3f}")
    print("\n".join(lines), flush=True)
