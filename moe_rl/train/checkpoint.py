"""Megatron dist checkpoints: a TrainWorker's model and optimizer state, or a model alone; reshardable.

    save(worker, "ckpt/step_10/policy", extra={"step": 10})
    extra = load(worker, "ckpt/step_10/policy")   # into any TP/PP/EP/DP layout
    save_model(module, "ckpt/converted")           # weights only (what `moe-rl convert` writes)
    load_model(module, "ckpt/converted")

The model is saved as sharded tensors (torch_dist format), the distributed optimizer with the
`fully_reshardable` layout (optimizer state keyed by model parameter, so it reshards across TP/PP/EP/DP;
the default fully-sharded-model-space layout fails on CPU/gloo), so a checkpoint written with TP2 or PP2
loads into TP1/PP1 and back. The Adam step lives in each param group's state and is
restored with it. `extra` is a small dict of plain data stored beside (written by rank 0 only).

Loading never unpickles arbitrary objects: torch's checkpoint index (`.metadata`, a pickle) is first
read with an unpickler that admits only torch's checkpoint metadata classes, dtypes and sizes
(`read_metadata`); the other files are JSON, safetensors-like tensor data, or read with
`torch.load(weights_only=True)`. The same index lets `check_model_fits` name every tensor whose
name or shape differs from the model before anything is loaded, and `check_files` find a missing or
truncated shard file (the driver checks a checkpoint so before it starts anything); what fails later in
loading is a CheckpointError naming the checkpoint, one line.

Atomicity of a whole RL checkpoint (policy + critic + loop state) is the caller's job: write into a
temporary directory and rename it (see moe_rl/driver/run_checkpoints.py).
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.train import lora
from moe_rl.train.optim import lr_mult_setting
from moe_rl.weights.hf import CheckpointError, fingerprint

OPTIM_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
EXTRA_FILE = "moe_rl_extra.pt"
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                     "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _METADATA_MODULES \
                or (module, name) in {("torch", "Size"), ("torch.serialization", "_get_layout")}:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint index refers to {module}.{name}, which is not checkpoint "
                              "metadata: refusing to load it")


def read_metadata(path: str | Path):
    """torch.distributed.checkpoint Metadata of a dist checkpoint, read with the restricted unpickler."""
    path = Path(path)
    for needed in (EXTRA_FILE, "metadata.json", ".metadata"):
        if not (path / needed).is_file():
            raise CheckpointError(f"{path} is not a complete moe_rl checkpoint (missing {needed})")
    with open(path / ".metadata", "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except CheckpointError:
            raise
        except Exception as err:  # truncated (EOFError), damaged (UnpicklingError, ValueError, ...)
            raise CheckpointError(f"{path / '.metadata'} is not a readable checkpoint index "
                                  f"({type(err).__name__}: {err}); the checkpoint is damaged") from None


def read_extra(path: str | Path) -> dict:
    """The small plain-data record saved beside the tensors (steps, optimizer kind, caller's extra)."""
    read_metadata(path)
    # only our own plain types (ints, floats, strings, tensors): weights_only loading is safe
    try:
        return torch.load(Path(path) / EXTRA_FILE, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{Path(path) / EXTRA_FILE} holds more than plain data: {err}") from None
    except Exception as err:  # truncated or damaged
        raise CheckpointError(f"{Path(path) / EXTRA_FILE} is not readable ({type(err).__name__}: {err}); the "
                              "checkpoint is damaged") from None


def check_files(path: str | Path) -> None:
    """Every file of a dist checkpoint there and whole, without loading a tensor: the index and the
    record read, metadata.json parses, each shard file the index points into is as long as the bytes
    it holds there, and each other torch file (common.pt, a rank's EWMA anchor) has its zip directory
    (which torch writes last). CheckpointError naming the first file that is not."""
    path = Path(path)
    md = read_metadata(path)
    read_extra(path)
    try:
        json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / 'metadata.json'} is not readable JSON ({err}); the checkpoint is "
                              "damaged") from None
    ends: dict[str, int] = {}
    storage = getattr(md, "storage_data", None)  # which file, at which offset, holds each tensor's bytes
    for info in storage.values() if isinstance(storage, dict) else ():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (the checkpoint index points into it); the checkpoint is "
                                  "incomplete")
        size = f.stat().st_size
        if size < end:
            raise CheckpointError(f"{f} is truncated ({size} of its {end} bytes); the checkpoint is damaged")
    for f in sorted(path.glob("*.pt")):
        if f.name == EXTRA_FILE:
            continue
        try:
            with zipfile.ZipFile(f) as z:
                z.infolist()
        except (OSError, zipfile.BadZipFile) as err:
            raise CheckpointError(f"{f} is truncated or damaged ({err}); the checkpoint is damaged") from None


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in a dist checkpoint, by sharded key."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata(path)
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _model_tensors(sharded: dict) -> dict[str, tuple[int, ...]]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = dict(sharded)
    apply_factories(sharded)
    return {t.key: tuple(t.global_shape) for t in nested_values(sharded) if isinstance(t, ShardedTensor)}


