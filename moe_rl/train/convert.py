"""Checkpoint conversion: Hugging Face safetensors <-> Megatron dist checkpoints.

    hf_to_mcore(spec, "models/base", "ckpt/mcore", Layout(tp=2, ep=2))        # policy (or role="critic")
    mcore_to_hf(spec, "runs/x/checkpoints/step_000300/policy", "export/hf")  # trained RL checkpoint -> HF

`spec` (train.model.ModelSpec): the settings the checkpoint's model is built with, as a run's trainer
builds it (`moe-rl convert`: the default config's, driver.specs.convert_spec); its path and dtype are
replaced by the checkpoint's, and no routes are replayed.

A Megatron dist checkpoint is layout-free (sharded tensors with global shapes), so the layout used to
convert only decides how the work is split: each of the layout's ranks reads the HF tensors of its own
shard (safetensors; pickled `.bin` checkpoints are refused) and writes it, and on the way back each
rank exports the layers and experts it owns. The ranks run as local processes (gloo on CPU, NCCL on
GPU); the calling process merges their results and writes the HF index.

Checks, each a one-line `CheckpointMismatch`/`CheckpointError`:
- the HF checkpoint holds exactly the tensors the architecture needs (a config that disagrees with the
  weights, e.g. another layer or expert count, is refused before anything is written);
- a dist checkpoint fits the architecture it is exported with (names and global shapes, read from
  its index with a restricted unpickler, see moe_rl.train.checkpoint).

Every Megatron checkpoint we write carries the HF config and tokenizer files in `hf_config/`, so it
exports without being told the architecture (RL checkpoints get them from the loop).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moe_rl.train.parallel import Layout
from moe_rl.weights.hf import (
    HF_CONFIG_DIR,
    MTP_DIR,
    CheckpointError,
    CheckpointMismatch,
    HFReader,
    copy_hf_config,
    keep_mtp,
    kept_mtp,
    mtp_names,
    save_peft_adapter,
    write_index,
    write_shards,
)

# the critic's scalar head, as transformers' *ForTokenClassification (num_labels=1)
VALUE_HEAD = "score.weight"


@dataclass(frozen=True)
class Converted:
    out: Path
    tensors: int
    bytes: int
    role: str
    parameters: int = 0  # Megatron parameters rank 0 converted (its progress bar's total)
    kind: str = "tensors"  # what `tensors` counts
    note: str = ""  # what the user should know about the result (said after the summary)


def misdirected(path: Path, direction: str) -> str | None:
    """What `path` is, where it is not what `direction` converts from (a run directory, a checkpoint step
    holding policy/ and critic/, a model of the other format), with what to give instead; None otherwise."""
    dist = (path / ".metadata").is_file()
    hf = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    if (path / "checkpoints").is_dir():
        steps = sorted(p for p in (path / "checkpoints").glob("step_*") if (p / "policy").is_dir())
        newest = f" (newest: {steps[-1] / 'policy'})" if steps else ""
        return (f"{path} is a run directory: convert one of its checkpoints, "
                f"{path}/checkpoints/step_N/policy or .../critic{newest}")
    if (path / "policy").is_dir() and not dist:
        return f"{path} holds a step's checkpoints: convert {path / 'policy'}" + \
            (f" or {path / 'critic'}" if (path / "critic").is_dir() else "")
    if direction == "hf-to-mcore" and dist:
        return f"{path} is a Megatron checkpoint, not a Hugging Face model: the direction is mcore-to-hf"
    if direction == "mcore-to-hf" and hf and not dist:
        return f"{path} is a Hugging Face model, not a Megatron checkpoint: the direction is hf-to-mcore"
    return None


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise CheckpointMismatch(f"{path} is not a Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")) and any(path.glob("*.bin")):
        raise CheckpointMismatch(f"{path} holds pickled .bin weights only; convert them to safetensors first "
                                 "(pickles can run code when loaded, so they are never read here)")


class _Progress:
    """A bar over the Megatron parameters this rank converts (shown on rank 0); `count` is its total,
    which `describe` repeats."""

    def __init__(self, desc: str, on: bool):
        self.desc, self.on, self.count = desc, on, 0

    def __call__(self, items):
        from tqdm import tqdm

        items = list(items)
        self.count = len(items)
        return tqdm(items, desc=f"{self.desc} (rank 0)", unit="parameter", disable=not self.on, leave=False,
                    mininterval=1.0)


def _build(spec, hf_config: str, dtype: str, role: str, layout: Layout):
    from moe_rl.train import model as M
    from moe_rl.train import parallel

    parallel.init_distributed(layout)
    parallel.seed_model_parallel(0)
    spec = replace(spec, hf_path=hf_config, dtype=dtype, routing_replay=False)
    try:
        bridge = M.make_bridge(spec)
    except (ValueError, KeyError) as err:
        raise CheckpointMismatch(f"{hf_config}: architecture not supported by the bridge registry: "
                                 f"{err}") from None
    return bridge, M.build_gpt(bridge, spec, critic=role == "critic")


def _hf_to_mcore_rank(rank: int, world: int, spec, hf: str, out: str, layout: Layout, role: str, dtype: str,
                      value_head_from: str | None) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.train import checkpoint, hf_io

    bridge, module = _build(spec, hf, dtype, role, layout)
    progress = _Progress("HF -> Megatron", rank == 0)
    used = hf_io.load_hf_weights(bridge, module, hf, skip_output_layer=role == "critic", progress=progress)
    everyone: list[set[str]] = [set()] * world
    dist.all_gather_object(everyone, used)
    unused = sorted(HFReader(hf).names() - set().union(*everyone) - set(mtp_names(hf))
                    - ({"lm_head.weight", VALUE_HEAD} if role == "critic" else set()))
    if unused:  # every rank sees the same list: all refuse before anything is written
        raise CheckpointMismatch(f"{hf} holds {len(unused)} tensor(s) its config does not describe "
                                 f"(e.g. {', '.join(unused[:3])}): the config and the weights disagree")
    if role == "critic" and ps.is_pipeline_last_stage():
        hf_io.load_value_head(module, value_head_from or hf)
    checkpoint.save_model(module, out, extra={"role": role, "converted_from": str(hf)})
    return progress.count


def _mcore_to_hf_rank(rank: int, world: int, spec, ckpt: str, out: str, hf_config: str, layout: Layout,
                      role: str, dtype: str, shard_mb: float) -> tuple[dict[str, tuple[str, int]], int]:
    """Load this rank's shard, export the tensors it owns; returns {HF name: (file, bytes)} and the
    parameters it went through."""
    from megatron.core import parallel_state as ps

    from moe_rl.train import checkpoint, hf_io

    bridge, module = _build(spec, hf_config, dtype, role, layout)
    checkpoint.load_model(module, ckpt)
    # one copy of each tensor: TP rank 0 of the first data-parallel replica (expert tensors: of the
    # first expert-data-parallel replica)
    progress = _Progress("Megatron -> HF", rank == 0)
    mine = hf_io.export_hf_weights(bridge, module, skip_output_layer=role == "critic", owned_only=True,
                                   progress=progress)
    if role == "critic" and ps.is_pipeline_last_stage() and hf_io.owns_replica():
        mine = itertools.chain(mine, [(VALUE_HEAD, module.output_layer.weight.detach())])
    return write_shards(mine, out, prefix=f"model-rank{rank:04d}", shard_mb=shard_mb), progress.count


def _lora_rank(rank: int, world: int, spec, ckpt: str, out: str, hf_config: str, layout: Layout, record: dict,
               merge: bool, shard_mb: float):
    """A LoRA checkpoint's rank: the base from its Hugging Face checkpoint, the adapters from `ckpt`; then
    the merged model's tensors this rank owns (written as shards: {HF name: (file, bytes)}), or its
    adapters in PEFT's naming ({name: tensor}, for the caller to write as one file)."""
    from moe_rl.train import checkpoint, hf_io, lora

    bridge, module = _build(spec, hf_config, record["dtype"], "policy", layout)
    base = record["base"]
    _check_hf_dir(Path(base))
    checkpoint.check_lora_base(record, base, ckpt)
    hf_io.load_hf_weights(bridge, module, base)
    settings = lora.LoraSpec(record["rank"], record["alpha"], tuple(record["targets"]))
    lora.add_adapters(module, settings, hf_io.rank_names(module, bridge.config.num_moe_experts), seed=0)
    checkpoint.load_model(module, ckpt)
    if merge:
        merged = hf_io.export_hf_weights(bridge, module, owned_only=True)
        return write_shards(merged, out, prefix=f"model-rank{rank:04d}", shard_mb=shard_mb)
    # a fused linear's A serves several HF modules: each gets its own copy (safetensors refuses shared ones)
    return {name: t.cpu().clone() for name, t in hf_io.export_peft_adapters(bridge, module, owned_only=True)}


