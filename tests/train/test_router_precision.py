"""The routers compute in the precision the engine's model uses (train/model.router_dtype): a bfloat16
trainer of Qwen3-MoE rounds its router logits to bfloat16 as vLLM's (and transformers') gate does, so its
free routes are the engine's where a float32 router picks other experts at near ties; GLM-4.5's router
is float32 in vLLM, and so is a DeepSeek-V3 config's that asks for it."""

import pytest
import torch
from expert_jobs import bf16_routes_job
from transformers import AutoConfig

from moe_rl.train.launch_local import run_ranks
from moe_rl.train.model import router_dtype


def test_the_router_precision_is_the_engines(tiny_qwen, tiny_glm4_moe, tiny_deepseek_v3):
    assert router_dtype(AutoConfig.from_pretrained(tiny_qwen)) is None  # the model's dtype
    assert router_dtype(AutoConfig.from_pretrained(tiny_glm4_moe)) == "fp32"
    deepseek = AutoConfig.from_pretrained(tiny_deepseek_v3)
    assert router_dtype(deepseek) is None
    deepseek.moe_router_dtype = "float32"
    assert router_dtype(deepseek) == "fp32"


@pytest.mark.slow
def test_bf16_free_routes_are_transformers_bf16_routes(tiny_qwen):
    """8 x 64 random tokens: every expert choice of the bfloat16 trainer equals transformers' bfloat16
    gate's (a float32 router differs on 2 of them: 0.9995 agree, tools/bench/bf16_gap.py)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 300, (8, 64), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = hf(ids, output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    expected = torch.stack([r.float().topk(k, -1).indices.view(8, 64, k) for r in logits], 2).sort(-1).values
    routes, precision = run_ranks(bf16_routes_job, 1, (str(tiny_qwen), ids))[0]
    assert precision is None
    assert torch.equal(routes.long().sort(-1).values, expected)
