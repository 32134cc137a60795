"""On-policy distillation (algos/distill.py) worked by hand: the per-token reverse-KL estimate, the
advantage it gives alone and beside a task's, its figures, and the policy loss's gradient with it."""

import pytest
import torch
from test_batch import traj

from moe_rl.algos import aggregate, distill
from moe_rl.algos.checks import BatchCheckError
from moe_rl.algos.losses import PolicyLossSpec
from moe_rl.algos.masking import PolicyMaskSpec
from moe_rl.algos.targets import Scores, policy_denominators, targets
from moe_rl.batch import build_batch
from moe_rl.config import AlgorithmSection, RunConfig, TeacherSection
from moe_rl.driver import specs
from moe_rl.train.objectives import PolicyLoss


def params(**alg):
    return specs.target_spec(RunConfig(algorithm=AlgorithmSection(whiten_advantages=False, **alg),
                                            teacher=TeacherSection(path="/teacher")))


def batch():
    """One group of two samples: 1 prompt token, then 2 model tokens each; rewards 1 and 0; mu = -0.5."""
    return build_batch([traj(1, [(2, 0.0)], 1.0), traj(1, [(2, 0.0)], 0.0)], None)


# the teacher's log-probs of the sampled tokens: k = log mu - log teacher = [-0.3, 0.5] and [0.0, -0.4]
TEACHER = torch.tensor([[0.0, -0.2, -1.0], [0.0, -0.5, -0.1]])


def test_the_reverse_kl_estimate_and_its_figures_by_hand():
    b = batch()
    k = distill.reverse_kl_tokens(b.logp_mu_BS, TEACHER, b.mask_BS)
    torch.testing.assert_close(k, torch.tensor([[0.0, -0.3, 0.5], [0.0, 0.0, -0.4]]))
    f = distill.reverse_kl_figures(k, b.mask_BS)
    # mean of (-0.3, 0.5, 0.0, -0.4); p95 of the sorted (-0.4, -0.3, 0, 0.5) at 0.95 * 3 = 2.85: 0.85 * 0.5
    assert float(f["distill/reverse_kl_mean"]) == pytest.approx(-0.05)
    assert float(f["distill/reverse_kl_p95"]) == pytest.approx(0.425)
    empty = distill.reverse_kl_figures(k, torch.zeros_like(b.mask_BS))
    assert float(empty["distill/reverse_kl_mean"]) == 0 and float(empty["distill/reverse_kl_p95"]) == 0


def test_distillation_alone_and_beside_the_task_advantage():
    b = batch()
    t = targets(b, Scores(b.logp_mu_BS, logp_teacher_BS=TEACHER), params(advantage="none", distill_coef=2.0))
    # A = -2 k on model tokens, the task's nothing
    torch.testing.assert_close(t.adv_BS, torch.tensor([[0.0, 0.6, -1.0], [0.0, 0.0, 0.8]]))
    assert float(t.metrics["distill/reverse_kl_mean"]) == pytest.approx(-0.05)
    # rloo's A (1 and -1 per sample) plus -k, unwhitened
    t = targets(b, Scores(b.logp_mu_BS, logp_teacher_BS=TEACHER), params(advantage="rloo", distill_coef=1.0))
    torch.testing.assert_close(t.adv_BS, torch.tensor([[0.0, 1.3, 0.5], [0.0, -1.0, -0.6]]))
    # whitened, each term on its own: -k = (0.3, -0.5, 0, 0.4) has mean 0.05 and variance
    # 0.125 - 0.05^2 = 0.1225 (std 0.35), so (-k - 0.05) / 0.35 = (5/7, -11/7, -1/7, 1); rloo's +-1 stays
    p = specs.target_spec(RunConfig(algorithm=AlgorithmSection(advantage="rloo", distill_coef=1.0,
                                                                    whiten_advantages=True),
                                         teacher=TeacherSection(path="/teacher")))
    t = targets(b, Scores(b.logp_mu_BS, logp_teacher_BS=TEACHER), p)
    torch.testing.assert_close(t.adv_BS, torch.tensor([[0.0, 1 + 5 / 7, 1 - 11 / 7], [0.0, -1 - 1 / 7, 0.0]]),
                               atol=1e-6, rtol=0)


def test_the_teacher_is_a_checked_role():
    b = batch()
    with pytest.raises(BatchCheckError, match="policy_roles.*teacher log-probs are required"):
        targets(b, Scores(b.logp_mu_BS), params(advantage="none", distill_coef=1.0))
    bad = TEACHER.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(BatchCheckError, match="teacher log-prob is not a finite value"):
        targets(b, Scores(b.logp_mu_BS, logp_teacher_BS=bad), params(advantage="none", distill_coef=1.0))


def test_the_policy_gradient_with_the_distillation_advantage_by_hand():
    """PPO at r = 1 (pi_theta = pi_old = mu), token_mean over the 4 model tokens: l_t = -A_t r_t, so
    d L / d log pi_theta(x_t) = -A_t / 4 = c k_t / 4: the teacher's more likely tokens (k < 0) pushed up,
    its less likely ones down. And the same loss as the RL loss whose advantages are -c k."""
    b = batch()
    p = params(advantage="none", distill_coef=2.0)
    t = targets(b, Scores(b.logp_mu_BS, logp_teacher_BS=TEACHER), p)
    loss = PolicyLoss("ppo", PolicyLossSpec(0.2, 0.2), "token_mean", 0.0, "k3", 0.0, old_from_forward=False,
                      check_sync=False, policy_mask="none", mask_spec=PolicyMaskSpec())
    mb = b.with_targets(t)
    logp = b.logp_mu_BS.clone().requires_grad_(True)
    numerators, _ = loss({"logp_BS": logp, "entropy_BS": torch.zeros_like(logp)}, mb)
    d = policy_denominators(mb.pg_mask_BS, mb.loss_mask_BS, mb.is_weight_BS, p)
    (numerators["policy"] / d["policy"]).backward()
    assert float(d["policy"]) == 4
    k = torch.tensor([[0.0, -0.3, 0.5], [0.0, 0.0, -0.4]])
    torch.testing.assert_close(logp.grad, 2.0 * k / 4)
    # the RL loss with the advantages replaced by -c k: the same numerator
    rl = b.with_targets(targets(b, Scores(b.logp_mu_BS), params(advantage="reinforce")))
    rl.adv_BS = -2.0 * k
    same, _ = loss({"logp_BS": b.logp_mu_BS, "entropy_BS": torch.zeros_like(logp)}, rl)
    torch.testing.assert_close(same["policy"], numerators["policy"].detach())
    assert float(aggregate.loss_denominator(rl.pg_mask_BS, "token_mean")) == 4


def test_the_p95_is_torchs_quantile_and_takes_more_tokens_than_torch_does():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float(distill.quantile(x, 0.95)) == pytest.approx(float(torch.quantile(x, 0.95)), abs=1e-12)
    big = torch.arange(2**24 + 1, dtype=torch.float64)  # torch.quantile refuses more than 2^24
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(big, 0.95)
    assert float(distill.quantile(big, 0.95)) == 0.95 * 2**24
