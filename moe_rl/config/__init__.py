"""Run configuration: frozen dataclasses are the schema, YAML files are the user's surface.

    cfg = load_config("configs/quickstart.yaml", ["algorithm.gamma=0.99", "parallel.tp=2"])

The sections live in run.py (run, model, parallel, logging, checkpoint, cluster, teacher) and learning.py
(rollout, environment, algorithm, trainer, critic, reward model); each field's docstring is its one
description, which `moe-rl config explain FIELD` answers from and docs/config.md is generated from
(docs.py). Every user error is a `ConfigError` whose message is one line naming the field path and
what is allowed: unknown keys (with a did-you-mean), wrong types, out-of-range values and incompatible
combinations. Validation happens at load: each section's fields (its `check`), rules.py (the rules
between sections) and moe_rl/schema.py (keys and types); the rest of the code trusts a `RunConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moe_rl.config.learning import (
    AlgorithmSection,
    CriticSection,
    EnvironmentSection,
    RewardModelSection,
    RolloutSection,
    TrainerSection,
)
from moe_rl.config.rules import check_compatible
from moe_rl.config.run import (
    Arch,
    CheckpointSection,
    ClusterSection,
    FP8Recipe,
    LoggingSection,
    LoraSection,
    ModelSection,
    ParallelSection,
    RunSection,
    TeacherSection,
    TinyModel,
)
from moe_rl.schema import ConfigError, build, check_tree, parse_overrides, read_yaml, set_dotted

__all__ = ["AlgorithmSection", "Arch", "CheckpointSection", "ClusterSection", "ConfigError", "CriticSection",
           "EnvironmentSection", "FP8Recipe", "LoggingSection", "LoraSection", "ModelSection",
           "ParallelSection",
           "RewardModelSection", "RolloutSection", "RunConfig", "RunSection", "TeacherSection", "TinyModel",
           "TrainerSection",
           "dump_yaml", "from_dict", "load_config", "parse_overrides", "to_dict"]


@dataclass(frozen=True)
class RunConfig:
    """A whole run: one section per part (each documented by its class)."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    critic: CriticSection = field(default_factory=CriticSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)

    @property
    def critic_enabled(self) -> bool:
        return self.algorithm.uses_critic if self.critic.enabled is None else self.critic.enabled

    @property
    def lr_decay_end(self) -> int:
        """The RL step at which the policy's learning-rate decay reaches trainer.lr_min."""
        return self.trainer.lr_decay_steps or self.run.steps

    @property
    def proximal_from_update(self) -> bool:
        """pi_old is the single update's own forward (trainer.proximal_pass=auto, when it applies)."""
        from moe_rl.algos import registry

        a, tr = self.algorithm, self.trainer
        return (tr.proximal_pass == "auto" and tr.epochs == 1 and tr.minibatches == 1 and a.anchor == "old"
                and not registry.meta("correction", a.correction).reweights
                and not (self.critic_enabled and self.critic.warmup_steps))

    @property
    def actors(self) -> dict[str, int]:
        """The run's actors: trainer ranks per model (0 where the algorithm needs none) and engines."""
        n = self.parallel.world_size
        return {"policy": n, "critic": n if self.critic_enabled else 0,
                "reference": n if self.uses_reference and not self.model.lora.rank else 0,
                "reward_model": n if self.reward_model.path else 0,
                **{slot: n for slot in self.teachers}, "engine": self.rollout.num_engines}

    @property
    def gpus(self) -> int:
        """GPUs the run needs on a GPU cluster: one per trainer rank of each model and per engine worker
        (engine_tp per engine). Colocated, the roles share them (rank i of every model and engine worker i
        on GPU i): as many as the largest role needs; separate, each its own: the sum."""
        a = self.actors
        per_role = [n for role, n in a.items() if role != "engine"] + [a["engine"] * self.rollout.engine_tp]
        return max(per_role) if self.cluster.colocate else sum(per_role)

    @property
    def teachers(self) -> dict[str, str]:
        """The distillation teachers' actor slots and checkpoints, in teacher.all's order: "teacher"
        (teacher.path), "teacher_NAME" (teacher.named); none without algorithm.distill_coef."""
        if not self.algorithm.distill_coef:
            return {}
        return {("teacher_" + name if name else "teacher"): path for name, path in self.teacher.all.items()}

    @property
    def teacher_parallel(self) -> ParallelSection:
        """The teachers' layout: parallel.* where teacher.tp / pp / ep are not set, over the same ranks (and
        parallel.etp only where the teachers keep parallel.tp: with a tp of their own, their experts split
        as megatron's default, over it)."""
        t = self.teacher
        own = {k: getattr(t, k) for k in ("tp", "pp", "ep") if getattr(t, k) is not None}
        return dataclasses.replace(self.parallel, **own, **({"etp": None} if "tp" in own else {}))

    @property
    def engine_gpu_share(self) -> float:
        """The share of its GPU an engine may take: rollout.gpu_memory_utilization, else the default for
        engines alone on their GPUs or colocated with the trainer (RolloutSection.GPU_MEMORY_UTILIZATION)."""
        share = self.rollout.gpu_memory_utilization
        return share if share is not None else RolloutSection.GPU_MEMORY_UTILIZATION[self.cluster.colocate]

    def lora_sync(self, cuda: bool) -> tuple[str, str]:
        """How the engines get a LoRA policy's weights on a machine with (or without) CUDA, "adapters" or
        "merged", and why (rollout.engine_spec.resolve_lora_sync; ValueError where model.lora.sync asks for
        what cannot run there)."""
        from moe_rl.rollout.engine_spec import resolve_lora_sync

        lo, r = self.model.lora, self.rollout
        return resolve_lora_sync(lo.sync, lo.rank, lo.targets, cuda, r.weight_transfer, r.engine_tp)

    @property
    def uses_reference(self) -> bool:
        """A KL term (in the reward or the loss) reads the reference policy: a model of its own, or with
        model.lora the policy's frozen base (the policy scored with its adapters off)."""
        return bool(self.algorithm.kl_loss_coef or self.algorithm.kl_reward_coef)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


