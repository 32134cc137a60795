"""What the rollout engine asks of vLLM on each machine (engine_kwargs, the function RolloutEngine
calls): the GPU path is read here, since no GPU runs the tests."""

import dataclasses

from conftest import engine_spec

from moe_rl.config import from_dict
from moe_rl.driver.specs import engine_spec as settings_from_config
from moe_rl.rollout.engine_spec import engine_kwargs


def test_cpu_engine_eager_with_a_fixed_kv_cache_and_whole_prompt_steps():
    s = engine_spec("m")  # defaults: 256-token context, 128 sequences
    kw = engine_kwargs(s, "capture", cuda=False)
    assert kw["enforce_eager"] and not kw["enable_prefix_caching"]  # the capture hook sees every position
    assert kw["kv_cache_memory_bytes"] == 2**30 and "gpu_memory_utilization" not in kw
    assert kw["max_num_batched_tokens"] == 256 * 128 and kw["max_num_seqs"] == 128
    assert "enable_return_routed_experts" not in kw and "weight_transfer_config" not in kw
    kw = engine_kwargs(dataclasses.replace(s, kv_cache_gb=2.5), None, cuda=False)
    # no routes recorded
    assert kw["kv_cache_memory_bytes"] == int(2.5 * 2**30) and kw["enable_prefix_caching"]


def test_cpu_kv_cache_holds_the_longest_batch_twice_at_most_one_gib(tiny_qwen, tiny_deepseek_v3):
    from transformers import AutoConfig

    from moe_rl.config import RolloutSection
    from moe_rl.rollout.engine_spec import kv_bytes_per_token

    s = engine_spec("m", max_num_seqs=16, max_model_len=512)
    # the defaults are the config's (RolloutSection), carried by the spec
    r = RolloutSection
    assert (s.cpu_kv_cache_max_gb, s.cpu_kv_fills, s.gpu_batched_tokens) \
        == (r.CPU_KV_CACHE_GB, r.CPU_KV_FILLS, r.GPU_BATCHED_TOKENS) == (1.0, 2, 8192)
    # 4 KiB a token: 16 sequences of 512 tokens twice over
    assert engine_kwargs(s, None, cuda=False, kv_bytes_per_token=4096)["kv_cache_memory_bytes"] \
        == 2 * 16 * 512 * 4096
    big = dataclasses.replace(s, max_num_seqs=1024, max_model_len=4096)  # 32 GiB wanted: 1 GiB given
    assert engine_kwargs(big, None, cuda=False, kv_bytes_per_token=4096)["kv_cache_memory_bytes"] == 2**30
    assert engine_kwargs(dataclasses.replace(s, kv_cache_gb=0.5), None, cuda=False,
                         kv_bytes_per_token=4096)["kv_cache_memory_bytes"] == 2**29
    qwen = AutoConfig.from_pretrained(tiny_qwen)
    per_layer = 2 * qwen.num_key_value_heads * qwen.head_dim
    assert kv_bytes_per_token(qwen, "float32", 1) == 4 * qwen.num_hidden_layers * per_layer
    assert kv_bytes_per_token(qwen, "bfloat16", 2) == 2 * qwen.num_hidden_layers * per_layer // 2
    # multi-latent attention: the latent and the shared RoPE key, whole on every worker
    ds = AutoConfig.from_pretrained(tiny_deepseek_v3)
    assert kv_bytes_per_token(ds, "float32", 2) \
        == 4 * ds.num_hidden_layers * (ds.kv_lora_rank + ds.qk_rope_head_dim)


