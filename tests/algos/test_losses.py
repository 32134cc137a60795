"""Each loss against an independent straight-from-the-formula version (value and autograd gradient),
plus finite-difference gradchecks and hand examples."""

import pytest
import torch

from moe_rl.algos import losses
from moe_rl.algos.losses import PolicyLossParams

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


@pytest.mark.parametrize("el, eh, cd", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0), (0.1, 0.1, 1.5)])
def test_ppo_matches_formula(el, eh, cd):
    logp, old, adv, mask = _data()
    hp = PolicyLossParams(el, eh, cd)
    v1, g1 = _grad(lambda lp: losses.ppo_clip_loss(lp, old, adv, mask, hp)[0].sum(), logp)
    v2, g2 = _grad(lambda lp: ppo_formula(lp, old, adv, mask, el, eh, cd), logp)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)


def test_ppo_hand_example_and_clip_metrics():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 10.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = losses.ppo_clip_loss(logp, old, adv, mask, PolicyLossParams(0.2, 0.3, 3.0))
    # r=1.5,A=+1 -> clipped to 1.3 -> -1.3; r=0.5,A=-1 -> max(0.5, 0.8) = 0.8;
    # r=1.1 -> -1.1; r=10,A=-1 -> max(10, 1.3) = 10 -> dual clip min(10, 3) = 3
    torch.testing.assert_close(loss, torch.tensor([[-1.3, 0.8, -1.1, 3.0]]))
    assert float(m["clipfrac_high"]) == 0.25 and float(m["clipfrac_low"]) == 0.25 and float(m["clipfrac_dual"]) == 0.25


def test_gspo_sequence_ratio_value_and_gradient():
    logp, old, _, mask = _data(1)
    adv = torch.tensor([[0.7], [-1.2], [0.3]], dtype=torch.float64).expand(B, T)
    hp = PolicyLossParams(0.2, 0.2)
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


def test_gmpo_matches_formula():
    logp, old, _, mask = _data(2)
    adv = torch.tensor([[0.7], [-1.2], [0.3]], dtype=torch.float64).expand(B, T)
    hp = PolicyLossParams(0.4, 0.4)
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
    hp = PolicyLossParams(0.2, 0.2)
    _, g = _grad(lambda lp: losses.cispo_loss(lp, old, adv, mask, hp)[0].sum(), logp)
    w = torch.exp(logp.detach() - old).clamp(0.8, 1.2)
    torch.testing.assert_close(g, torch.where(mask, -w * adv, 0.0))  # d/dlogp of -sg(w) A logp
    assert (g[mask] != 0).all()


# GSPO-token and CISPO use stop-gradients by design (their gradients are surrogates, checked against
# the formula above), so finite differences apply to the losses without them.
@pytest.mark.parametrize("name", ["ppo", "gmpo"])
def test_gradcheck_finite_differences(name):
    from moe_rl.algos import registry

    logp, old, adv, mask = _data(4)
    # move ratios away from the clip kinks so the loss is differentiable at the point
    logp = (old + 0.05 * torch.randn(B, T, dtype=torch.float64)).detach().requires_grad_(True)
    fn = registry.get("policy_loss", name)
    hp = PolicyLossParams(0.3, 0.3, 3.0 if name == "ppo" else None)
    assert torch.autograd.gradcheck(lambda lp: fn(lp, old, adv, mask, hp)[0], (logp,))


def test_value_loss_by_hand_and_gradcheck():
    v = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    v_old = torch.tensor([[0.5, 0.0, 1.0]], dtype=torch.float64)
    G = torch.tensor([[2.0, 5.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    loss, m = losses.clipped_value_loss(v, v_old, G, mask, clip=0.2)
    # t0: unclipped (1-2)^2=1, clipped V=0.7 -> 1.69 -> 0.5*1.69; t2: (2-.5)^2=2.25, clipped 1.2 -> .49 -> max 2.25
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.845, 0.0, 1.125]], dtype=torch.float64))
    assert float(m["value_clipfrac"]) == 0.5
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.0, 1.5]], dtype=torch.float64))  # clipped branch has no grad


def test_kl_and_entropy_from_logits():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    ref = torch.randn(2, 3, 7, dtype=torch.float64)
    p, q = logits.softmax(-1), ref.softmax(-1)
    torch.testing.assert_close(losses.full_kl_from_logits(logits, ref), (p * (p.log() - q.log())).sum(-1).float())
    torch.testing.assert_close(losses.entropy_from_logits(logits), (-(p * p.log()).sum(-1)).float())
    lp = torch.tensor([[-1.0, -2.0]])
    assert torch.allclose(losses.sampled_kl_loss(lp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[1, 0]], dtype=torch.bool), "k3"),
                          torch.tensor([[0.0, 0.0]]))
