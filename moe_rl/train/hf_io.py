"""Hugging Face weights in and out of sharded megatron-core models, through mbridge.

mbridge knows each architecture's name mapping and the fused formats (QKV interleaving, gate/up
concatenation, TP splits), but it speaks Transformer Engine parameter names: `global_names` gives
each local parameter its TE name (moe_rl.weights.hf.to_te_name) with global numbers (the layer with
the pipeline offset applied, the expert with the expert-parallel offset). Loading and export are
driven here so that every TP/PP/EP layout works the same way: each rank reads the HF tensors it needs
(safetensors, no pickle) and keeps its own shard; export gathers TP shards and yields HF-named
tensors for the layers and experts this rank owns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.train import lora
from moe_rl.weights.hf import VALUE_HEADS, CheckpointMismatch, HFReader, is_expert, to_te_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def global_names(model, ep_rank: int, ep_size: int, num_experts: int | None) -> dict[str, str]:
    """Local parameter name -> TE-style global name (pipeline layer and expert offsets applied)."""
    model = _unwrap(model)
    layer_offset = {}
    if hasattr(model, "decoder"):
        for idx, layer in enumerate(model.decoder.layers):
            layer_offset[idx] = layer.layer_number - 1
    per_rank = (num_experts or 0) // max(ep_size, 1)
    mla = bool(getattr(model.config, "multi_latent_attention", False))
    out = {}
    for name in model.state_dict():
        if "_extra_state" in name or lora.is_adapter(name):  # adapters have no Hugging Face name
            continue
        g = name
        m = _LAYER.match(g)
        if m:
            g = g.replace(f"decoder.layers.{m.group(1)}.", f"decoder.layers.{layer_offset[int(m.group(1))]}.",
                          1)
        out[name] = to_te_name(g, ep_rank * per_rank, mla)
    return out


def rank_names(model, num_experts: int | None) -> dict[str, str]:
    """`global_names` for this rank's place in megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return global_names(model, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                        num_experts)


def _all_gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every rank's `t` of a (tensor-parallel) group, in rank order."""
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards


