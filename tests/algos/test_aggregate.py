"""Explicit global denominators: pieces of a minibatch (microbatches, data-parallel shards) each compute
their numerator and divide by the denominator of the whole minibatch; the sum of the pieces' losses and
gradients equals the loss written straight from the formula, however the batch is cut."""

import pytest
import torch

from moe_rl.algos import aggregate as agg

B, T, C = 8, 6, 6.0
MODES = [("token_mean", False), ("seq_mean", False), ("seq_sum_const", False), ("token_mean", True),
         ("seq_mean", True)]
LAYOUTS = {
    "whole": [slice(0, 8)],
    "four_uneven_microbatches": [slice(0, 3), slice(3, 4), slice(4, 7), slice(7, 8)],
    # two data-parallel ranks: rank 0 holds rows 0-4 in two microbatches, rank 1 rows 5-7
    "two_ranks": [slice(0, 2), slice(2, 5), slice(5, 8)],
}


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # sample 3 has no model tokens
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    theta = torch.randn(B, T, generator=g, dtype=torch.float64)
    weight = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return theta, mask, weight


def _loss_BT(theta):
    return (theta - 0.3).square() * torch.sin(theta)


def _formula(theta, mask, w, mode, sn):
    """The module docstring's definitions, one sample and token at a time."""
    loss = _loss_BT(theta)
    num, den, n_seq = 0.0, 0.0, 0
    for i in range(B):
        J = int(mask[i].sum())
        if J == 0:
            continue
        n_seq += 1
        row_num = sum(w[i, t] * loss[i, t] for t in range(T) if mask[i, t])
        row_w = sum(float(w[i, t]) for t in range(T) if mask[i, t])
        if mode == "seq_mean":
            num = num + row_num / J
            den += row_w / J if sn else 0.0
        else:
            num = num + row_num
            den += row_w if sn else J
    if mode == "seq_mean" and not sn:
        den = n_seq
    if mode == "seq_sum_const":
        den = n_seq * C
    return num / den


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode, sn", MODES)
def test_pieces_over_the_global_denominator_match_the_formula(mode, sn, layout):
    theta, mask, w = _batch()
    ref_theta = theta.clone().requires_grad_(True)
    ref = _formula(ref_theta, mask, w, mode, sn)
    ref.backward()
    rows_list = LAYOUTS[layout]
    theta.requires_grad_(True)
    # the global denominator: the pieces' contributions summed (an all-reduce over ranks is this sum)
    denom = sum(agg.loss_denominator(mask[r], mode, C, w[r], sn) for r in rows_list)
    total = 0.0
    for r in rows_list:
        piece = agg.loss_numerator(_loss_BT(theta[r]), mask[r], mode, w[r]) / denom
        piece.backward()  # gradients accumulate: the data-parallel reduction is a SUM
        total += float(piece.detach())
    assert total == pytest.approx(float(ref.detach()), rel=1e-12, abs=0)
    torch.testing.assert_close(theta.grad, ref_theta.grad, rtol=1e-12, atol=1e-15)
    assert (theta.grad[~mask] == 0).all()


def test_denominators_by_hand():
    _, mask, w = _batch()
    assert float(agg.loss_denominator(mask, "token_mean")) == 27.0  # 6+1+3+0+5+2+6+4
    assert float(agg.loss_denominator(mask, "seq_mean")) == 7.0  # the empty sample does not count
    assert float(agg.loss_denominator(mask, "seq_sum_const", constant=10.0)) == 70.0
    sn_tok = float((w * mask).sum())
    assert float(agg.loss_denominator(mask, "token_mean", weight_BT=w,
                                      self_normalize=True)) == pytest.approx(sn_tok, rel=1e-15)
    with pytest.raises(ValueError, match="positive constant"):
        agg.loss_denominator(mask, "seq_sum_const")
    with pytest.raises(ValueError, match="self-normalised"):
        agg.loss_denominator(mask, "seq_sum_const", constant=1.0, weight_BT=w, self_normalize=True)
    with pytest.raises(ValueError, match="self-normalised"):
        agg.loss_denominator(mask, "token_mean", self_normalize=True)
    with pytest.raises(ValueError, match="aggregation mode"):
        agg.loss_numerator(torch.ones(2, 3), torch.ones(2, 3), "mean")


def test_empty_batch_gives_a_zero_denominator():
    # callers skip the update on a zero denominator (never divide by an epsilon)
    none = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("token_mean", "seq_mean"):
        assert float(agg.loss_denominator(none, mode)) == 0.0
    assert float(agg.loss_denominator(none, "seq_sum_const", constant=4.0)) == 0.0
    # everything rejected under self-normalisation
    assert float(agg.loss_denominator(torch.ones(2, 3, dtype=torch.bool), "token_mean",
                                      weight_BT=torch.zeros(2, 3), self_normalize=True)) == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "seq_sum_const"])
def test_numerator_ignores_non_finite_values_at_mask0_positions(mode):
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    loss = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 4.0, float("-inf")]], requires_grad=True)
    w = torch.tensor([[0.5, float("nan"), 1.0], [1.0, 2.0, float("inf")]])
    num = agg.loss_numerator(loss, mask, mode, w)
    num.backward()
    # token sums: 0.5*1 + 1*2 = 2.5 and 2*4 = 8; seq_mean divides by J = 2 and 1
    assert float(num.detach()) == (1.25 + 8.0 if mode == "seq_mean" else 10.5)
    assert torch.isfinite(loss.grad).all() and (loss.grad[~mask] == 0).all()
