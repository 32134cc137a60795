"""A multi-turn environment of your own, with a tool: `environment.name: examples/tool_env/envs.py:Lookup`.

The model is asked for the code of a word. It may call the tool, `<lookup>apple</lookup>`, and sees
`<value>417</value>` as the next (user) message; it finishes with `<answer>417</answer>`. Reward: 1 for
the right code, -0.05 for each tool call beyond the first; `max_lookups` failed or extra calls end the
episode. The tool here is a dictionary; a real one (a search, a code runner) would run in a thread or
through moe_rl.rollout.sandbox, never blocking the event loop.
"""

import random
import re
from dataclasses import dataclass

from moe_rl.rollout.envs import Environment, StepResult

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember"]


class Lookup(Environment):
    @dataclass(frozen=True)
    class Options:  # environment.options: checked when the config loads
        max_lookups: int = 3
        codes_seed: int = 0  # the dictionary: one code per word, from this seed

        def check(self):
            if self.max_lookups < 1:
                raise ValueError(f"max_lookups={self.max_lookups} must be >= 1")

    required_fields = ("word",)  # what a dataset row must carry (this environment also makes its own)

    def codes(self) -> dict[str, int]:
        rng = random.Random(self.options.codes_seed)
        return {w: rng.randint(100, 999) for w in WORDS}

    async def reset(self, row: dict) -> list[dict]:
        self.word, self.calls = row["word"], 0
        return [{"role": "system", "content": "Use <lookup>word</lookup>, then reply <answer>code</answer>."},
                {"role": "user", "content": f"What is the code of {self.word}?"}]

    async def step(self, action_text: str) -> StepResult:
        answer = re.search(r"<answer>\s*(\d+)\s*</answer>", action_text)
        if answer:
            right = int(answer.group(1)) == self.codes()[self.word]
            return StepResult(None, done=True, final_reward=float(right),
                              info={"lookups": self.calls, "success": float(right)})
        call = re.search(r"<lookup>\s*(\w+)\s*</lookup>", action_text)
        self.calls += 1
        if self.calls > self.options.max_lookups:
            return StepResult(None, done=True, final_reward=0.0, tool_error=True,
                              info={"lookups": self.calls})
        penalty = -0.05 if self.calls > 1 else 0.0
        if not call or call.group(1) not in self.codes():
            return StepResult("<value>unknown</value>", reward=penalty, tool_error=True,
                              info={"lookups": self.calls})
        return StepResult(f"<value>{self.codes()[call.group(1)]}</value>", reward=penalty,
                          info={"lookups": self.calls})

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """Looks the word up, then answers with the value it saw (a warm start's demonstrations)."""
        seen = re.findall(r"<value>(\d+)</value>", conversation)
        if seen:
            return f"<answer>{seen[-1]}</answer>"
        word = re.findall(r"code of (\w+)", conversation)[-1]
        return f"<lookup>{word}</lookup>"

    @classmethod
    def generate_prompts(cls, n: int, seed: int, options: Options) -> list[dict]:
        rng = random.Random(seed)
        return [{"word": rng.choice(WORDS)} for _ in range(n)]