def test_gpu_engine_cuda_graphs_prefix_cache_with_vllm_routes_and_memory_from_config():
    cfg = from_dict({},
                    ["cluster.colocate=false", "rollout.weight_transfer=nccl", "rollout.max_model_len=16384"],
                    cuda_available=True)
    kw = engine_kwargs(settings_from_config(cfg, "m"), "vllm", cuda=True)
    assert not kw["enforce_eager"]  # CUDA graphs: weights are reloaded in place
    # vLLM's routed-experts output requires prefix caching (the cache is reset after each weight update)
    assert kw["enable_return_routed_experts"] and kw["enable_prefix_caching"]
    assert kw["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in kw
    assert kw["max_num_batched_tokens"] == 8192  # chunked prefill, not max_model_len * max_num_seqs (2.1M)
    assert kw["weight_transfer_config"] == {"backend": "nccl"}
    colocated = from_dict({}, ["cluster.colocate=true"], cuda_available=True)
    assert engine_kwargs(settings_from_config(colocated, "m"), "vllm",
                         cuda=True)["gpu_memory_utilization"] == 0.4
    own = from_dict({}, ["rollout.gpu_memory_utilization=0.6", "rollout.max_num_seqs=16000",
                         "rollout.max_num_batched_tokens=16384"], cuda_available=True)
    kw = engine_kwargs(settings_from_config(own, "m"), "vllm", cuda=True)
    assert (kw["gpu_memory_utilization"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) \
        == (0.6, 16000, 16384)
    sleeping = from_dict({}, ["rollout.sleep_engines=true"], cuda_available=True)  # colocated by default
    assert engine_kwargs(settings_from_config(sleeping, "m"), "vllm", cuda=True)["enable_sleep_mode"]
    assert "enable_sleep_mode" not in kw
    fixed = from_dict({}, ["rollout.kv_cache_gb=20"], cuda_available=True)
    kw = engine_kwargs(settings_from_config(fixed, "m"), "vllm", cuda=True)
    # the KV cache fixed, and the share of the GPU vLLM checks is free at start-up still given
    assert kw["kv_cache_memory_bytes"] == 20 * 2**30 and kw["gpu_memory_utilization"] == 0.4
    # no batch in flight when weights change or the prefix cache resets (vLLM's GPU default is async)
    assert kw["async_scheduling"] is False


def test_route_sources_per_machine():
    import pytest

    from moe_rl.rollout.engine_spec import resolve_route_source

    assert resolve_route_source("auto", True) == "vllm" and resolve_route_source("auto", False) == "capture"
    with pytest.raises(ValueError, match="Model Runner V2"):
        resolve_route_source("capture", True)  # the hook reads the CPU model runner's batch layout
    with pytest.raises(ValueError, match="needs vLLM's GPU build"):
        resolve_route_source("vllm", False)


def test_vllm_routed_expert_rows_keep_the_moe_layers_in_order():
    import numpy as np
    import pytest

    from moe_rl.rollout.routing import moe_rows

    # 2 positions, 3 hidden layers (layer 0 dense: vLLM leaves its row unused), top-2
    rows = np.array([[[9, 9], [1, 2], [3, 0]],
                     [[9, 9], [2, 3], [0, 1]]], dtype=np.uint8)
    assert moe_rows(rows, [1, 2]).tolist() == [[[1, 2], [3, 0]], [[2, 3], [0, 1]]]
    with pytest.raises(ValueError, match="do not cover MoE layers"):
        moe_rows(rows, [1, 3])


def test_cpu_engine_workers_bind_disjoint_cores():
    import pytest

    from moe_rl.rollout.engine_spec import cpu_thread_binding

    assert cpu_thread_binding([1, 0], 2) == "0|1"
    assert cpu_thread_binding(list(range(16)), 2) == "0-7|8-15"
    # each worker's thread count (the placement's share) takes the first cores; more than there are: all
    assert cpu_thread_binding(list(range(16)), 2, threads=3) == "0-2|3-5"
    assert cpu_thread_binding(list(range(4)), 2, threads=4) == "0-1|2-3"
    # the second engine of a node starts after the first one's cores; too few left: all of them
    assert cpu_thread_binding(list(range(8)), 2, threads=2, first=4) == "4-5|6-7"
    assert cpu_thread_binding([2, 3, 4, 5, 6, 7], 2, threads=1, first=2) == "4|5"
    assert cpu_thread_binding(list(range(8)), 2, threads=2, first=6) == "0-3|4-7"
    with pytest.raises(ValueError, match="2 engine workers need 2 cores"):
        cpu_thread_binding([0], 2)
