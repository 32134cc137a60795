"""A trainer rank's device memory handed back while colocated engines generate, then restored bitwise.

What a rank holds between steps: its parameters (Megatron's DDP may keep them inside contiguous
buffers), the fp32 gradient buffers, the optimizer's fp32 master weights and Adam moments. Every one of
these is a view of some storage, and many tensors share one storage (parameters are views of a DDP
buffer; `main_grad` views of the gradient buffer). So what moves is storages, not tensors: each storage's
bytes are copied to host memory (pinned on GPU) and the storage is resized to zero, which frees its
device memory while every view keeps its shape, strides and identity; on the way back the storage
regrows and the bytes are copied in. No tensor is re-created, so DDP's hooks, the optimizer's parameter
references and the routers' replay state see the same objects before and after.

    held = Offloaded.of(storages(model, optimizer))   # bytes moved: held.bytes
    held.restore()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def storages(model, optimizer) -> list[torch.UntypedStorage]:
    """The distinct storages behind a DDP-wrapped model's parameters, its gradient buffers and the
    (megatron) optimizer's master weights and state, in a fixed order."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for buffer in [*getattr(model, "buffers", []), *getattr(model, "expert_parallel_buffers", [])]:
        tensors += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
    tensors += [p.main_grad for p in model.parameters() if getattr(p, "main_grad", None) is not None]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            tensors += group["params"]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


@dataclass
class Offloaded:
    """Storages emptied on their device, their bytes held in host memory until `restore`."""

    held: list[tuple[torch.UntypedStorage, torch.Tensor]]

    @staticmethod
    def of(sts: Iterable[torch.UntypedStorage]) -> Offloaded:
        held = []
        for st in sts:
            device = _bytes_view(st)
            host = torch.empty(device.shape, dtype=torch.uint8, pin_memory=device.is_cuda)
            host.copy_(device)
            st.resize_(0)
            held.append((st, host))
        if held and held[0][0].device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the freed blocks back for the engines
        return Offloaded(held)

    @property
    def bytes(self) -> int:
        return sum(host.numel() for _, host in self.held)

    def restore(self) -> None:
        for st, host in self.held:
            st.resize_(host.numel())
            _bytes_view(st).copy_(host, non_blocking=host.is_pinned())
        if self.held and self.held[0][0].device.type == "cuda":
            torch.cuda.synchronize()
        self.held = []
