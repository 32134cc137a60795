"""A single-turn task scored by a reward function of yours.

    environment:
      name: single_turn
      dataset: data/train.jsonl          # rows with a `prompt` and whatever your function reads
      reward_fn: my_pkg.rewards:score     # or path/to/rewards.py:score

    def score(row: dict, response: str) -> float | dict:
        ...  # a float, or {"reward": float, "any_other_number": ...} (logged as env/any_other_number)

The row's `prompt` opens the episode (a string: one user message; or a list of chat messages, each
{"role": "system" | "user" | "assistant", "content": str}); the model answers once; the function
scores the answer (an `async def` runs on the engine's event loop, a plain function in a thread). A
function that raises, or returns anything but a finite number or such a dict, makes that episode an
env_error: counted, logged and not trained on. Before anything starts, the function scores an empty
answer to the first dataset row (`SingleTurn.trial`): one that fails there stops the run in one line.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from dataclasses import dataclass

from moe_rl.rollout.envs import (
    EnvContext,
    EnvImportError,
    Environment,
    StepResult,
    TrialError,
    error_text,
    import_object,
    register_env,
)

ROLES = ("system", "user", "assistant")


def check_chat_prompt(prompt) -> str | None:
    """What is wrong with a row's `prompt` (a string, or a list of chat messages), or None."""
    if isinstance(prompt, str):
        return None if prompt else "prompt is empty"
    if not isinstance(prompt, list) or not prompt:
        return f"prompt must be a string or a non-empty list of chat messages, not {type(prompt).__name__}"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not {"role", "content"} <= set(m):
            return f"prompt[{i}] must be an object with exactly 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"prompt[{i}].role is {m['role']!r}; one of {', '.join(ROLES)}"
        if not isinstance(m["content"], str):
            return f"prompt[{i}].content must be a string"
    return None


def prompt_messages(prompt, system_prompt: str = "") -> list[dict]:
    """The chat messages a row's `prompt` opens with (a system message first, when given and the
    prompt has none)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


@functools.lru_cache(maxsize=8)
def reward_function(spec: str):
    """The reward function an import path names (loaded once per process); EnvImportError unless it
    takes (row, response)."""
    fn = import_object(spec)
    if not callable(fn):
        raise EnvImportError(f"'{spec}' is not a function")
    try:
        inspect.signature(fn).bind({}, "")
    except TypeError:
        raise EnvImportError(f"'{spec}' must take (row, response); its signature is "
                             f"{inspect.signature(fn)}") from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return fn


class RewardValueError(TypeError, ValueError):
    """A reward function returned something that is not a reward (a TypeError and a ValueError both):
    `what` it returned and how to `fix` it."""

    def __init__(self, spec: str, what: str, fix: str):
        self.what, self.fix = what, fix
        super().__init__(f"{spec} {what}; {fix}")


def reward_value(value, spec: str) -> tuple[float, dict]:
    """A reward function's result as (reward, numbers to log); RewardValueError for anything else (not a
    number, not finite, a dict without `reward` or with a non-number beside it)."""
    extra = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise RewardValueError(spec, f"returned a dict without 'reward' ({sorted(value)})",
                                   "put the reward under 'reward'")
        try:
            extra = {k: float(v) for k, v in value.items() if k != "reward"}
        except (TypeError, ValueError):
            bad = next(k for k, v in value.items() if k != "reward" and not isinstance(v, (int, float)))
            raise RewardValueError(spec, f"returned {bad!r}: {value[bad]!r:.40}", "the entries beside "
                                   "'reward' are logged (env/NAME): each must be a number") from None
        value = value["reward"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        got = "None" if value is None else f"{type(value).__name__} {value!r:.40}"
        raise RewardValueError(spec, f"returned {got}", "return a float, or a dict with 'reward'")
    if not math.isfinite(value):
        raise RewardValueError(spec, f"returned a reward of {value}", "rewards must be finite")
    return float(value), extra


@register_env("single_turn")
class SingleTurn(Environment):
    @dataclass(frozen=True)
    class Options:
        system_prompt: str = ""  # a system message before each prompt that has none (none when empty)

    required_fields = ("prompt",)

    @classmethod
    def check_row(cls, row: dict) -> str | None:
        return check_chat_prompt(row["prompt"])

    @classmethod
    def check_context(cls, context: EnvContext) -> None:
        if not context.reward_fn:
            raise ValueError("the single_turn environment scores each answer with your function: set "
                             "environment.reward_fn (package.module:function or path/to/file.py:function)")
        reward_function(context.reward_fn)

    async def reset(self, prompt: dict) -> list[dict]:
        self.row, self.fn = prompt, reward_function(self.context.reward_fn)
        return prompt_messages(prompt["prompt"], self.options.system_prompt)

    async def step(self, action_text: str) -> StepResult:
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(self.row, action_text)
        else:  # in a thread: a slow function must not stall the engine's other conversations
            value = await asyncio.to_thread(self.fn, self.row, action_text)
        reward, info = reward_value(value, self.context.reward_fn)
        return StepResult(None, done=True, final_reward=reward, info=info)

    async def trial(self, row: dict) -> None:
        """`reset` on the run's first row, then the reward function on an empty answer: every answer must
        score, the empty one too (a model's early answers often are)."""
        await super().trial(row)
        try:
            await self.step("")
        except RewardValueError as err:
            raise TrialError("environment.reward_fn",
                             f"{self.context.reward_fn} {err.what} for the answer ''", err.fix) from None
        except Exception as err:
            raise TrialError("environment.reward_fn", f"{self.context.reward_fn} raised {error_text(err)} "
                             "scoring the answer ''",
                             "a reward function must score every answer, the empty one too") from None
