"""LoRA adapters on megatron-core's linears and routers: y = W x + (alpha/r) B A x.

    n = add_adapters(module, LoraSpec(rank=8, alpha=16, targets=("linear_qkv", "linear_fc1")), names,
                     seed)
    for name, adapter in adapted_weights(module):   # each adapted weight's local name, its adapter
        merged_weight(adapter)                       # W + (alpha/r) B A, this rank's shard: what engines get

Targets, by module name: attention's linear_qkv and linear_proj, the dense MLPs' and every expert's
linear_fc1 and linear_fc2 (one adapter per expert, grouped like the experts' weights), the MoE router and
the output layer (a column-parallel linear over the vocabulary: its B has a row per token). Each adapted
weight gets two parameters beside it, `lora_A` [r, in] and `lora_B` [out, r] (a grouped expert linear,
whose weights are weight0, weight1, ...: lora_A0, lora_B0, ...), and the module a hook that adds the
adapter's output to its own. The base stays the same module with the same parameter
names, so loading, export and routing replay are unchanged; every base parameter is frozen (no gradient,
so no gradient buffer and no optimizer state).

Both layer specs: the local spec's ColumnParallelLinear / RowParallelLinear (SequentialMLP: an expert's
linears are modules of their own), and Transformer Engine's linears (matched by class name: TE needs
CUDA): TELayerNormColumnParallelLinear, whose adapter reads the norm's output (TE returns it:
`return_layernorm_output`), TEColumnParallelLinear, TERowParallelLinear, and TEGroupedMLP's grouped
linears, whose input the hook splits by the tokens each expert got. The router's adapter adds to its
logits (`Router.gating`): R3 replays which experts tokens go to, and the gates' weights come from these.

Sharding follows the weight. A column-parallel W [out/tp, in] keeps A whole (replicated) and shards B
[out/tp, r]; the adapter sees the layer's full input (under sequence parallelism it gathers the
sequence as the layer does), and each rank's A gradient is a partial sum. A row-parallel W [out, in/tp]
shards A [r, in/tp] and keeps B whole; each rank's adapter output is a partial sum, reduced like the
layer's (reduce-scatter under sequence parallelism; experts: left to the token dispatcher, as megatron
leaves their output), and each rank's B gradient is a partial sum. The replicated factor is tagged
`sequence_parallel`, so megatron's finalize_model_grads sums its gradient over the tensor-parallel group
(sequence parallelism is on whenever tp > 1 here), as it does for the norms and the router. Expert
adapters take their weight's `allreduce` tag (DDP reduces them over the expert-data-parallel group).

Initialisation is PEFT's: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)), B = 0, so the
model starts as the base. A is drawn whole from a generator seeded by the run's seed and the weight's
global name, then sliced: every layout (TP, PP, EP) starts from the same adapters. Checkpoint layouts:
train/lora_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_rl.train.lora_checkpoint import add_checkpoint_layouts, tp_group

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router", "output_layer")

# Transformer Engine's linears in megatron-core (extensions/transformer_engine.py), by class name
_TE_SPLITS = {"TELayerNormColumnParallelLinear": "column", "TEColumnParallelLinear": "column",
              "TERowParallelLinear": "row", "TEColumnParallelGroupedLinear": "column",
              "TERowParallelGroupedLinear": "row"}
_ADAPTER = re.compile(r"\.lora_[AB]\d*$")


@dataclass(frozen=True)
class LoraSpec:
    """Built from model.lora by moe_rl.driver.specs.policy_spec."""

    rank: int  # r
    alpha: float  # the adapter's output is scaled by alpha / r
    targets: tuple[str, ...]  # module names of TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapter_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * B A x: x [..., in], a [r, in], b [out, r] -> [..., out]."""
    return scale * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)


def is_adapter(name: str) -> bool:
    return _ADAPTER.search(name) is not None


