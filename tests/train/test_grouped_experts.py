"""Grouped experts (train/experts.py: every expert's GEMM of a linear in one torch._grouped_mm call)
against megatron-core's SequentialMLP on the same weights: log-probs and every gradient equal to 1e-6 in
fp32 on one rank, EP2 and TP2 (expert TP), with experts that get no token (EP2: a rank with none at
all), and with LoRA adapters on the experts."""

import pytest
import torch
from expert_jobs import experts_job

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow
TOL = dict(atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout,lora_rank", [({}, 0), ({}, 4), ({"ep": 2}, 0), ({"tp": 2}, 4)],
                         ids=["one-rank", "one-rank-lora", "ep2", "tp2-lora"])
def test_grouped_experts_equal_sequential(tiny_qwen, layout, lora_rank):
    world = 2 if layout else 1
    for out in run_ranks(experts_job, world, (str(tiny_qwen), layout, lora_rank)):
        seq, grouped = out["sequential"], out["grouped"]
        assert seq["module"] == {"SequentialMLP"} and grouped["module"] == {"GroupedExperts"}
        torch.testing.assert_close(grouped["logp"], seq["logp"], **TOL)
        assert grouped["grads"].keys() == seq["grads"].keys()
        # layer 1 routes to every expert: each local expert of every rank has a gradient there
        everywhere = [n for n in seq["grads"] if "layers.1.mlp.experts.local_experts" in n]
        assert everywhere and all(seq["grads"][n].abs().max() > 0 for n in everywhere)
        for name, grad in seq["grads"].items():
            torch.testing.assert_close(grouped["grads"][name], grad, **TOL, msg=name)


def test_auto_is_sequential_on_the_cpu_and_grouped_is_refused_where_it_cannot_run(tiny_qwen):
    """On the CPU auto is sequential (grouped runs but is slower there); grouped is refused, naming the width,
    where torch's kernel cannot take the rows."""
    from expert_jobs import experts_choice_job

    chosen = run_ranks(experts_choice_job, 1, (str(tiny_qwen),))[0]
    assert chosen == {
        "auto": "SequentialMLP", "grouped": "GroupedExperts", "sequential": "SequentialMLP",
        "odd auto": "SequentialMLP", "odd sequential": "SequentialMLP",
        "odd grouped": "model.experts=grouped: torch._grouped_mm needs rows of multiples of 16 bytes in "
                       "torch.float32; not: expert width per expert-TP rank 62; use model.experts=sequential "
                       "or auto"}
