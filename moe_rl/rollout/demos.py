"""Supervised warm-start data: episodes played by an environment's scripted expert.

Starting RL from random weights (nothing can be downloaded here) is hopeless for a language model:
it would first have to discover the answer format by chance. Real pipelines start from a model that
already speaks the task's format (pretraining + SFT); the quickstart does the same in miniature. The
expert's turns go through the same agent loop as the model's — same chat template, same observation
tokens, same response mask — so the warm start trains on exactly the sequences RL will produce.
"""

from __future__ import annotations

import random

from moe_rl.rollout.agent import end_of_turn_id
from moe_rl.rollout.engine import GenerationResult


class DemonstrationError(ValueError):
    """A scripted turn the run's settings cut short: its demonstrations (or baseline) would be wrong."""


class ExpertPolicy:
    """Plays a scripted turn function in place of the model (token-in/token-out like the engine):
    `turn(conversation, rng) -> text`, an environment's `expert_turn` or one of its
    `reference_policies`. A turn longer than `turn_limit` tokens with its end of turn (the model's per-turn
    limit, rollout.max_new_tokens) is a DemonstrationError, not a silently cut demonstration; a turn the
    episode's remaining token budget cuts is cut, as the model's would be."""

    def __init__(self, tokenizer, turn, seed: int, turn_limit: int | None = None):
        self.tok, self.turn, self.rng, self.turn_limit = tokenizer, turn, random.Random(seed), turn_limit
        self.eos = end_of_turn_id(tokenizer)
        self.version = 0

    async def agenerate(self, ids, sampling):
        text = self.turn(self.tok.decode(ids), self.rng)
        out = self.tok.encode(text, add_special_tokens=False)
        if self.turn_limit is not None and len(out) + 1 > self.turn_limit:
            name = getattr(self.turn, "__qualname__", "the scripted turn")
            raise DemonstrationError(f"{name} played a turn of {len(out)} tokens + end of turn ({text!r}); "
                                     f"rollout.max_new_tokens={self.turn_limit} cuts it: raise it to at "
                                     f"least {len(out) + 1}")
        out = out[: max(0, sampling.max_tokens - 1)] + [self.eos]
        return GenerationResult("demo", list(ids), out, [-1.0] * len(out), "stop", 0, None)
