"""Each loss against an independent straight-from-the-formula version (value and autograd gradient),
plus finite-difference gradchecks and hand examples."""

import pytest
import torch

from moe_rl.algos import losses
from moe_rl.algos.losses import PolicyLossSpec

torch.manual_seed(0)
B, T = 3, 5


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = (logp_old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return logp.requires_grad_(True), logp_old, adv, mask


def _grad(fn, logp):
    logp.grad = None
    out = fn(logp)
    out.backward()
    return out.detach(), logp.grad.clone()


def ppo_formula(logp, old, adv, mask, el, eh, cd):
    total = 0.0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            l_asym = torch.maximum(-adv[i, t] * r, -adv[i, t] * torch.clamp(r, 1 - el, 1 + eh))
            if cd is not None and adv[i, t] < 0:
                l_asym = torch.minimum(l_asym, -cd * adv[i, t])
            total = total + l_asym
    return total


def _ppo_data():
    """_data() with every PPO branch present: log-ratio and advantage set on four valid tokens."""
    logp, old, adv, mask = _data()
    logp = logp.detach().clone()
    for (i, t), lr, a in [((0, 0), 1.3, -1.0),  # r = 3.67, A < 0: dual-clipped for c_dual 3 and 1.5
                          ((0, 1), -0.5, -0.5),  # r = 0.61, A < 0: clipped low
                          ((1, 1), 0.4, 0.8),  # r = 1.49, A > 0: clipped high
                          ((1, 2), 0.6, -1.0)]:  # r = 1.82, A < 0: dual-clipped for c_dual 1.5 only
        logp[i, t] = old[i, t] + lr
        adv[i, t] = a
    return logp.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize("el, eh, cd",
                         [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0), (0.1, 0.1, 1.5)])
def test_ppo_matches_formula(el, eh, cd):
    logp, old, adv, mask = _ppo_data()
    hp = PolicyLossSpec(el, eh, cd)
    v1, g1 = _grad(lambda lp: losses.ppo_clip_loss(lp, old, adv, mask, hp)[0].sum(), logp)
    v2, g2 = _grad(lambda lp: ppo_formula(lp, old, adv, mask, el, eh, cd), logp)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)
    _, m = losses.ppo_clip_loss(logp.detach(), old, adv, mask, hp)
    assert float(m["clipfrac_low"]) > 0 and float(m["clipfrac_high"]) > 0  # the branches are exercised
    if cd is not None:
        assert float(m["clipfrac_dual"]) == (1 / 8 if cd == 3.0 else 2 / 8)


def test_ppo_hand_example_and_clip_metrics():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 10.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = losses.ppo_clip_loss(logp, old, adv, mask, PolicyLossSpec(0.2, 0.3, 3.0))
    # r=1.5,A=+1 -> clipped to 1.3 -> -1.3; r=0.5,A=-1 -> max(0.5, 0.8) = 0.8;
    # r=1.1 -> -1.1; r=10,A=-1 -> max(10, 1.3) = 10 -> dual clip min(10, 3) = 3
    torch.testing.assert_close(loss, torch.tensor([[-1.3, 0.8, -1.1, 3.0]]))
    assert float(m["clipfrac_high"]) == 0.25 and float(m["clipfrac_low"]) == 0.25 \
        and float(m["clipfrac_dual"]) == 0.25