def lora_to_hf(spec, ckpt: Path, out: Path, hf_config: Path, layout: Layout, record: dict, merge: bool,
               shard_mb: float) -> Converted:
    """A LoRA policy checkpoint (adapters alone) as a PEFT adapter (adapter_config.json and
    adapter_model.safetensors, which HF PEFT loads onto the base model), or with `merge` as a whole HF
    checkpoint of W + (alpha/r) B A."""
    parts = _run(_lora_rank, ranks_for(layout), (spec, str(ckpt), str(out), str(hf_config), layout, record,
                                                 merge, shard_mb))
    merged = _union(parts)
    if merge:
        copy_hf_config(hf_config, out)
        write_index(out, merged)
        return Converted(out, len(merged), sum(size for _, size in merged.values()), "policy (LoRA merged)",
                         kind="Hugging Face tensors")
    save_peft_adapter(merged, out, record["base"], record["rank"], record["alpha"])
    return Converted(out, len(merged), sum(t.numel() * t.element_size() for t in merged.values()),
                     "policy (LoRA adapters, PEFT format)", kind="adapter tensors")


def _union(parts: list[dict]) -> dict:
    """The ranks' exports as one dict; each name must come from one rank only (its owner)."""
    merged: dict = {}
    for part in parts:
        if merged.keys() & part.keys():
            raise RuntimeError(f"two ranks exported {sorted(merged.keys() & part.keys())[:3]} (ownership "
                               "bug)")
        merged.update(part)
    return merged