def split_of(module) -> str | None:
    """How an adaptable module's weight is split over tensor parallelism: "column" (output rows: A whole,
    B sharded), "row" (input columns: A sharded, B whole), "replicated" (the MoE router: both whole);
    None for a module adapters do not go on."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import Router

    for cls in type(module).__mro__:
        if cls.__name__ in _TE_SPLITS:
            return _TE_SPLITS[cls.__name__]
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    if isinstance(module, Router):
        return "replicated"
    return None


@dataclass(frozen=True)
class Adapter:
    """One adapted weight of `module`: `weight` and its factors (index: a grouped linear's expert)."""

    module: torch.nn.Module
    index: str = ""  # "" or a grouped linear's gemm index, as in its weight0, weight1, ...

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.module, f"weight{self.index}")

    @property
    def a(self) -> torch.nn.Parameter:
        return getattr(self.module, f"lora_A{self.index}")

    @property
    def b(self) -> torch.nn.Parameter:
        return getattr(self.module, f"lora_B{self.index}")

    @property
    def split(self) -> str:
        return self.module.lora_split


def adapted_weights(model) -> Iterator[tuple[str, Adapter]]:
    """(local name of the adapted weight, its Adapter) for every adapter of `model`."""
    for name, module in model.named_modules():
        for index in getattr(module, "lora_indices", ()):
            yield f"{name}.weight{index}", Adapter(module, index)


@torch.no_grad()
def merged_weight(adapter: Adapter) -> torch.Tensor:
    """W + (alpha/r) B A for this rank's shard of an adapted weight."""
    w = adapter.weight
    delta = adapter.module.lora_scale * adapter.b.double() @ adapter.a.double()
    return (w.double() + delta).to(w.dtype)


def _unpack(output) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, bias, the norm's output or None) of a linear: (out, bias); TE's LayerNormLinear with
    return_layernorm_output gives ((out, normed), bias), or (out, bias, normed) where it returns a bias."""
    if len(output) == 3:
        return output
    out, bias = output
    if isinstance(out, tuple):
        return out[0], bias, out[1]
    return out, bias, None


@contextlib.contextmanager
def adapters_off(model):
    """Within it, every adapter of `model` adds nothing: the model is its frozen base (the KL reference of
    a LoRA policy, scored without a copy of its own)."""
    adapted = [m for m in model.modules() if getattr(m, "lora_indices", None)]
    for m in adapted:
        m.lora_off = True
    try:
        yield
    finally:
        for m in adapted:
            m.lora_off = False


def _column_hook(module, args, kwargs, output):
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if module.lora_off:
        return _unpack(output)[:2]
    out, bias, normed = _unpack(output)
    x = normed if normed is not None else args[0] if args else kwargs["input_"]
    if x.shape[0] != out.shape[0]:  # a sequence-parallel input, which the layer gathered: so does the adapter
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=tp_group(module))
    return out + adapter_delta(x, module.lora_A, module.lora_B, module.lora_scale), bias


def _row_hook(module, args, kwargs, output):
    from megatron.core.tensor_parallel import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    if module.lora_off:
        return output
    x = args[0] if args else kwargs["input_"]
    partial = adapter_delta(x, module.lora_A, module.lora_B, module.lora_scale)
    group = tp_group(module)
    if getattr(module, "explicit_expert_comm", False) or group.size() == 1:
        delta = partial  # experts: megatron leaves their partial output to the dispatcher
    elif module.sequence_parallel:
        delta = reduce_scatter_to_sequence_parallel_region(partial, group=group)
    else:
        delta = reduce_from_tensor_model_parallel_region(partial, group=group)
    out, bias = output
    return out + delta, bias


def _grouped_hook(module, args, kwargs, output):
    """A grouped expert linear (TE GroupedLinear: forward(x, m_splits), x [tokens, in] sorted by expert):
    each expert's tokens through its own adapter. Outputs are partial under expert TP, left to the
    dispatcher as the layer's are."""
    if module.lora_off:
        return output
    x = args[0] if args else kwargs["x"]
    splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    parts = torch.split(x, [int(n) for n in splits])
    delta = torch.cat([adapter_delta(part, getattr(module, f"lora_A{i}"), getattr(module, f"lora_B{i}"),
                                     module.lora_scale) for i, part in enumerate(parts)])
    out, bias = output
    return out + delta, bias


