"""Name -> function registries for the selectable pieces of the RL math.

    @register("advantage", "grpo")
    def grpo_advantage(...): ...

    get("advantage", "grpo")  # -> the function

Configs select methods by these names; `names(kind)` lists what a config may choose.
"""

from __future__ import annotations

from collections.abc import Callable

KINDS = ("advantage", "policy_loss", "correction")
_REGISTRY: dict[str, dict[str, Callable]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    if kind not in _REGISTRY:
        raise KeyError(f"unknown registry kind {kind!r}; kinds: {KINDS}")

    def deco(fn: Callable) -> Callable:
        if name in _REGISTRY[kind]:
            raise KeyError(f"{kind} {name!r} is registered twice")
        _REGISTRY[kind][name] = fn
        return fn

    return deco


def get(kind: str, name: str) -> Callable:
    _load_all()
    try:
        return _REGISTRY[kind][name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(_REGISTRY[kind]))}") from None


def names(kind: str) -> list[str]:
    _load_all()
    return sorted(_REGISTRY[kind])


def _load_all() -> None:
    # Importing the modules runs their @register decorators.
    from moe_rl.algos import advantages, correction, losses  # noqa: F401
