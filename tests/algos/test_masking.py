"""Trust masks (algos/masking.py: OPSM, M2PO) and the geometric corrections (algos/correction.py: geo_tis,
geo_mask) on examples worked by hand, the bugs peers shipped, and the masks through the loss production
runs (train.objectives.PolicyLoss): values, gradients, denominators, and the same result however the
batch is cut into microbatches."""

import math

import pytest
import torch

from moe_rl.algos import aggregate, registry
from moe_rl.algos.correction import CorrectionSpec
from moe_rl.algos.losses import PolicyLossSpec
from moe_rl.algos.masking import PolicyMaskSpec, mean_log_ratio, sequence_advantage
from moe_rl.batch import Batch
from moe_rl.train.objectives import PolicyLoss

NEG_INF = float("-inf")
# three sequences of three tokens, the last one a token shorter (padding: -inf log-probs there)
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
MU = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, NEG_INF]])
# pi_theta: sequences 0 and 1 drifted by (0.5 + 0.2 + 0.3) / 3 = 1/3 on average, sequence 2 by 0.05
THETA = torch.tensor([[-1.5, -1.2, -1.3], [-1.5, -1.2, -1.3], [-1.1, -1.0, NEG_INF]])
# sequence 0: token advantages of both signs, mean -1/6 (slime #1917's example); 1: positive; 2: negative
ADV = torch.tensor([[-0.5, 0.25, -0.25], [1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])


def opsm(logp_old=THETA, mu=MU, delta=0.1):
    fn = registry.get("policy_mask", "opsm")
    return fn(THETA, logp_old, mu, ADV, MASK, PolicyMaskSpec(opsm_delta=delta))


def test_sequence_figures_by_hand():
    assert mean_log_ratio(MU, THETA, MASK).tolist() == pytest.approx([1 / 3, 1 / 3, 0.05])
    assert sequence_advantage(ADV, MASK).tolist() == pytest.approx([-1 / 6, 1.0, -1.0])


def test_opsm_drops_whole_negative_sequences_that_drifted_from_mu():
    keep, metrics = opsm()
    # sequence 0: A_0 = -1/6 < 0 and 1/3 > delta -> every token masked, its positive-advantage token too
    # (deciding per token by each token's own sign, slime #1917 / miles #1127, would have kept token 1);
    # sequence 1 drifted as much but its advantage is positive; sequence 2's drift 0.05 is below delta
    assert keep.tolist() == [[False, False, False], [True, True, True], [True, True, False]]
    assert metrics["opsm_masked_frac"] == pytest.approx(1 / 3)
    assert metrics["opsm_masked_of_negative"] == pytest.approx(1 / 2)
    assert opsm(delta=0.04)[0][2].tolist() == [False, False, False]  # 0.05 > 0.04: sequence 2 goes too
    assert opsm(delta=0.5)[0].equal(MASK)  # nothing drifted that far


def test_opsm_measures_drift_against_mu_never_pi_old():
    # pi_old = pi_theta (the first update of a step) while the engine sampled from mu: the drift OPSM
    # exists for is the engine's (TRL #4857 measured it against pi_old, and masked nothing here)
    keep, _ = opsm(logp_old=THETA)
    assert not keep[0].any()
    keep, _ = opsm(logp_old=MU, mu=THETA)  # mu = pi_theta: no drift, whatever pi_old is
    assert keep.equal(MASK)


def m2po(logp, old, adv, mask, tau=0.04):
    return registry.get("policy_mask", "m2po")(logp, old, None, adv, mask, PolicyMaskSpec(m2po_tau=tau))


# log r = log pi_theta - log pi_old: row 0 [0.5, -0.3, 0.1] with A > 0, row 1 [-0.4, 0.2, 0.0] with A < 0
OLD2 = torch.zeros(2, 3)
LOGR = torch.tensor([[0.5, -0.3, 0.1], [-0.4, 0.2, 0.0]])
ADV2 = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
MASK2 = torch.ones(2, 3, dtype=torch.bool)


def test_m2po_masks_the_largest_active_quadrant_tokens_until_the_second_moment_fits():
    """(log r)^2 = 0.25 0.09 0.01 / 0.16 0.04 0: M2 = 0.55 / 6. tau = 0.04 needs the sum <= 0.24, so 0.31
    must go. Candidates (A > 0 with r > 1, A < 0 with r < 1): 0.25, 0.01 (row 0) and 0.16 (row 1); -0.3 in
    row 0 (A > 0, r < 1) and 0.2 in row 1 (A < 0, r > 1) are outside PPO's active quadrants. Largest
    first: 0.25 (short of 0.31), + 0.16 = 0.41: two masked, M2 after = 0.14 / 6, N still 6."""
    keep, metrics = m2po(LOGR, OLD2, ADV2, MASK2)
    assert keep.tolist() == [[False, True, True], [False, True, True]]
    assert metrics["m2po_m2_before"] == pytest.approx(0.55 / 6)
    assert metrics["m2po_m2_after"] == pytest.approx(0.14 / 6)
    assert metrics["m2po_masked_frac"] == pytest.approx(2 / 6)
    assert m2po(LOGR, OLD2, ADV2, MASK2, tau=0.1)[0].equal(MASK2)  # 0.55 / 6 <= 0.1 already
    # tau = 0: every candidate goes, and that is all the mask may take
    keep, metrics = m2po(LOGR, OLD2, ADV2, MASK2, tau=0.0)
    assert keep.tolist() == [[False, True, False], [False, True, True]]
    assert metrics["m2po_m2_after"] == pytest.approx(0.13 / 6)


def test_m2po_is_one_selection_over_the_batch_independent_of_row_order_and_ties_go_together():
    perm = torch.tensor([1, 0])
    keep, _ = m2po(LOGR, OLD2, ADV2, MASK2)
    assert m2po(LOGR[perm], OLD2, ADV2[perm], MASK2)[0].equal(keep[perm])
    # row 0's mass is outside the active quadrants (A > 0, r < 1: 0.36), row 1 holds one candidate (0.09):
    # alone, row 1's M2 is 0.03 <= tau; in the batch, M2 = 0.45 / 6 and only that candidate can go
    logr = torch.tensor([[-0.6, 0.0, 0.0], [-0.3, 0.0, 0.0]])
    batch = m2po(logr, OLD2, ADV2, MASK2)[0]
    alone = torch.cat([m2po(logr[i:i + 1], OLD2[:1], ADV2[i:i + 1], MASK2[:1])[0] for i in range(2)])
    assert batch.tolist() == [[True] * 3, [False, True, True]] and alone.equal(MASK2)
    tied = torch.tensor([[0.4, 0.4, 0.0], [-0.4, 0.0, 0.0]])  # three candidates of (log r)^2 = 0.16
    keep, _ = m2po(tied, OLD2, ADV2, MASK2, tau=0.05)  # 0.48 - 0.3 = 0.18 must go: one suffices,
    assert keep.tolist() == [[False, False, True], [False, True, True]]  # all three tie and go


def test_geometric_corrections_by_hand():
    """pi_old / mu per token: sequence 0: 1, 4, 1/2 -> geometric mean 2^(1/3) = 1.26; sequence 1: 1, 1/3,
    3, 1 -> 1 (tis_seq's product would be 2 and 1)."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old = torch.log(torch.tensor([[0.5, 0.4, 0.2, 0.1], [0.3, 0.3, 0.6, 0.2]]))
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.1], [0.3, 0.9, 0.2, 0.2]]))
    geo = 2 ** (1 / 3)
    c = registry.get("correction", "geo_tis")(old, mu, mask, CorrectionSpec(geo_max=1.2))
    assert c.weight_BT[0, :3].tolist() == pytest.approx([1.2] * 3) and c.weight_BT[0, 3] == 0
    assert c.weight_BT[1].tolist() == pytest.approx([1.0] * 4)
    assert c.metrics["geo_truncated_frac"] == pytest.approx(0.5)
    c = registry.get("correction", "geo_tis")(old, mu, mask, CorrectionSpec(geo_max=2.0))
    assert c.weight_BT[0, :3].tolist() == pytest.approx([geo] * 3)
    c = registry.get("correction", "geo_mask")(old, mu, mask, CorrectionSpec(geo_min=0.9, geo_max=1.2))
    assert c.keep_BT.tolist() == [[False] * 4, [True] * 4] and c.metrics["geo_rejected_frac"] == 0.5
    c = registry.get("correction", "geo_mask")(old, mu, mask, CorrectionSpec(geo_min=1.1, geo_max=1.3))
    assert c.keep_BT.tolist() == [[True] * 3 + [False], [False] * 4]
    # length-invariant: the same token ratios repeated twice as long give the same weights
    twice = registry.get("correction", "geo_tis")(old[:1, :3].repeat(1, 2), mu[:1, :3].repeat(1, 2),
                                                  torch.ones(1, 6, dtype=torch.bool),
                                                  CorrectionSpec(geo_max=2.0))
    assert twice.weight_BT[0].tolist() == pytest.approx([geo] * 6)
    assert math.isclose(math.exp(float(mean_log_ratio(old, mu, mask)[0])), geo, rel_tol=1e-6)


def _loss(mask_name: str, **kw) -> PolicyLoss:
    return PolicyLoss("ppo", PolicyLossSpec(0.2, 0.2), kw.pop("aggregation", "token_mean"), 0.0, "k3", 0.0,
                      old_from_forward=False, check_sync=False, policy_mask=mask_name,
                      mask_spec=PolicyMaskSpec(), **kw)


def _mb(logp_old, adv, mask, mu, keep=None) -> Batch:
    B, S = mask.shape
    return Batch(torch.zeros(B, S, dtype=torch.long), mask.sum(1), mask_BS=mask, loss_mask_BS=mask,
                 logp_mu_BS=mu, adv_BS=adv, logp_old_BS=logp_old, is_weight_BS=mask.float(), pg_mask_BS=mask,
                 policy_keep_BS=keep)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_opsm_through_the_policy_loss_zeroes_the_masked_sequence_and_keeps_the_denominator(aggregation):
    """PPO at r = 1 (pi_theta = pi_old): l_t = -A_t, d l_t / d log pi_theta(a_t) = -A_t. OPSM masks sequence
    0: its tokens have no loss and no gradient; the others' are unchanged, and the numerator is divided by
    the denominator of all the loss tokens (8 tokens, or 3 sequences), as without the mask."""
    logp = THETA.clone().requires_grad_(True)
    loss = _loss("opsm", aggregation=aggregation)
    assert "logp_mu_BS" in loss.fields
    numerators, metrics = loss({"logp_BS": logp, "entropy_BS": torch.zeros(3, 3)}, _mb(THETA, ADV, MASK, MU))
    numerators["policy"].backward()
    J = torch.tensor([3.0, 3.0, 2.0]).unsqueeze(1) if aggregation == "seq_mean" else torch.ones(3, 1)
    expected = torch.where(MASK, -ADV / J, 0.0)
    expected[0] = 0.0
    torch.testing.assert_close(logp.grad, expected)
    assert float(numerators["policy"].detach()) == pytest.approx(float(expected.sum()))
    assert metrics["opsm_masked_frac"] == pytest.approx(1 / 3)
    # the same loss tokens, the same global denominator as an unmasked loss
    assert float(aggregate.loss_denominator(MASK, aggregation)) == (8 if aggregation == "token_mean" else 3)


def test_a_batch_mask_arrives_with_the_minibatch_and_any_microbatch_cut_sums_to_the_whole():
    """M2PO's mask is decided over the whole minibatch (the driver) and travels as policy_keep_BS; the loss
    zeroes those tokens. Numerators and gradients of microbatches of one row each sum to the whole's."""
    keep, _ = m2po(LOGR, OLD2, ADV2, MASK2)
    loss = _loss("m2po")
    assert "policy_keep_BS" in loss.fields and "logp_mu_BS" not in loss.fields
    logp = LOGR.clone().requires_grad_(True)
    whole, _ = loss({"logp_BS": logp, "entropy_BS": torch.zeros(2, 3)}, _mb(OLD2, ADV2, MASK2, OLD2, keep))
    whole["policy"].backward()
    grad_whole = logp.grad.clone()
    # by hand: PPO at pi_old = 1 (log r = LOGR), d l / d log pi = -A r on the kept tokens inside the clip
    # range or on its active side (row 0: r = e^-0.3 < 0.8 with A > 0 stays unclipped, r = e^0.1; row 1,
    # A < 0: r = e^0.2 > 1.2 and r = 1); the masked ones (log r 0.5 and -0.4) get nothing
    e = math.exp
    torch.testing.assert_close(grad_whole, torch.tensor([[0.0, -e(-0.3), -e(0.1)], [0.0, e(0.2), 1.0]]))
    parts, grads = 0.0, []
    for i in range(2):
        part = LOGR[i:i + 1].clone().requires_grad_(True)
        n, _ = loss({"logp_BS": part, "entropy_BS": torch.zeros(1, 3)},
                    _mb(OLD2[:1], ADV2[i:i + 1], MASK2[:1], OLD2[:1], keep[i:i + 1]))
        n["policy"].backward()
        parts, grads = parts + float(n["policy"].detach()), grads + [part.grad]
    assert parts == pytest.approx(float(whole["policy"].detach()))
    torch.testing.assert_close(torch.cat(grads), grad_whole)


def test_opsm_gives_the_same_loss_however_the_rows_are_cut():
    loss = _loss("opsm")
    whole, _ = loss({"logp_BS": THETA, "entropy_BS": torch.zeros(3, 3)}, _mb(THETA, ADV, MASK, MU))
    parts = sum(float(loss({"logp_BS": THETA[i:i + 1], "entropy_BS": torch.zeros(1, 3)},
                           _mb(THETA[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], MU[i:i + 1]))[0]["policy"])
                for i in range(3))
    assert parts == pytest.approx(float(whole["policy"]))
