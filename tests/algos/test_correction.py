import math

import pytest
import torch

from moe_rl.algos import registry
from moe_rl.algos.correction import CorrectionParams, ess, ess_from_log_weights, staleness


def corr(name, old, mu, mask, **kw):
    return registry.get("correction", name)(old, mu, mask, CorrectionParams(**kw))


def test_token_tis_truncates_and_detaches():
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.4]]))
    old = torch.log(torch.tensor([[0.5, 0.4, 0.2]])).requires_grad_(True)
    c = corr("tis_token", old, mu, torch.tensor([[1, 1, 0]], dtype=torch.bool), is_cap=2.0)
    torch.testing.assert_close(c.weight_BT, torch.tensor([[1.0, 2.0, 0.0]]))  # ratio 4 truncated to 2
    assert not c.weight_BT.requires_grad
    assert float(c.metrics["tis_truncated_frac"]) == 0.5
    # raw token ESS over the two valid tokens: (1+4)^2 / (1+16)
    torch.testing.assert_close(c.metrics["ess_token_raw"], torch.tensor(25 / 17, dtype=torch.float64))
    torch.testing.assert_close(c.metrics["ess_token_truncated"], torch.tensor(9 / 5, dtype=torch.float64))


def test_sequence_is_in_log_space_neither_underflows_nor_overflows():
    T = 4000
    mask = torch.ones(3, T, dtype=torch.bool)
    mu = torch.full((3, T), -1.0)
    old = mu.clone()
    # sample 0: 2000 ratios e^-0.5 then 2000 ratios e^+0.5. A running product of ratios underflows to 0
    # after ~175 tokens in float32 (and overflows on the way back), the log-space sum is exactly 0: w = 1.
    old[0, : T // 2] -= 0.5
    old[0, T // 2:] += 0.5
    old[1] += 0.01  # log w = 40 (e^40 ~ 2.4e17): truncated to the cap
    old[2, 1:] = float("-inf")  # pi_old = 0 on a token: log w = -inf, w = 0, no NaN
    c = corr("tis_seq", old, mu, mask, seq_is_cap=10.0)
    assert float(c.weight_BT[0, 0]) == 1.0
    assert float(c.weight_BT[1, 0]) == pytest.approx(10.0, rel=1e-6, abs=0)
    assert float(c.weight_BT[2, 0]) == 0.0
    assert (c.weight_BT == c.weight_BT[:, :1]).all()  # every token of a sample carries w_i
    assert float(c.metrics["seq_is_truncated_frac"]) == pytest.approx(1 / 3, rel=1e-6, abs=0)


def test_sequence_is_weight_below_float32_range_in_float64():
    # in float64 the weight exp(-200) is representable and must come out (not 0, not 1e-12-ish)
    T = 4000
    mask = torch.ones(1, T, dtype=torch.bool)
    mu = torch.full((1, T), -1.0, dtype=torch.float64)
    c = corr("tis_seq", mu - 0.05, mu, mask, seq_is_cap=10.0)
    assert c.weight_BT.dtype == torch.float64
    assert float(c.weight_BT[0, 0]) == pytest.approx(math.exp(-200), rel=1e-9, abs=0)


def test_sequence_is_raw_ess_in_log_space():
    # log w = 4 * 50 = 200 for samples 0 and 1 (e^200 overflows float32 and squares to 1e173 in float64)
    mu = torch.full((4, 4), -60.0)
    old = torch.full((4, 4), -10.0)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[3] = False  # no model token: not in the sequence index set
    old[2] = mu[2]  # log w = 0: next to two weights e^200, ESS stays 2 (to float64 precision)
    c = corr("tis_seq", old, mu, mask, seq_is_cap=10.0)
    # ESS = (sum w)^2 / sum w^2 = (2 e^200 + 1)^2 / (2 e^400 + 1) = 2 + O(e^-200)
    assert float(c.metrics["ess_seq_raw"]) == pytest.approx(2.0, rel=1e-12, abs=0)
    assert float(c.metrics["ess_frac_seq_raw"]) == pytest.approx(2 / 3, rel=1e-12, abs=0)
    # truncated: (10 + 10 + 1)^2 / (100 + 100 + 1) = 441 / 201
    assert float(c.metrics["ess_seq_truncated"]) == pytest.approx(441 / 201, rel=1e-6, abs=0)
    # one huge and one tiny weight: ESS = (e^200 + e^-200)^2 / (e^400 + e^-400) = 1 + O(e^-400)
    old2 = torch.tensor([[-10.0] * 4, [-110.0] * 4])
    c = corr("tis_seq", old2, torch.full((2, 4), -60.0), torch.ones(2, 4, dtype=torch.bool))
    assert float(c.metrics["ess_seq_raw"]) == pytest.approx(1.0, rel=1e-12, abs=0)
    # no valid entries: ESS 0
    c = corr("tis_seq", old, mu, torch.zeros(4, 4, dtype=torch.bool))
    assert float(c.metrics["ess_seq_raw"]) == 0.0 and float(c.metrics["ess_frac_seq_raw"]) == 0.0


def test_ess_from_log_weights_by_hand():
    valid = torch.tensor([True, True, True, False])
    # w = (1, 1, 2) (and a padded entry): (1 + 1 + 2)^2 / (1 + 1 + 4) = 16 / 6
    e, f = ess_from_log_weights(torch.log(torch.tensor([1.0, 1.0, 2.0, 1e30])), valid)
    assert float(e) == pytest.approx(8 / 3, rel=1e-6, abs=0) and float(f) == pytest.approx(8 / 9, rel=1e-6, abs=0)
    # the same weights scaled by e^500: unchanged
    e, _ = ess_from_log_weights(torch.log(torch.tensor([1.0, 1.0, 2.0, 1.0], dtype=torch.float64)) + 500, valid)
    assert float(e) == pytest.approx(8 / 3, rel=1e-12, abs=0)
    # every weight 0 (log w = -inf), or nothing valid: 0
    e, f = ess_from_log_weights(torch.full((3,), float("-inf")), torch.ones(3, dtype=torch.bool))
    assert float(e) == 0.0 and float(f) == 0.0
    e, f = ess_from_log_weights(torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    assert float(e) == 0.0 and float(f) == 0.0


@pytest.mark.parametrize("name", ["none", "bypass", "tis_token", "tis_seq", "icepop"])
def test_corrections_compute_half_precision_inputs_in_float32(name):
    assert name in registry.names("correction")
    g = torch.Generator().manual_seed(3)
    mu = -torch.rand(3, 7, generator=g) * 2
    old = mu + 0.7 * torch.randn(3, 7, generator=g)
    mask = torch.rand(3, 7, generator=g) < 0.7
    kw = dict(is_cap=1.5, seq_is_cap=2.0, icepop_min=0.6, icepop_max=1.6)
    for dtype in (torch.bfloat16, torch.float16):
        lo = corr(name, old.to(dtype), mu.to(dtype), mask, **kw)
        hi = corr(name, old.to(dtype).float(), mu.to(dtype).float(), mask, **kw)
        assert lo.weight_BT.dtype == torch.float32
        torch.testing.assert_close(lo.weight_BT, hi.weight_BT, rtol=0, atol=0)
        assert torch.equal(lo.keep_BT, hi.keep_BT)
        for k in hi.metrics:
            torch.testing.assert_close(lo.metrics[k], hi.metrics[k], rtol=0, atol=0)
    assert corr(name, old.double(), mu.double(), mask, **kw).weight_BT.dtype == torch.float64


def test_corrections_ignore_non_finite_logprobs_at_mask0_positions():
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    mu = torch.tensor([[-1.0, float("-inf"), -2.0]])
    old = torch.tensor([[-0.5, float("nan"), -2.5]])
    for name in registry.names("correction"):
        c = corr(name, old, mu, mask)
        assert torch.isfinite(c.weight_BT).all(), name
        assert all(torch.isfinite(v).all() for v in c.metrics.values()), name


def test_icepop_band():
    mu = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[0.4, 0.5, 2.0, 2.5]]))
    c = corr("icepop", old, mu, torch.ones(1, 4, dtype=torch.bool), icepop_min=0.5, icepop_max=2.0)
    assert c.keep_BT.tolist() == [[False, True, True, False]]
    assert float(c.metrics["rejection_rate"]) == 0.5
    torch.testing.assert_close(c.metrics["ess_frac_token_post_rejection"], torch.tensor(0.5, dtype=torch.float64))


