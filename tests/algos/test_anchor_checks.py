import pytest
import torch

from moe_rl.algos.anchor import EwmaAnchor
from moe_rl.algos.checks import BatchCheckError, check_batch


def test_ewma_anchor_by_hand_and_as_a_weighted_average():
    beta = 0.5
    anchor = EwmaAnchor({"w": torch.tensor([0.0])}, beta)
    anchor.update({"w": torch.tensor([1.0])})
    assert anchor.z == 1.5 and float(anchor.params["w"]) == pytest.approx(2 / 3)
    anchor.update({"w": torch.tensor([2.0])})
    assert anchor.z == 1.75 and float(anchor.params["w"]) == pytest.approx(2.5 / 1.75)
    # normalised EMA == sum_k beta^(n-k) theta_k / sum_k beta^(n-k), including theta_0
    thetas = [0.0, 1.0, 2.0, -3.0, 0.5]
    a = EwmaAnchor({"w": torch.tensor([thetas[0]], dtype=torch.float64)}, 0.7)
    for th in thetas[1:]:
        a.update({"w": torch.tensor([th])})
    n = len(thetas) - 1
    w = [0.7 ** (n - k) for k in range(n + 1)]
    assert float(a.params["w"]) == pytest.approx(
        sum(wi * t for wi, t in zip(w, thetas, strict=True)) / sum(w), rel=1e-6)
    state = a.state_dict()
    b = EwmaAnchor({"w": torch.tensor([0.0])}, 0.7)
    b.load_state_dict(state)
    assert b.z == a.z and b.n == 4
    with pytest.raises(KeyError):
        a.update({"v": torch.tensor([1.0])})
    with pytest.raises(ValueError):
        EwmaAnchor({}, 1.0)


def _good():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0, 0, 1.0, 0], [0, 0.5, 0, 0]])
    logp = torch.full((2, 4), -1.0)
    return dict(mask_BT=mask, attention_mask_BT=att, rewards_BT=rewards,
                terminated_B=torch.tensor([True, False]), boundary_value_B=torch.tensor([float("nan"), 0.3]),
                logp_behaviour_BT=logp, logp_old_BT=logp.clone())


def test_good_batch_passes_and_counts():
    assert check_batch(**_good(), needs_boundary=True, needs_behaviour=True, synchronous=True) == {
        "empty_samples": 0, "samples": 2, "valid_tokens": 4}


@pytest.mark.parametrize("breaks, rule, sample", [
    (lambda b: b["attention_mask_BT"].__setitem__((1, 1), False), "action_mask", 1),
    (lambda b: b["rewards_BT"].__setitem__((0, 3), 1.0), "reward_placement", 0),
    # a non-finite reward is named as such, on a model token or not (NaN != 0 must not pass as placement)
    (lambda b: b["rewards_BT"].__setitem__((1, 3), float("nan")), "finite_rewards", 1),
    (lambda b: b["rewards_BT"].__setitem__((0, 2), float("-inf")), "finite_rewards", 0),
    (lambda b: (b["rewards_BT"].__setitem__((1, 1), float("inf")),
                b["rewards_BT"].__setitem__((0, 0), float("nan"))),
     "finite_rewards", 0),
    (lambda b: b["boundary_value_B"].__setitem__(1, float("inf")), "boundary", 1),
    (lambda b: b["logp_behaviour_BT"].__setitem__((1, 0), float("nan")), "policy_roles", 1),
    (lambda b: b["logp_old_BT"].__setitem__((0, 2), -3.0), "sync_roles", 0),
    (lambda b: b["mask_BT"].zero_(), "empty_batch", None),
])
def test_each_rule_names_sample_and_rule(breaks, rule, sample):
    batch = _good()
    breaks(batch)
    if rule == "empty_batch":
        batch["rewards_BT"].zero_()
    with pytest.raises(BatchCheckError) as info:
        check_batch(**batch, needs_boundary=True, needs_behaviour=True, synchronous=True)
    assert info.value.rule == rule and info.value.sample == sample
    assert rule in str(info.value)


def test_missing_roles():
    batch = _good()
    batch["logp_behaviour_BT"] = None
    with pytest.raises(BatchCheckError, match="behaviour"):
        check_batch(**batch, needs_behaviour=True)
    with pytest.raises(BatchCheckError, match="reference"):
        check_batch(**_good(), needs_reference=True)


def test_finite_rewards_message_names_the_position():
    batch = _good()
    batch["rewards_BT"][1, 2] = float("nan")
    with pytest.raises(BatchCheckError, match="sample 1: reward at position 2 is nan"):
        check_batch(**batch)


def test_sync_check_is_not_hidden_by_non_finite_padding():
    batch = _good()
    batch["logp_behaviour_BT"][1, 3] = float("-inf")  # padding: log-prob -inf in both roles
    batch["logp_old_BT"][1, 3] = float("-inf")
    check_batch(**batch, synchronous=True)  # passes: padding is never read
    batch["logp_old_BT"][1, 0] = -3.0  # a real mismatch on a model token of the same sample
    with pytest.raises(BatchCheckError) as info:
        check_batch(**batch, synchronous=True)
    assert info.value.rule == "sync_roles" and info.value.sample == 1
