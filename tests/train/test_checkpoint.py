"""Dist checkpoints reshard: saved with TP2 or PP2, loaded into one rank, the next step's loss and the
weights after it (which depend on the restored Adam moments and step count) match. A save leaves no
process behind."""

import pytest
import torch
from train_jobs import B, S, batch_tensors, ckpt_job

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}])
def test_save_two_ranks_load_one(tmp_path, tiny_qwen, layout):
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(ckpt_job, 2, (str(tiny_qwen), layout, str(ckpt), "save"))
    loaded = run_ranks(ckpt_job, 1, (str(tiny_qwen), {}, str(ckpt), "load"))[0]
    ref = saved[-1]  # last pipeline stage holds the loss
    # the save ran in each rank's process: no process of its own left behind (megatron's writer would
    # spawn a queue server, an interpreter re-importing the rank's main module: seconds in a Ray actor)
    assert [r["extra"]["children"] for r in saved] == [[], []]
    assert loaded["extra"] == {"step": 1, "note": "after one update"} and loaded["steps"] == 2
    assert loaded["step2"]["loss"] == pytest.approx(ref["step2"]["loss"], abs=1e-6)
    assert loaded["step2"]["grad_norm"] == pytest.approx(ref["step2"]["grad_norm"], rel=1e-5)
    _, lengths, _, _ = batch_tensors()
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    torch.testing.assert_close(loaded["after"].logp_BS * valid, ref["after"].logp_BS * valid, atol=1e-5,
                               rtol=0)


def test_distributed_optimizer_resume(tmp_path, tiny_qwen):
    """DP2 uses the distributed optimizer: loading needs a state_dict template from a fresh optimizer
    and a step count per parameter (cpu_compat's optimizer_step shim); a wrong Adam step changes the
    bias correction of the next update, so the weights after it would differ."""
    ckpt = tmp_path / "dp2"
    saved = run_ranks(ckpt_job, 2, (str(tiny_qwen), {}, str(ckpt), "save"))
    loaded = run_ranks(ckpt_job, 2, (str(tiny_qwen), {}, str(ckpt), "load"))
    _, lengths, _, _ = batch_tensors()
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    for ref, res in zip(saved, loaded, strict=True):
        assert res["steps"] == 2 and res["extra"] == {"step": 1, "note": "after one update"}
        assert res["step2"]["loss"] == pytest.approx(ref["step2"]["loss"], abs=1e-6)
        assert res["step2"]["grad_norm"] == pytest.approx(ref["step2"]["grad_norm"], rel=1e-5)
        torch.testing.assert_close(res["after"].logp_BS * valid, ref["after"].logp_BS * valid, atol=1e-6,
                                   rtol=0)


def test_incomplete_checkpoint_is_refused(tmp_path, tiny_qwen):
    (tmp_path / "half").mkdir()
    with pytest.raises(RuntimeError, match="not a complete moe_rl checkpoint"):
        run_ranks(ckpt_job, 1, (str(tiny_qwen), {}, str(tmp_path / "half"), "load"))


def test_distributed_optimizer_state_into_plain_optimizer_is_refused(tmp_path, tiny_qwen):
    ckpt = tmp_path / "dp2"
    run_ranks(ckpt_job, 2, (str(tiny_qwen), {}, str(ckpt), "save"))  # DP2: distributed optimizer
    with pytest.raises(RuntimeError, match="distributed optimizer state, this run uses a plain optimizer"):
        run_ranks(ckpt_job, 1, (str(tiny_qwen), {}, str(ckpt), "load"))