def _run(fn, world: int, args: tuple):
    from moe_rl.train.launch_local import run_ranks

    try:
        return run_ranks(fn, world, args, timeout=24 * 3600)
    except RuntimeError as err:
        # a rank's CheckpointError (or CheckpointMismatch) is the user's error: show its one line
        for kind in (CheckpointMismatch, CheckpointError):
            marker = f"{kind.__name__}: "
            if marker in str(err):
                raise kind(str(err).split(marker)[-1].strip().splitlines()[0]) from None
        raise


def hf_to_mcore(spec, hf: str | Path, out: str | Path, layout: Layout | None = None, role: str = "policy",
                dtype: str | None = None, value_head_from: str | None = None) -> Converted:
    """Write a Megatron dist checkpoint (weights only) of the policy or critic from an HF checkpoint.

    dtype: float32 | bfloat16; None keeps the checkpoint's own (so the round trip is bitwise).
    """
    hf, out, layout = Path(hf), Path(out), layout or Layout()
    if not hf.is_dir():
        raise CheckpointError(f"{hf}: no such model directory")
    if misdirected(hf, "hf-to-mcore"):
        raise CheckpointMismatch(misdirected(hf, "hf-to-mcore"))
    _check_hf_dir(hf)
    if role not in ("policy", "critic"):
        raise CheckpointMismatch(f"role must be policy or critic, not {role!r}")
    if out.exists() and any(out.iterdir()):
        raise CheckpointMismatch(f"{out} exists and is not empty; choose a new output directory")
    dtype = dtype or _stored_dtype(hf)
    try:
        counts = _run(_hf_to_mcore_rank, ranks_for(layout),
                      (spec, str(hf), str(out), layout, role, dtype, value_head_from))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    copy_hf_config(hf, out / HF_CONFIG_DIR)
    keep_mtp(hf, out / MTP_DIR)  # not built by the trainer: kept as they are, for the way back
    shapes = _tensor_bytes(out)
    return Converted(out, len(shapes), sum(shapes.values()), role, counts[0],
                     "checkpoint tensors (layers stacked)")


def _stored_dtype(hf: Path) -> str:
    reader = HFReader(hf)
    dtype = reader.get(next(iter(sorted(reader.names())))).dtype
    return {torch.bfloat16: "bfloat16"}.get(dtype, "float32")


def ranks_for(layout: Layout) -> int:
    """Ranks for a layout, with the smallest data-parallel size that holds its experts (tp*cp*dp must
    split into etp*ep)."""
    dense, experts = layout.tp * layout.cp, (layout.etp or layout.tp) * layout.ep
    return layout.pp * math.lcm(dense, experts)


