"""Environments: one instance per conversation, asynchronous reset/step; built in by name, or yours
by import path. The whole interface, the token and mask rules and two examples: docs/environments.md.

    from dataclasses import dataclass
    from moe_rl.rollout.envs import Environment, StepResult

    class MyTask(Environment):
        @dataclass(frozen=True)
        class Options:                                          # environment.options, checked at load
            max_len: int = 32

            def check(self):
                if self.max_len <= 0:
                    raise ValueError(f"max_len={self.max_len} must be positive")

        required_fields = ("prompt", "answer")                 # dataset rows must carry these

        async def reset(self, row: dict) -> list[dict]:       # chat messages that open the episode
            ...
        async def step(self, action_text: str) -> StepResult:  # the model's turn, decoded
            ...

then `environment.name: my_pkg.tasks:MyTask` (an importable module) or `path/to/tasks.py:MyTask` (a
file) in the config; the built-in ones are named (`moe-rl check-config --list`). A plain reward
function needs no class: `environment.name: single_turn` with `environment.reward_fn:
my_pkg.rewards:score`. Environments must not block the event loop for long: run heavy work in a thread,
or untrusted code through `moe_rl.rollout.sandbox`.

A supervised warm start (`trainer.warm_start_steps`) needs a scripted expert: override `expert_turn`.

Before anything starts, the driver makes one environment and calls its `trial` on the run's first
prompt (`try_first_prompt`): `reset` (and, for single_turn, the reward function on an empty answer). A
mistake in your code is then one line naming the setting, the exception and where it was raised,
instead of env_error counts after a minute of start-up.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

_ENVS: dict[str, type] = {}


@dataclass
class StepResult:
    observation: str | None  # text shown to the model as the next user/tool message (None: nothing)
    reward: float = 0.0  # turn feedback for the model turn just taken
    done: bool = False  # the episode ended (true termination)
    final_reward: float | None = None  # R(tau) when done (defaults to 0)
    tool_error: bool = False  # this step's tool call failed (timeout, crash, bad call)
    # numbers to log (their mean over a step's episodes, as env/KEY); `success` (0/1) is what evaluation
    # counts for pass@k (without it: a terminal reward > 0)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvContext:
    """Run-level settings an environment may read, from the config (not its own options)."""

    tool_timeout_s: float = 5.0  # environment.tool_timeout_s
    reward_fn: str = ""  # environment.reward_fn: an import path (single_turn)


class Environment:
    """Base class. Subclasses implement reset and step; one instance serves one conversation."""

    @dataclass(frozen=True)
    class Options:
        """The environment's `environment.options`: override with a frozen dataclass of its own (typed
        fields with defaults, and a `check()` raising ValueError); built and checked when the config
        loads. This one takes none."""

    role_for_observations = "user"  # chat role under which observations are appended
    # the episode is run by a harness of the user's through the gateway (envs/harness.py), not by
    # reset / step
    drives_itself: ClassVar[bool] = False
    # after this many steps with tool_error=True the agent loop ends the episode (outcome tool_error);
    # None: no limit. An instance may set its own (e.g. from its options) in reset
    max_tool_errors: int | None = 3
    # its tools run code through moe_rl.rollout.sandbox: the sandbox is tried when the config loads and
    # when an engine starts (check_context), and a machine that cannot run it stops the run there
    sandboxed_tools: ClassVar[bool] = False
    # its tools read self.context.tool_timeout_s (environment.tool_timeout_s): elsewhere the setting is
    # refused as one without effect
    reads_tool_timeout: ClassVar[bool] = False
    required_fields: ClassVar[tuple[str, ...]] = ()  # fields every dataset row must carry

    def __init__(self, options: Any = None, context: EnvContext | None = None):
        self.options = options if options is not None else type(self).Options()
        self.context = context or EnvContext()

    @classmethod
    def check_row(cls, row: dict) -> str | None:
        """What is wrong with a dataset row beyond its required fields (checked when the file loads,
        before anything starts), or None. Default: nothing."""
        return None

    @classmethod
    def check_context(cls, context: EnvContext) -> None:
        """The environment's rules over the run-level settings it reads and the machine it runs on;
        ValueError (one line) if not met. Called when the config loads and when each engine starts.
        This one checks `max_tool_errors` and, for `sandboxed_tools`, that the sandbox runs here: an
        override calls it too (`super().check_context(context)`)."""
        limit = cls.max_tool_errors
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{cls.__name__}.max_tool_errors={limit!r} must be a positive integer or None "
                             "(no limit)")
        if cls.sandboxed_tools:
            from moe_rl.rollout.sandbox import SandboxUnavailable, check

            try:
                check()
            except SandboxUnavailable as err:
                raise ValueError(f"{cls.__name__} runs its tools in the sandbox, and this machine "
                                 f"{err}") from None

    @classmethod
    def has_expert(cls) -> bool:
        """Whether the class has a scripted expert (overrides `expert_turn`) for supervised warm starts."""
        return getattr(cls.expert_turn, "__func__", None) is not Environment.expert_turn.__func__

    @classmethod
    def portable_options(cls, options: dict) -> dict:
        """`environment.options` as another process (a Ray worker, any working directory) can build them,
        e.g. file paths made absolute. Default: as they are."""
        return options

    @classmethod
    def generates_prompts(cls) -> bool:
        """Whether the class makes its own prompts (else it needs environment.dataset)."""
        return getattr(cls.generate_prompts, "__func__", None) is not Environment.generate_prompts.__func__

    async def reset(self, prompt: dict) -> list[dict]:
        raise NotImplementedError

    async def step(self, action_text: str) -> StepResult:
        raise NotImplementedError

    async def trial(self, row: dict) -> None:
        """What the driver tries on the run's first prompt before anything starts (`try_first_prompt`):
        `reset`, whose result must be chat messages. An override tries more (single_turn scores an empty
        answer) after `await super().trial(row)`; raise TrialError to name the setting to fix."""
        problem = check_messages(await self.reset(row))
        if problem:
            raise TrialError("environment.name", f"{type(self).__name__}.reset returned {problem[0]}",
                             problem[1])

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """A scripted expert's next turn given the conversation so far (for supervised warm starts)."""
        raise NotImplementedError(f"{cls.__name__} has no scripted expert")

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """Scripted policies a run plays on its held-out prompts and reports beside its own results (how
        far it is from chance and from optimal), by name: turn functions like `expert_turn`. By default
        the scripted expert, where the class has one."""
        return {"scripted expert": cls.expert_turn} if cls.has_expert() else {}

    @classmethod
    def generate_prompts(cls, n: int, seed: int, options: Any) -> list[dict]:
        """Prompts for environments that make their own (used when no dataset is configured)."""
        raise NotImplementedError(f"{cls.__name__} needs a dataset (environment.dataset)")


