"""Settings that nothing in the run reads: each registered method's declared settings and each Switch's (a
choice on which some settings depend) are read only where their method or choice is on; a setting given
in the config file or on the command line while nothing reads it is refused in one line, and one that a
command-line change makes inert is named in one warning (`check_settings_are_read`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from moe_rl.schema import ConfigError


@dataclass(frozen=True)
class Switch:
    """A choice, other than a registered method, on which some settings depend: they are read only when
    it is on (`on(cfg)`). `reads`: field paths; 'section.sub.*' stands for every field below it."""

    choice: str  # the choice, as a message names it
    on: Callable
    reads: tuple[str, ...]


def _critic(cfg) -> bool:
    return cfg.critic_enabled


def _env_class(cfg):
    from moe_rl.rollout.envs import get_env

    return get_env(cfg.environment.name)


SWITCHES = (
    Switch("algorithm.aggregation=seq_sum_const", lambda c: c.algorithm.aggregation == "seq_sum_const",
           ("algorithm.loss_constant",)),
    Switch("algorithm.anchor=ewma", lambda c: c.algorithm.anchor == "ewma", ("algorithm.ewma_decay",)),
    Switch("algorithm.overlong_buffer > 0", lambda c: c.algorithm.overlong_buffer > 0,
           ("algorithm.overlong_penalty",)),
    Switch("algorithm.kl_reward_coef > 0", lambda c: c.algorithm.kl_reward_coef > 0,
           ("algorithm.kl_reward_estimator",)),
    Switch("algorithm.kl_loss_coef > 0", lambda c: c.algorithm.kl_loss_coef > 0,
           ("algorithm.kl_loss_estimator",)),
    Switch("a critic (algorithm.advantage=gae)", _critic,
           ("critic.init_from", "critic.lr", "critic.lr_mult", "critic.value_clip", "critic.warmup_steps")),
    Switch("the tiny model (model.path empty)", lambda c: not c.model.path, ("model.tiny.*",)),
    Switch("rollout.async_mode=true", lambda c: c.rollout.async_mode,
           ("rollout.max_staleness", "rollout.async_depth")),
    Switch("environment.dynamic_sampling=true", lambda c: c.environment.dynamic_sampling,
           ("environment.max_resample_rounds",)),
    Switch("an environment whose tools read it (Environment.reads_tool_timeout: calculator)",
           lambda c: _env_class(c).reads_tool_timeout, ("environment.tool_timeout_s",)),
    Switch("rollout.record_routes=true (the routes they show)", lambda c: c.rollout.record_routes,
           ("logging.heatmap_every", "logging.routing_diagnostics_every")),
    Switch("rollout.record_routes=false (replayed routes keep the expert bias frozen)",
           lambda c: not c.rollout.record_routes, ("model.expert_bias_update_rate",)),
    Switch("logging.samples > 0", lambda c: c.logging.samples > 0, ("logging.samples_every",)),
    Switch("logging.backends with wandb", lambda c: "wandb" in c.logging.backends, ("logging.wandb_dir",)),
    Switch("logging.backends with mlflow", lambda c: "mlflow" in c.logging.backends,
           ("logging.mlflow_tracking_uri",)),
    Switch("a run that writes checkpoints (checkpoint.every > 0 or checkpoint.at_end=true)",
           lambda c: c.checkpoint.every > 0 or c.checkpoint.at_end, ("checkpoint.keep",)),
    Switch("a dataset (environment.dataset or trainer.eval_dataset)",
           lambda c: bool(c.environment.dataset or c.trainer.eval_dataset), ("environment.dataset_fields",)),
    Switch("trainer.warm_start_steps > 0", lambda c: c.trainer.warm_start_steps > 0,
           ("trainer.warm_start_lr", "trainer.warm_start_batch", "trainer.warm_start_policy")),
    Switch("trainer.lr_schedule=linear or cosine", lambda c: c.trainer.lr_schedule != "constant",
           ("trainer.lr_decay_steps", "trainer.lr_min")),
    Switch("evaluation (trainer.eval_prompts > 0)", lambda c: c.trainer.eval_prompts > 0,
           ("trainer.eval_every", "trainer.eval_dataset", "trainer.eval_samples", "trainer.eval_greedy")),
    # packing is for variable-length rows of one CP rank: CP splits rows into chunks, and megatron-core's
    # allgather dispatcher under expert parallelism needs equal-shaped microbatches
    Switch("parallel.cp=1 without model.moe_dispatcher=allgather under parallel.ep > 1",
           lambda c: c.parallel.cp == 1 and not (c.model.moe_dispatcher == "allgather" and c.parallel.ep > 1),
           ("trainer.pack_sequences",)),
    Switch("parallel.dp > 1", lambda c: c.parallel.dp > 1, ("trainer.dp_balance",)),
    Switch("trainer.precision_aware_optimizer=true", lambda c: c.trainer.precision_aware_optimizer,
           ("trainer.adam_moments_dtype",)),
    Switch("reward_model.path", lambda c: bool(c.reward_model.path),
           ("reward_model.weight", "reward_model.rule_weight")),
    Switch("model.lora.rank > 0", lambda c: c.model.lora.rank > 0,
           ("model.lora.alpha", "model.lora.targets", "model.lora.sync")),
    Switch("algorithm.distill_coef > 0", lambda c: c.algorithm.distill_coef > 0,
           ("teacher.path", "teacher.named", "teacher.tp", "teacher.pp", "teacher.ep", "teacher.dtype")),
)


def leaf_paths(obj, prefix: str = "") -> dict[str, object]:
    """Every leaf field of a config dataclass tree: dotted path -> value."""
    out = {}
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), f"{prefix}{f.name}"
        out |= leaf_paths(value, path + ".") if dataclasses.is_dataclass(value) else {path: value}
    return out


def conditional_readers(cfg) -> dict[str, list[tuple[str, bool]]]:
    """The settings that only some choices read: path -> [(choice, whether this config makes it)], from
    the method registry (each method's declared `params`, fields of the algorithm section) and SWITCHES."""
    from moe_rl.algos import registry

    paths = list(leaf_paths(cfg))
    algorithm_fields = {f.name for f in dataclasses.fields(cfg.algorithm)}
    readers: dict[str, list[tuple[str, bool]]] = {}
    for kind in registry.KINDS:
        chosen = getattr(cfg.algorithm, kind)
        for name in registry.names(kind):
            for param in sorted(registry.meta(kind, name).params & algorithm_fields):
                readers.setdefault(f"algorithm.{param}",
                                   []).append((f"algorithm.{kind}={name}", name == chosen))
    for switch in SWITCHES:
        on = bool(switch.on(cfg))
        for pattern in switch.reads:
            matched = [p for p in paths if p == pattern
                       or (pattern.endswith(".*") and p.startswith(pattern[:-1]))]
            if not matched:
                raise KeyError(f"Switch {switch.choice!r} reads {pattern!r}, which is no config field")
            for path in matched:
                readers.setdefault(path, []).append((switch.choice, on))
    return readers


def check_settings_are_read(cfg, file_cfg=None, overridden: set[str] = frozenset()) -> None:
    """A setting set away from its default that no choice of this run reads is refused, in one line
    naming the setting and the choices that read it: a value without effect is a mistake to show, not
    to keep (algorithm.dual_clip with gspo, critic.lr without a critic, ...). One the config file set, that
    the file's own choices read and the command line's `overridden` settings turned off (`file_cfg`: the
    file's config alone), is named in a ConfigWarning instead: the command line switched a feature off, and
    its settings go with it."""
    import warnings

    from moe_rl.schema import ConfigWarning

    values, defaults = leaf_paths(cfg), leaf_paths(type(cfg)())
    in_file = conditional_readers(file_cfg) if file_cfg is not None else {}
    for path, readers in conditional_readers(cfg).items():
        if values[path] == defaults[path] or any(on for _, on in readers):
            continue
        choices = " or ".join(choice for choice, _ in readers)
        from_file = not any(path == key or path.startswith(key + ".") for key in overridden)
        if from_file and any(on for _, on in in_file.get(path, ())):
            warnings.warn(ConfigWarning(f"{path}: {values[path]!r} from the config file has no effect now "
                                        f"that the command line ({', '.join(sorted(overridden))}) turned off "
                                        f"what reads it ({choices}); ignored"), stacklevel=2)
            continue
        raise ConfigError(path, f"{values[path]!r} has no effect in this run: only {choices} reads it "
                          f"(leave it at its default, {defaults[path]!r})")