def test_gspo_sequence_ratio_value_and_gradient():
    logp, old, _, mask = _data(1)
    # mean log-ratios (0.21, 0.47, 0.14) -> move sample 1 to 0.47 - 0.8 = -0.33: s = 0.72 < 0.8 with A < 0
    logp = (logp.detach() - 0.8 * (torch.arange(B) == 1).unsqueeze(1)).requires_grad_(True)
    adv = torch.tensor([[0.7], [-1.2], [0.3]], dtype=torch.float64).expand(B, T)
    hp = PolicyLossSpec(0.2, 0.2)
    J = mask.sum(1)

    def formula(lp):
        total = 0.0
        for i in range(B):
            s = torch.exp(((lp[i] - old[i]) * mask[i]).sum() / J[i])
            li = torch.maximum(-adv[i, 0] * s, -adv[i, 0] * torch.clamp(s, 0.8, 1.2))
            total = total + li  # seq_mean numerator: sum_i (1/J_i) sum_t l_i = sum_i l_i
        return total

    def ours(lp):
        loss, _ = losses.gspo_loss(lp, old, adv, mask, hp)
        return (loss.sum(1) / J).sum()

    v1, g1 = _grad(ours, logp)
    v2, g2 = _grad(formula, logp)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)
    # sample 0 (s = 1.23, A > 0) and sample 1 (s = 0.72, A < 0) are clipped: no gradient; sample 2 is not
    _, m = losses.gspo_loss(logp.detach(), old, adv, mask, hp)
    assert float(m["seq_clipfrac_high"]) == pytest.approx(1 / 3) \
        and float(m["seq_clipfrac_low"]) == pytest.approx(1 / 3)
    assert (g1[:2] == 0).all() and (g1[2, mask[2]] != 0).all()


def test_gmpo_matches_formula():
    logp, old, _, mask = _data(2)
    adv = torch.tensor([[0.7], [-1.2], [0.3]], dtype=torch.float64).expand(B, T)
    hp = PolicyLossSpec(0.4, 0.4)
    J = mask.sum(1)

    def formula(lp):
        total = 0.0
        for i in range(B):
            sgn = torch.sign(adv[i, 0])
            logs = []
            for t in range(T):
                if mask[i, t]:
                    lr = lp[i, t] - old[i, t]
                    logs.append(sgn * torch.minimum(sgn * lr, sgn * torch.clamp(lr, -0.4, 0.4)))
            total = total + -adv[i, 0] * torch.exp(torch.stack(logs).mean())
        return total

    def ours(lp):
        loss, _ = losses.gmpo_loss(lp, old, adv, mask, hp)
        return (loss.sum(1) / J).sum()

    v1, g1 = _grad(ours, logp)
    v2, g2 = _grad(formula, logp)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)


def test_cispo_keeps_gradient_for_clipped_tokens():
    logp, old, adv, mask = _data(3)
    hp = PolicyLossSpec(0.2, 0.2)
    _, g = _grad(lambda lp: losses.cispo_loss(lp, old, adv, mask, hp)[0].sum(), logp)
    w = torch.exp(logp.detach() - old).clamp(0.8, 1.2)
    torch.testing.assert_close(g, torch.where(mask, -w * adv, 0.0))  # d/dlogp of -sg(w) A logp
    assert (g[mask] != 0).all()


