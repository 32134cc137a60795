"""Megatron on CPU across layouts: TP2, EP2 (alltoall and allgather dispatchers), TP2 with EP2 and expert
TP1, and PP2 give the same logits, log-probs and one-step loss as a single rank (fp32, <= 1e-5), with and
without router replay."""

import pytest
import torch
from train_jobs import POLICY, B, S, batch_tensors, layout_job, own_routes_job, policy_tensors

from moe_rl.train.hf_parity import hf_token_logprobs
from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow
TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    """Single rank: free routing scores, the routes it recorded, and a training step."""
    routes = torch.zeros(B, S, 2, 2, dtype=torch.long)  # placeholder for the first pass
    first = run_ranks(layout_job, 1, (str(tiny_qwen), {}, "alltoall", routes))[0]
    routes = first["free"].routes_BSLK
    ref = run_ranks(layout_job, 1, (str(tiny_qwen), {}, "alltoall", routes))[0]
    return routes, ref


def _valid():
    _, lengths, mask, _ = batch_tensors()
    return torch.arange(S).expand(B, S) < lengths.unsqueeze(1), mask


@pytest.mark.quick
def test_single_rank_replay_of_own_routes_is_exact_and_logits_match_hf(reference, tiny_qwen):
    routes, ref = reference
    valid, _ = _valid()
    torch.testing.assert_close(ref["replay"].logp_BS * valid, ref["free"].logp_BS * valid, atol=0, rtol=0)
    ids, lengths, _, _ = batch_tensors()
    hf_logp = hf_token_logprobs(tiny_qwen, ids)
    torch.testing.assert_close(ref["free"].logp_BS * valid, hf_logp * valid, **TOL)
    assert routes.shape == (B, S, 2, 2) and routes.max() < 4


def test_replaying_own_routes_is_bitwise_over_random_batches(tiny_qwen):
    """Padding positions inside a microbatch pass through the experts too; replay must send them where
    free routing did (replay.fill_padding keeps recorded padding routes), or the experts' GEMMs change
    shape and the valid rows' rounding with them (seen as 1-ulp log-prob gaps in 34 of 200 batches)."""
    gaps = run_ranks(own_routes_job, 1, (str(tiny_qwen), range(40)))[0]
    assert gaps == [0.0] * 40


@pytest.mark.quick
def test_step_loss_is_productions_ppo_of_the_scored_logprobs(reference):
    """The step's loss, recomputed here from the log-probs the same weights score with the same routes:
    PPO-Clip, importance-weighted token sum over the global number of model tokens."""
    _, ref = reference
    _, _, mask, adv = batch_tensors()
    logp = ref["replay"].logp_BS
    t = policy_tensors(logp, mask, adv)
    ratio = torch.exp(torch.where(mask, logp - t["logp_old_BS"], 0.0))
    clipped = ratio.clamp(1 - POLICY.hp.clip_low, 1 + POLICY.hp.clip_high)
    loss_BT = torch.maximum(-adv * ratio, -adv * clipped)
    expected = float((loss_BT * t["is_weight_BS"] * mask).sum() / mask.sum())
    assert ref["step"]["loss"] == pytest.approx(expected, abs=1e-6)
    # the batch exercises both branches: some tokens clipped (no gradient), most not
    outside = ((ratio < 1 - POLICY.hp.clip_low) | (ratio > 1 + POLICY.hp.clip_high)) & mask
    assert 0 < int(outside.sum()) < int(mask.sum()) // 2


def test_replay_after_update_reproduces_routes_and_trains_router(reference):
    routes, ref = reference
    assert ref["mbs"] > 1  # the shard really was cut into microbatches
    assert all(d > 0 for d in ref["router_moved"])  # router gradients flow under replay
    valid, _ = _valid()
    after_routes = ref["after_free"].routes_BSLK
    changed = ((after_routes.sort(-1).values != routes.sort(-1).values).any(-1).any(-1)
               & valid).float().mean()
    # lr 1e-2 moves the routers: some tokens route differently now, and replay pins them to the old routes
    gap = ((ref["after_replay"].logp_BS - ref["after_free"].logp_BS).abs() * valid).max()
    assert float(changed) > 0 and float(gap) > 0


