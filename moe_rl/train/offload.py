"""A trainer rank's device memory handed back while colocated engines generate, then restored bitwise.

What a rank holds between steps: its parameters (Megatron's DDP may keep them inside contiguous
buffers), the fp32 gradient buffers, the optimizer's fp32 master weights and Adam moments (and, under
PPO-EWMA, the anchor). Every one of these is a view of some storage, and many tensors share one storage
(parameters are views of a DDP buffer; `main_grad` views of the gradient buffer). So what moves is
storages, not tensors: each storage's bytes are copied to host memory (pinned on GPU) and the storage
is resized to zero, which frees its device memory while every view keeps its shape, strides and
identity; on the way back the storage regrows and the bytes are copied in. No tensor is re-created, so
DDP's hooks, the optimizer's parameter references and the routers' replay state see the same objects
before and after. A tensor must not be read while its storage is away.

    host = HostCopies()
    moved = host.offload(storages(model, optimizer))   # bytes
    host.restore()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def storages(model, optimizer, extra: Iterable[torch.Tensor] = ()) -> list[torch.UntypedStorage]:
    """The distinct storages behind a DDP-wrapped model's parameters, its gradient buffers, the
    (megatron) optimizer's master weights and state (None: a model that only scores), and `extra`
    tensors, in a fixed order."""
    tensors: list[torch.Tensor] = list(model.parameters())
    ddp_buffers = [] if optimizer is None else [*model.buffers, *model.expert_parallel_buffers]  # DDP's lists
    for buffer in ddp_buffers:
        tensors += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
    tensors += [p.main_grad for p in model.parameters() if getattr(p, "main_grad", None) is not None]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        inner = opt.optimizer
        for group in inner.param_groups:
            tensors += group["params"]
        tensors += [v for state in inner.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    tensors += list(extra)
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


class HostCopies:
    """Host buffers that hold storages' bytes while the storages are emptied on their device. The
    buffers are kept between offloads (pinned memory is costly to allocate and torch's pinned cache
    never returns it) and reused while the storages keep their sizes."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.away: list[torch.UntypedStorage] = []

    @property
    def offloaded(self) -> bool:
        return bool(self.away)

    def offload(self, sts: list[torch.UntypedStorage]) -> int:
        """Copy every storage to host memory, then empty them all (nothing is emptied if a copy fails).
        Returns the bytes moved."""
        if self.away:
            raise RuntimeError("offload while already offloaded: restore first")
        sizes = [st.nbytes() for st in sts]
        if [b.numel() for b in self.buffers] != sizes:  # first offload, or the state grew (Adam moments)
            pin = bool(sts) and sts[0].device.type == "cuda"
            self.buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
        for st, host in zip(sts, self.buffers, strict=True):
            host.copy_(_bytes_view(st))
        for st in sts:
            st.resize_(0)
        self.away = list(sts)
        if sts and sts[0].device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the freed blocks back for the engines
        return sum(sizes)

    def restore(self) -> None:
        if not self.away:
            raise RuntimeError("restore without an offload")
        for st, host in zip(self.away, self.buffers, strict=True):
            st.resize_(host.numel())
            _bytes_view(st).copy_(host, non_blocking=host.is_pinned())
        if self.away[0].device.type == "cuda":
            torch.cuda.synchronize()
        self.away = []
