"""The trainer's optimizer settings and the megatron-core OptimizerConfig a trainer rank builds from them:
Adam, megatron's distributed optimizer where it shards something, the share of its state on the host
(trainer.optimizer_offload) and the precision-aware optimizer (trainer.precision_aware_optimizer).
Imports no torch at module level: the planner (moe_rl/plan.py) reads `shards_optimizer` here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimSpec:
    """Built from the config by moe_rl.driver.specs.optim_spec (defaults live in the config sections,
    config/run.py and config/learning.py)."""

    lr: float  # trainer.lr or critic.lr
    lr_mult: tuple[tuple[str, float], ...]  # trainer.lr_mult or critic.lr_mult: (glob, factor) pairs
    weight_decay: float  # trainer.*
    adam_beta1: float
    adam_beta2: float
    grad_clip: float
    distributed_optimizer: bool  # parallel.distributed_optimizer
    micro_batch_tokens: int  # trainer.*
    pack_sequences: bool  # trainer.*; THD: a microbatch's sequences end to end in one row (train/packing.py)
    logit_chunk_tokens: int  # trainer.*: log-probs this many tokens at a time (train/logprobs.py; 0: whole)
    optimizer_offload: float  # trainer.*: the share of the optimizer's state and step on the host
    precision_aware: bool  # trainer.precision_aware_optimizer
    adam_moments_dtype: str  # trainer.*: under the precision-aware optimizer without offload
    adam_eps: float = 1e-8  # no config field


def offload_config(fraction: float) -> dict:
    """megatron-core OptimizerConfig fields for `fraction` of the optimizer's state on the host: its
    HybridDeviceOptimizer keeps that share of the fp32 copies and Adam moments in pinned host memory and
    steps them with torch's CPU AdamW; copies overlapped with the CPU step (CUDA only: config.rules)."""
    if not fraction:
        return {}
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                overlap_cpu_optimizer_d2h_h2d=True, pin_cpu_grads=True, pin_cpu_params=True)


def precision_config(precision_aware: bool, moments_dtype: str) -> dict:
    """megatron-core OptimizerConfig fields of the precision-aware optimizer: the fp32 main weights owned by
    the optimizer (Transformer Engine's FusedAdam, which keeps their 16-bit remainders; under offload the
    HybridDeviceOptimizer), Adam's moments in `moments_dtype` (CUDA and a bf16 model only: config.rules)."""
    if not precision_aware:
        return {}
    import torch

    moments = {"float32": torch.float32, "bfloat16": torch.bfloat16}[moments_dtype]
    return dict(use_precision_aware_optimizer=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)


def shards_optimizer(distributed_optimizer: bool, dp: int, offload: float, precision_aware: bool) -> bool:
    """Whether a trainer uses megatron's distributed optimizer: where parallel.distributed_optimizer asks
    for it and there is something to shard (at dp 1 it only adds copies: 3x optimizer time on CPU), and
    always under optimizer offload (HybridDeviceOptimizer steps fp32 shards) and the precision-aware
    optimizer (megatron supports it with the distributed optimizer only)."""
    return distributed_optimizer and dp > 1 or bool(offload) or precision_aware


def uses_distributed_optimizer(optim: OptimSpec, dp: int) -> bool:
    """shards_optimizer for a trainer rank's settings at data-parallel size `dp`."""
    return shards_optimizer(optim.distributed_optimizer, dp, optim.optimizer_offload, optim.precision_aware)


def optimizer_config(optim: OptimSpec, distributed: bool, params_dtype: torch.dtype):
    """The OptimizerConfig of a trainer rank: Adam with `optim`'s settings over parameters of `params_dtype`
    (bf16 ones: fp32 main weights beside them)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps, clip_grad=optim.grad_clip,
        use_distributed_optimizer=distributed, bf16=params_dtype is torch.bfloat16, params_dtype=params_dtype,
        **offload_config(optim.optimizer_offload),
        **precision_config(optim.precision_aware, optim.adam_moments_dtype))


def lr_mult_setting(role: str) -> str:
    """The config field a role's multipliers come from: trainer.lr_mult (policy) or critic.lr_mult."""
    return f"{'trainer' if role == 'policy' else 'critic'}.lr_mult"


def apply_lr_mult(module, lr_mult: tuple[tuple[str, float], ...], setting: str,
                  names: dict[str, str]) -> None:
    """Check `lr_mult`'s globs against `module`'s trainable parameters (one pipeline stage and expert rank's
    megatron-core module, before its DistributedDataParallel wrapper), and freeze those a factor of 0
    matches: no gradient, no optimizer state, no part of the gradient norm. The globs (fnmatch) see `names`
    (the module's parameter names -> the whole model's: global layer and expert numbers; a name not there
    as it is). Raises ValueError naming `setting` for a glob that matches no parameter on any rank, a
    parameter two globs match, or a rank the zeros leave with nothing to train. Collective over the default
    process group where `lr_mult` is set."""
    import fnmatch
    import itertools

    import torch

    if not lr_mult:
        return
    trainable = {names.get(n, n): p for n, p in module.named_parameters() if p.requires_grad}
    matched = {glob: {n for n in trainable if fnmatch.fnmatchcase(n, glob)} for glob, _ in lr_mult}
    frozen = set().union(*(matched[glob] for glob, factor in lr_mult if factor == 0))
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, ({glob: len(found) for glob, found in matched.items()},
                                                 len(trainable) - len(frozen)))
    for glob, _ in lr_mult:
        if not any(rank[glob] for rank, _ in counts):
            raise ValueError(f"{setting}: {glob!r} matches none of the model's trainable parameters, named "
                             f"like {', '.join(list(trainable)[:3])}")
    for (glob, found), (other, found_too) in itertools.combinations(matched.items(), 2):
        if both := found & found_too:
            raise ValueError(f"{setting}: {glob!r} and {other!r} both match {min(both)}: one glob a "
                             "parameter")
    if idle := [rank for rank, (_, left) in enumerate(counts) if not left]:
        raise ValueError(f"{setting}: its factors of 0 freeze every trainable parameter of rank(s) "
                         f"{', '.join(map(str, idle))}: leave something to train")
    for name in frozen:
        trainable[name].requires_grad_(False)


def lr_mult_overrides(config, lr_mult: tuple[tuple[str, float], ...], names: dict[str, str]) -> dict:
    """megatron-core's optimizer overrides under OptimizerConfig `config`: its standard ones (no weight
    decay on biases and norms) and an `lr_mult` for the parameters each glob of `lr_mult` with a factor
    other than 0 matches (`apply_lr_mult` checked the globs and froze the zeros' parameters). The globs see
    `names` as there; megatron names a parameter as its DistributedDataParallel wrapper does."""
    import fnmatch

    from megatron.core.optimizer import ParamKey, ParamWithNamePredicate, get_standard_config_overrides

    def seen(wrapped: str) -> str:
        local = wrapped.removeprefix("module.")
        return names.get(local, local)

    overrides = get_standard_config_overrides(config)
    for glob, factor in lr_mult:
        if factor == 0:
            continue
        match = ParamWithNamePredicate(name=f"lr_mult {glob}",
                                       fn=lambda _, name, glob=glob: fnmatch.fnmatchcase(seen(name), glob))
        overrides[ParamKey(with_name_predicate=match)] = {"lr_mult": float(factor)}
    return overrides
