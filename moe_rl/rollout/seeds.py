"""Sampling seeds: one per (run, step, prompt group, sample, resampling round, turn), none shared.

A seed is a hash of the path that leads to it, so two samples of a run never sample from one seed
(an arithmetic scheme such as `run*1000 + step + 7919*group + k` hands sample (step+1, k-1) the seed
of (step, k): consecutive steps repeat each other's samples token for token). The same path gives
the same seed in every process, so a rollout regenerated after an engine failure, or split over more
engines, samples what the first would have.

    step = sample_seed(run_seed, "step", step)       # the driver, per step (or "eval")
    rnd = sample_seed(step, "round", r)              # dynamic sampling's resampling round r
    episode = sample_seed(rnd, "sample", group, k)   # sample k of prompt group `group`
    turn = sample_seed(episode, "turn", t)           # the engine's seed for the episode's turn t
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # vLLM seeds a torch.Generator (manual_seed takes < 2**64); 63 bits also fit an int64


def sample_seed(parent: int, *path: int | str) -> int:
    """A seed in [0, 2**63) from `parent` and the path below it (blake2b of their decimal text): distinct
    paths give distinct seeds (any collision among a million seeds: probability ~5e-8)."""
    text = "/".join(str(p) for p in (parent, *path)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - SEED_BITS)
