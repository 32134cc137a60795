"""Sampling seeds: every turn of every sample of a run gets a seed of its own, and the same run asks for
the same seeds again. The agent loop is the production one, with the real tokenizer and environment;
the engine is a recording stand-in (what it is asked for is the subject, not what it samples)."""

import asyncio
import random

from conftest import agent_settings
from transformers import AutoTokenizer

from moe_rl.rollout.agent import Agent
from moe_rl.rollout.engine import GenerationResult
from moe_rl.rollout.envs import EnvSpec
from moe_rl.rollout.seeds import SEED_BITS, sample_seed


class RecordingEngine:
    """Guesses a random digit per turn; records the seed of every generate call."""

    def __init__(self, tok):
        self.tok, self.version, self.seeds, self.rng = tok, 0, [], random.Random(0)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(self, ids, sampling):
        self.seeds.append(sampling.seed)
        out = [*self.tok.encode(str(self.rng.randint(1, 9)), add_special_tokens=False), self.end]
        return GenerationResult("x", list(ids), out, [-0.5] * len(out), "stop", self.version, None)


def run_seeds(tok, run_seed: int, steps: int, dynamic: bool) -> list[int]:
    """The seeds of `steps` rollout steps of 8 prompts x 4 samples, up to 4 turns each, as the driver
    asks for them (Rollouts.generate: one step seed; the agent derives the rest)."""
    engine = RecordingEngine(tok)
    agent = Agent(engine, tok, EnvSpec("guess_number"), agent_settings(max_turns=4, token_budget=200))
    prompts = [{"secret": 1 + i % 9} for i in range(64)]
    for step in range(steps):
        seed = sample_seed(run_seed, "step", step)
        if dynamic:  # a guessing game with 4 samples rarely ties, so rounds past the first are few; still
            asyncio.run(agent.dynamic_sampling(lambda k: prompts[:k], 8, 4, 2, seed))
        else:
            asyncio.run(agent.run_groups(prompts[:8], 4, seed))
    return engine.seeds


def test_every_turn_of_every_sample_of_a_run_has_its_own_seed(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    for dynamic in (False, True):
        seeds = run_seeds(tok, 1234, steps=30, dynamic=dynamic)
        assert len(seeds) > 30 * 32 * 2  # several turns per episode
        assert len(set(seeds)) == len(seeds), (f"{len(seeds) - len(set(seeds))} repeated seeds "
                                               f"(dynamic={dynamic})")
        assert all(0 <= s < 2**SEED_BITS for s in seeds)
        # the same run asks for the same seeds
        assert seeds == run_seeds(tok, 1234, steps=30, dynamic=dynamic)
    # nor do two runs share one
    assert not set(run_seeds(tok, 1, 5, False)) & set(run_seeds(tok, 2, 5, False))


def test_seed_paths_by_hand():
    # a hash of the path: no arithmetic relation between neighbouring steps, groups or samples
    assert sample_seed(1234, "step", 1) != sample_seed(1235, "step", 0)
    assert sample_seed(7, "sample", 0, 1) != sample_seed(7, "sample", 1, 0)
    assert sample_seed(7, "sample", 1, 0) != sample_seed(7, "sample", 10)  # "1/0" vs "10": separated by "/"
    assert sample_seed(7, "turn", 3) == sample_seed(7, "turn", 3)
