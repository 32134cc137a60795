"""Hugging Face weights in and out of sharded megatron-core models, through mbridge.

mbridge knows each architecture's name mapping and the fused formats (QKV interleaving, gate/up
concatenation, TP splits), but it speaks Transformer Engine parameter names. The local spec names
differ in two places, which `to_te_name` maps:

    decoder.layers.L.input_layernorm.weight                 -> ...self_attention.linear_qkv.layer_norm_weight
    decoder.layers.L.mlp.experts.local_experts.E.linear_fcN.weight -> ...mlp.experts.linear_fcN.weightG

with L the global layer (pipeline offset applied) and G the global expert id (expert-parallel offset
applied). Loading and export are driven here so that every TP/PP/EP layout works the same way:
each rank reads the HF tensors it needs (safetensors, no pickle) and keeps its own shard; export
gathers TP shards and yields HF-named tensors for the layers and experts this rank owns.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from moe_rl.train.checkpoint import CheckpointError

HF_CONFIG_DIR = "hf_config"  # a Megatron checkpoint's copy of its HF config and tokenizer files
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TE grouped experts


class CheckpointMismatch(CheckpointError):
    """The checkpoint does not fit the model (names, shapes or architecture)."""


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
    out = {}
    for name in model.state_dict():
        if "_extra_state" in name:
            continue
        g = name
        m = _LAYER.match(g)
        if m:
            g = g.replace(f"decoder.layers.{m.group(1)}.", f"decoder.layers.{layer_offset[int(m.group(1))]}.", 1)
        out[name] = to_te_name(g, ep_rank * per_rank)
    return out


def to_te_name(name: str, expert_offset: int = 0) -> str:
    if name.endswith(".input_layernorm.weight"):
        return name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    m = _LOCAL_EXPERT.search(name)
    if m:
        return name[: m.start()] + f".mlp.experts.{m.group(2)}.weight{int(m.group(1)) + expert_offset}"
    m = _TE_EXPERT.search(name)
    if m:
        return name[: m.start()] + f".mlp.experts.{m.group(1)}.weight{int(m.group(2)) + expert_offset}"
    return name


def _is_expert(te_name: str) -> bool:
    return ".mlp.experts.linear_fc" in te_name


class HFReader:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            with safe_open(self.path / "model.safetensors", "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointMismatch(f"{self.path} has no model.safetensors or model.safetensors.index.json")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointMismatch(f"checkpoint {self.path} has no tensor '{name}'")
        with safe_open(self.path / self.where[name], "pt") as f:
            return f.get_tensor(name)

    def names(self) -> set[str]:
        return set(self.where)


def _tp_info(te_name: str):
    from megatron.core import parallel_state as ps

    if _is_expert(te_name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


@torch.no_grad()
def load_hf_weights(bridge, model, hf_path: str | Path, skip_output_layer: bool = False,
                    progress: Callable[[Iterable], Iterable] = iter) -> set[str]:
    """Fill this rank's shard of `model` from a Hugging Face checkpoint (any TP/PP/EP layout).

    Returns the HF tensor names this rank read (callers check that nothing in the checkpoint is unused).
    """
    from megatron.core import parallel_state as ps

    reader = HFReader(hf_path)
    names = global_names(model, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                         bridge.config.num_moe_experts)
    state = _unwrap(model).state_dict()
    used: set[str] = set()
    for local, te in progress(list(names.items())):
        param = state[local]
        if local.endswith("output_layer.weight") and skip_output_layer:
            continue
        try:
            hf_names = bridge._weight_name_mapping_mcore_to_hf(te)
        except NotImplementedError:
            raise CheckpointMismatch(f"no Hugging Face mapping for model parameter '{te}' ({type(bridge).__name__})") from None
        used.update(hf_names)
        full = bridge._weight_to_mcore_format(te, [reader.get(n) for n in hf_names])
        rank, size, _ = _tp_info(te)
        if size > 1 and full.shape != param.shape:
            full = list(bridge._weight_split_across_tp(te, full, param, size))[rank]
        if full.shape != param.shape:
            raise CheckpointMismatch(f"'{te}': checkpoint shape {tuple(full.shape)} does not fit the model's {tuple(param.shape)}")
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
    from megatron.core import parallel_state as ps

    names = global_names(model, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                         bridge.config.num_moe_experts)
    params = dict(_unwrap(model).named_parameters())  # Parameters carry the tensor_model_parallel tag
    state = _unwrap(model).state_dict()
    owner = {False: owns_replica(False), True: owns_replica(True)}
    for local, te in progress(list(names.items())):
        if local.endswith("output_layer.weight") and skip_output_layer:
            continue
        param = params.get(local, state[local])
        _, size, group = _tp_info(te)
        full = param.detach()
        if size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(full) for _ in range(size)]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = _merge_tp(bridge, te, shards, param)
        if owned_only and not owner[_is_expert(te)]:
            continue
        hf_names, tensors = bridge._weight_to_hf_format(te, full)
        yield from zip(hf_names, tensors, strict=True)


def _merge_tp(bridge, te: str, shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    # mbridge's merge assumes expert shards come from the expert-TP group; ours do
    if _is_expert(te):
        if ".linear_fc2." in te:
            return torch.cat(shards, dim=1)
        gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
        return torch.cat([torch.cat(gates), torch.cat(ups)])
    return bridge._weight_merge_across_tp(te, shards, param)


def load_value_head(model, hf_path: str | Path) -> bool:
    """Initialise a critic's value head from a reward-model checkpoint's `score.weight` if it has one."""
    reader = HFReader(hf_path)
    head = getattr(_unwrap(model), "output_layer", None)
    for name in ("score.weight", "v_head.weight", "value_head.weight"):
        if name in reader.names() and head is not None:
            w = reader.get(name)
            if w.shape != head.weight.shape:
                raise CheckpointMismatch(f"reward-model head '{name}' has shape {tuple(w.shape)}, the critic needs {tuple(head.weight.shape)}")
            with torch.no_grad():
                head.weight.copy_(w.to(head.weight.dtype))
            return True
    return False


def copy_hf_config(src: str | Path, dst: str | Path) -> Path:
    """Copy config, generation config and tokenizer files (no weights) from `src` into `dst`."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy2(f, dst / f.name)
    return dst