def check_model_fits(module, path: str | Path) -> None:
    """Raise CheckpointError naming the model tensors the checkpoint lacks or holds with another shape."""
    saved = tensor_shapes(path)
    wanted = _model_tensors(model_sharded(module))
    missing = sorted(k for k in wanted if k not in saved)
    wrong = sorted(f"{k} {saved[k]} vs model {wanted[k]}" for k in wanted if k in saved
                   and saved[k] != wanted[k])
    if missing or wrong:
        parts = ([f"missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}"] if missing else []) + \
                ([f"{len(wrong)} shape mismatch(es), e.g. {'; '.join(wrong[:3])}"] if wrong else [])
        raise CheckpointError(f"{path} does not fit this model's architecture: {'; '.join(parts)}")


def model_sharded(module) -> dict:
    """The model's sharded state; with LoRA adapters, the adapters alone (the frozen base is the Hugging
    Face checkpoint the run builds the model from, recorded with the adapters' settings as `lora`)."""
    sd = module.sharded_state_dict()
    if lora.adapter_parameters(module):
        sd = {k: v for k, v in sd.items() if lora.is_adapter(k)}
    return sd


def _restore_model(module, state: dict) -> None:
    adapters = lora.adapter_parameters(module)
    module.load_state_dict(state, strict=not adapters)  # adapters only: the base stays as built


def _sharded(worker, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = model_sharded(worker.module)
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = worker.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                 metadata=OPTIM_SHARDING)
    return state


def _optimizer_kind(worker) -> str:
    return "distributed" if worker.ddp_config.use_distributed_optimizer else "plain"


def _in_process_write_results() -> None:
    """megatron-core's file writer hands its write results back through a multiprocessing Manager's
    queue, made on the first save by spawning a server process: a fresh interpreter that re-imports the
    saving process's main module (4-5 s of CPU in a Ray actor) and stays for the life of the rank. A
    synchronous save (ours: no async_sharded_save) puts and takes them in the saving process itself,
    where a plain queue serves."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _save(state: dict, path: Path, record: dict) -> None:
    from megatron.core import dist_checkpointing

    _in_process_write_results()
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(path), content_metadata=OPTIM_SHARDING)
    if dist.get_rank() == 0:
        torch.save(record, path / EXTRA_FILE)
    dist.barrier()


def save(worker, path: str | Path, extra: dict | None = None) -> None:
    spec, lo = worker.spec, worker.spec.lora
    adapters = {} if lo is None else {"lora": {
        "base": spec.hf_path, "base_fingerprint": fingerprint(spec.hf_path), "rank": lo.rank,
        "alpha": lo.alpha, "targets": list(lo.targets), "dtype": spec.dtype}}
    _save(_sharded(worker, is_loading=False), Path(path),
          {"extra": extra or {}, "steps": worker.steps, "optimizer": _optimizer_kind(worker),
           "role": worker.role, "lr_mult": dict(worker.optim_spec.lr_mult), **adapters})


def check_lora_base(record: dict, base: str | Path, path: str | Path) -> None:
    """Adapters apply to the base they were trained on: refuse a base whose weights differ from the
    checkpoint's record (weights.hf.fingerprint; a record without one, from before it was kept, passes)."""
    saved = record.get("base_fingerprint")
    if saved is not None and saved != fingerprint(base):
        raise CheckpointError(f"{path}: its LoRA adapters were trained on a base whose weights differ from "
                              f"those at {base} (fingerprint {fingerprint(base)}, the checkpoint's {saved}): "
                              "the base changed since; resume on the base the adapters were trained on")


