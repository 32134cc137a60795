"""vLLM rollout engine with weight sync from Megatron: after a sync, vLLM's sampled-token log-probs equal
Megatron's scoring of the same tokens with the recorded routes replayed (fp32, <= 1e-4); the routing
record covers every computed position; syncing the old weights back restores the outputs exactly."""

import numpy as np
import pytest
import torch
from rollout_jobs import megatron_score_job, megatron_train_export_job, vllm_sync_job

from moe_rl.train.launch_local import run_in_process, run_ranks

pytestmark = pytest.mark.slow


# qwen2_moe: with a gated shared expert; qwen_dense: a dense first layer (routes of MoE layers only);
# glm4_moe and deepseek_v3: grouped sigmoid routing with an expert bias, a shared expert, a dense first
# layer (DeepSeek: multi-latent attention)
@pytest.fixture(scope="module", params=["qwen", "qwen2_moe", "qwen_dense", "glm4_moe", "deepseek_v3"])
def synced(request, tmp_path_factory):
    tiny_qwen = request.getfixturevalue(f"tiny_{request.param}")
    root = tmp_path_factory.mktemp("sync")
    n_buckets = run_ranks(megatron_train_export_job, 1,
                          (str(tiny_qwen), str(root / "buckets"), str(root / "trained"), 0.05))[0]
    gen = run_in_process(vllm_sync_job, (str(tiny_qwen), str(root / "buckets")))
    # MoE layers: two layers each, or three after a dense one (qwen_dense); one after a dense one (GLM,
    # DeepSeek)
    gen["moe_layers"] = {"glm4_moe": 1, "deepseek_v3": 1}.get(request.param, 2)
    return root, n_buckets, gen


def test_sync_changes_outputs_and_old_weights_restore_them(synced):
    _, n_buckets, gen = synced
    assert n_buckets > 1 and gen["buckets"] == n_buckets  # really bucketed
    assert gen["synced_tensors"] == gen["checkpoint_tensors"]  # the whole model went over, once
    before, after, restored = gen["before"], gen["after"], gen["restored"]
    assert any(a.logprobs != b.logprobs for a, b in zip(after, before, strict=True))
    for b, r in zip(before, restored, strict=True):
        assert b.token_ids == r.token_ids and b.logprobs == r.logprobs
    assert [r.weight_version for r in after] == [1, 1, 1] and restored[0].weight_version == 2


def test_half_updated_weights_never_generate(synced):
    """A weight update that dies halfway (its source fails mid-stream) leaves the engine refusing to
    generate (the run then replaces the engine: driver/rollout_manager.py)."""
    _, _, gen = synced
    assert gen["refused"].startswith("the engine's weights are half-updated (an update after version 4 did "
                                     "not finish)")


def test_engines_sleep_at_level_2_where_the_syncs_replace_every_weight(synced):
    """Colocated engines sleep until the next weight sync: where the syncs replace every weight (the last
    one delivered every tensor of the checkpoint) the weights are discarded (level 2), not copied to host
    memory and back (level 1); before any sync, or after one that left weights alone, level 1. Discarded
    weights generate nothing until a sync has replaced them all."""
    from moe_rl.rollout.engine import sleep_level

    _, _, gen = synced
    assert gen["sleep_levels"] == {"before_any_sync": 1, "after_a_whole_sync": 2, "after_a_partial_sync": 1}
    assert gen["refused_asleep"].startswith("the engine is asleep")
    assert gen["refused_discarded"].startswith("the engine's weights were discarded by a level-2 sleep")
    # the checkpoint's own values synced back after the level-2 sleep; the partial sync loaded its own values
    for b, a, p in zip(gen["before"], gen["after_level_2"], gen["after_partial"], strict=True):
        assert b.token_ids == a.token_ids == p.token_ids and b.logprobs == a.logprobs == p.logprobs
    ckpt = {"embed", "layers.0.q", "layers.1.q"}
    assert sleep_level(None, ckpt) == 1
    assert sleep_level(ckpt, ckpt) == 2 and sleep_level(ckpt | {"extra"}, ckpt) == 2
    assert sleep_level(ckpt - {"layers.1.q"}, ckpt) == 1


