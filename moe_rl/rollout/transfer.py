"""Weight sync over vLLM's weight transfer (GPU): HF-named tensors go from the trainer straight into the
engines' workers — no files, no host copies.

  nccl  the sending trainer rank broadcasts over an NCCL group it shares with every engine worker
  ipc   the engine opens the trainer's GPU tensors through CUDA IPC handles (same GPU, colocated),
        packed: each trainer rank copies the tensors, chunk after chunk, into one buffer of
        rollout.weight_sync_bucket_mb that it shares once (`ipc_buffer_bytes`). Unpacked, vLLM shares
        every tensor and keeps them all alive until the update ends: a copy of the model per GPU.

vLLM drives each round from the sending trainer rank (global rank 0): `send_weights()` asks the
engines (through a `VLLMWeightSyncClient`) to start an update, ships every tensor of the source while
the engines load them layer by layer, then finishes the update. Every trainer rank iterates the
source in lockstep (the export gathers TP shards: a collective); only rank 0 sends. For nccl the
source is `GatheredExport` (any layout: the owners of other stages' layers and other ranks' experts
pass them to rank 0); ipc merges per-rank CUDA IPC handles of identical tensor lists, so it takes
`ExportSource`, which every rank yields alike only with pp=1 and ep=1.

The NCCL group is rank 0 (trainer) + one rank per engine worker: engine i's workers start after
those of engines 0..i-1 (`engine_rank_offsets`; vLLM would give every independent engine offset 1).

This is the trainer ranks' side of vLLM's transfer, run in the trainer processes; the sources take
the export as a callable (moe_rl.train.hf_io's, bound by the caller), so nothing here knows Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

Named = Iterable[tuple[str, torch.Tensor]]


class ExportSource(WeightSource):
    """The trainer's Megatron -> HF export as vLLM's re-iterable weight source.

    `export()` starts a fresh pass of the export (all ranks, in lockstep). The metadata (names, dtypes,
    shapes) comes from one pass, made once and cached: the export's shapes never change."""

    def __init__(self, export: Callable[[], Named]):
        self._export = export
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._export()]
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._export())


class GatheredExport(WeightSource):
    """The whole model's HF tensors on global rank 0, in any TP/PP/EP layout: rank 0 yields its own
    tensors, then receives every other owner's in rank order; each owner (`owned_export`: one rank
    per pipeline stage and expert rank) sends its tensors to rank 0 one at a time. The other ranks
    yield nothing; they take part in the export's TP gathers. Collective: all ranks iterate together.

    `owned_export()` starts a fresh pass of this rank's owned tensors (`export_hf_weights(...,
    owned_only=True)`). The metadata — every owner's (name, dtype, shape), gathered once — is the
    whole model on every rank."""

    def __init__(self, owned_export: Callable[[], Named]):
        self._export = owned_export
        self._owned: list[list[ParamMeta]] | None = None  # per rank: what it sends
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            mine = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._export()]
            self._owned = [None] * dist.get_world_size()
            dist.all_gather_object(self._owned, mine)
            self._meta = [m for owned in self._owned for m in owned]
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.metadata()
        return self._receive() if dist.get_rank() == 0 else self._send()

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._export()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        for src, owned in enumerate(self._owned[1:], start=1):
            for m in owned:
                buf = torch.empty(m.shape, dtype=m.dtype, device=device)
                dist.recv(buf, src=src)
                yield m.name, buf

    def _send(self) -> Iterator[tuple[str, torch.Tensor]]:
        for _, t in self._export():
            dist.send(t.contiguous(), dst=0)
        yield from ()


def engine_rank_offsets(workers_per_engine: list[int]) -> list[int]:
    """First NCCL rank of each engine's workers; the trainer's sender is rank 0."""
    offsets, nxt = [], 1
    for n in workers_per_engine:
        offsets.append(nxt)
        nxt += n
    return offsets


def ipc_buffer_bytes(bucket_mb: float, meta: list[ParamMeta]) -> int:
    """The packed CUDA IPC buffer: bucket_mb (rollout.weight_sync_bucket_mb), or the largest tensor where
    that is larger (vLLM's packer refuses a tensor its buffer cannot hold, e.g. an embedding table)."""
    largest = max((math.prod(m.shape) * m.dtype.itemsize for m in meta), default=0)
    return max(int(bucket_mb * 2**20), largest)


def _nccl(rank: int, address: str, port: int, world_size: int, source: WeightSource, bucket_mb: float):
    return NCCLTrainerWeightTransferEngine, NCCLTrainerInitInfo(master_address=address, master_port=port,
                                                                world_size=world_size, rank=rank)


def _ipc(rank: int, address: str, port: int, world_size: int, source: WeightSource, bucket_mb: float):
    # the metadata: one pass of the export, on every rank alike (cached by ExportSource)
    return IPCTrainerWeightTransferEngine, IPCTrainerInitInfo(
        rank=rank, packed=True, packed_buffer_size_bytes=ipc_buffer_bytes(bucket_mb, source.metadata()))


BACKENDS = {"nccl": _nccl, "ipc": _ipc}


def trainer_init_info(backend: str, source: WeightSource, rank: int, master_address: str, master_port: int,
                      world_size: int, bucket_mb: float):
    """(vLLM's trainer-side transfer engine class, its init info) for this rank."""
    return BACKENDS[backend](rank, master_address, master_port, world_size, source, bucket_mb)


def start_transfer(backend: str, source: WeightSource, client, rank: int, master_address: str,
                   master_port: int, world_size: int, bucket_mb: float):
    """This trainer rank's side of the transfer: rank 0 opens it with the engines (for nccl, an NCCL
    group of `world_size` ranks rendezvousing at master_address:master_port); the other ranks only take
    part in the export. `client` implements vLLM's VLLMWeightSyncClient (rank 0 only); `bucket_mb`
    bounds what one round of ipc holds at once (`ipc_buffer_bytes`)."""
    engine_cls, info = trainer_init_info(backend, source, rank, master_address, master_port, world_size,
                                         bucket_mb)
    return engine_cls.trainer_init(info, client=client, source=source)