def test_sapo_matches_formula_and_by_hand():
    """l_t = -(4/tau_t) sigmoid(tau_t (r_t - 1)) A_t, tau_t = tau_pos where A > 0, else tau_neg: each token's
    value and gradient from the formula, and one row worked by hand (defaults tau_pos 1, tau_neg 1.05)."""
    import math

    logp, old, adv, mask = _data(6)
    hp = PolicyLossSpec(sapo_tau_pos=0.7, sapo_tau_neg=1.4)

    def formula(lp):
        total = 0.0
        for i in range(B):
            for t in range(T):
                if mask[i, t]:
                    tau = 0.7 if adv[i, t] > 0 else 1.4
                    r = torch.exp(lp[i, t] - old[i, t])
                    total = total - 4.0 / tau * torch.sigmoid(tau * (r - 1.0)) * adv[i, t]
        return total

    v1, g1 = _grad(lambda lp: losses.sapo_loss(lp, old, adv, mask, hp)[0].sum(), logp)
    v2, g2 = _grad(formula, logp)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)
    # by hand: ratios 1, 1.5 (A = 1, 2: tau 1) and 0.5 (A = -1: tau 1.05); d l / d log pi = -4 s (1 - s) A r
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.tensor([[0.0, math.log(1.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = losses.sapo_loss(lp, old, adv, mask, PolicyLossSpec())
    loss.sum().backward()
    s1, s2 = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(0.525))  # sigmoid(1 * 0.5), sigmoid(1.05 * -0.5)
    assert loss[0].tolist() == pytest.approx([-2.0, -4 * s1 * 2, 4 / 1.05 * s2])
    w = [1.0, 4 * s1 * (1 - s1), 4 * s2 * (1 - s2)]  # on-policy (r = 1): exactly the plain policy gradient
    assert lp.grad[0].tolist() == pytest.approx([-w[0], -w[1] * 2 * 1.5, w[2] * 0.5])
    assert float(metrics["sapo_weight_mean"]) == pytest.approx(sum(w) / 3)
    assert 0.9 < w[2] < w[1] < 1  # off-policy tokens damped, smoothly; none cut to 0


# GSPO-token and CISPO use stop-gradients by design (their gradients are surrogates, checked against
# the formula above), so finite differences apply to the losses without them.
@pytest.mark.parametrize("name", ["ppo", "gmpo", "sapo"])
def test_gradcheck_finite_differences(name):
    from moe_rl.algos import registry

    logp, old, adv, mask = _data(4)
    # ratios away from the clip kinks, so the loss is differentiable at the point: most inside the clip
    # range, two well outside it (clipped, including PPO's dual clip at r = e^1.5 > 3 with A < 0)
    delta = 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    delta[0, 0], delta[1, 1] = 0.8, 1.5
    adv = adv.clone()
    adv[0, 0], adv[1, 1] = 1.0, -1.0
    logp = (old + delta).detach().requires_grad_(True)
    fn = registry.get("policy_loss", name)
    hp = PolicyLossSpec(0.3, 0.3, 3.0 if name == "ppo" else None)
    assert torch.autograd.gradcheck(lambda lp: fn(lp, old, adv, mask, hp)[0], (logp,))


def test_value_loss_by_hand_and_gradcheck():
    v = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    v_old = torch.tensor([[0.5, 0.0, 1.0]], dtype=torch.float64)
    G = torch.tensor([[2.0, 5.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    loss, m = losses.clipped_value_loss(v, v_old, G, mask, clip=0.2)
    # t0: unclipped (1-2)^2=1, clipped V=0.7 -> 1.69 -> 0.5*1.69; t2: (2-.5)^2=2.25, clipped 1.2 -> .49 -> max
    # 2.25
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.845, 0.0, 1.125]], dtype=torch.float64))
    assert float(m["value_clipfrac"]) == 0.5
    loss.sum().backward()
    # clipped branch has no grad
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.0, 1.5]], dtype=torch.float64))


@pytest.mark.parametrize("estimator, expected", [
    # log pi = (-1, -2, -0.5), log pi_ref = (-1.5, -1, -3); the third position is masked out.
    ("k1", [0.5, -1.0]),  # log pi - log pi_ref
    ("k2", [0.125, 0.5]),  # (log pi - log pi_ref)^2 / 2
    # d = log pi_ref - log pi = (-0.5, 1): e^d - d - 1 = (0.10653065971263342, 0.7182818284590451)
    ("k3", [0.10653065971263342, 0.7182818284590451]),
])
def test_sampled_kl_loss_by_hand(estimator, expected):
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    out = losses.sampled_kl_loss(lp, ref, mask, estimator)
    torch.testing.assert_close(out, torch.tensor([[*expected, 0.0]], dtype=torch.float64), rtol=1e-15, atol=0)


POLICY_LOSSES = ["ppo", "gspo", "gmpo", "cispo", "sapo"]


def test_every_registered_policy_loss_is_covered():
    from moe_rl.algos import registry

    assert sorted(POLICY_LOSSES) == registry.names("policy_loss")