def _adapted_gating(router):
    """The router's gating with its adapter: logits W x + (alpha/r) B A x, in the router's dtype."""
    gating = router.gating

    def adapted(x):
        logits = gating(x)
        if router.lora_off:
            return logits
        dtype = logits.dtype
        return logits + adapter_delta(x.to(dtype), router.lora_A.to(dtype), router.lora_B.to(dtype),
                                      router.lora_scale)
    return adapted


def _initial_a(global_name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """The whole A [rank, fan_in] of one weight, the same in every layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) * bound


def _carry_gradients(embedding, args, output):
    """The embedding's output, requiring grad: with the embedding frozen it would not, and megatron's
    activation recompute (a reentrant checkpoint) gives no gradient to anything inside a layer whose
    input does not require one, adapters included."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return output


def _add_factors(module, index: str, split: str, settings: LoraSpec, global_name: str, seed: int) -> None:
    """lora_A{index} and lora_B{index} beside weight{index}, sharded and tagged like it."""
    weight = getattr(module, f"weight{index}")
    if weight is None:  # the output layer of a model whose embeddings are tied to it
        raise ValueError(f"LoRA target '{global_name}' has no weight of its own (the model ties its output "
                         "layer to its embeddings); drop output_layer from model.lora.targets")
    group = tp_group(module)
    rank, size = group.rank(), group.size()
    out_local, in_local = weight.shape
    sharded_input = split == "row" and size > 1
    a = _initial_a(global_name, settings.rank, in_local * size if sharded_input else in_local, seed)
    if sharded_input:
        a = a.chunk(size, dim=1)[rank]
    opts = dict(dtype=weight.dtype, device=weight.device)
    a = torch.nn.Parameter(a.to(**opts).contiguous())
    b = torch.nn.Parameter(torch.zeros(out_local, settings.rank, **opts))
    setattr(module, f"lora_A{index}", a)
    setattr(module, f"lora_B{index}", b)
    for p in (a, b):
        p.allreduce = getattr(weight, "allreduce", True)
    if split == "replicated":  # the router: whole on every TP rank, each seeing its sequence shard
        a.sequence_parallel = b.sequence_parallel = size > 1  # as megatron tags the router's weight
        return
    sharded, replicated = (b, a) if split == "column" else (a, b)
    if size > 1:
        sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = \
            True, 0 if split == "column" else 1, 1
        replicated.sequence_parallel = True  # finalize_model_grads sums its gradient over TP


def add_adapters(module, settings: LoraSpec, global_names: dict[str, str], seed: int) -> int:
    """Freeze every parameter of `module` (one pipeline stage), then give each targeted weight its
    adapters (trainable) and each targeted module its hook. `global_names`: local parameter name ->
    global name (hf_io.global_names), which seeds each weight's A. Returns the number of adapted
    weights."""
    for p in module.parameters():
        p.requires_grad_(False)
    if getattr(module, "embedding", None) is not None:  # the first pipeline stage
        module.embedding.register_forward_hook(_carry_gradients)
    adapted = 0
    for name, target in list(module.named_modules()):
        split = split_of(target)
        if split is None or name.rsplit(".", 1)[-1] not in settings.targets:
            continue
        grouped = getattr(target, "num_gemms", None)
        target.lora_indices = tuple(str(i) for i in range(grouped)) if grouped else ("",)
        target.lora_scale, target.lora_split, target.lora_off = settings.scale, split, False
        for index in target.lora_indices:
            _add_factors(target, index, split, settings, global_names[f"{name}.weight{index}"], seed)
        adapted += len(target.lora_indices)
        if split == "replicated":
            target.gating = _adapted_gating(target)
            continue
        if hasattr(target, "return_layernorm_output"):  # TE's fused norm: hand the adapter the norm's output
            target.return_layernorm_output = True
        hook = _grouped_hook if grouped else _column_hook if split == "column" else _row_hook
        target.register_forward_hook(hook, with_kwargs=True)
    add_checkpoint_layouts(module)
    return adapted


def adapter_parameters(module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by local name."""
    return {n: p for n, p in module.named_parameters() if is_adapter(n)}
