"""Masked model-token GAE: the guide's worked examples, a slow reference written straight from the
equations (hypothesis), and the common per-token reverse loop."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.algos import gae
from moe_rl.algos.advantages import AdvantageInputs, AdvantageSpec, gae_advantage

BACKENDS = ["kernel", "torch"]
T_, F_ = torch.tensor([True]), torch.tensor([False])


def reference_gae(rewards, values, mask, terminated, boundary, gamma, lam):
    """Per sample: compress to the decision timeline q_1..q_J, recurse from A_{J+1} = 0, write back."""
    B, T = values.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        q = [t for t in range(T) if mask[i, t]]
        J = len(q)
        lam_i = float(lam[i]) if isinstance(lam, torch.Tensor) else lam
        A_next = 0.0
        for j in range(J - 1, -1, -1):
            if j < J - 1:
                v_star, d = float(values[i, q[j + 1]]), 0.0
            else:
                d = 1.0 if terminated[i] else 0.0
                v_star = 0.0 if terminated[i] else float(boundary[i])
            delta = float(rewards[i, q[j]]) + gamma * v_star - float(values[i, q[j]])
            A = delta + gamma * lam_i * (1 - d) * A_next
            adv[i, q[j]] = A
            ret[i, q[j]] = A + float(values[i, q[j]])
            A_next = A
    return adv, ret


@pytest.mark.parametrize("backend", BACKENDS)
def test_guide_example_mask_101(backend):
    # raw mask (1, 0, 1): position 2 (index 1) is a tool result; gamma=0.9, lambda=0.8
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    values = torch.tensor([[0.5, 7.0, 0.25]])  # V at the tool position must not be used
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    g, lam = 0.9, 0.8
    adv, ret = gae.masked_gae(rewards, values, mask, T_, torch.tensor([0.0]), g, lam, backend=backend)
    delta2 = 1.0 + g * 0.0 - 0.25  # terminal: V*_{J+1} = 0
    delta1 = 0.0 + g * 0.25 - 0.5  # successor is q_2 = index 2, skipping the tool token
    A2 = delta2
    A1 = delta1 + g * lam * A2  # one gamma*lambda factor, not two
    torch.testing.assert_close(adv, torch.tensor([[A1, 0.0, A2]]))
    torch.testing.assert_close(ret, torch.tensor([[A1 + 0.5, 0.0, A2 + 0.25]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_termination_vs_truncation(backend):
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)  # ends with an observation, then padding
    values = torch.tensor([[1.0, 2.0, 9.0, 9.0]])
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0]])
    g, lam, boundary = 0.5, 1.0, torch.tensor([4.0])
    term, _ = gae.masked_gae(rewards, values, mask, T_, boundary, g, lam, backend=backend)
    trunc, _ = gae.masked_gae(rewards, values, mask, F_, boundary, g, lam, backend=backend)
    # terminated: A2 = 0.5 - 2 = -1.5; A1 = (0 + 0.5*2 - 1) + 0.5*A2 = -0.75
    torch.testing.assert_close(term, torch.tensor([[-0.75, -1.5, 0.0, 0.0]]))
    # truncated: A2 = 0.5 + 0.5*4 - 2 = 0.5; A1 = 0 + 0.5*0.5 = 0.25
    torch.testing.assert_close(trunc, torch.tensor([[0.25, 0.5, 0.0, 0.0]]))


def test_decoupled_lambdas_use_the_same_frozen_values():
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    values = torch.tensor([[0.1, 0.2, 0.3]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = gae.decoupled_gae(rewards, values, mask, T_, torch.zeros(1), 1.0, 0.0, 1.0)
    # lambda_actor = 0: one-step TD residuals
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.1, 0.7]]))
    # lambda_critic = 1, gamma = 1: Monte-Carlo return of the terminal reward
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_advantage_routes_decoupled_and_length_adaptive_traces():
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    values = torch.tensor([[0.1, 0.2, 0.3]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    inp = AdvantageInputs(rewards, mask, torch.ones(1), torch.zeros(1, dtype=torch.long), values, T_,
                          torch.zeros(1))
    # gamma = 1: delta = (0.2 - 0.1, 0.3 - 0.2, 1 - 0.3) = (0.1, 0.1, 0.7)
    # lam_actor = 0 -> A = delta; lam_critic = 1 -> G = Monte-Carlo return 1 everywhere
    adv, ret = gae_advantage(inp, AdvantageSpec(gamma=1.0, lam=0.0, lam_critic=1.0))
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.1, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    # plain GAE with lam = 0.5: A3 = 0.7, A2 = 0.1 + 0.5*0.7 = 0.45, A1 = 0.1 + 0.5*0.45 = 0.325; G = A + V
    adv, ret = gae_advantage(inp, AdvantageSpec(gamma=1.0, lam=0.5))
    torch.testing.assert_close(adv, torch.tensor([[0.325, 0.45, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[0.425, 0.65, 1.0]]))
    # length-adaptive: J = 3, alpha = 2/3 -> lambda_actor = 1 - 1/(2/3 * 3) = 0.5 (same A as above);
    # the critic keeps hp.lam = 1 -> G = 1
    adv, ret = gae_advantage(inp, AdvantageSpec(gamma=1.0, lam=1.0, length_adaptive_alpha=2 / 3))
    torch.testing.assert_close(adv, torch.tensor([[0.325, 0.45, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_length_adaptive_lambda():
    lam = gae.length_adaptive_lambda(torch.tensor([0, 1, 4, 100]), alpha=0.5)
    # 1 - 1/(0.5 J): J=1 -> -1 -> clamped 0; J=4 -> 0.5; J=100 -> 0.98
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.5, 0.98]))
    mask = torch.ones(2, 4, dtype=torch.bool)
    rewards = torch.randn(2, 4)
    values = torch.randn(2, 4)
    lam_B = torch.tensor([0.3, 0.9])
    adv, _ = gae.masked_gae(rewards, values, mask, torch.ones(2, dtype=torch.bool), torch.zeros(2), 0.99,
                            lam_B)
    ref, _ = reference_gae(rewards, values, mask, [True, True], [0, 0], 0.99, lam_B)
    torch.testing.assert_close(adv.double(), ref, atol=1e-5, rtol=1e-5)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    p_obs = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    mask = torch.rand(B, T, generator=gen) >= p_obs
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    terminated = torch.rand(B, generator=gen) < 0.5
    boundary = torch.randn(B, generator=gen, dtype=torch.float64)
    gamma = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
    lam = draw(st.sampled_from([0.0, 0.3, 0.95, 1.0]))
    return rewards, values, mask, terminated, boundary, gamma, lam


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(BACKENDS))
def test_fast_gae_matches_reference(batch, backend):
    rewards, values, mask, terminated, boundary, gamma, lam = batch
    adv, ret = gae.masked_gae(rewards, values, mask, terminated, boundary, gamma, lam, backend=backend)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, terminated, boundary, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, ref_ret, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_common_reverse_loop_when_every_sample_terminates(backend):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 300
    mask = torch.rand(B, T, generator=gen) < 0.6
    values, rewards = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen) * mask
    ones = torch.ones(B, dtype=torch.bool)
    adv, ret = gae.masked_gae(rewards, values, mask, ones, torch.full((B,), 123.0), 0.99, 0.95,
                              backend=backend)
    loop_adv, loop_ret = gae.reverse_loop_gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, loop_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret, loop_ret, atol=2e-5, rtol=1e-5)


def test_long_sequences_stay_finite_in_float32():
    # chunked rescaling must not overflow: T=5000 with a small gamma*lambda
    T = 5000
    mask = torch.ones(2, T, dtype=torch.bool)
    values = torch.zeros(2, T)
    rewards = torch.zeros(2, T)
    rewards[:, -1] = 1.0
    adv, _ = gae.masked_gae(rewards, values, mask, torch.ones(2, dtype=torch.bool), torch.zeros(2), 1.0, 0.5,
                            backend="torch")
    assert torch.isfinite(adv).all()
    assert math.isclose(float(adv[0, -1]), 1.0) and math.isclose(float(adv[0, -3]), 0.25, rel_tol=1e-5)
    assert float(adv[0, 0]) == 0.0  # 0.5**4999 underflows to exactly 0, as it should


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_and_rewards_at_mask0_positions_are_ignored(backend, bad):
    # observation / padding positions may carry garbage (the critic's output there is never read)
    mask = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, 0.0, 0.25, 0.0], [0.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    terminated, boundary = torch.tensor([True, False, False]), torch.tensor([bad, 3.0, bad])
    clean, clean_ret = gae.masked_gae(rewards, values, mask, terminated, torch.tensor([0.0, 3.0, 0.0]), 0.9,
                                      0.8, backend=backend)
    dirty_v, dirty_r = values.clone(), rewards.clone()
    dirty_v[~mask] = bad
    dirty_r[~mask] = bad
    adv, ret = gae.masked_gae(dirty_r, dirty_v, mask, terminated, boundary, 0.9, 0.8, backend=backend)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv, clean, rtol=0, atol=0)
    torch.testing.assert_close(ret, clean_ret, rtol=0, atol=0)
    # by hand, sample 0 (mask 1 0 1, terminated): A2 = 1 - 0.25 = 0.75; A1 = 0.9*0.25 - 0.5 + 0.72*0.75 =
    # 0.265
    # sample 1 (mask 0 1 1, truncated at V_boot = 3): A2 = 0 + 0.9*3 - 2 = 0.7; A1 = 0.5 + 0.9*2 - 1 +
    # 0.72*0.7
    torch.testing.assert_close(adv,
                               torch.tensor([[0.265, 0.0, 0.75, 0.0], [0.0, 1.804, 0.7, 0.0], [0.0] * 4]))


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_computed_in_float32(backend, dtype):
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 50, generator=gen) < 0.7
    values = torch.randn(3, 50, generator=gen).to(dtype)
    rewards = (torch.randn(3, 50, generator=gen) * mask).to(dtype)
    terminated, boundary = torch.tensor([True, False, False]), torch.tensor([0.0, 1.5, -0.5], dtype=dtype)
    adv, ret = gae.masked_gae(rewards, values, mask, terminated, boundary, 0.99, 0.95, backend=backend)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    # the same (exactly representable) numbers in float32 give the same result
    ref_adv, ref_ret = gae.masked_gae(rewards.float(), values.float(), mask, terminated, boundary.float(),
                                      0.99, 0.95, backend=backend)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=0)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=0)
    empty, _ = gae.masked_gae(rewards[:, :0], values[:, :0], mask[:, :0], terminated, boundary, 0.99, 0.95,
                              backend=backend)
    assert empty.shape == (3, 0) and empty.dtype == torch.float32


def test_each_checkout_builds_its_own_kernel(tmp_path):
    """Two clones of the project on one machine get two entries in torch's extension cache (one name
    for both made each rebuild the kernel, ~30 s, whenever the other had run); one checkout keeps its
    name, however its path is spelt."""
    from pathlib import Path

    here = Path(gae.__file__).with_name("gae_kernel.cpp")
    other = tmp_path / "clone" / "moe_rl" / "algos" / "gae_kernel.cpp"
    assert gae.kernel_name(here) != gae.kernel_name(other)
    assert gae.kernel_name(here) == gae.kernel_name(here.parent / ".." / "algos" / "gae_kernel.cpp")
