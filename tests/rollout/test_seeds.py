"""Sampling seeds: every turn of every sample of a run gets a seed of its own, and the same run asks for
the same seeds again. The agent loop is the production one, with the real tokenizer and environment;
the engine is a recording stand-in (what it is asked for is the subject, not what it samples)."""

import asyncio
import random
import re

from conftest import agent_spec
from transformers import AutoTokenizer

from moe_rl.rollout.agent import Agent
from moe_rl.rollout.engine import GenerationResult
from moe_rl.rollout.envs import EnvSpec
from moe_rl.rollout.seeds import SEED_BITS, sample_seed


class RecordingEngine:
    """Guesses a random number of the game's range per turn; records the seed of every generate call."""

    def __init__(self, tok):
        self.tok, self.version, self.seeds, self.rng = tok, 0, [], random.Random(0)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(self, ids, sampling):
        self.seeds.append(sampling.seed)
        low, high = map(int, re.search(r"from (\d+) to (\d+)", self.tok.decode(ids)).groups())
        out = [*self.tok.encode(str(self.rng.randint(low, high)), add_special_tokens=False), self.end]
        return GenerationResult("x", list(ids), out, [-0.5] * len(out), "stop", self.version, None)


def run_seeds(tok, run_seed: int, steps: int, dynamic: bool) -> tuple[list[int], list[int], int]:
    """The seeds of `steps` rollout steps of 8 prompts x 4 samples, up to 4 turns each, as the driver
    asks for them (Rollouts.generate: one step seed; the agent derives the rest); with dynamic sampling,
    the rounds each step took and the groups it dropped. A step's first round draws games of a single
    number, which every sample wins with its first guess: all its groups tie and are dropped, and the
    step samples again (games from 1 to 9, which rarely tie)."""
    engine = RecordingEngine(tok)
    agent = Agent(engine, tok, EnvSpec("guess_number"), agent_spec(max_turns=4, token_budget=200))
    prompts = [{"secret": 1 + i % 9} for i in range(64)]
    rounds = []
    for step in range(steps):
        seed = sample_seed(run_seed, "step", step)
        if dynamic:
            drawn = []

            def next_prompts(k, drawn=drawn):
                drawn.append(k)
                return [{"secret": 5, "low": 5, "high": 5} for _ in range(k)] if len(drawn) == 1 \
                    else prompts[:k]
            asyncio.run(agent.dynamic_sampling(next_prompts, 8, 4, 2, seed))
            rounds.append(len(drawn))
        else:
            asyncio.run(agent.run_groups(prompts[:8], 4, seed))
    return engine.seeds, rounds, agent.stats.dropped_groups


def first_turn_seeds(run_seed: int, step: int, round_: int, groups: range) -> set[int]:
    """The seeds of the first turns of dynamic sampling's round `round_` of a step, by the path of
    moe_rl/rollout/seeds.py (step, round, sample of group g, turn 0), 4 samples a group."""
    rnd = sample_seed(sample_seed(run_seed, "step", step), "round", round_)
    return {sample_seed(sample_seed(rnd, "sample", g, k), "turn", 0) for g in groups for k in range(4)}


def test_every_turn_of_every_sample_of_a_run_has_its_own_seed(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    for dynamic in (False, True):
        seeds, rounds, dropped = run_seeds(tok, 1234, steps=30, dynamic=dynamic)
        assert len(seeds) > 30 * 32 * 2  # several turns per episode
        assert len(set(seeds)) == len(seeds), (f"{len(seeds) - len(set(seeds))} repeated seeds "
                                               f"(dynamic={dynamic})")
        assert all(0 <= s < 2**SEED_BITS for s in seeds)
        # the same run asks for the same seeds
        assert seeds == run_seeds(tok, 1234, steps=30, dynamic=dynamic)[0]
    # dynamic sampling: every step's first round was dropped whole, and every step sampled a second
    # round (fresh prompts, group ids 8 to 15) with that round's own seeds
    assert len(rounds) == 30 and all(r >= 2 for r in rounds) and dropped >= 30 * 8, (rounds, dropped)
    for step in range(30):
        for round_, groups in ((0, range(8)), (1, range(8, 16))):
            assert first_turn_seeds(1234, step, round_, groups) <= set(seeds), (step, round_)
    # nor do two runs share one
    assert not set(run_seeds(tok, 1, 5, False)[0]) & set(run_seeds(tok, 2, 5, False)[0])


def test_seed_paths_by_hand():
    # a hash of the path: no arithmetic relation between neighbouring steps, groups or samples
    assert sample_seed(1234, "step", 1) != sample_seed(1235, "step", 0)
    assert sample_seed(7, "sample", 0, 1) != sample_seed(7, "sample", 1, 0)
    assert sample_seed(7, "sample", 1, 0) != sample_seed(7, "sample", 10)  # "1/0" vs "10": separated by "/"
    assert sample_seed(7, "turn", 3) == sample_seed(7, "turn", 3)
