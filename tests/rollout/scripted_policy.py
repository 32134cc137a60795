"""The scripted stand-in for the engine that the agent-loop tests play (masks, spans and rewards worked
out by hand), and `run` for the loop's coroutines."""

import asyncio

from moe_rl.rollout.engine import GenerationResult


class ScriptedPolicy:
    """Emits the given texts as model turns (each closed by <|im_end|>), log-prob -0.5 per token."""

    def __init__(self, tok, turns, close=True):
        self.tok, self.turns, self.close, self.version, self.calls = tok, list(turns), close, 5, []

    async def agenerate(self, ids, sampling):
        self.calls.append(list(ids))
        text = self.turns.pop(0)
        out = self.tok.encode(text, add_special_tokens=False)
        if self.close:
            out.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
        out = out[: sampling.max_tokens]
        return GenerationResult("x", list(ids), out, [-0.5] * len(out), "stop", self.version, None)


def run(coro):
    return asyncio.run(coro)
