"""LoRA adapters on megatron-core's parallel linears (the local layer spec): y = W x + (alpha/r) B A x.

    n = add_adapters(module, LoraSettings(rank=8, alpha=16, targets=("linear_qkv", "linear_fc1")), names,
                     seed)
    merged_weight(linear)   # W + (alpha/r) B A, this rank's shard: what the engines get

Each targeted ColumnParallelLinear / RowParallelLinear (attention's linear_qkv and linear_proj, the
dense MLP's and every expert's linear_fc1 and linear_fc2: SequentialMLP builds one pair per expert, so
the adapters are per expert, grouped like the experts' weights) gets two parameters beside its weight,
`lora_A` [r, in] and `lora_B` [out, r], and a forward hook that adds the adapter's output to the layer's.
The base stays the same module with the same parameter names, so loading, export and routing replay are
unchanged; every base parameter is frozen (no gradient, so no gradient buffer and no optimizer state).

Sharding follows the weight. A column-parallel W [out/tp, in] keeps A whole (replicated) and shards B
[out/tp, r]; the adapter sees the layer's full input (under sequence parallelism it gathers the
sequence as the layer does), and each rank's A gradient is a partial sum. A row-parallel W [out, in/tp]
shards A [r, in/tp] and keeps B whole; each rank's adapter output is a partial sum, reduced like the
layer's (reduce-scatter under sequence parallelism; experts: left to the token dispatcher, as megatron
leaves their output), and each rank's B gradient is a partial sum. The replicated factor is tagged
`sequence_parallel`, so megatron's finalize_model_grads sums its gradient over the tensor-parallel group
(sequence parallelism is on whenever tp > 1 here), as it does for the norms. Expert adapters are tagged
`allreduce=False` like the experts' weights (DDP reduces them over the expert-data-parallel group).

Initialisation is PEFT's: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)), B = 0, so the
model starts as the base. A is drawn whole from a generator seeded by the run's seed and the layer's
global name, then sliced: every layout (TP, PP, EP) starts from the same adapters.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoraSettings:
    """Built from model.lora by moe_rl.settings.model_spec."""

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
    return name.endswith((".lora_A", ".lora_B"))


def _kind(module) -> str | None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return None


def is_column(linear) -> bool:
    """Whether an adapted linear is column-parallel (A whole, B sharded) rather than row-parallel."""
    return _kind(linear) == "column"


def _tp(module) -> tuple[int, int]:
    group = module.tp_group
    return group.rank(), group.size()


def _column_hook(module, args, kwargs, output):
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    x = args[0] if args else kwargs["input_"]
    if module.sequence_parallel and not module.explicit_expert_comm:  # the layer gathers its input so
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=module.tp_group)
    out, bias = output
    return out + adapter_delta(x, module.lora_A, module.lora_B, module.lora_scale), bias


def _row_hook(module, args, kwargs, output):
    from megatron.core.tensor_parallel import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    x = args[0] if args else kwargs["input_"]
    partial = adapter_delta(x, module.lora_A, module.lora_B, module.lora_scale)
    if module.explicit_expert_comm:  # megatron leaves an expert's partial output to the dispatcher
        delta = partial
    elif module.sequence_parallel:
        delta = reduce_scatter_to_sequence_parallel_region(partial, group=module.tp_group)
    else:
        delta = reduce_from_tensor_model_parallel_region(partial, group=module.tp_group)
    out, bias = output
    return out + delta, bias


def _initial_a(global_name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """The whole A [rank, fan_in] of one layer, the same in every layout."""
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


def add_adapters(module, settings: LoraSettings, global_names: dict[str, str], seed: int) -> int:
    """Freeze every parameter of `module` (one pipeline stage), then give each targeted linear its
    adapters (trainable) and hook. `global_names`: local parameter name -> global name
    (hf_io.global_names), which seeds each layer's A. Returns the number of adapted linears."""
    for p in module.parameters():
        p.requires_grad_(False)
    if getattr(module, "embedding", None) is not None:  # the first pipeline stage
        module.embedding.register_forward_hook(_carry_gradients)
    adapted = 0
    for name, linear in list(module.named_modules()):
        kind = _kind(linear)
        if kind is None or name.rsplit(".", 1)[-1] not in settings.targets:
            continue
        weight = linear.weight
        rank, size = _tp(linear)
        out_local, in_local = weight.shape
        sharded_input = kind == "row" and size > 1
        fan_in = in_local * size if sharded_input else in_local
        a = _initial_a(global_names[f"{name}.weight"], settings.rank, fan_in, seed)
        if sharded_input:
            a = a.chunk(size, dim=1)[rank]
        opts = dict(dtype=weight.dtype, device=weight.device)
        linear.lora_A = torch.nn.Parameter(a.to(**opts).contiguous())
        linear.lora_B = torch.nn.Parameter(torch.zeros(out_local, settings.rank, **opts))
        linear.lora_scale = settings.scale
        sharded, replicated = (linear.lora_B, linear.lora_A) if kind == "column" else \
            (linear.lora_A, linear.lora_B)
        for p in (linear.lora_A, linear.lora_B):
            p.allreduce = getattr(weight, "allreduce", True)
        if size > 1:
            sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = \
                True, 0 if kind == "column" else 1, 1
            replicated.sequence_parallel = True  # finalize_model_grads sums its gradient over TP
        linear.register_forward_hook(_column_hook if kind == "column" else _row_hook, with_kwargs=True)
        linear.sharded_state_dict = _checkpoint_layout(linear, kind)
        adapted += 1
    for mlp in module.modules():  # a gated MLP's fc1 holds [gate; up] per TP shard: its B rows do too
        fc1 = getattr(mlp, "linear_fc1", None)
        if hasattr(fc1, "lora_B") and getattr(mlp.config, "gated_linear_unit", False):
            mlp.sharded_state_dict = _gated_checkpoint_layout(mlp)
    return adapted


def _checkpoint_layout(linear, kind: str):
    """The linear's sharded_state_dict with its adapters sharded like its weight (megatron's own treats
    any other tensor as replicated across TP): B along the output rows of a column-parallel linear, A
    along the input columns of a row-parallel one."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if kind == "column" else {"weight": 1, "lora_A": 1}

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(linear.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=linear.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])
    return sharded_state_dict


def _gated_checkpoint_layout(mlp):
    """A gated MLP's sharded_state_dict with fc1's B split into its gate and up halves, as megatron
    splits fc1's weight, so that a checkpoint reshards across TP."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    original = mlp.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = original(prefix, sharded_offsets, metadata)
        key = f"{prefix}linear_fc1.lora_B"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                (metadata or {}).get("singleton_local_shards", False))
        return out
    return sharded_state_dict


@torch.no_grad()
def merged_weight(linear) -> torch.Tensor:
    """W + (alpha/r) B A for this rank's shard of an adapted linear (its weight alone if not adapted)."""
    if not hasattr(linear, "lora_A"):
        return linear.weight.detach()
    delta = linear.lora_scale * linear.lora_B.double() @ linear.lora_A.double()
    return (linear.weight.double() + delta).to(linear.weight.dtype)


def adapter_parameters(module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by local name."""
    return {n: p for n, p in module.named_parameters() if is_adapter(n)}
