"""What a user can get wrong, checked before Ray and vLLM start (20-45 s): `preflight`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moe_rl.config import RunConfig, dump_yaml
from moe_rl.driver.report import CONFIG_FILE, say
from moe_rl.schema import ConfigError

if TYPE_CHECKING:
    from moe_rl.rollout.envs import EnvSpec


def preflight(cfg: RunConfig, out: Path, env: EnvSpec,
              resume_with_changes: bool = False) -> tuple[list[dict], list[dict]]:
    """What a user can get wrong, checked before Ray and vLLM start (which takes 20-45 s): the output
    directory (given, a directory, writable), the model (and a context vLLM would refuse), the training
    and held-out prompts (returned) with the environment (`env`) tried on the first one, the checkpoint
    to resume from (`check_resume_point`), and whether the actors fit the local Ray cluster the run will
    start."""
    from moe_rl.config.rules import check_layout_fits_hf_config, check_lora_rank_hf, check_model_features
    from moe_rl.driver.prompts import evaluation_prompts, training_prompts
    from moe_rl.rollout.envs import try_first_prompt
    from moe_rl.weights.hf import (
        CheckpointError,
        check_causal_lm_dir,
        check_model_dir,
        check_reward_model_dir,
    )

    if not cfg.run.output_dir.strip():
        raise ConfigError("run.output_dir", "is empty: the run would write into the current directory; give "
                          "it a directory of its own, e.g. run.output_dir=runs/NAME")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"run.output_dir: '{out}' is a file, not a directory")
    hf = check_model_dir(cfg.model.path) if cfg.model.path else None
    if hf is not None:
        check_layout_fits_hf_config(cfg.parallel, hf)
        check_lora_rank_hf(cfg.model.lora, hf)
        check_model_features(cfg, hf)
    check_context_length(cfg, hf)
    if cfg.reward_model.path:  # placed like the policy: the same layout must fit it
        check_layout_fits_hf_config(cfg.parallel, check_reward_model_dir(cfg.reward_model.path))
    for name, path in cfg.teacher.all.items() if cfg.teachers else ():  # in the teachers' own layout
        hf_teacher = check_causal_lm_dir(path, teacher_field(name))
        try:
            check_layout_fits_hf_config(cfg.teacher_parallel, hf_teacher)
        except ConfigError as err:  # parallel.X names the run's layout; the teachers' is teacher.X
            raise ConfigError(teacher_field(name), f"'{path}' does not fit the teachers' layout (teacher.tp/"
                              f"pp/ep, else parallel.*): {str(err).replace('parallel.', '')}") from None
        limit, source = positions(hf_teacher, f"{path}/config.json")
        if limit is not None and limit < cfg.rollout.max_model_len:
            raise ConfigError(teacher_field(name), f"'{path}' has {limit} positions ({source}), fewer than "
                              f"rollout.max_model_len={cfg.rollout.max_model_len}: it could not score an "
                              "episode's later tokens")
    prompts, eval_prompts = training_prompts(cfg, env), evaluation_prompts(cfg, env)
    if cfg.teachers:
        check_rows_have_teachers(cfg, prompts)
    e = cfg.environment
    try_first_prompt(env, prompts[0], f"the first row of {e.dataset}" if e.dataset else
                     f"the first prompt {e.name} generated")
    if cfg.trainer.eval_dataset and eval_prompts:
        try_first_prompt(env, eval_prompts[0], f"the first row of {cfg.trainer.eval_dataset}")
    check_resume_point(cfg, out, resume_with_changes)
    check_fits_locally(cfg)
    check_writable(out)
    return prompts, eval_prompts


def teacher_field(name: str) -> str:
    """The config field of teacher `name` ("": teacher.path)."""
    return f"teacher.named.{name}" if name else "teacher.path"


def check_rows_have_teachers(cfg: RunConfig, prompts: list[dict]) -> None:
    """Every training row's teacher exists: the one its `teacher` field names (teacher.named), or
    teacher.path for a row that names none. ConfigError naming the first row that has none."""
    for i, row in enumerate(prompts):
        name = str(row.get("teacher") or "")  # null (a Parquet row without one): the default teacher
        if name not in cfg.teacher.all:
            dataset = cfg.environment.dataset
            where = f"row {i + 1} of {dataset}" if dataset else f"prompt {i + 1}"
            raise ConfigError("teacher.named" if name else "teacher.path",
                              f"{where} names teacher '{name}', which is not configured (named: "
                              f"{sorted(cfg.teacher.named) or 'none'})" if name else
                              f"{where} names no teacher and teacher.path is empty: give the row a `teacher` "
                              f"field (one of {sorted(cfg.teacher.named)}) or set teacher.path")


def check_resume_point(cfg: RunConfig, out: Path, resume_with_changes: bool) -> None:
    """The checkpoint the run will resume from, if any: the run directory's config.yaml against `cfg`
    (only checkpoints.RESUMABLE_CHANGES may differ, unless `resume_with_changes`; every change is said),
    its files whole (`checkpoints.check_resume`), and steps left to take (a launcher's retry of a run
    that reached run.steps finishes what came after its last step)."""
    import yaml

    from moe_rl.driver.run_checkpoints import (
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
        raise ConfigError("run.output_dir", f"'{out}' holds a run of another config, to be resumed from "
                          f"{resume.name}: {show_changes(refused)} (its {CONFIG_FILE} against this one). "
                          "Start a new run in another run.output_dir, put these settings back, or resume "
                          "with them changed: moe-rl train --resume-with-changes (run.steps, logging.*, "
                          "checkpoint.every/keep/at_end/resume and cluster addresses, threads and timeouts "
                          "may change without it)")
    roles = ["policy", "critic"] if cfg.critic_enabled else ["policy"]
    st = check_resume(resume, roles,
                      auto=cfg.checkpoint.resume == "auto" and resume.parent == out / "checkpoints")
    if st["step"] >= cfg.run.steps and not written_by_this_try(resume):
        raise ConfigError("run.steps", f"{cfg.run.steps}: this run already reached it ({resume} is step "
                                       f"{st['step']}); "
                          "raise run.steps to continue it, or start over in a new run.output_dir")
    if changes:
        say(f"resuming from {resume} with settings changed since {CONFIG_FILE}: "
            f"{show_changes(changes, len(changes))}")


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
        limit, source = positions(hf, f"{cfg.model.path}/config.json")
        fix = ""
        if limit is None:
            return  # vLLM reads other keys then
    if want > limit:
        raise ConfigError("rollout.max_model_len", f"{want} is above the {limit} positions the model has "
                          f"({source}); vLLM refuses such an engine: lower rollout.max_model_len{fix}")


def positions(hf: dict, where: str) -> tuple[int | None, str]:
    """The positions a Hugging Face config gives (max_position_embeddings, times its RoPE scaling factor
    where it has one: an upper bound, as vLLM scales by it for most RoPE types) and where that comes
    from; None where the config has no such key."""
    limit, source = hf.get("max_position_embeddings"), f"max_position_embeddings in {where}"
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None, source
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        limit, source = int(limit * factor), f"{source}, times its RoPE factor {factor:g}"
    return limit, source


def check_fits_locally(cfg: RunConfig) -> None:
    """The run's actors against the Ray cluster the driver will start on this machine (cluster.num_cpus,
    else the CPUs this process may use; the GPUs torch sees), as placement.Placement counts them: one CPU
    per actor placed separately (a hundredth colocated), and RunConfig.gpus GPUs. PlacementError if they
    do not fit. A run on an existing Ray cluster (cluster.address, RAY_ADDRESS) is sized once connected."""
    import ray

    from moe_rl.driver.placement import PlacementError

    if cfg.cluster.ray_address or ray.is_initialized():
        return
    counts = {role: n for role, n in cfg.actors.items() if n}
    actors, per_actor = sum(counts.values()), 0.01 if cfg.cluster.colocate else 1.0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = {"GPU": cfg.gpus, "CPU": cfg.gpus * per_actor} if gpus else {"CPU": actors * per_actor}
    have = {"GPU": gpus, "CPU": cfg.cluster.num_cpus or len(os.sched_getaffinity(0))}
    for kind in ("GPU", "CPU"):
        if need.get(kind, 0) > have[kind] + 1e-9:
            given = f"cluster.num_cpus={cfg.cluster.num_cpus}" if kind == "CPU" and cfg.cluster.num_cpus \
                else \
                "the CPUs this process may use" if kind == "CPU" else "the GPUs this machine shows"
            raise PlacementError(f"the run needs {need[kind]:g} {kind} for {actors} actors ({counts}), the "
                                 f"local Ray cluster would have {have[kind]:g} ({given}); use "
                                 "cluster.colocate=true, fewer ranks or engines, or a larger cluster")


def check_writable(out: Path) -> None:
    """run.output_dir made (with its parents) and written to: ConfigError naming it if it cannot be."""
    probe = out / f".moe_rl_write_test_{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError("run.output_dir", f"cannot write to '{out}' ({err.strerror or err}); give a "
                          "directory this user can create and write") from None
