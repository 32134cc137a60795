"""MoE router losses (megatron-core's load-balancing and z losses) in the trainer's update, by config."""

import pytest

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow


def test_router_losses_are_off_by_default_and_change_the_update_when_on(tiny_qwen):
    """model.moe_aux_loss_coeff / moe_z_loss_coeff: 0 leaves the update as it was and logs nothing; on,
    megatron-core's load-balancing and z losses join the router's gradient and are logged (the
    switch loss of top-2 of 4 experts is near its minimum of 1 for a random router)."""
    import torch
    from train_jobs import router_loss_job

    off = run_ranks(router_loss_job, 1, (str(tiny_qwen), 0.0, 0.0))[0]
    on = run_ranks(router_loss_job, 1, (str(tiny_qwen), 0.1, 0.01))[0]
    assert "moe_aux_loss" not in off["figures"] and "moe_z_loss" not in off["figures"]
    assert 0.9 < on["figures"]["moe_aux_loss"] < 2.0 and on["figures"]["moe_z_loss"] > 0
    assert on["figures"]["loss"] == off["figures"]["loss"]  # the policy loss itself is the same
    assert any(not torch.equal(on["routers"][n], off["routers"][n]) for n in off["routers"])
