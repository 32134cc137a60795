"""The run's start-up: the model (built at tiny size where none is given), the GAE kernel, Ray, the
placement, the trainer groups and the engines, and the weight-sync connection between them."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import moe_rl
from moe_rl.config import RunConfig, dump_yaml
from moe_rl.driver.report import CONFIG_FILE, say
from moe_rl.driver.specs import RunSpecs


def start(cfg: RunConfig, spec: RunSpecs, out: Path, prompts: list[dict], eval_prompts: list[dict]):
    """Ray, the placement, the trainer groups and the engines (built from `spec`), on the run's model."""
    import ray

    from moe_rl.algos.gae import prepare_kernel
    from moe_rl.driver import placement, session
    from moe_rl.driver.rollout_manager import Rollouts
    from moe_rl.driver.trainer_groups import Models

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
    # the reward model's and the teachers' tokenizers must be the policy's: checked before anything starts
    from moe_rl.driver.preflight import teacher_field

    others = {"reward_model.path": cfg.reward_model.path,
              **{teacher_field(name): p for name, p in cfg.teacher.all.items() if cfg.teachers}}
    for field, other in others.items():
        if other:
            check_same_tokens(path, other, field)
    from moe_rl.weights.hf import mtp_names

    if mtp := mtp_names(path):
        say(f"the model's multi-token-prediction layer(s) ({len(mtp)} tensors) are neither built nor "
            "trained: checkpoints and Hugging Face exports carry them as the model has them")
    phase("model")
    say("preparing the fused GAE kernel (compiled once per machine, then cached)")
    say(f"GAE kernel {'ready' if prepare_kernel() else 'unavailable: the tensor path runs instead'} "
        f"({time.perf_counter() - t:.1f} s)")
    phase("GAE kernel")
    say(f"{'on the Ray this process started' if ray.is_initialized() else 'starting Ray'}, "
        f"{cfg.parallel.world_size} policy rank(s){' + critic' if cfg.critic_enabled else ''}"
        f"{f' + {len(cfg.teachers)} teacher(s)' if cfg.teachers else ''} and "
        f"{cfg.rollout.num_engines} vLLM engine(s)")
    session.start_ray(cfg)
    phase("Ray")
    session.check_interrupted()
    place = placement.Placement(cfg, cfg.actors)
    session.RUN_PARTS.append(place)  # its placement group is removed on every exit path (session.shutdown)
    # colocated on GPUs: each engine profiles its GPUs' memory alone (placement.engines_first)
    if place.engines_first:
        rollouts = Rollouts(cfg, place, spec, prompts, eval_prompts)
        session.RUN_PARTS.append(rollouts)  # stopped on every exit path (session.shutdown)
        rollouts.started()
        phase("engines")
        models = Models(cfg, place, spec)
        session.RUN_PARTS.append(models)
        models.started()
        phase("trainer ranks (after the engines)")
    else:
        models, rollouts = Models(cfg, place, spec), Rollouts(cfg, place, spec, prompts, eval_prompts)
        session.RUN_PARTS.extend([models, rollouts])  # stopped on every exit path (session.shutdown)
        models.started()  # the trainer ranks and the engines start side by side: wait for them all
        phase("trainer ranks")
        rollouts.started()
        phase("engines (beyond the ranks)")
    say("placement: " + "; ".join([f"{k} ranks on {', '.join(g.nodes)} ({threads(g.threads)})"
                                   for k, g in models.groups().items()]
                                  + [f"engines on {', '.join(rollouts.nodes)} "
                                     f"({threads(rollouts.threads)})"]))
    session.check_interrupted()
    rollouts.connect(models.policy)
    phase("weight-sync connect")
    say(sync_line(cfg, (rollouts.lora_sync, rollouts.lora_sync_why)))
    moe_rl.started()
    say(f"start-up: {time.perf_counter() - t0:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in took.items())
        + ")")
    return models, rollouts


def sync_line(cfg: RunConfig, lora_sync: tuple[str | None, str] = (None, "")) -> str:
    """How the engines get the policy's weights, as the start-up says it; `lora_sync`: what the engines
    resolved for a LoRA policy (rollout.engine_spec.resolve_lora_sync), and why."""
    lo, (mode, why) = cfg.model.lora, lora_sync
    if mode == "adapters":
        return (f"weight sync: LoRA adapters (rank {lo.rank}, alpha {lo.alpha:g}, on "
                f"{', '.join(lo.targets)}) through the object store, each sync a new vLLM adapter "
                "(LoRARequest); the base weights never move")
    line = f"weight sync: {cfg.rollout.weight_transfer}"
    if mode == "merged":
        line += (f", LoRA merged: the engines get W + (alpha/r) B A (rank {lo.rank}, alpha {lo.alpha:g}, "
                 f"on {', '.join(lo.targets)}), whole weights, not adapters ({why})")
    return line


def model_dir(cfg: RunConfig, out: Path) -> str:
    """Where the run's model is: model.path, or run.output_dir/base_model for the tiny one (`model_path`)."""
    return cfg.model.path or str(out / "base_model")


def model_path(cfg: RunConfig, out: Path) -> str:
    """The run's model: model.path, or a tiny one built from model.tiny at `model_dir`."""
    path = model_dir(cfg, out)
    if not cfg.model.path:
        from moe_rl.tiny import build_tiny_checkpoint

        build_tiny_checkpoint(path, cfg.model.tiny, seed=cfg.run.seed)
    return path


def threads(counts: list[int]) -> str:
    """'2 threads each', or each process's count where they differ."""
    if len(set(counts)) == 1:
        return f"{counts[0]} thread{'s' if counts[0] > 1 else ''}{' each' if len(counts) > 1 else ''}"
    return "threads " + ", ".join(map(str, counts))


def check_same_tokens(policy_path: str, other_path: str, field: str) -> None:
    """A model that reads the policy's token ids (a reward model, a teacher: config `field`) must have
    the policy's tokenizer (the same vocabulary, where it has one; else the same vocabulary size).
    CheckpointError otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    from moe_rl.weights.hf import CheckpointError

    try:
        same = (AutoTokenizer.from_pretrained(other_path).get_vocab()
                == AutoTokenizer.from_pretrained(policy_path).get_vocab())
    # no tokenizer beside the other model: its embedding table must fit at least
    except (OSError, ValueError):
        same = (AutoConfig.from_pretrained(other_path).vocab_size
                == AutoConfig.from_pretrained(policy_path).vocab_size)
    if not same:
        raise CheckpointError(f"{field}: '{other_path}' has another tokenizer than the policy's "
                              f"({policy_path}); it would score token ids it does not know")
