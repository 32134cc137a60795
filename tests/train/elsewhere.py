"""A second device on a CPU-only machine, for tests of device consistency.

On a GPU, an index built on the CPU and used on a CUDA tensor (`index_copy_`, `index_select`, a mask
compared across devices) raises; on a CPU-only machine every tensor is on the CPU and such a bug passes
unseen. `on_elsewhere()` gives the code under test a device of its own: tensors made with
`elsewhere(t)`, or by a factory given `device=ELSEWHERE`, report `ELSEWHERE` (the meta device) as
their device while their values live on the CPU, so data-dependent code (`int(x.sum())`, `nonzero`,
`tolist`) runs as it would on a GPU. Inside the mode every aten operation is checked: one that mixes
an elsewhere tensor with a CPU tensor (other than a 0-dim one, which torch lets CUDA kernels read as a
scalar) raises `DeviceMix`, as CUDA would (and stricter: advanced indexing with a CPU index, which
CUDA allows at the cost of a copy and a sync, is refused too). Copies between the devices (`.to`,
`copy_`) are transfers, allowed.

The meta device alone would not do: its kernels check devices for some operations (index_copy_) but
not others (index_select, indexing), and it holds no values for code that reads them.

    with on_elsewhere():
        out = code_under_test(elsewhere(x))
        assert out.device == ELSEWHERE
    values = plain(out)
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ELSEWHERE = torch.device("meta")
# transfers between the devices: the one place the two may meet
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.lift_fresh.default}


class DeviceMix(RuntimeError):
    pass


class Elsewhere(torch.Tensor):
    """Values on the CPU, device reported as ELSEWHERE."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=ELSEWHERE, requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, requires_grad: bool = False):
        self.values = data

    def __repr__(self):
        return f"Elsewhere({self.values!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise DeviceMix(f"{func}: an elsewhere tensor used outside on_elsewhere()")


def elsewhere(t: torch.Tensor, requires_grad: bool = False) -> Elsewhere:
    return Elsewhere(t.detach().clone(), requires_grad=requires_grad)


def plain(t):
    """The CPU values of an elsewhere tensor (or of each in a nest of lists, tuples and dicts)."""
    return tree_map(lambda x: x.values if isinstance(x, Elsewhere) else x, t)


def _describe(t: torch.Tensor) -> str:
    return f"{'elsewhere' if isinstance(t, Elsewhere) else t.device.type} {tuple(t.shape)}"


def _on_device(index):
    """A Python list inside an index (`x[:, [0, 2]]`) as a tensor on ELSEWHERE: torch would build it on
    the indexed tensor's device itself, out of this harness's sight."""
    if isinstance(index, list):
        return torch.tensor(index).to(ELSEWHERE)
    if isinstance(index, tuple):
        return tuple(_on_device(i) for i in index)
    return index


class _Factories(TorchFunctionMode):
    """What reaches a device without passing aten's dispatch: `torch.tensor(data, device=...)` and
    list indices, made on the CPU and transferred instead; `tolist` (which refuses subclasses) reads
    the values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None \
                and torch.device(device) == ELSEWHERE \
                and not isinstance(args[0], torch.Tensor):
            del kwargs["device"]
            return func(*args, **kwargs).to(ELSEWHERE)
        if func is torch.Tensor.tolist and isinstance(args[0], Elsewhere):  # a read to the host, as on a GPU
            return args[0].values.tolist()
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], Elsewhere):
            args = (args[0], _on_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _Checked(TorchDispatchMode):
    """Every aten operation on CPU values, as if elsewhere tensors were on a device of their own."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        here = [t for t in tensors if isinstance(t, Elsewhere)]
        stray = [t for t in tensors if not isinstance(t, Elsewhere)
                 and not (t.dim() == 0 and t.device.type == "cpu")]
        if here and stray and func not in _COPIES:
            raise DeviceMix(f"{func} mixes devices: " + ", ".join(_describe(t) for t in tensors))
        if any(t.device == ELSEWHERE for t in stray):
            raise DeviceMix(f"{func}: a {_describe(stray[0])} tensor made out of this harness's sight")
        target = kwargs.get("device")
        if target is not None and torch.device(target) == ELSEWHERE:
            kwargs["device"] = torch.device("cpu")
            to_elsewhere = True
        else:
            to_elsewhere = target is None and bool(here)
        inputs = {id(t.values): t for t in here} | {id(t): t for t in tensors if not isinstance(t, Elsewhere)}
        out = func(*plain(args), **plain(kwargs))

        def wrap(x):
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in inputs:  # an in-place operation returns its own self
                return inputs[id(x)]
            return Elsewhere(x) if to_elsewhere else x

        return tree_map(wrap, out)


@contextlib.contextmanager
def on_elsewhere():
    """Inside: elsewhere tensors compute (on their CPU values) and every operation is checked."""
    with _Factories(), _Checked():
        yield
