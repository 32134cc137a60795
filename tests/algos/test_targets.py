"""algos.targets: which pi_old a step uses, that the checklist runs before any target, and the
minibatch denominators, on batches small enough to work by hand."""

import pytest
import torch
from test_batch import traj

from moe_rl.algos.checks import BatchCheckError
from moe_rl.algos.targets import Scores, correct, policy_denominators, targets
from moe_rl.batch import build_batch
from moe_rl.config import AlgorithmSection, RolloutSection, RunConfig
from moe_rl.driver import specs


def params(**alg):
    return specs.target_spec(RunConfig(algorithm=AlgorithmSection(whiten_advantages=False, **alg)))


def two_samples():
    """One group, two samples of 2 model tokens after 1 prompt token; rewards 1 and 0; mu = -0.5."""
    return build_batch([traj(1, [(2, 0.0)], 1.0), traj(1, [(2, 0.0)], 0.0)], None)


def test_pi_old_is_the_scored_policy_mu_or_left_to_each_minibatch():
    b = two_samples()
    policy = torch.where(b.mask_BS, -0.5 + 1e-4, 0.0)  # within the synchronous tolerance of mu
    t = targets(b, Scores(policy), params(advantage="rloo"))
    assert t.logp_old_BS is policy and t.is_weight_BS.eq(1).all() \
        and t.pg_mask_BS.equal(b.loss_mask_BS & b.mask_BS)
    assert t.logp_policy_BS is policy
    # rloo by hand: A_0 = R_0 - R_1 = 1, A_1 = -1 on model tokens, 0 elsewhere
    assert t.adv_BS.tolist() == [[0, 1, 1], [0, -1, -1]]
    t = targets(b, Scores(policy), params(advantage="rloo", correction="bypass"))
    assert t.logp_old_BS is b.logp_mu_BS  # bypass: pi_old := mu
    t = targets(b, Scores(policy), params(advantage="rloo", correction="tis_token", anchor="ewma"))
    assert t.logp_old_BS is None and t.is_weight_BS is None and t.pg_mask_BS is None  # scored per minibatch
    full = b.with_targets(t)
    assert full.pg_mask_BS is None and full.adv_BS is t.adv_BS


def test_checklist_runs_before_the_targets():
    b = two_samples()
    b.rewards_BS[0, 0] = float("nan")  # a prompt position: the advantage would never read it
    with pytest.raises(BatchCheckError, match="finite_rewards"):
        targets(b, Scores(b.logp_mu_BS), params(advantage="grpo"))
    b = two_samples()
    drifted = torch.where(b.mask_BS, -0.6, 0.0)  # pi_old 0.1 from mu
    with pytest.raises(BatchCheckError, match="sync_roles"):  # no correction assumes mu = pi_old
        targets(b, Scores(drifted), params(advantage="grpo"))
    t = targets(b, Scores(drifted), params(advantage="grpo", correction="tis_token"))  # corrected: allowed
    # w = pi_old / mu = exp(-0.1) on model tokens
    assert t.is_weight_BS[b.mask_BS].tolist() == pytest.approx([torch.exp(torch.tensor(-0.1)).item()] * 4,
                                                               rel=1e-6)
    cfg = RunConfig(algorithm=AlgorithmSection(advantage="grpo"), rollout=RolloutSection(async_mode=True))
    targets(b, Scores(drifted), specs.target_spec(cfg))  # asynchronous: mu = pi_old is not assumed


def test_policy_denominators_weighted_and_plain():
    """token_mean: D_pg = kept tokens (self-normalised: the kept weights' sum), D = every loss token."""
    b = two_samples()
    p = params(advantage="grpo", correction="tis_token")
    c = correct(torch.where(b.mask_BS, -0.3, 0.0), b.logp_mu_BS, b.mask_BS, p)  # w = exp(0.2), capped at 2
    keep = b.loss_mask_BS & c.keep_BT
    d = policy_denominators(keep, b.loss_mask_BS, c.weight_BT, p)
    assert float(d["policy"]) == 4 and float(d["regularizer"]) == 4
    sn = params(advantage="grpo", correction="tis_token", self_normalize=True)
    d = policy_denominators(keep, b.loss_mask_BS, c.weight_BT, sn)
    assert float(d["policy"]) == pytest.approx(4 * torch.exp(torch.tensor(0.2)).item(), rel=1e-6)
    assert float(d["regularizer"]) == 4


def test_group_normalised_advantages_are_not_whitened_again_by_default():
    """GRPO's and Dr.GRPO's group-normalised advantages are the estimate: a second whitening over the
    batch's tokens subtracts a token-weighted mean that is not 0 where length correlates with reward, so a
    group whose rewards are all equal would move off 0. Four wrong answers of 11 tokens in one group; one
    right answer of 7 and three wrong of 15 in another."""
    same = [traj(1, [(11, 0.0)], 0.0, group=0) for _ in range(4)]
    mixed = [traj(1, [(7, 0.0)], 1.0, group=1)] + [traj(1, [(15, 0.0)], 0.0, group=1) for _ in range(3)]
    b = build_batch(same + mixed, None)

    def adv(**alg):
        cfg = RunConfig(algorithm=AlgorithmSection(**alg), rollout=RolloutSection(samples_per_prompt=4))
        return targets(b, Scores(b.logp_mu_BS), specs.target_spec(cfg)).adv_BS

    for advantage in ("grpo", "drgrpo", "rloo"):
        a = adv(advantage=advantage)
        assert a[:4].eq(0).all(), advantage  # the all-wrong group: exactly 0
        right, wrong = (1.5, -0.5) if advantage == "grpo" else (0.75, -0.25) if advantage == "drgrpo" \
            else (1.0, -1 / 3)  # grpo: (1 - 1/4) / std_unbiased(1, 0, 0, 0) = 0.75 / 0.5
        assert a[4][b.mask_BS[4]].tolist() == pytest.approx([right] * 7, rel=1e-5)  # eps 1e-6
        assert a[5][b.mask_BS[5]].tolist() == pytest.approx([wrong] * 15, rel=1e-5)
    # whitened on request (algorithm.whiten_advantages=true): the token-weighted mean of GRPO's advantages,
    # (7 * 1.5 - 45 * 0.5) / 96 = -0.125, with variance (7 * 2.25 + 45 * 0.25) / 96 - 0.125^2 = 0.265625,
    # moves the all-wrong group to 0.125 / 0.265625^0.5 = +0.2425
    whitened = adv(advantage="grpo", whiten_advantages=True)
    assert whitened[0][b.mask_BS[0]].tolist() == pytest.approx([0.125 / 0.265625**0.5] * 11, rel=1e-4)
    # a batch baseline's estimators keep the whitening (REINFORCE++-baseline is defined with it)
    assert AlgorithmSection(advantage="reinforce_pp_baseline").whitens and AlgorithmSection().whitens
    assert not AlgorithmSection(advantage="grpo").whitens and AlgorithmSection(advantage="grpo",
                                                                              whiten_advantages=True).whitens