class TrialError(ValueError):
    """A mistake `Environment.trial` found: what failed (`str(err)`, one line), the config field that
    leads to it (`field`) and, optionally, how to fix it (`fix`)."""

    def __init__(self, field: str, message: str, fix: str = ""):
        self.field, self.fix = field, fix
        super().__init__(message)


TRIAL_TIMEOUT_S = 30.0  # as long as an episode's reset or step may take (AgentSpec.env_timeout_s)
# moe_rl/, Python's own
_OURS = (str(Path(__file__).resolve().parents[2]) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
_INSTALLED = tuple(dict.fromkeys(sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")))


def error_text(err: BaseException) -> str:
    """`Type: message (file.py:line)`, the place being the innermost frame of the user's code (not
    moe_rl's, not Python's standard library, and not an installed package's where the user's own code
    called it), where there is one: a one-line account of an exception raised by code of yours."""
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_OURS)
              and not f.filename.startswith("<")]
    # the user's own code before the libraries it called (an openai client's connection error: the harness's
    # line that made the request)
    frames = [f for f in frames if not f.filename.startswith(_INSTALLED)] or frames
    if frames:
        where = os.path.relpath(frames[-1].filename)
        text += f" ({frames[-1].filename if where.startswith('..') else where}:{frames[-1].lineno})"
    return " ".join(text.split())  # one line


def check_messages(messages) -> tuple[str, str] | None:
    """What is wrong with what `reset` returned (it must be a non-empty list of chat messages, each a
    dict with a string `role` and `content`) and how to fix it, or None."""
    fix = "reset returns the chat messages that open the episode: [{'role': 'user', 'content': '...'}, ...]"
    if not isinstance(messages, list) or not messages:
        return (f"{type(messages).__name__} {messages!r:.60}" if not isinstance(messages, list)
                else "an empty list"), fix
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            return f"{m!r:.60} as message {i}", fix
    return None


def try_first_prompt(spec: EnvSpec, row: dict, source: str) -> None:
    """One environment of the run, made and tried (`Environment.trial`) on `row`, before anything starts.
    ConfigError (one line: the field, what failed and where, on `source`) if it fails."""
    from moe_rl.schema import ConfigError

    cls = spec.env_cls
    try:
        env = spec.make()
    except Exception as err:
        raise ConfigError("environment.name", f"making {cls.__name__} failed: {error_text(err)}") from None
    try:
        asyncio.run(asyncio.wait_for(env.trial(row), TRIAL_TIMEOUT_S))
    except TrialError as err:
        raise ConfigError(err.field, f"{err} on {source}, before the run starts"
                          + (f"; {err.fix}" if err.fix else "")) from None
    except (TimeoutError, asyncio.TimeoutError):
        raise ConfigError("environment.name", f"{cls.__name__}.reset did not return within "
                          f"{TRIAL_TIMEOUT_S:g} s on {source} (an episode's reset has as long)") from None
    except Exception as err:
        raise ConfigError("environment.name", f"{cls.__name__}.reset failed on {source} before the run "
                          f"starts: {error_text(err)}") from None


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


class EnvImportError(ValueError):
    """An environment or reward function named by import path that cannot be loaded; one line."""


def import_object(spec: str):
    """The object an import path names: `package.module:attr` (an importable module; the current
    directory counts, as for `python -m`) or `path/to/file.py:attr` (a file, relative to the current
    directory or absolute). EnvImportError (one line) if it cannot be loaded."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise EnvImportError(f"'{spec}' is not an import path like package.module:Name or "
                             "path/to/file.py:Name")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where).resolve()
            if not path.is_file():
                raise EnvImportError(f"'{spec}': no file {path}")
            name = f"moe_rl_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
            module = sys.modules.get(name)
            if module is None:
                loader = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(loader)
                sys.modules[name] = module
                try:
                    loader.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except EnvImportError:
        raise
    except Exception as err:
        raise EnvImportError(f"'{spec}': importing {where} failed ({type(err).__name__}: {err})") from None
    if not hasattr(module, attr):
        raise EnvImportError(f"'{spec}': {where} has no {attr}")
    return getattr(module, attr)


def get_env(name: str) -> type:
    """The environment class a config names: registered (`guess_number`) or by import path."""
    _load_builtins()
    if ":" in name:
        cls = import_object(name)
        if not (inspect.isclass(cls) and issubclass(cls, Environment)):
            raise EnvImportError(f"'{name}' is not an Environment subclass (moe_rl.rollout.envs.Environment)"
                                 + ("; for a reward function use environment.name: single_turn with "
                                    "environment.reward_fn" if callable(cls) else ""))
        check_implements(cls, name)
        return cls
    if name not in _ENVS:
        close = difflib.get_close_matches(name, _ENVS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise KeyError(f"unknown environment '{name}'{hint}; registered: {', '.join(sorted(_ENVS))} "
                       "(or an import path, package.module:Class or path/to/file.py:Class)")
    return _ENVS[name]


def check_implements(cls: type, name: str) -> None:
    """EnvImportError unless `cls` defines `reset` and `step` as `async def` (the agent awaits both)."""
    missing = [m for m in ("reset", "step") if getattr(cls, m) is getattr(Environment, m)]
    if missing:
        raise EnvImportError(f"'{name}' does not implement {' and '.join(missing)}: an Environment defines "
                             "`async def reset(self, row) -> list[dict]` and `async def step(self, "
                             "action_text) -> StepResult` (docs/environments.md)")
    plain = [m for m in ("reset", "step") if not inspect.iscoroutinefunction(getattr(cls, m))]
    if plain:
        raise EnvImportError(f"'{name}': {' and '.join(f'{cls.__name__}.{m}' for m in plain)} must be `async "
                             "def` (the agent awaits it)")


def absolute_name(name: str) -> str:
    """An environment name as another process (a Ray worker, any working directory) can load it: file
    paths made absolute."""
    where, sep, attr = name.rpartition(":")
    if sep and (where.endswith(".py") or "/" in where):
        return f"{Path(where).resolve()}:{attr}"
    return name


def build_options(env_cls: type, options: dict, path: str = "environment.options"):
    """`env_cls.Options` from config data: keys and types checked like every config field, then its
    `check()`. ConfigError (one line naming the option) otherwise."""
    import dataclasses

    from moe_rl.schema import ConfigError, build

    if options and not dataclasses.fields(env_cls.Options):
        key = next(iter(options))
        raise ConfigError(f"{path}.{key}", f"unknown key; allowed: none ({env_cls.__name__} takes no "
                          f"options: it declares no Options dataclass); remove {path}")
    opts = build(env_cls.Options, options, path, {})
    check = getattr(opts, "check", None)
    if check is not None:
        try:
            check()
        except ValueError as err:
            raise ConfigError(path, str(err)) from None
    return opts


@dataclass(frozen=True)
class EnvSpec:
    """What a process needs to make the run's environments: plain data (any process can load it)."""

    name: str | type  # registered, or an import path (file paths absolute: `absolute_name`); or the class

    options: dict = field(default_factory=dict)  # environment.options, as data
    context: EnvContext = field(default_factory=EnvContext)

    @property
    def env_cls(self) -> type:
        return self.name if isinstance(self.name, type) else get_env(self.name)

    def built_options(self):
        return build_options(self.env_cls, self.options)

    def make(self, options=None) -> Environment:
        """One environment (for one conversation)."""
        return self.env_cls(options if options is not None else self.built_options(), self.context)


def _load_builtins() -> None:
    from moe_rl.rollout.envs import arithmetic, calculator, guess, harness, math_answer, single_turn, stated  # noqa: F401