def save_model(module, path: str | Path, extra: dict | None = None) -> None:
    """Weights only (no optimizer state): what conversion writes; loads with `load_model` or
    `load(worker, path, optimizer=False)`."""
    _save({"model": model_sharded(module)}, Path(path),
          {"extra": extra or {}, "steps": 0, "optimizer": "none"})


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1]}" if lines else type(err).__name__


def load_model(module, path: str | Path) -> dict:
    """Restore model weights into `module` (any layout); returns the saved record."""
    from megatron.core import dist_checkpointing

    meta = read_extra(path)
    check_model_fits(module, path)
    state = dist_checkpointing.load({"model": model_sharded(module)}, str(path))
    _restore_model(module, state["model"])
    return meta


def check_lr_mult(worker, meta: dict, path: Path) -> None:
    """A parameter's learning-rate multiplier keys its optimizer's parameter group: a resume with other
    multipliers than the checkpoint's (as its record has them) cannot take its optimizer state. A checkpoint
    written before the record existed is taken to have none (multipliers came a day before it)."""
    saved, mine = meta.get("lr_mult"), dict(worker.optim_spec.lr_mult)
    if saved == mine or (saved is None and not mine):
        return
    was = f"with {lr_mult_setting(worker.role)} {saved}" if saved is not None else \
        "before checkpoints recorded their learning-rate multipliers (so, as far as it says, with none)"
    raise CheckpointError(
        f"{path}: its optimizer state was saved {was} and this run has {mine}, which make other parameter "
        "groups: resume with the multipliers it was saved with, or convert its weights (moe-rl convert "
        "mcore-to-hf) and start a new run from them")


def load(worker, path: str | Path, optimizer: bool = True) -> dict:
    """Restore model (and optimizer) state into `worker`; returns the saved `extra` dict.

    megatron-core cannot load a distributed optimizer's state (data-parallel > 1) into a plain one
    (data-parallel 1) or back: such a resume raises, or with optimizer=False restores weights only.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = read_extra(path)
    saved_kind = meta.get("optimizer", _optimizer_kind(worker))
    if optimizer and saved_kind == "none":
        raise CheckpointError(f"{path} holds weights only (no optimizer state); load it with optimizer=False")
    if optimizer and saved_kind != _optimizer_kind(worker):
        raise CheckpointError(f"{path} holds {saved_kind} optimizer state, this run uses a "
                              f"{_optimizer_kind(worker)} "
                              "optimizer (data-parallel size changed to or from 1); resume with the same "
                              "data-parallel size, or load weights only")
    check_files(path)
    check_model_fits(worker.module, path)
    if optimizer:
        check_lr_mult(worker, meta, path)
    if worker.spec.lora is not None:
        check_lora_base(meta.get("lora", {}), worker.spec.hf_path, path)
    try:
        state = dist_checkpointing.load(_sharded(worker, is_loading=True, with_optimizer=optimizer),
                                        str(path))
    except Exception as err:  # a file damaged beyond what check_files sees: one line, not torch's traceback
        raise CheckpointError(f"{path}: loading failed ({_last_line(err)}); the checkpoint is "
                              "damaged") from None
    _restore_model(worker.module, state["model"])
    if optimizer:
        # the parameter groups come back with the rate they were saved with: a run resumed with another
        # trainer.lr or critic.lr (or schedule) trains at its own
        worker.optimizer.load_state_dict(state["optimizer"])
        worker.set_lr(worker.lr)
    worker.steps = int(meta["steps"])
    return meta["extra"]
