"""Megatron dist checkpoints of a TrainWorker: model and optimizer state, reshardable.

    save(worker, "ckpt/step_10/policy", extra={"step": 10})
    extra = load(worker, "ckpt/step_10/policy")   # into any TP/PP/EP/DP layout

The model is saved as sharded tensors (torch_dist format), the distributed optimizer with the
`fully_reshardable` layout (optimizer state keyed by model parameter, so it reshards across TP/PP/EP/DP; the default fully-sharded-model-space layout fails on CPU/gloo), so a checkpoint written
with TP2 or PP2 loads into TP1/PP1 and back. The Adam step lives in each param group's state and is
restored with it. `extra` is a small picklable dict stored beside (written by rank 0 only).

Atomicity of a whole RL checkpoint (policy + critic + loop state) is the caller's job: write into a
temporary directory and rename it (see moe_rl.loop).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist

OPTIM_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
EXTRA_FILE = "moe_rl_extra.pt"


def _sharded(worker, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = worker.module.sharded_state_dict()
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = worker.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_SHARDING)
    return state


def _optimizer_kind(worker) -> str:
    return "distributed" if worker.ddp_config.use_distributed_optimizer else "plain"


def save(worker, path: str | Path, extra: dict | None = None) -> None:
    from megatron.core import dist_checkpointing

    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(worker, is_loading=False), str(path),
                            content_metadata=OPTIM_SHARDING)
    if dist.get_rank() == 0:
        torch.save({"extra": extra or {}, "steps": worker.steps, "optimizer": _optimizer_kind(worker)}, path / EXTRA_FILE)
    dist.barrier()


def load(worker, path: str | Path, optimizer: bool = True) -> dict:
    """Restore model (and optimizer) state into `worker`; returns the saved `extra` dict.

    megatron-core cannot load a distributed optimizer's state (data-parallel > 1) into a plain one
    (data-parallel 1) or back: such a resume raises, or with optimizer=False restores weights only.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / EXTRA_FILE).is_file() or not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete moe_rl checkpoint (missing {EXTRA_FILE} or metadata.json)")
    # extra holds only our own plain types (ints, floats, strings, tensors): weights_only loading is safe
    try:
        meta = torch.load(path / EXTRA_FILE, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path / EXTRA_FILE} holds more than plain data: {err}") from None
    if optimizer and meta.get("optimizer", _optimizer_kind(worker)) != _optimizer_kind(worker):
        raise ValueError(f"{path} holds {meta['optimizer']} optimizer state, this run uses a {_optimizer_kind(worker)} "
                         "optimizer (data-parallel size changed to or from 1); resume with the same data-parallel "
                         "size, or load weights only")
    state = dist_checkpointing.load(_sharded(worker, is_loading=True, with_optimizer=optimizer), str(path))
    worker.module.load_state_dict(state["model"])
    if optimizer:
        worker.optimizer.load_state_dict(state["optimizer"])
    worker.steps = int(meta["steps"])
    return meta["extra"]
