"""Single-turn verifiable arithmetic (exact match), for group-based methods (GRPO, RLOO, ...).

"What is 3+4?" -> the model answers; reward 1.0 if the first integer in its answer equals the result.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from moe_rl.rollout.envs import Environment, StepResult, register_env

_INT = re.compile(r"-?\d+")


@register_env("arithmetic")
class Arithmetic(Environment):
    @dataclass(frozen=True)
    class Options:
        max_operand: int = 9  # generated prompts add two integers in [0, max_operand]

        def check(self) -> None:
            if self.max_operand < 0:
                raise ValueError(f"max_operand={self.max_operand} must be >= 0")

    required_fields = ("question", "answer")

    async def reset(self, prompt: dict) -> list[dict]:
        self.answer = int(prompt["answer"])
        return [{"role": "user", "content": str(prompt["question"])}]

    async def step(self, action_text: str) -> StepResult:
        m = _INT.search(action_text)
        correct = m is not None and int(m.group()) == self.answer
        return StepResult(None, done=True, final_reward=1.0 if correct else 0.0)

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """Answers with a random number of the right size (format only)."""
        return str(rng.randint(0, 18))

    @classmethod
    def generate_prompts(cls, n: int, seed: int, options: Options) -> list[dict]:
        max_operand = options.max_operand
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            out.append({"question": f"What is {a}+{b}?", "answer": a + b})
        return out
