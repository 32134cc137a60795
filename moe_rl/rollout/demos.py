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


class ExpertPolicy:
    """Plays a scripted turn function in place of the model (token-in/token-out like the engine):
    `turn(conversation, rng) -> text`, an environment's `expert_turn` or one of its
    `reference_policies`."""

    def __init__(self, tokenizer, turn, seed: int):
        self.tok, self.turn, self.rng = tokenizer, turn, random.Random(seed)
        self.eos = end_of_turn_id(tokenizer)
        self.version = 0

    async def agenerate(self, ids, sampling):
        text = self.turn(self.tok.decode(ids), self.rng)
        out = self.tok.encode(text, add_special_tokens=False)[: max(0, sampling.max_tokens - 1)] + [self.eos]
        return GenerationResult("demo", list(ids), out, [-1.0] * len(out), "stop", 0, None)
