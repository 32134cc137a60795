"""Stated reward: the prompt says what the episode will earn, whatever the model answers.

"This episode pays 0.5." -> any answer ends the episode with reward 0.5. The value of every state is
written in its prompt, so a critic that learns anything must reach explained variance near 1 here:
a check of the value-learning path (critic scoring, the V(s_t) shift, returns, the value loss), not
a task to learn a policy on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moe_rl.rollout.envs import Environment, StepResult, register_env


@register_env("stated_reward")
class StatedReward(Environment):
    @dataclass(frozen=True)
    class Options:
        levels: int = 3  # rewards are k / (levels - 1) for k in 0..levels-1

        def check(self) -> None:
            if self.levels < 2:
                raise ValueError(f"levels={self.levels} must be >= 2 (one level has no variance)")

    required_fields = ("reward",)

    async def reset(self, prompt: dict) -> list[dict]:
        self.reward = float(prompt["reward"])
        return [{"role": "user", "content": f"This episode pays {prompt['reward']}."}]

    async def step(self, action_text: str) -> StepResult:
        return StepResult(None, done=True, final_reward=self.reward)

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        return "ok"

    @classmethod
    def generate_prompts(cls, n: int, seed: int, options: Options) -> list[dict]:
        levels = options.levels
        rng = random.Random(seed)
        return [{"reward": round(rng.randrange(levels) / (levels - 1), 3)} for _ in range(n)]