def test_bypass_and_none_need_no_weights():
    m = torch.ones(1, 2, dtype=torch.bool)
    for name, needs in (("none", False), ("bypass", True)):
        c = corr(name, torch.tensor([[-0.5, -2.0]]), torch.tensor([[-1.0, -1.0]]), m)  # ratios e^0.5, e^-1
        assert (c.weight_BT == 1).all() and c.keep_BT.all() and registry.meta("correction", name).reads_behaviour == needs


def test_ess_by_hand():
    valid = torch.ones(4, dtype=torch.bool)
    e, f = ess(torch.tensor([1.0, 1.0, 0.0, 0.0]), valid)
    assert float(e) == 2.0 and float(f) == 0.5
    e, f = ess(torch.zeros(4), valid)
    assert float(e) == 0.0 and float(f) == 0.0
    e, f = ess(torch.tensor([3.0, 3.0, 3.0, 99.0]), torch.tensor([1, 1, 1, 0], dtype=torch.bool))
    assert float(e) == 3.0 and float(f) == 1.0


def test_staleness():
    keep, m = staleness(torch.tensor([5, 3, 4]), train_version=5, max_staleness=1)
    assert keep.tolist() == [True, False, True]
    assert int(m["staleness_max"]) == 2 and int(m["stale_dropped"]) == 1
    with pytest.raises(ValueError, match="sample 0 .* newer"):
        staleness(torch.tensor([6]), train_version=5, max_staleness=1)


def test_ess_from_log_weights_does_not_hide_nan():
    e, _ = ess_from_log_weights(torch.tensor([0.0, float("nan")]), torch.ones(2, dtype=torch.bool))
    assert math.isnan(float(e))