def _loss_and_grad(name, logp, old, adv, mask, hp):
    from moe_rl.algos import registry

    leaf = logp.detach().clone().requires_grad_(True)
    loss_BT, metrics = registry.get("policy_loss", name)(leaf, old, adv, mask, hp)
    loss_BT.sum().backward()
    return loss_BT.detach(), leaf.grad, metrics


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_non_finite_logprobs_at_mask0_positions_are_ignored(name, bad):
    # padding / observation positions may carry log-prob -inf (or NaN): loss, gradient and metrics must
    # be those of the zero-filled batch
    logp, old, adv, mask = _data(5)
    hp = PolicyLossSpec(0.2, 0.28, 3.0 if name == "ppo" else None)
    clean = _loss_and_grad(name, torch.where(mask, logp, 0.0), torch.where(mask, old, 0.0), adv, mask, hp)
    dirty = _loss_and_grad(name, torch.where(mask, logp, bad), torch.where(mask, old, bad), adv, mask, hp)
    for c, d in zip(clean[:2], dirty[:2], strict=True):
        assert torch.isfinite(d).all()
        torch.testing.assert_close(d, c, rtol=0, atol=0)
    assert clean[2].keys() == dirty[2].keys()
    for k in clean[2]:
        assert torch.isfinite(dirty[2][k]), k
        torch.testing.assert_close(dirty[2][k], clean[2][k], rtol=0, atol=0)


def test_value_and_kl_losses_ignore_non_finite_mask0_positions():
    mask = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    v = torch.tensor([[1.0, float("nan"), 2.0, float("inf")]], dtype=torch.float64, requires_grad=True)
    v_old = torch.tensor([[0.5, float("nan"), 1.0, 0.0]], dtype=torch.float64)
    G = torch.tensor([[2.0, float("-inf"), 0.5, float("nan")]], dtype=torch.float64)
    loss, m = losses.clipped_value_loss(v, v_old, G, mask, clip=0.2)
    loss.sum().backward()
    # as in test_value_loss_by_hand_and_gradcheck, with the mask-0 positions ignored
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.845, 0.0, 1.125, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.0, 1.5, 0.0]], dtype=torch.float64))
    assert float(m["value_clipfrac"]) == 0.5
    for est in ("k1", "k2", "k3"):
        lp = torch.tensor([[-1.0, float("-inf"), -2.0, float("nan")]], dtype=torch.float64,
                          requires_grad=True)
        ref = torch.tensor([[-1.5, float("-inf"), -1.0, -1.0]], dtype=torch.float64)
        kl = losses.sampled_kl_loss(lp, ref, mask, est)
        kl.sum().backward()
        assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all(), est
        assert kl[0, 1] == 0 and kl[0, 3] == 0 and lp.grad[0, 1] == 0 and lp.grad[0, 3] == 0


def test_gspo_in_bf16_makes_the_clip_decisions_of_fp32():
    # 4 sequences of 16 tokens, log pi_old = -0.75; one or two tokens moved by one bf16 step
    # (2^-8 = 0.00390625 at 0.75), so the mean log-ratios are +-2.44e-4 (inside eps 3e-4 / 4e-4) and
    # +-4.88e-4 (outside): s = exp(mean) clips sequence 1 high and sequence 3 low.
    step = 2.0**-8
    old = torch.full((4, 16), -0.75)
    logp = old.clone()
    logp[0, 0] += step
    logp[1, :2] += step
    logp[2, 0] -= step
    logp[3, :2] -= step
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]]).expand(4, 16)
    mask = torch.ones(4, 16, dtype=torch.bool)
    hp = PolicyLossSpec(3e-4, 4e-4)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        lp = logp.to(dtype)
        assert torch.equal(lp.float(), logp)  # the inputs are exact in bf16
        _, grad, metrics = _loss_and_grad("gspo", lp, old.to(dtype), adv.to(dtype), mask, hp)
        zero_grad = (grad == 0).all(1).tolist()
        results[dtype] = (float(metrics["seq_clipfrac_high"]), float(metrics["seq_clipfrac_low"]), zero_grad)
    # clipped sequences (1: A > 0 above 1 + eps_h; 3: A < 0 below 1 - eps_l) get no gradient
    assert results[torch.float32] == (0.25, 0.25, [False, True, False, True])
    assert results[torch.bfloat16] == results[torch.float32]


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_losses_compute_half_precision_inputs_in_float32(name):
    logp, old, adv, mask = (x.detach() for x in _data(6))
    hp = PolicyLossSpec(0.2, 0.28, 3.0 if name == "ppo" else None)
    for dtype in (torch.bfloat16, torch.float16):
        lo = _loss_and_grad(name, logp.to(dtype), old.to(dtype), adv.to(dtype), mask, hp)
        hi = _loss_and_grad(name, logp.to(dtype).float(), old.to(dtype).float(), adv.to(dtype).float(), mask,
                            hp)
        assert lo[0].dtype == torch.float32
        torch.testing.assert_close(lo[0], hi[0], rtol=0, atol=0)
        torch.testing.assert_close(lo[1].float(), hi[1].to(dtype).float(), rtol=0, atol=0)
        for k in hi[2]:
            assert lo[2][k].dtype == hi[2][k].dtype, k
            torch.testing.assert_close(lo[2][k], hi[2][k], rtol=0, atol=0)
    # float64 stays float64
    assert _loss_and_grad(name, logp, old, adv, mask, hp)[0].dtype == torch.float64


