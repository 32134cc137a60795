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
    # per layer: both MoE layers, their mean the total
    layers = [on["figures"][f"moe_aux_loss_layer{i:02d}"] for i in range(2)]
    assert sum(layers) / 2 == pytest.approx(on["figures"]["moe_aux_loss"])


def test_under_replay_the_balancing_loss_reads_the_routers_own_choice_and_the_bias_is_frozen(tiny_qwen):
    """Routes replayed as experts 0 and 1 for every token (nothing like the router's choice): the
    log-probs change (other experts computed); the first MoE layer's load-balancing and z losses do not
    (megatron-core computes them from that router's own top-k and logits, and its input does not depend on
    any routing), the second layer's do (its input went through the replayed experts of the first); the
    aux-loss-free expert bias does not move under replay (update rate 0)."""
    import torch
    from train_jobs import router_loss_job

    free = run_ranks(router_loss_job, 1, (str(tiny_qwen), 0.1, 0.01))[0]
    replayed = run_ranks(router_loss_job, 1, (str(tiny_qwen), 0.1, 0.01, True))[0]
    assert not torch.allclose(replayed["logp"], free["logp"])
    for key in ("moe_aux_loss_layer00", "moe_z_loss_layer00"):
        assert replayed["figures"][key] == pytest.approx(free["figures"][key], rel=1e-6), key
    assert replayed["figures"]["moe_aux_loss_layer01"] != free["figures"]["moe_aux_loss_layer01"]
    assert replayed["bias_rate"] == free["bias_rate"] == 0.0


@pytest.mark.parametrize("replay", [False, True], ids=["free", "replay"])
def test_glm4_expert_bias_moves_only_at_its_rate_and_never_under_replay(tiny_glm4_moe, replay):
    """model.expert_bias_update_rate on a GLM-4.5 router (a random bias in the checkpoint): 0 keeps the
    checkpoint's bias (mbridge's DeepSeek bridge would move it by 0.001); at 0.01 with free routing each
    expert's bias moves by exactly 0.01 toward equal load (megatron's sign rule: up where an expert got
    fewer tokens than the mean, down where more); under replay it stays."""
    import torch
    from routing_jobs import expert_bias_job

    before, still = run_ranks(expert_bias_job, 1, (str(tiny_glm4_moe), 0.0, replay))[0]
    _, moved = run_ranks(expert_bias_job, 1, (str(tiny_glm4_moe), 0.01, replay))[0]
    assert before and set(before) == set(still) == set(moved)
    for name, bias in before.items():
        assert bias.abs().max() > 0.05  # the checkpoint's own, loaded
        assert torch.equal(still[name], bias)
        step = (moved[name] - bias).abs()
        if replay:
            assert torch.equal(moved[name], bias)
        else:
            assert torch.allclose(step[step > 0], torch.full_like(step[step > 0], 0.01)) and (step > 0).any()