def _tensor_bytes(ckpt: Path) -> dict[str, int]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moe_rl.train.checkpoint import read_metadata

    md = read_metadata(ckpt)
    return {k: v.size.numel() * v.properties.dtype.itemsize for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def checkpoint_role_and_dtype(ckpt: str | Path) -> tuple[str, str]:
    """'policy' or 'critic' (a scalar output layer), and the stored floating dtype."""
    from moe_rl.train.checkpoint import read_metadata

    md = read_metadata(ckpt).state_dict_metadata
    head = md.get("output_layer.weight")
    role = "critic" if head is not None and tuple(head.size)[0] == 1 else "policy"
    emb = md.get("embedding.word_embeddings.weight") or head
    dtype = {torch.float32: "float32",
             torch.bfloat16: "bfloat16"}.get(getattr(getattr(emb, "properties", None), "dtype", None),
                                             "float32")
    return role, dtype


def mcore_to_hf(spec, ckpt: str | Path, out: str | Path, hf_config: str | Path | None = None,
                layout: Layout | None = None, shard_mb: float = 4096, merge: bool = False) -> Converted:
    """Export a Megatron dist checkpoint (converted, or a trained policy/critic) as an HF checkpoint; a LoRA
    policy's (adapters alone) as a PEFT adapter, or with `merge` as the merged model (`lora_to_hf`)."""
    ckpt, out, layout = Path(ckpt), Path(out), layout or Layout()
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: no such checkpoint directory")
    if misdirected(ckpt, "mcore-to-hf"):
        raise CheckpointMismatch(misdirected(ckpt, "mcore-to-hf"))
    from moe_rl.train.checkpoint import read_extra

    record = read_extra(ckpt).get("lora")
    hf_config = Path(hf_config) if hf_config else ckpt / HF_CONFIG_DIR
    if not hf_config.is_dir() and record is not None:  # a LoRA checkpoint names its base
        hf_config = Path(record["base"])
    if not (hf_config / "config.json").is_file():
        raise CheckpointMismatch(f"no Hugging Face config for {ckpt}: it has no {HF_CONFIG_DIR}/ directory; "
                                 "name the base model's directory with --hf-config")
    if merge and record is None:
        raise CheckpointMismatch(f"{ckpt} holds whole weights, no LoRA adapters: there is nothing to merge")
    if out.exists() and any(out.iterdir()):
        raise CheckpointMismatch(f"{out} exists and is not empty; choose a new output directory")
    out.mkdir(parents=True, exist_ok=True)
    if record is not None:
        try:
            return lora_to_hf(spec, ckpt, out, hf_config, layout, record, merge, shard_mb)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
    role, dtype = checkpoint_role_and_dtype(ckpt)
    try:
        parts = _run(_mcore_to_hf_rank, ranks_for(layout),
                     (spec, str(ckpt), str(out), str(hf_config), layout, role, dtype, shard_mb))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    written: dict[str, tuple[str, int]] = _union([part for part, _ in parts])
    mtp = kept_mtp(ckpt / MTP_DIR, out)
    copy_hf_config(hf_config, out)
    note = "" if mtp else _without_lost_mtp(ckpt, out / "config.json")
    if role == "critic":
        _critic_config(out / "config.json")
    written |= mtp
    write_index(out, written)
    return Converted(out, len(written), sum(size for _, size in written.values()), role, parts[0][1],
                     "Hugging Face tensors", note)


def _without_lost_mtp(ckpt: Path, config: Path) -> str:
    """Where the model declares multi-token-prediction layers but the checkpoint's copy of them is gone
    (its `mtp` link, to the run directory's one copy, broken: a checkpoint copied without it), the export's
    config declares none, so that it loads as the model it holds (the MTP layers only serve speculative
    decoding); what happened, in a line ("" where nothing was lost)."""
    cfg = json.loads(config.read_text())
    layers = cfg.get("num_nextn_predict_layers") or 0
    if not layers:
        return ""
    cfg["num_nextn_predict_layers"] = 0
    config.write_text(json.dumps(cfg, indent=2))
    return (f"warning: {ckpt / MTP_DIR} is missing (a checkpoint copied without the run directory's "
            f"{MTP_DIR}/ that its link points to?): the export has none of the model's {layers} "
            "multi-token-prediction layer(s) and its config.json says num_nextn_predict_layers: 0")


def _critic_config(path: Path) -> None:
    """A critic exports as a token-classification model with one label: backbone + `score` [1, hidden]."""
    cfg = json.loads(path.read_text())
    cfg["architectures"] = [a.replace("ForCausalLM", "ForTokenClassification")
                            for a in cfg.get("architectures", [])]
    cfg["num_labels"] = 1
    cfg["id2label"], cfg["label2id"] = {"0": "value"}, {"value": 0}
    path.write_text(json.dumps(cfg, indent=2))


def describe(result: Converted) -> str:
    source = f", from the {result.parameters} Megatron parameters of rank 0" if result.parameters else ""
    return (f"{result.role} checkpoint written to {result.out}: {result.tensors} {result.kind}, "
            f"{result.bytes / 2**20:.1f} MiB{source}") + (f"\n{result.note}" if result.note else "")

