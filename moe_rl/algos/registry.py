"""Name -> function registries for the selectable pieces of the RL math, with what each method needs.

    @register("advantage", "grpo", min_group_size=2, params=frozenset({"eps"}))
    def grpo_advantage(...): ...

    get("advantage", "grpo")   # -> the function
    meta("advantage", "grpo")  # -> AdvantageMeta(needs_critic=False, min_group_size=2,
                               #                  params=frozenset({'eps'}))

Configs select methods by these names; `names(kind)` lists what a config may choose and `meta` what a
choice implies (for config checks and the driver), so no caller compares method names. Every kind's
`params` names the fields of its hyperparameter dataclass (AdvantageSpec, PolicyLossSpec,
CorrectionSpec, PolicyMaskSpec) that the method reads; the config refuses a setting of that name
that the chosen method does not read (moe_rl.config.rules), and tests/algos/test_registry.py checks
each declaration against what the function does. The method modules (advantages, correction, losses,
masking) register on import; the package moe_rl.algos imports them, and importing this module runs
the package first, so the registries are complete for every caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdvantageMeta:
    needs_critic: bool = False  # reads values_BT and boundary_value_B: the run trains a critic
    min_group_size: int = 1  # samples per prompt it needs; > 1: a baseline from the prompt's other samples
    params: frozenset[str] = frozenset()  # the AdvantageSpec fields it reads
    reads_reward: bool = True  # False: no task signal (A = 0): the run learns from distillation alone
    # its advantages are whitened over the batch's model tokens unless algorithm.whiten_advantages says
    # otherwise: on where the estimate needs a batch baseline or scale (GAE, REINFORCE++), off where it is
    # normalised within its prompt group already (GRPO, Dr.GRPO, RLOO: whitening again would move a group
    # whose rewards are all equal off 0 whenever length correlates with reward)
    whiten: bool = False

    @property
    def needs_groups(self) -> bool:
        """Reads group_B (the prompt groups)."""
        return self.min_group_size > 1


@dataclass(frozen=True)
class CorrectionMeta:
    reads_behaviour: bool = True  # needs mu's log-probs (the rollout's), as a weight or as pi_old
    old_is_behaviour: bool = False  # pi_old := mu: the PPO ratio is pi_theta / mu (no proximal pass)
    params: frozenset[str] = frozenset()  # the CorrectionSpec fields it reads

    @property
    def reweights(self) -> bool:
        """Weights or masks tokens by pi_old / mu (with pi_old its own policy, e.g. an EWMA anchor)."""
        return self.reads_behaviour and not self.old_is_behaviour


@dataclass(frozen=True)
class PolicyLossMeta:
    # defined per sequence (one ratio or objective per sample): seq_mean aggregation
    sequence_level: bool = False
    params: frozenset[str] = frozenset()  # the PolicyLossSpec fields it reads


@dataclass(frozen=True)
class PolicyMaskMeta:
    # "sequence": each sequence decided from its own tokens (in the loss, per microbatch); "batch": a
    # selection over the whole optimizer batch (on the driver, before the update)
    scope: str = "sequence"
    reads_behaviour: bool = True  # reads mu's log-probs (the rollout's)
    reads_old: bool = False  # decides from pi_theta / pi_old: nothing to mask while they are equal
    params: frozenset[str] = frozenset()  # the PolicyMaskSpec fields it reads


META = {"advantage": AdvantageMeta, "policy_loss": PolicyLossMeta, "correction": CorrectionMeta,
        "policy_mask": PolicyMaskMeta}
KINDS = tuple(META)
_REGISTRY: dict[str, dict[str, tuple[Callable, object]]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str, **meta) -> Callable[[Callable], Callable]:
    """Register fn as `name` of `kind`; `meta`: fields of the kind's META dataclass (unset ones take
    its defaults)."""
    if kind not in _REGISTRY:
        raise KeyError(f"unknown registry kind {kind!r}; kinds: {KINDS}")
    info = META[kind](**meta)

    def deco(fn: Callable) -> Callable:
        if name in _REGISTRY[kind]:
            raise KeyError(f"{kind} {name!r} is registered twice")
        _REGISTRY[kind][name] = (fn, info)
        return fn

    return deco


def _entry(kind: str, name: str) -> tuple[Callable, object]:
    entries = _REGISTRY[kind]
    if name not in entries:
        raise KeyError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(entries))}")
    return entries[name]


def get(kind: str, name: str) -> Callable:
    return _entry(kind, name)[0]


def meta(kind: str, name: str) -> AdvantageMeta | PolicyLossMeta | CorrectionMeta | PolicyMaskMeta:
    """What the method needs: an instance of META[kind]."""
    return _entry(kind, name)[1]


def names(kind: str) -> list[str]:
    return sorted(_REGISTRY[kind])
