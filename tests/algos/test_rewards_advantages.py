import torch

from moe_rl.algos import registry, rewards
from moe_rl.algos.advantages import AdvantageInputs, AdvantageSpec, group_stats, whiten


def test_terminal_reward_goes_on_last_valid_model_token_not_tensor_end():
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    r = rewards.place_terminal_reward(torch.tensor([1.0, 2.0, 3.0]), mask)
    expected = torch.zeros(3, 5)
    expected[0, 2] = 1.0
    expected[1, 3] = 2.0  # sample 2 has no model token: no reward anywhere
    torch.testing.assert_close(r, expected)
    assert rewards.last_action_index(mask).tolist() == [2, 3, -1]


def test_kl_estimators_by_hand():
    lp, lr = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert torch.allclose(rewards.kl_k1(lp, lr), torch.tensor([0.5]))
    assert torch.allclose(rewards.kl_k2(lp, lr), torch.tensor([0.125]))
    # d = log pi_ref - log pi = -0.5: e^-0.5 + 0.5 - 1 = 0.10653065971263342
    torch.testing.assert_close(rewards.kl_k3(lp, lr), torch.tensor([0.10653065971263342]))
    shaped, k = rewards.kl_shaped_rewards(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[-1.0, -1.0, -9.0]]),
                                          torch.tensor([[-1.5, -0.5, -1.0]]),
                                          torch.tensor([[1, 1, 0]], dtype=torch.bool), 0.1)
    torch.testing.assert_close(k, torch.tensor([[0.5, -0.5, 0.0]]))
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, 1.05, 0.0]]))


def test_k1_and_k3_are_unbiased_for_kl():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    kl = (p * (p / q).log()).sum()
    lp, lq = p.log(), q.log()
    for est in (rewards.kl_k1, rewards.kl_k3):
        torch.testing.assert_close((p * est(lp, lq)).sum(), kl)


def test_dapo_overlong_penalty():
    out = rewards.overlong_penalty(torch.tensor([10, 12, 14, 16, 17]), max_length=16, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def _inp(scores, groups, mask=None):
    mask = torch.ones(len(scores), 3, dtype=torch.bool) if mask is None else mask
    return AdvantageInputs(torch.zeros(mask.shape), mask, torch.tensor(scores), torch.tensor(groups))


def test_outcome_estimators_by_hand():
    scores, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [0, 0, 0, 0, 7, 7]
    hp = AdvantageSpec(eps=0.0)
    get = lambda name: registry.get("advantage", name)(_inp(scores, groups), hp)[0][:, 0]  # noqa: E731
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 7: all equal
    std = (1 / 3) ** 0.5
    torch.testing.assert_close(get("drgrpo"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    grpo_hp = AdvantageSpec(eps=1e-6)
    grpo = registry.get("advantage", "grpo")(_inp(scores, groups), grpo_hp)[0][:, 0]
    torch.testing.assert_close(grpo, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]) / (std + 1e-6))
    # RLOO: R_i - mean of the others; sample 0: 1 - (0+0+1)/3
    torch.testing.assert_close(get("rloo"), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0]))
    torch.testing.assert_close(get("reinforce"), torch.tensor(scores) - 4 / 6)
    mean, std_, n = group_stats(torch.tensor(scores), torch.tensor(groups))
    assert n.tolist() == [4, 4, 4, 4, 2, 2]
    assert mean.tolist() == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    torch.testing.assert_close(std_, torch.tensor([std] * 4 + [0.0] * 2, dtype=torch.float64), rtol=1e-15,
                               atol=0)


def test_reinforce_pp_baseline_is_the_group_centred_score():
    # groups {0: (3, 1)}, {5: (2, 5, 8)}: means 2 and 5 -> (1, -1, -3, 0, 3); no std division (the loop
    # whitens)
    inp = _inp([3.0, 1.0, 2.0, 5.0, 8.0], [0, 0, 5, 5, 5])
    adv, ret = registry.get("advantage", "reinforce_pp_baseline")(inp, AdvantageSpec(eps=0.0))
    assert ret is None
    torch.testing.assert_close(adv, torch.tensor([[1.0] * 3, [-1.0] * 3, [-3.0] * 3, [0.0] * 3, [3.0] * 3]))