def test_value_and_kl_losses_compute_half_precision_inputs_in_float32():
    g = torch.Generator().manual_seed(7)
    v, v_old, G = (torch.randn(2, 6, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.rand(2, 6, generator=g) < 0.7
    lo, m_lo = losses.clipped_value_loss(v, v_old, G, mask, clip=0.2)
    hi, m_hi = losses.clipped_value_loss(v.float(), v_old.float(), G.float(), mask, clip=0.2)
    assert lo.dtype == torch.float32 and m_lo["value_clipfrac"].dtype == m_hi["value_clipfrac"].dtype
    torch.testing.assert_close(lo, hi, rtol=0, atol=0)
    assert losses.clipped_value_loss(v, v_old, G, mask, clip=None)[1]["value_clipfrac"].dtype == torch.float32
    lp, ref = ((-torch.rand(2, 6, generator=g) * 3).to(torch.bfloat16),
               (-torch.rand(2, 6, generator=g) * 3).to(torch.bfloat16))
    for est in ("k1", "k2", "k3"):
        out = losses.sampled_kl_loss(lp, ref, mask, est)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, losses.sampled_kl_loss(lp.float(), ref.float(), mask, est), rtol=0,
                                   atol=0)
    assert losses.masked_mean(lp, mask).dtype == torch.float32


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_a_ratio_that_would_overflow_gives_a_finite_gradient(name):
    """A token with log pi_theta - log pi_old = 100 (exp overflows float32 past 88.7): the loss and every
    gradient stay finite (unclamped, the worker would see a NaN gradient and skip the whole update), and
    that token's gradient is 0 where its term is clipped; the other tokens' gradients are unchanged."""
    from moe_rl.algos import registry

    fn = registry.get("policy_loss", name)
    hp = PolicyLossSpec(0.2, 0.28, 3.0 if name == "ppo" else None)
    old = torch.tensor([[-1.0, -1.0, -2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for sign in (-1.0, 1.0):  # both advantage signs: PPO's dual-clip branch, and its high clip
        adv = torch.tensor([[sign, sign, sign]])
        logp = torch.tensor([[99.0, -0.9, -2.1]], requires_grad=True)  # log-ratios 100, 0.1, -0.1
        loss, metrics = fn(logp, old, adv, mask, hp)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all(), (name, sign, logp.grad)
        assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
        if name in ("ppo", "cispo", "sapo"):  # token-level: the far-off token alone is clipped (SAPO: its
            # gate saturated), its gradient 0
            assert logp.grad[0, 0] == 0 or name == "cispo", (name, sign, logp.grad)
            sane = torch.tensor([[-0.9, -2.1]], requires_grad=True)
            fn(sane, old[:, 1:], adv[:, 1:], mask[:, 1:], hp)[0].sum().backward()
            torch.testing.assert_close(logp.grad[:, 1:], sane.grad)  # the rest as without it
        if name == "ppo":  # A < 0: dual-clipped to -3 A; A > 0: clipped at 1 + 0.28
            assert loss[0, 0].item() == pytest.approx(3.0 if sign < 0 else -1.28)
