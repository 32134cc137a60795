"""Guess the number: a multi-turn game with "higher"/"lower" feedback.

The secret is an integer in [low, high]. Each model turn is one guess (the first integer in the turn);
the environment answers "higher", "lower" or ends the episode: on the right number, or when the game's
`guesses` are used up (a turn without a number in range uses one too). That end is the game's rule, a
true termination: nothing is bootstrapped past it (environment.max_turns, the framework's cut, would be
a truncation, bootstrapped from the critic's value of a game that could go on). A random policy already
wins sometimes (1 / (high - low + 1) per guess), so reward rises from a non-zero level as the policy
learns to use the observations (`feedback: range` also tells the range the answers so far leave).
Rewards: terminal 1.0 for a correct guess, 0 otherwise; turn feedback -0.05 for each wrong guess and
-0.1 for a turn without a number in range, each `ruled_out_penalty` more where the feedback had already
ruled the answer out (so a turn without a number always costs the most). env/ruled_out counts a game's
ruled-out turns.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from moe_rl.rollout.envs import Environment, StepResult, register_env

_INT = re.compile(r"-?\d+")


@register_env("guess_number")
class GuessNumber(Environment):
    @dataclass(frozen=True)
    class Options:
        low: int = 1  # the secret's range, for prompts that do not carry one
        high: int = 9
        guesses: int = 4  # turns per game: the last one without the number loses it (a true end)
        # added to a turn's cost when the feedback so far already ruled its answer out (a number outside
        # the range the "higher"/"lower" answers leave, a repeated one, or no number in range at all):
        # a turn-level signal for using the observations (0: off; success is unchanged either way)
        ruled_out_penalty: float = 0.0
        # what a wrong guess is told: "direction", "higher" or "lower"; "range", that and the range the
        # answers so far leave ("higher: 6 to 9"), so the state is in the last message
        feedback: str = "direction"

        def check(self) -> None:
            if self.feedback not in ("direction", "range"):
                raise ValueError(f"feedback={self.feedback!r} must be 'direction' or 'range'")
            if self.low > self.high:
                raise ValueError(f"low={self.low} must be <= high={self.high}")
            if self.guesses < 1:
                raise ValueError(f"guesses={self.guesses} must be >= 1")
            if not self.ruled_out_penalty >= 0:
                raise ValueError(f"ruled_out_penalty={self.ruled_out_penalty} must be >= 0 (a cost)")

    required_fields = ("secret",)

    async def reset(self, prompt: dict) -> list[dict]:
        self.low, self.high = (int(prompt.get("low", self.options.low)),
                               int(prompt.get("high", self.options.high)))
        self.secret, self.left = int(prompt["secret"]), self.options.guesses
        self.open, self.ruled_out = (self.low, self.high), 0  # the range the feedback so far leaves
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} is outside [{self.low}, {self.high}]")
        return [{"role": "user", "content": f"Guess my number from {self.low} to {self.high}."}]

    async def step(self, action_text: str) -> StepResult:
        m = _INT.search(action_text)
        guess = int(m.group()) if m else None
        self.left -= 1
        if guess == self.secret:
            return StepResult(None, done=True, final_reward=1.0,
                              info={"guess": guess, "ruled_out": self.ruled_out})
        valid = guess is not None and self.low <= guess <= self.high
        reward, info = (-0.05, {"guess": guess}) if valid else (-0.1, {})
        lo, hi = self.open
        if not (valid and lo <= guess <= hi):  # no number the feedback (or the range) leaves open
            self.ruled_out += 1
            reward -= self.options.ruled_out_penalty
        if valid:
            self.open = (max(lo, guess + 1), hi) if guess < self.secret else (lo, min(hi, guess - 1))
        info["ruled_out"] = self.ruled_out  # turns the feedback had ruled out, this game so far
        if not self.left:  # the game is lost
            return StepResult(None, reward=reward, done=True, final_reward=0.0, info=info)
        if not valid:
            return StepResult(f"A number from {self.low} to {self.high}.", reward=reward, info=info)
        word = "higher" if guess < self.secret else "lower"
        if self.options.feedback == "range":
            word += f": {self.open[0]} to {self.open[1]}"
        return StepResult(word, reward=reward, info=info)

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """A format-only expert: a uniformly random number in range each turn, ignoring the feedback.
        It wins sometimes; using the "higher"/"lower" observations is left for RL to learn."""
        low, high = (int(x) for x in re.search(r"from (-?\d+) to (-?\d+)", conversation).groups())
        return str(rng.randint(low, high))

    @classmethod
    def binary_search_turn(cls, conversation: str, rng) -> str:
        """The optimal player: the middle of the range the feedback so far leaves (it always wins within
        ceil(log2(high - low + 2)) guesses: 4 for 1..9)."""
        low, high = (int(x) for x in re.search(r"from (-?\d+) to (-?\d+)", conversation).groups())
        tail = conversation.split(f"from {low} to {high}", 1)[1]
        for guess, feedback in re.findall(r"(-?\d+)\D*?\b(higher|lower)\b", tail):
            low, high = (int(guess) + 1, high) if feedback == "higher" else (low, int(guess) - 1)
        return str((low + high) // 2)

    @classmethod
    def reference_policies(cls) -> dict:
        """Chance (random guesses in range, the feedback ignored: the warm start's expert) and optimal
        (binary search)."""
        return {"random guesses": cls.expert_turn, "binary search": cls.binary_search_turn}

    @classmethod
    def generate_prompts(cls, n: int, seed: int, options: Options) -> list[dict]:
        low, high = options.low, options.high
        rng = random.Random(seed)
        return [{"secret": rng.randint(low, high), "low": low, "high": high} for _ in range(n)]