@pytest.mark.parametrize("layout, dispatcher, pack", [
    ({"tp": 2}, "alltoall", False),
    ({"ep": 2}, "alltoall", False),
    ({"ep": 2}, "allgather", False),
    ({"pp": 2}, "alltoall", False),
    # expert tensor parallelism 1 under tp 2 (parallel.etp): attention split over 2 ranks, each expert whole
    # on the rank of its expert-parallel group
    ({"tp": 2, "ep": 2, "etp": 1}, "alltoall", False),
    # packed sequences (THD): one row per microbatch, positions restart per sequence, attention stays
    # inside each sequence; scores, routes and the update equal the padded single rank's
    ({}, "alltoall", True),
    ({"tp": 2}, "alltoall", True),
    ({"pp": 2}, "alltoall", True),
    ({"ep": 2}, "alltoall", True),
    ({"ep": 2}, "allgather", True),  # needs equal-shaped microbatches: stays padded
    # context parallelism: each rank holds two chunks of every row, keys/values gathered in attention
    ({"cp": 2}, "alltoall", False),
    ({"cp": 2}, "alltoall", True),  # packing asked for: CP rows stay padded, and are cut by their padded size
])
def test_layout_matches_single_rank(reference, tiny_qwen, layout, dispatcher, pack):
    routes, ref = reference
    world = 2 if layout else 1
    results = run_ranks(layout_job, world, (str(tiny_qwen), layout, dispatcher, routes, pack))
    assert_matches_single_rank(results, ref, layout)
    if "cp" in layout:
        assert all(r["worker_mbs"] == r["padded_mbs"] for r in results), [r["worker_mbs"] for r in results]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def grouped_reference(request):
    """reference's single rank for DeepSeek-V3 and GLM-4.5 (one MoE layer after a dense one)."""
    path = str(request.getfixturevalue(f"tiny_{request.param}"))
    first = run_ranks(layout_job, 1, (path, {}, "alltoall", torch.zeros(B, S, 1, 2, dtype=torch.long)))[0]
    routes = first["free"].routes_BSLK
    return request.param, path, routes, run_ranks(layout_job, 1, (path, {}, "alltoall", routes))[0]


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_deepseek_and_glm4_layouts_match_single_rank(grouped_reference, layout):
    """Grouped sigmoid routing with an expert bias, shared experts, a dense first layer: TP2 and EP2
    score, replay and train as one rank. DeepSeek's latent attention under TP2 only scores as one rank:
    megatron-core's local spec splits its down-projections over TP and the shared RoPE key's gradient
    then misses the other rank's heads (the config refuses parallel.tp > 1 for it on the local spec)."""
    arch, path, routes, ref = grouped_reference
    results = run_ranks(layout_job, 2, (path, layout, "alltoall", routes))
    if arch == "deepseek_v3" and "tp" in layout:
        valid, _ = _valid()
        for res in results:
            for key in ("free", "replay"):
                torch.testing.assert_close(res[key].logp_BS * valid, ref[key].logp_BS * valid, **TOL)
            after, expected = res["after_replay"].logp_BS * valid, ref["after_replay"].logp_BS * valid
            assert not torch.allclose(after, expected, **TOL)  # the known gap: once fixed, lift the refusal
        return
    assert_matches_single_rank(results, ref, layout)


def assert_matches_single_rank(results: list[dict], ref: dict, layout: dict) -> None:
    """layout_job's results of every rank against the single rank's: log-probs and entropy free, replayed
    and after the step, the routes recorded, the step's loss and gradient norm."""
    valid, _ = _valid()
    world = len(results)
    for res in results:
        assert res["dp_rank"][0] == res["dp_rank"][1]  # parallel.dp_rank_of agrees with megatron's groups
        for key in ("free", "replay", "after_replay", "after_free"):
            for name in ("logp_BS", "entropy_BS"):
                torch.testing.assert_close(getattr(res[key], name) * valid, getattr(ref[key], name) * valid,
                                           **TOL, msg=f"{key}/{name}")
        v = valid[:, :, None, None]
        # padding routes are arbitrary
        torch.testing.assert_close(res["free"].routes_BSLK * v, ref["free"].routes_BSLK * v)
    losses = [r["step"]["loss"] for r in results if "loss" in r["step"]]
    # EP2 alone is data-parallel 2: each rank's loss is its shard's share of the global loss; under TP, CP
    # (and EP folded into TP) every rank of the one data-parallel replica has the whole loss
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    total = sum(losses) * dp / len(losses)
    assert total == pytest.approx(ref["step"]["loss"], abs=1e-5)
    assert results[0]["step"]["grad_norm"] == pytest.approx(ref["step"]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("pack", [False, True])
def test_replay_under_activation_recompute(reference, tiny_qwen, pack):
    from train_jobs import recompute_job

    routes, ref = reference
    res = run_ranks(recompute_job, 1, (str(tiny_qwen), routes, pack))[0]
    valid, _ = _valid()
    assert res["step"]["loss"] == pytest.approx(ref["step"]["loss"], abs=1e-6)
    assert res["step"]["grad_norm"] == pytest.approx(ref["step"]["grad_norm"], rel=1e-5)
    torch.testing.assert_close(res["after_replay"].logp_BS * valid, ref["after_replay"].logp_BS * valid,
                               **TOL)
    assert res["refused"].startswith("sample 1 position 2 has no recorded route (ids [255, ")
