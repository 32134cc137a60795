"""A trainer rank hands its parameters, gradient buffers and optimizer state to host memory while
colocated engines generate, and gets them back bitwise: two steps with an offload before each equal two
steps without, under the distributed optimizer (DP2) in bf16 (fp32 master weights too); one rank in
fp32 without it is the colocated loop run of tests/test_loop.py."""

import pytest
import torch
from train_jobs import offload_job

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world,layout,dtype", [(2, {}, "bfloat16")], ids=["dp2-bf16"])
def test_offload_and_onload_are_bitwise_transparent(tiny_qwen, world, layout, dtype):
    plain = run_ranks(offload_job, world, (str(tiny_qwen), layout, dtype, False))
    moved = run_ranks(offload_job, world, (str(tiny_qwen), layout, dtype, True))
    for a, b in zip(plain, moved, strict=True):
        assert b["emptied"] and b["moved"][0] > 0
        assert b["refused"] == ["this rank's weights are in host memory (offloaded for a rollout)",
                                "offload while already offloaded"]
        # after the first step the optimizer holds Adam moments (and bf16's fp32 master weights) too
        assert b["moved"][1] > b["moved"][0]
        for x, y in zip(a["scores"], b["scores"], strict=True):
            assert torch.equal(x, y)
        assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
