"""Trainer -> rollout-engine weight sync, in buckets, with a version bump.

    for bucket in buckets(export_hf_weights(bridge, model), bucket_mb=64): ...  # moe_rl.train.hf_io

In-process, buckets of HF-named tensors go straight to `RolloutEngine.update_weights`. Between Ray
actors a bucket travels through Ray's object store as `as_buffers` gives it: each tensor's bytes a
NumPy view, which pickle hands the store out of band (one copy into shared memory; the reader on the
same node gets views of it, `from_buffers`; another node receives the bytes). Engine worker processes
of their own (tensor parallelism) read safetensors files in shared memory (/dev/shm), one bucket at a
time (`RolloutEngine.update_weights_through_files`): `write_bucket` / `read_bucket`, whose tensors
map the file rather than copy it, so a worker that takes a slice of a tensor reads only that slice.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load, load_file, save_file

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> str:
    """The transformer layer a HF tensor name belongs to ("" for embeddings, final norm, head)."""
    m = _LAYER.search(name)
    return m.group(1) if m else ""


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_mb: float,
            group=layer_of) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of about bucket_mb MiB, never splitting a `group` (by
    default a transformer layer: the engine finalises a layer's kernels once all its weights arrived).
    Tensors of one group must come consecutively; a group larger than the limit travels alone."""
    limit = int(bucket_mb * 2**20)
    cur, size, cur_group, group_items, group_size = [], 0, None, [], 0

    def flush_group():
        nonlocal cur, size
        if cur and size + group_size > limit:
            out = cur
            cur, size = [], 0
            return out
        return None

    for name, t in named:
        g = group(name) if group else name
        if g != cur_group and group_items:
            full = flush_group()
            if full:
                yield full
            cur.extend(group_items)
            size += group_size
            group_items, group_size = [], 0
        cur_group = g
        group_items.append((name, t))
        group_size += t.numel() * t.element_size()
    if group_items:
        full = flush_group()
        if full:
            yield full
        cur.extend(group_items)
    if cur:
        yield cur


def as_buffers(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...], object]]:
    """A bucket for Ray's object store: (name, dtype, shape, the tensor's bytes as a uint8 NumPy array
    viewing it, no copy) per tensor."""
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), _bytes_of(t.detach().cpu().contiguous()))
            for n, t in bucket]


class _Bytes:
    """A contiguous CPU tensor's memory through NumPy's array interface; the array made from it keeps
    the tensor alive. Not `t.numpy()`: that marks the tensor's storage unresizable for good, and
    offloading (train/offload.py) empties the storages of exported parameters."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel() * t.element_size(),),
                                    "typestr": "|u1", "version": 3}


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return np.asarray(_Bytes(t)) if t.numel() else np.empty(0, dtype=np.uint8)  # an empty one has no address


def from_buffers(items: list[tuple[str, str, tuple[int, ...], object]]) -> list[tuple[str, torch.Tensor]]:
    """`as_buffers`' tensors again, viewing the arrays (no copy; the object store's read-only memory:
    readers copy out of them, never write)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(n, torch.from_numpy(b).view(getattr(torch, dtype)).view(shape))
                for n, dtype, shape, b in items]


def shm_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) \
        else Path(tempfile.gettempdir())
    return base


def write_bucket(bucket: list[tuple[str, torch.Tensor]], directory: str | Path, index: int) -> Path:
    """Write one bucket as safetensors; returns its path (atomic: written under a temporary name)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"bucket_{index:05d}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, str(tmp))
    os.replace(tmp, path)
    return path


def read_bucket(source: str | Path | bytes, delete: bool = True) -> list[tuple[str, torch.Tensor]]:
    """A bucket from its file (removed after reading with delete=True) or from its bytes."""
    if isinstance(source, bytes):
        return list(load(source).items())
    tensors = load_file(str(source))
    if delete:
        os.unlink(source)
    return list(tensors.items())
