"""The GPU check's FLOP arithmetic (tools/gpu_check.py): the GPUs' dense bf16 peaks, a model's active
parameters per token, a training step's FLOPs and the MFU, and a check of them on a case worked by hand
and against the model's own parameter count (the --dry-run's)."""

from __future__ import annotations

import torch

from moe_rl.config import TinyModel
from moe_rl.tiny import VOCAB_SIZE

# dense bf16 tensor-core peaks of NVIDIA's datasheets (without sparsity), by what torch.cuda.get_device_name
# holds: the first entry whose words all appear in the name
PEAK_BF16_FLOPS = [
    (("H100", "PCIe"), 756e12, "H100 PCIe"), (("H100", "NVL"), 835e12, "H100 NVL"),
    (("H100",), 989e12, "H100 SXM"), (("GH200",), 989e12, "GH200"), (("H200",), 989e12, "H200"),
    (("H800",), 989e12, "H800"), (("H20",), 148e12, "H20"), (("GB200",), 2500e12, "GB200"),
    (("B200",), 2250e12, "B200"), (("A100",), 312e12, "A100"), (("L40S",), 362e12, "L40S"),
]


def peak_bf16_flops(gpu_name: str, given_tflops: float | None = None) -> tuple[float | None, str]:
    """The GPU's dense bf16 peak (FLOP/s) and where the figure comes from, naming the GPU: `given_tflops`
    (--peak-tflops) where set, else the datasheet figure of the model torch names; (None, why) for a GPU
    not in the table (no MFU then)."""
    if given_tflops:
        return given_tflops * 1e12, f"--peak-tflops {given_tflops:g} for {gpu_name}"
    for words, flops, model in PEAK_BF16_FLOPS:
        if all(w in gpu_name for w in words):
            return flops, f"{gpu_name}: {model} dense bf16 tensor-core peak, {flops / 1e12:g} TFLOP/s " \
                          "(datasheet)"
    return None, f"{gpu_name}: not in gpu_flops.PEAK_BF16_FLOPS; give --peak-tflops for an MFU"


def active_params(spec: TinyModel, vocab: int = VOCAB_SIZE) -> int:
    """Weights a token's forward pass multiplies with, every layer an MoE layer (no first_dense_layers):
    per layer the q/k/v/o projections, the router and its top_k experts (gate, up, down), plus the
    output layer. The input embedding (a lookup) and the norms (no matrix product) are left out."""
    h, d = spec.hidden_size, spec.head_dim
    attention = h * d * 2 * (spec.num_attention_heads + spec.num_key_value_heads)
    router = h * spec.num_experts
    experts = spec.top_k * 3 * h * spec.moe_intermediate_size
    return spec.num_layers * (attention + router + experts) + vocab * h


def train_flops(active: int, tokens: int) -> float:
    """Forward and backward matrix products of a training step: 6 FLOP per active weight and token."""
    return 6.0 * active * tokens


def mfu(active: int, tokens: int, seconds: float, peak: float | None) -> float | None:
    return None if peak is None else train_flops(active, tokens) / seconds / peak


def arithmetic_problems(spec: TinyModel) -> list[str]:
    """The FLOP/MFU formulas on a case worked by hand, and active_params against the parameters of the
    model `spec` itself (transformers on the meta device: the unchosen experts' share, the embedding
    and the norms taken out). One line per problem."""
    from transformers import AutoModelForCausalLM

    from moe_rl.tiny import hf_config

    problems = []
    # hidden 4, 2 layers, 2 heads + 1 kv head of 2, 4 experts top-2 of width 3, vocabulary 10:
    # attention 4*2*(2+1)*2 = 48, router 16, two experts 2*3*4*3 = 72 -> 136 a layer, 272 + output 40
    hand = TinyModel(hidden_size=4, num_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
                     num_experts=4, top_k=2, moe_intermediate_size=3)
    if active_params(hand, vocab=10) != 312:
        problems.append(f"active_params of the hand-worked case is {active_params(hand, vocab=10)}, not 312")
    # 6 * 312 * 100 tokens = 187200 FLOP in 1 us = 1.872e11 FLOP/s, / 989e12
    if abs(mfu(312, 100, 1e-6, 989e12) / (1.872e11 / 989e12) - 1) > 1e-12:
        problems.append(f"mfu of the hand-worked case is {mfu(312, 100, 1e-6, 989e12):.6g}, not "
                        f"{1.872e11 / 989e12:.6g}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(spec, 0, 0))
    named = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    lookup_and_norms = sum(p.numel() for n, p in named.items()
                           if "embed_tokens" in n or n.endswith("norm.weight"))
    unchosen = experts - experts * spec.top_k // spec.num_experts
    counted = sum(p.numel() for p in named.values()) - lookup_and_norms - unchosen
    if counted != active_params(spec):
        problems.append(f"the model's own parameters give {counted} active, active_params "
                        f"{active_params(spec)}")
    return problems