def test_routing_record_covers_every_computed_position(synced):
    _, _, gen = synced
    assert gen["layers"] == gen["moe_layers"]
    for r in gen["after"]:
        n = len(r.prompt_ids) + len(r.token_ids)
        rec = r.routes
        assert rec.experts_PLK.dtype == np.uint8 and rec.experts_PLK.shape[1:] == (gen["layers"], 2)
        # every prompt and generated position except the last sampled token (never fed back)
        assert rec.computed_P.all() and rec.experts_PLK.shape[0] == n - 1
        routes, tail = rec.to_replay(n, top_k=2)
        assert routes.shape == (n, gen["layers"], 2) and tail == 1
    # the routes of the requests an engine step finished come back in one call (requests started together
    # finish in the same step when they have as many tokens)
    assert gen["route_calls_before"] == len({len(r.token_ids) for r in gen["before"]})


def test_vllm_logprobs_match_megatron_with_replayed_routes(synced):
    root, _, gen = synced
    after = gen["after"]
    seqs = [r.prompt_ids + r.token_ids for r in after]
    S = max(map(len, seqs))
    routes = torch.zeros(len(seqs), S, gen["layers"], 2, dtype=torch.long)
    for i, r in enumerate(after):
        routes[i, : len(seqs[i])] = r.routes.to_replay(len(seqs[i]), 2)[0]
    out = run_ranks(megatron_score_job, 1, (str(root / "trained"), seqs, routes))[0]
    max_err, agree, total = 0.0, 0, 0
    for i, r in enumerate(after):
        P, n = len(r.prompt_ids), len(seqs[i])
        mg = out["replay"][i, P:n]
        max_err = max(max_err, float((mg - torch.tensor(r.logprobs)).abs().max()))
        same = (out["free_routes"][i, : n - 1].sort(-1).values == routes[i, : n - 1].sort(-1).values).all(-1)
        agree += int(same.sum())
        total += same.numel()
    assert max_err <= 1e-4
    # without replay the trainer routes for itself; in fp32 with identical weights it agrees with vLLM
    # (reported as a metric by the loop; bf16 would show the mismatch R3 exists for). Measured: 1.0000
    # for both models. A position-layer can only disagree at a near-tie, where the k-th and (k+1)-th
    # router logits lie within the ~1e-6 fp32 gap between vLLM's CPU kernels and Megatron's; the bound
    # allows a few such ties (1%, at least one), while a real error (expert ids permuted, routes shifted
    # by a position, layers swapped) drops agreement towards chance (1/6 for top-2 of 4 experts).
    print(f"free-routing agreement with vLLM: {agree}/{total} = {agree / total:.4f}, replayed logp max err "
          f"{max_err:.2e}")
    assert total - agree <= max(1, total // 100)


def test_next_turn_returns_routes_from_where_the_record_ends(synced):
    _, _, gen = synced
    first, turn2, whole, start = gen["after"][0], gen["turn2"], gen["whole"], gen["turn2_start"]
    assert start == len(first.prompt_ids) + len(first.token_ids) - 1  # the first turn's last sampled token
    n2 = len(turn2.prompt_ids) + len(turn2.token_ids) - 1
    assert not turn2.routes.computed_P[:start].any() and turn2.routes.computed_P[start:n2].all()
    merged = first.routes.extended(turn2.routes)
    assert merged.computed_P.all() and merged.num_positions == n2
    # the same weights route the shared prefix alike: the merged record equals a full re-recording
    assert turn2.token_ids == whole.token_ids
    assert np.array_equal(merged.experts_PLK, whole.routes.experts_PLK)