# Settings that no longer exist: why, for configs written before.
_REMOVED = {
    "parallel.sequence_parallel": "removed: sequence parallelism is on exactly when parallel.tp > 1",
    "rollout.engine": "removed: vLLM is the only rollout engine",
    "rollout.in_process": "removed: it was never read",
    "logging.tensorboard": "removed: logging.backends lists the trackers ([tensorboard] as before; [] none)",
}


def from_dict(data: dict, overrides: list[str] = (), cuda_available: bool | None = None) -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"a config is a mapping of sections, got {type(data).__name__}")
    file_data, data = data, copy.deepcopy(data)
    overridden = parse_overrides(list(overrides))
    for key, value in overridden:
        set_dotted(data, key, value)
    cfg = build(RunConfig, data, "", _REMOVED)
    check_tree(cfg)
    if cuda_available is None and not cfg.cluster.ray_address:  # a cluster's GPUs: once joined (start_ray)
        import torch

        cuda_available = torch.cuda.is_available()
    # the rules between sections; the file's own settings that the command line made inert are warned of
    check_compatible(cfg, cuda_available, _file_config(file_data) if overridden else None,
                     {key for key, _ in overridden})
    return cfg


def _file_config(data: dict) -> RunConfig | None:
    """The config the file alone gives (before the command line's overrides), where it builds."""
    try:
        return build(RunConfig, copy.deepcopy(data), "", _REMOVED)
    except ConfigError:
        return None


def load_config(path: str | Path, overrides: list[str] = (), cuda_available: bool | None = None) -> RunConfig:
    return from_dict(read_yaml(path), overrides, cuda_available)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
