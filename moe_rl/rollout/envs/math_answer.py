"""Math with verified answers: the final answer is extracted and checked against the row's `answer`
by symbolic equivalence (the `math-verify` package: 1/2 = 0.5 = \\frac{1}{2}, 12 = 12.0, x = 3 vs 3),
not by string match.

    environment:
      name: math
      dataset: examples/math_word_problems.jsonl   # rows {"prompt": ..., "answer": "42"}

Extraction (`options.extract`): the last \\boxed{...} (braces balanced), or, with
`boxed_or_last_number` (the default), the last number when nothing is boxed. Reward:
`correct_reward` for an equivalent answer, plus `format_reward` when it was boxed. Logged per step:
env/correct, env/boxed (env/verify_timeout: answers whose check ran out of time, scored wrong).

Verification runs in helper processes (sympy can take unbounded time on adversarial output): a check
that passes `verify_timeout_s` is scored wrong and its process killed and replaced (the checks queued
beside it run again).
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Literal

from moe_rl.rollout.envs import Environment, StepResult, register_env
from moe_rl.rollout.envs.single_turn import check_chat_prompt, prompt_messages

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
MAX_ANSWER_CHARS = 200  # longer "answers" are not parsed (wrong)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...}, braces balanced; None if there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start:i - 1].strip()
    return None


def extract_answer(text: str, mode: str) -> tuple[str | None, bool]:
    """(the final answer, whether it was boxed) by `mode`: "boxed" or "boxed_or_last_number"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    if mode == "boxed_or_last_number":
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", ""), False
    return None, False


def equivalent(answer: str, gold: str) -> bool:
    """Whether `answer` and `gold` are the same mathematical object (math-verify). Runs in the helper
    process; no timeouts of its own (they use signals, which only the main thread may set)."""
    import logging

    from math_verify import parse, verify

    # "timeout is disabled": the helper process bounds it
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def read(s: str):
        s = s.strip().removeprefix("$").removesuffix("$")
        return parse(f"${s}$", parsing_timeout=None) or parse(s, parsing_timeout=None)

    g, a = read(gold), read(answer)
    return bool(g and a and verify(g, a, timeout_seconds=None))


def _ready() -> bool:
    """A helper process's first task: import what `equivalent` needs."""
    import math_verify  # noqa: F401

    return True


class Verifier:
    """Helper processes for `equivalent`: a check that runs past its time is abandoned (wrong) and its
    process killed; the checks that shared the pool with it run again on a new one."""

    WORKERS = 2
    START_TIMEOUT_S = 120.0  # a new pool's processes start and import sympy outside any check's time

    def __init__(self):
        self.pool: ProcessPoolExecutor | None = None
        self.starting: list = []  # concurrent futures of the pool's start (any event loop may wait on them)

    async def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(max_workers=self.WORKERS,
                                            mp_context=multiprocessing.get_context("spawn"))
            self.starting = [self.pool.submit(_ready) for _ in range(self.WORKERS)]
        pool = self.pool
        await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, self.starting)), self.START_TIMEOUT_S)
        return pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        if pool is self.pool:
            self.pool, self.starting = None, []
        for p in list(getattr(pool, "_processes", {}).values()):  # a stuck check holds its process: kill it
            p.kill()
        pool.shutdown(wait=False)  # pending checks fail with BrokenProcessPool and run again

    async def check(self, answer: str, gold: str, timeout_s: float) -> bool | None:
        """Equivalence, or None when the check ran out of time."""
        for _ in range(3):
            pool = await self._pool()
            try:
                return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, equivalent,
                                                                                         answer, gold),
                                              timeout_s)
            except asyncio.TimeoutError:
                self._discard(pool)
                return None
            except BrokenProcessPool:  # another check's timeout killed the pool (or a helper crashed)
                self._discard(pool)
        return None


_VERIFIER = Verifier()  # one per process: episodes of an engine share it


@register_env("math")
class MathAnswer(Environment):
    @dataclass(frozen=True)
    class Options:
        correct_reward: float = 1.0  # an answer equivalent to the row's
        format_reward: float = 0.0  # added when the answer is boxed, right or wrong
        extract: Literal["boxed", "boxed_or_last_number"] = "boxed_or_last_number"
        system_prompt: str = "Solve the problem. Put the final answer in \\boxed{}."  # "" for none
        verify_timeout_s: float = 5.0

        def check(self) -> None:
            if self.verify_timeout_s <= 0:
                raise ValueError(f"verify_timeout_s={self.verify_timeout_s} must be positive")
            if importlib.util.find_spec("math_verify") is None:
                raise ValueError("the math environment checks answers with math-verify, which is not "
                                 "installed: pip install 'moe-rl[math]'")

    required_fields = ("prompt", "answer")

    @classmethod
    def check_row(cls, row: dict) -> str | None:
        if not isinstance(row["answer"], (str, int, float)) or isinstance(row["answer"], bool) \
                or str(row["answer"]) == "":
            return f"answer must be a non-empty string or a number, not {row['answer']!r}"
        return check_chat_prompt(row["prompt"])

    async def reset(self, prompt: dict) -> list[dict]:
        self.gold = str(prompt["answer"])
        return prompt_messages(prompt["prompt"], self.options.system_prompt)

    async def step(self, action_text: str) -> StepResult:
        o = self.options
        answer, boxed = extract_answer(action_text, o.extract)
        correct, timed_out = False, False
        if answer is not None and len(answer) <= MAX_ANSWER_CHARS:
            verdict = await _VERIFIER.check(answer, self.gold, o.verify_timeout_s)
            correct, timed_out = bool(verdict), verdict is None
        reward = o.correct_reward * correct + o.format_reward * boxed
        return StepResult(None, done=True, final_reward=reward,
                          info={"correct": float(correct), "boxed": float(boxed),
                                "verify_timeout": float(timed_out), "success": float(correct)})

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """A format-only expert: a boxed number (the answer's format, not its value)."""
        return f"The answer is \\boxed{{{rng.randint(0, 20)}}}."
