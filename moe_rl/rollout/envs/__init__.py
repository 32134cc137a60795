"""Environments: one instance per conversation, asynchronous reset/step, registered by name.

Plug in your own:

    from moe_rl.rollout.envs import Environment, StepResult, register_env

    @register_env("my_task")
    class MyTask(Environment):
        async def reset(self, prompt: dict) -> list[dict]:      # chat messages that open the episode
            ...
        async def step(self, action_text: str) -> StepResult:  # the model's turn, decoded
            ...

then `environment.name: my_task` in the config. `prompt` is one dataset row (a dict); `options` come
from `environment.options` (plus `tool_timeout_s`, from `environment.tool_timeout_s`). Environments must
not block the event loop for long: run heavy work in a thread or use `moe_rl.rollout.sandbox` for
untrusted code.

Declare the options your environment reads and `moe-rl check-config` checks them (unknown keys, types,
your own rules) when the config loads; without a declaration any options are accepted:

    class MyTask(Environment):
        options_schema = {"max_len": int, "hint": str}      # name -> int, float, str or bool
        option_defaults = {"max_len": 32, "hint": ""}

        @classmethod
        def check_options(cls, options: dict) -> None:       # declared defaults filled in
            if options["max_len"] <= 0:
                raise ValueError(f"max_len={options['max_len']} must be positive")

A supervised warm start (`trainer.warm_start_steps`) needs a scripted expert: override `expert_turn`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar

_ENVS: dict[str, type] = {}


@dataclass
class StepResult:
    observation: str | None  # text shown to the model as the next user/tool message (None: nothing)
    reward: float = 0.0  # turn feedback for the model turn just taken
    done: bool = False  # the episode ended (true termination)
    final_reward: float | None = None  # R(tau) when done (defaults to 0)
    tool_error: bool = False  # this step's tool call failed (timeout, crash, bad call)
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class. Subclasses implement reset and step; one instance serves one conversation."""

    role_for_observations = "user"  # chat role under which observations are appended
    max_tool_errors = 3  # after this many failed tool calls the episode ends with outcome tool_error
    # The options read from `environment.options`: name -> type (int, float, str or bool), and their
    # defaults. None: undeclared, any options are accepted. `tool_timeout_s` is never declared here: it
    # comes from `environment.tool_timeout_s` and is always passed.
    options_schema: ClassVar[dict[str, type] | None] = None
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **options):
        self.options = options

    def option(self, name: str) -> Any:
        """`environment.options[name]`, or the declared default."""
        return self.options.get(name, self.option_defaults.get(name))

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """The environment's own rules over its options (declared defaults filled in, types already
        checked), run when the config loads. Raise ValueError with a one-line message. Default: none."""

    @classmethod
    def has_expert(cls) -> bool:
        """Whether the class has a scripted expert (overrides `expert_turn`) for supervised warm starts."""
        return getattr(cls.expert_turn, "__func__", None) is not Environment.expert_turn.__func__

    async def reset(self, prompt: dict) -> list[dict]:
        raise NotImplementedError

    async def step(self, action_text: str) -> StepResult:
        raise NotImplementedError

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """A scripted expert's next turn given the conversation so far (for supervised warm starts)."""
        raise NotImplementedError(f"{cls.__name__} has no scripted expert")

    @classmethod
    def generate_prompts(cls, n: int, seed: int, **options) -> list[dict]:
        """Prompts for environments that make their own (used when no dataset is configured)."""
        raise NotImplementedError(f"{cls.__name__} needs a dataset (environment.dataset)")


def register_env(name: str):
    def deco(cls):
        if name in _ENVS:
            raise KeyError(f"environment {name!r} is registered twice")
        _ENVS[name] = cls
        return cls

    return deco


def env_names() -> list[str]:
    _load_builtins()
    return sorted(_ENVS)


def get_env(name: str) -> type:
    _load_builtins()
    if name not in _ENVS:
        close = difflib.get_close_matches(name, _ENVS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise KeyError(f"unknown environment '{name}'{hint}; registered: {', '.join(sorted(_ENVS))}")
    return _ENVS[name]


def _load_builtins() -> None:
    from moe_rl.rollout.envs import arithmetic, calculator, guess, stated  # noqa: F401