def _tp_info(te_name: str):
    from megatron.core import parallel_state as ps

    if is_expert(te_name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


@torch.no_grad()
def load_hf_weights(bridge, model, hf_path: str | Path, skip_output_layer: bool = False,
                    progress: Callable[[Iterable], Iterable] = iter) -> set[str]:
    """Fill this rank's shard of `model` from a Hugging Face checkpoint (any TP/PP/EP layout).

    Returns the HF tensor names this rank read (callers check that nothing in the checkpoint is unused).
    """

    reader = HFReader(hf_path)
    names = rank_names(model, bridge.config.num_moe_experts)
    state = _unwrap(model).state_dict()
    used: set[str] = set()
    for local, te in progress(list(names.items())):
        param = state[local]
        if local.endswith("output_layer.weight") and skip_output_layer:
            continue
        try:
            hf_names = bridge._weight_name_mapping_mcore_to_hf(te)
        except NotImplementedError:
            raise CheckpointMismatch(f"no Hugging Face mapping for model parameter '{te}' "
                                     f"({type(bridge).__name__})") from None
        used.update(hf_names)
        full = bridge._weight_to_mcore_format(te, [reader.get(n) for n in hf_names])
        rank, size, _ = _tp_info(te)
        if size > 1 and full.shape != param.shape:
            full = list(bridge._weight_split_across_tp(te, full, param, size))[rank]
        if full.shape != param.shape:
            raise CheckpointMismatch(f"'{te}': checkpoint shape {tuple(full.shape)} does not fit the model's "
                                     f"{tuple(param.shape)}")
        param.copy_(full.to(param.dtype))
    return used


def owns_replica(expert: bool = False) -> bool:
    """Whether this rank writes the one copy of a (dense or expert) tensor its replicas all hold:
    TP rank 0 of the first data-parallel (and context-parallel) replica, or for experts expert-TP rank
    0 of the first expert-data-parallel replica."""
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    return (ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


@torch.no_grad()
def export_hf_weights(bridge, model, skip_output_layer: bool = False, owned_only: bool = False,
                      progress: Callable[[Iterable], Iterable] = iter) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every parameter this rank holds (TP shards gathered).

    Every TP rank of a group yields the same tensors; PP stages and EP ranks yield their own layers
    and experts; with owned_only, only the rank that `owns_replica` yields each tensor. Collective:
    all TP ranks must iterate together.
    """

    names = rank_names(model, bridge.config.num_moe_experts)
    params = dict(_unwrap(model).named_parameters())  # Parameters carry the tensor_model_parallel tag
    state = _unwrap(model).state_dict()
    adapted = dict(lora.adapted_weights(_unwrap(model)))
    owner = {False: owns_replica(False), True: owns_replica(True)}
    for local, te in progress(list(names.items())):
        if local.endswith("output_layer.weight") and skip_output_layer:
            continue
        param = params.get(local, state[local])
        _, size, group = _tp_info(te)
        # W + (alpha/r) B A where adapted, merged one weight at a time as it is exported
        full = lora.merged_weight(adapted[local]) if local in adapted else param.detach()
        if size > 1 and getattr(param, "tensor_model_parallel", False):
            full = _merge_tp(bridge, te, _all_gather(full, size, group), param)
        if owned_only and not owner[is_expert(te)]:
            continue
        hf_names, tensors = bridge._weight_to_hf_format(te, full)
        yield from zip(hf_names, tensors, strict=True)


@torch.no_grad()
def export_peft_adapters(bridge, model, owned_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (PEFT name, tensor) for the LoRA adapters of every linear this rank holds (TP shards
    gathered), in Hugging Face PEFT's naming: for each HF module the linear's weight maps to,
    `base_model.model.{module}.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. A fused Megatron
    linear (q, k and v in linear_qkv; gate and up in linear_fc1) shares its A among its HF modules, and
    its B rows split as its weight's rows do (mbridge's mapping, applied to B padded to the weight's
    width). Experts come out per expert (`mlp.experts.{e}.gate_proj`, ...). Collective like
    `export_hf_weights`."""

    names = rank_names(model, bridge.config.num_moe_experts)
    owner = {False: owns_replica(False), True: owns_replica(True)}
    for local, adapter in lora.adapted_weights(_unwrap(model)):
        te = names[local]
        _, size, group = _tp_info(te)
        a, b = adapter.a.detach(), adapter.b.detach()
        if adapter.split == "column":  # B [out/tp, r] rows like the weight's: pad to its shape, merge, split
            r, width = a.shape
            if r > width:
                raise CheckpointMismatch(f"'{te}': rank {r} is above the input width {width}; the export "
                                         "pads B to the weight's width")
            padded = torch.nn.functional.pad(b, (0, width - r))
            if size > 1:
                padded = _merge_tp(bridge, te, _all_gather(padded, size, group), adapter.weight)
            hf_names, parts = bridge._weight_to_hf_format(te, padded)
            pairs = [(n, a, part[:, :r]) for n, part in zip(hf_names, parts, strict=True)]
        else:  # row-parallel: A [r, in/tp] gathered along its columns, B [out, r] whole (router: both whole)
            if size > 1 and adapter.split == "row":
                a = torch.cat(_all_gather(a, size, group), dim=1)
            pairs = [(n, a, b) for n in bridge._weight_name_mapping_mcore_to_hf(te)]
        if owned_only and not owner[is_expert(te)]:
            continue
        for hf_name, a_hf, b_hf in pairs:
            module = hf_name.removesuffix(".weight")
            yield f"base_model.model.{module}.lora_A.weight", a_hf.contiguous()
            yield f"base_model.model.{module}.lora_B.weight", b_hf.contiguous()


def _merge_tp(bridge, te: str, shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    # mbridge's merge assumes expert shards come from the expert-TP group; ours do
    if is_expert(te):
        if ".linear_fc2." in te:
            return torch.cat(shards, dim=1)
        gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
        return torch.cat([torch.cat(gates), torch.cat(ups)])
    return bridge._weight_merge_across_tp(te, shards, param)


def load_value_head(model, hf_path: str | Path) -> bool:
    """Initialise a critic's value head from a reward-model checkpoint's `score.weight` if it has one."""
    reader = HFReader(hf_path)
    head = getattr(_unwrap(model), "output_layer", None)
    for name in VALUE_HEADS:
        if name in reader.names() and head is not None:
            w = reader.get(name)
            if w.shape != head.weight.shape:
                raise CheckpointMismatch(f"reward-model head '{name}' has shape {tuple(w.shape)}, the critic "
                                         f"needs {tuple(head.weight.shape)}")
            with torch.no_grad():
                head.weight.copy_(w.to(head.weight.dtype))
            return True
    return False
