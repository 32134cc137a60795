"""Checkpoint layouts of LoRA adapters (train/lora.py): each adapted module's sharded_state_dict gives its
adapters the sharding of the weight they sit beside, so that an adapters-only checkpoint reshards across
TP / EP / PP like a whole model's. Megatron's own layouts treat any other tensor as replicated across TP.

- a column-parallel linear: B along its output rows; a row-parallel one: A along its input columns;
- a gated MLP's fc1 (local spec and TE, dense or SequentialMLP's experts): B split into its gate and up
  halves per TP shard, as megatron splits fc1's weight;
- TE's grouped expert linears: each expert's adapters with the global expert axis megatron gives its
  weight, under the keys SequentialMLP's experts' adapters have (checkpoints move between the specs);
- the router: whole, replicated (megatron's default layout, unchanged).
"""

from __future__ import annotations


def tp_group(module):
    """The tensor-parallel group a module's weight is split over (megatron's TE wrappers keep it as
    `_tp_group`; grouped experts: the expert-TP group)."""
    return getattr(module, "_tp_group", None) or module.tp_group


def add_checkpoint_layouts(module) -> None:
    """Give every adapted module of `module` (one pipeline stage, adapters added: train/lora.py) its
    layout."""
    for target in list(module.modules()):
        split = getattr(target, "lora_split", None)
        if split in ("column", "row"):
            grouped = hasattr(target, "num_gemms")
            target.sharded_state_dict = (_grouped_layout if grouped else _linear_layout)(target, split)
    for mlp in list(module.modules()):  # a gated MLP's fc1 holds [gate; up] per TP shard: its B rows do too
        fc1 = getattr(mlp, "linear_fc1", None)
        if getattr(fc1, "lora_indices", None) and getattr(mlp.config, "gated_linear_unit", False):
            mlp.sharded_state_dict = _gated_layout(mlp, fc1)


def _linear_layout(linear, split: str):
    """A linear's sharded_state_dict with its adapters sharded like its weight: B along the output rows of
    a column-parallel linear, A along the input columns of a row-parallel one."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if split == "column" else {"weight": 1, "lora_A": 1}

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(linear.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=tp_group(linear),
                                                   dp_cp_group=metadata["dp_cp_group"])
    return sharded_state_dict


def _expert_offsets(experts, sharded_offsets: tuple, singleton: bool) -> list[tuple]:
    """Each local expert's sharded offsets: the global expert axis appended (megatron's grouped layout),
    none where the metadata asks for singleton local shards (the expert id goes in the key instead)."""
    ep = experts._pg_collection.ep
    first, total = ep.rank() * experts.num_gemms, ep.size() * experts.num_gemms
    return [sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + i, total))
            for i in range(experts.num_gemms)]


def _grouped_layout(linear, split: str):
    """A TE grouped expert linear's sharded_state_dict (megatron's, for weight0, weight1, ...) with every
    expert's adapters added as megatron adds its weight: sharded over expert TP like it, on the global
    expert axis, replicated over the expert-data-parallel group."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import ensure_metadata_has_dp_cp_group

    original = linear.sharded_state_dict
    axes = {"lora_B": 0} if split == "column" else {"lora_A": 1}

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = original(prefix, sharded_offsets, metadata)
        singleton = metadata.get("singleton_local_shards", False)
        edp_rank = linear._pg_collection.expt_dp.rank()
        ep = linear._pg_collection.ep
        for i, offsets in enumerate(_expert_offsets(linear, sharded_offsets, singleton)):
            key_prefix = f"{ep.rank() * linear.num_gemms + i}.{prefix}" if singleton else prefix
            state = {"lora_A": getattr(linear, f"lora_A{i}"), "lora_B": getattr(linear, f"lora_B{i}")}
            sub = make_sharded_tensors_for_checkpoint(state, key_prefix, axes, offsets,
                                                      tp_group=linear._tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
            for name in state:
                sharded = sub[f"{key_prefix}{name}"]
                sharded.replica_id = (*sharded.replica_id[:2], edp_rank)
                out[f"{prefix}{name}{i}"] = sharded
        return out
    return sharded_state_dict


def _gated_layout(mlp, fc1):
    """A gated MLP's sharded_state_dict with fc1's B (each expert's, in a grouped MLP) split into its gate
    and up halves, as megatron splits fc1's weight."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    original = mlp.sharded_state_dict
    grouped = hasattr(fc1, "num_gemms")

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = original(prefix, sharded_offsets, metadata)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        offsets = _expert_offsets(fc1, sharded_offsets, singleton) if grouped else [sharded_offsets]
        for index, expert_offsets in zip(fc1.lora_indices, offsets, strict=True):
            key = f"{prefix}linear_fc1.lora_B{index}"
            out[key] = apply_swiglu_sharded_factory(out[key], expert_offsets, singleton)
        return out
    return sharded_state_dict