def write_shards(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, prefix: str = "model",
                 shard_mb: float = 2048) -> dict[str, tuple[str, int]]:
    """Write HF-named tensors as safetensors files `{prefix}-00001.safetensors`, ... of about shard_mb;
    returns {name: (file, bytes)} for the index."""
    from safetensors.torch import save_file

    from moe_rl.weights.sync import buckets

    written = {}
    for i, shard in enumerate(buckets(named, shard_mb)):
        file = f"{prefix}-{i + 1:05d}.safetensors"
        save_file({n: t.detach().contiguous().cpu() for n, t in shard}, str(Path(out_dir) / file), metadata={"format": "pt"})
        written.update({n: (file, t.numel() * t.element_size()) for n, t in shard})
    return written


def write_index(out_dir: str | Path, written: dict[str, tuple[str, int]]) -> Path:
    """model.safetensors.index.json for the files `write_shards` wrote (a stale single-file
    model.safetensors is removed so loaders read the index)."""
    out = Path(out_dir)
    total = sum(size for _, size in written.values())
    weight_map = {n: file for n, (file, _) in sorted(written.items())}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "model.safetensors").unlink(missing_ok=True)
    return out


def save_hf_checkpoint(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, config_from: str | Path,
                       shard_mb: float = 2048) -> Path:
    """Write HF-named tensors as a sharded safetensors checkpoint (with index) next to the config and
    tokenizer files of `config_from`. Rank-local: call where the full set of tensors is available."""
    out = copy_hf_config(config_from, out_dir)
    return write_index(out, write_shards(named, out, shard_mb=shard_mb))
