"""Norms of megatron-core's local layer spec, on CPU and GPU alike.

megatron-core's torch norm wrapper (`WrappedTorchNorm`, what the local spec builds) refuses sequence
parallelism, which MoE with TP > 1 requires, and builds torch's norm on torch's default device and
dtype (the CPU, fp32) while every other parameter lives on the rank's GPU in params_dtype. `install()`
makes it build, under sequence parallelism, a plain RMSNorm / LayerNorm whose parameters are tagged
`sequence_parallel` (their grads are then all-reduced across TP by finalize_model_grads), and without
it torch's own norm; both on the device megatron builds parameters on, in params_dtype. The
Transformer Engine spec has its own norms and is untouched.
"""

from __future__ import annotations

import torch

_INSTALLED = False


def parameter_device():
    """Where megatron builds parameters: the rank's current GPU, else the CPU (None: torch's default)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


class SequenceParallelNorm(torch.nn.Module):
    """RMSNorm / LayerNorm with sequence-parallel parameters; the wrapper's parameter names (`weight`,
    `bias`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        device = parameter_device()
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.bias = None if self.rms else torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x):
        if self.rms:
            return torch.nn.functional.rms_norm(x, self.shape, self.weight, self.eps)
        return torch.nn.functional.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def install() -> None:
    """Have `WrappedTorchNorm` build a SequenceParallelNorm under sequence parallelism and torch's norm on
    megatron's device and dtype without it (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        if config.sequence_parallel:
            return SequenceParallelNorm(config, hidden_size, eps)
        norm = original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                            normalization)
        return norm.to(device=parameter_device(), dtype=config.params_dtype)

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
    _INSTALLED = True
