"""A MoE layer's local experts with their GEMMs grouped: the local layer spec's fast path without
Transformer Engine.

    GroupedExperts(num_local_experts, config, submodules, pg_collection)   # SequentialMLP's arguments
    experts(hidden [T, h], tokens_per_expert [E], probs [T]) -> ([T, h], None)

megatron-core's local spec runs the experts one by one (SequentialMLP: an MLP, two small GEMMs and an
activation per expert). GroupedExperts keeps SequentialMLP's modules and parameters (local_experts.i.
linear_fc1 / linear_fc2: the same names, shapes, sharding and checkpoints) and computes each linear of
all experts in one `torch._grouped_mm` call over the tokens, sorted by expert as the dispatcher hands
them over (an expert that got no token is an empty group: zero output rows, zero gradient):

    h = x W1_e^T  (+ scale B1_e A1_e x)        [T, 2f]   the rows of expert e with W1_e, for every e
    a = silu(h_gate) * h_up * p                [T, f]    p: each row's routing weight
    y = a W2_e^T  (+ scale B2_e A2_e a)        [T, h]

LoRA adapters on the experts (train/lora.py puts lora_A / lora_B beside each expert's weight) are
grouped the same way; routing replay, expert parallelism and expert tensor parallelism act outside the
experts (the router and the token dispatcher) and are unchanged: under expert TP each rank's W1_e / W2_e
are its shards, and the output is the partial sum megatron leaves to the dispatcher, as SequentialMLP's.

Where the grouped GEMM runs (`grouped_runs`): torch's kernel takes float32 and bfloat16 on the CPU (where
it is no faster than the loop over experts, so model.experts=auto keeps SequentialMLP there:
train/model.local_experts) and bfloat16 on CUDA GPUs of compute capability 9.0 (Hopper) and above, with
every row stride a multiple of 16 bytes (hidden size, expert width per expert-TP rank and LoRA rank,
times the dtype's size).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from moe_rl.model_shape import GROUPED_GEMM_ALIGN_BYTES, grouped_gemm_misfits


@functools.cache
def _kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs on this device type in this dtype (a tiny call, once)."""
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type
    x = torch.ones(4, 8, dtype=dtype, device=device)
    w = torch.ones(2, 8, 8, dtype=dtype, device=device)
    try:
        out = torch._grouped_mm(x, w, offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return bool(out[0, 0] == 8)


def settings_refused(config) -> str | None:
    """The model settings GroupedExperts does not compute (megatron's MLP paths it leaves out), in
    words; None: none of them."""
    refused = [name for name, on in (
        ("a bias on the expert linears", config.add_bias_linear), ("FP8/FP4", config.fp8 or config.fp4),
        ("fused activations", config.bias_activation_fusion or config.use_te_activation_func),
        ("routing weights on the input", config.moe_apply_probs_on_input)) if on]
    return f"it computes none of: {', '.join(refused)}" if refused else None


def grouped_runs(device_type: str, dtype: torch.dtype, widths: dict[str, int]) -> str | None:
    """None where GroupedExperts runs for these widths (model_shape.grouped_expert_widths) on this device
    type in this dtype; else why not, in words."""
    if not _kernel_runs(device_type, dtype):
        where = "this GPU" if device_type == "cuda" else "the CPU"
        return f"torch._grouped_mm does not run on {where} in {dtype} (torch {torch.__version__})"
    bad = grouped_gemm_misfits(torch.empty((), dtype=dtype).element_size(), widths)
    if bad:
        return (f"torch._grouped_mm needs rows of multiples of {GROUPED_GEMM_ALIGN_BYTES} bytes in {dtype}; "
                f"not: {', '.join(bad)}")
    return None


class GroupedLinear(torch.autograd.Function):
    """y = x W_e^T on each expert e's rows: x [T, in] sorted by expert, offs [E] their cumulative counts
    (int32), one weight [out, in] per expert -> y [T, out].

    torch._grouped_mm's own autograd would keep the stacked weights [E, out, in], a copy of every local
    expert's weights per layer, alive from the forward to the backward; this keeps x and the experts'
    own parameters (no copy) and stacks the weights again for the backward's input gradient:
        dx = dy W_e,   dW_e = dy_e^T x_e   (an expert without rows: zero)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        dws = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            dw = torch._grouped_mm(dy.t(), x, offs=offs)  # [E, out, in]
            needs = ctx.needs_input_grad[2:]
            dws = [g if need else None for g, need in zip(dw.unbind(0), needs, strict=True)]
        return dx, None, *dws


def _grouped_linear(x: torch.Tensor, offs: torch.Tensor, linears) -> torch.Tensor:
    """x [T, in] (rows sorted by expert, offs [E] their cumulative counts) through each expert's linear
    [out, in] and its LoRA adapter where it has one -> [T, out]."""
    out = GroupedLinear.apply(x, offs, *[lin.weight for lin in linears])
    first = linears[0]
    if getattr(first, "lora_indices", None) and not first.lora_off:
        low = GroupedLinear.apply(x, offs, *[lin.lora_A for lin in linears])  # [T, r]
        out = out + first.lora_scale * GroupedLinear.apply(low, offs, *[lin.lora_B for lin in linears])
    return out


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts and parameters, each linear of all of them in one grouped GEMM (module
    docstring). The activation is the unfused one megatron's MLP computes on the local spec (no bias,
    the fusions off: model.kernel_settings); train/model.local_experts builds it only where
    settings_refused finds nothing."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """hidden [T, h], tokens_per_expert [E], probs [T] -> ([T, h], None): SequentialMLP.forward's
        result."""
        x = permuted_local_hidden_states
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = _grouped_linear(x, offs, [e.linear_fc1 for e in self.local_experts])
        a = _activation(self.config, h)
        a = (a * permuted_probs.unsqueeze(-1)).to(a.dtype)
        return _grouped_linear(a, offs, [e.linear_fc2 for e in self.local_experts]), None


def _activation(config, h: torch.Tensor) -> torch.Tensor:
    """megatron-core MLP's unfused activation (mlp.py, MLP.forward): the gated linear unit with its
    clamp and offset, or the plain activation."""
    if not config.gated_linear_unit:
        return config.activation_func(h)
    gate, linear = torch.chunk(h, 2, dim=-1)
    if (clamp := config.activation_func_clamp_value) is not None:
        gate = gate.clamp(min=None, max=clamp)
        linear = linear.clamp(min=-clamp, max=clamp)
    return config.activation_func(gate) * (linear + config.glu_linear_offset)