def test_outcome_advantages_only_on_model_tokens():
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    adv, ret = registry.get("advantage", "grpo")(_inp([1.0, 0.0], [0, 0], mask), AdvantageSpec())
    assert ret is None
    # mean 0.5, unbiased std sqrt(0.5): A = +-0.5 / (sqrt(0.5) + 1e-6)
    a = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a, 0.0, a], [0.0, -a, 0.0]]))


def test_reward_to_go():
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    r = torch.tensor([[1.0, 0.0, 2.0, 3.0]])
    inp = AdvantageInputs(r, mask, torch.zeros(1), torch.zeros(1, dtype=torch.long))
    adv, _ = registry.get("advantage", "reward_to_go")(inp, AdvantageSpec(gamma=0.5))
    torch.testing.assert_close(adv, torch.tensor([[1 + 0.5 * 2 + 0.25 * 3, 0.0, 2 + 0.5 * 3, 3.0]]))


def test_whitening_over_valid_tokens_only():
    adv = torch.tensor([[1.0, 100.0, 3.0], [5.0, -7.0, -100.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    returns = adv.clone()
    w = whiten(adv, mask, eps=0.0)
    valid = w[mask]
    torch.testing.assert_close(valid.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(valid.var(unbiased=False), torch.tensor(1.0))
    assert (w[~mask] == 0).all()
    # by hand: valid (1, 3, 5, -7), mean 0.5, var (0.25 + 6.25 + 20.25 + 56.25) / 4 = 20.75
    sd = 20.75**0.5
    torch.testing.assert_close(w, torch.tensor([[0.5 / sd, 0.0, 2.5 / sd], [4.5 / sd, -7.5 / sd, 0.0]]))
    # shift_mean=False scales without centring
    torch.testing.assert_close(whiten(adv, mask, eps=0.0, shift_mean=False),
                               torch.tensor([[1 / sd, 0.0, 3 / sd], [5 / sd, -7 / sd, 0.0]]))
    torch.testing.assert_close(returns, adv)  # inputs (and so the critic target) untouched


def test_whitening_ignores_non_finite_mask0_values():
    adv = torch.tensor([[1.0, float("nan"), 3.0], [5.0, -7.0, float("inf")]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    w = whiten(adv, mask, eps=0.0)
    sd = 20.75**0.5  # as in test_whitening_over_valid_tokens_only
    torch.testing.assert_close(w, torch.tensor([[0.5 / sd, 0.0, 2.5 / sd], [4.5 / sd, -7.5 / sd, 0.0]]))


def test_kl_shaping_ignores_non_finite_logprobs_at_mask0_positions():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    shaped, k = rewards.kl_shaped_rewards(torch.tensor([[0.0, 1.0, 0.0]]),
                                          torch.tensor([[-1.0, -1.0, float("-inf")]]),
                                          torch.tensor([[-1.5, -0.5, float("-inf")]]), mask, 0.1)
    torch.testing.assert_close(k, torch.tensor([[0.5, -0.5, 0.0]]))
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, 1.05, 0.0]]))


def test_rloo_group_of_one_gets_no_advantage():
    """Scores (1, 0 | 5): group 0 by hand 2/1 * (1 - 0.5) = 1 and -1; group 1 lost its siblings: 0."""
    mask = torch.ones(3, 2, dtype=torch.bool)
    inp = AdvantageInputs(rewards_BT=torch.zeros(3, 2), mask_BT=mask, score_B=torch.tensor([1.0, 0.0, 5.0]),
                          group_B=torch.tensor([0, 0, 1]))
    adv, _ = registry.get("advantage", "rloo")(inp, AdvantageSpec())
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0]
