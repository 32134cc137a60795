import math

import pytest
import torch

from moe_rl.algos import registry
from moe_rl.algos.correction import CorrectionSpec, ess, ess_from_log_weights, staleness


def corr(name, old, mu, mask, **kw):
    return registry.get("correction", name)(old, mu, mask, CorrectionSpec(**kw))


def _ess(ws: list[float]) -> float:
    """(sum w)^2 / sum w^2, 0 when every weight is 0; in Python floats."""
    s2 = sum(w * w for w in ws)
    return sum(ws) ** 2 / s2 if s2 > 0 else 0.0


def _ess_of_logs(log_ws: list[float]) -> float:
    """_ess of exp(log w), shifted by the largest log w so that nothing overflows."""
    top = max(log_ws, default=-math.inf)
    return 0.0 if top == -math.inf else _ess([math.exp(x - top) for x in log_ws])


def slow_correction(name, old, mu, mask, hp: CorrectionSpec):
    """The slow reference: each correction's docstring equation, a Python loop in float64 over the valid
    (mask-1) tokens. Returns ({(b, t): weight}, {(b, t): keep}, metrics) for the valid tokens."""
    B, T = mask.shape
    valid = [(b, t) for b in range(B) for t in range(T) if bool(mask[b, t])]
    log_r = {bt: float(old[bt]) - float(mu[bt]) for bt in valid}  # log pi_old - log mu
    n = len(valid)
    frac = (lambda x: x / n) if n else (lambda x: 0.0)
    metrics: dict[str, float] = {}
    keep = dict.fromkeys(valid, True)
    if name in ("none", "bypass"):  # w = 1
        weight = dict.fromkeys(valid, 1.0)
    elif name == "tis_token":  # w_t = min(pi_old / mu, c_IS)
        weight = {bt: min(math.exp(log_r[bt]), hp.is_cap) for bt in valid}
        metrics["tis_truncated_frac"] = frac(sum(math.exp(log_r[bt]) > hp.is_cap for bt in valid))
        metrics["ess_token_raw"] = _ess_of_logs(list(log_r.values()))
        metrics["ess_frac_token_raw"] = frac(metrics["ess_token_raw"])
        metrics["ess_token_truncated"] = _ess(list(weight.values()))
        metrics["ess_frac_token_truncated"] = frac(metrics["ess_token_truncated"])
    elif name == "tis_seq":  # log w_i = sum_t m_t log r_t; w_i = exp(min(log w_i, log c_seq)) on each token
        rows = sorted({b for b, _ in valid})
        log_w = {b: sum(log_r[bt] for bt in valid if bt[0] == b) for b in rows}
        w_i = {b: math.exp(min(log_w[b], math.log(hp.seq_is_cap))) for b in rows}
        weight = {bt: w_i[bt[0]] for bt in valid}
        per_row = (lambda x: x / len(rows)) if rows else (lambda x: 0.0)
        metrics["seq_is_truncated_frac"] = per_row(sum(log_w[b] > math.log(hp.seq_is_cap) for b in rows))
        metrics["ess_seq_raw"] = _ess_of_logs(list(log_w.values()))
        metrics["ess_frac_seq_raw"] = per_row(metrics["ess_seq_raw"])
        metrics["ess_seq_truncated"] = _ess(list(w_i.values()))
        metrics["ess_frac_seq_truncated"] = per_row(metrics["ess_seq_truncated"])
    elif name == "icepop":  # keep t iff c_min <= pi_old / mu <= c_max, weight 1
        keep = {bt: hp.icepop_min <= math.exp(log_r[bt]) <= hp.icepop_max for bt in valid}
        weight = {bt: float(keep[bt]) for bt in valid}
        metrics["rejection_rate"] = frac(sum(not k for k in keep.values()))
        metrics["ess_token_raw"] = _ess_of_logs(list(log_r.values()))
        metrics["ess_frac_token_raw"] = frac(metrics["ess_token_raw"])
        metrics["ess_token_post_rejection"] = _ess(list(weight.values()))
        metrics["ess_frac_token_post_rejection"] = frac(metrics["ess_token_post_rejection"])
    elif name in ("geo_tis", "geo_mask"):  # g_i = (1/J_i) sum_t m_t log r_t, on each token of sample i
        rows = sorted({b for b, _ in valid})
        g = {b: sum(log_r[bt] for bt in valid if bt[0] == b) / sum(bt[0] == b for bt in valid) for b in rows}
        per_row = (lambda x: x / len(rows)) if rows else (lambda x: 0.0)
        if name == "geo_tis":  # w_i = min(exp(g_i), c_geo)
            w_i = {b: min(math.exp(g[b]), hp.geo_max) for b in rows}
            metrics["geo_truncated_frac"] = per_row(sum(math.exp(g[b]) > hp.geo_max for b in rows))
            metrics["ess_seq_truncated"] = _ess(list(w_i.values()))
            metrics["ess_frac_seq_truncated"] = per_row(metrics["ess_seq_truncated"])
        else:  # keep sample i iff c_min <= exp(g_i) <= c_max, weight 1
            w_i = {b: float(hp.geo_min <= math.exp(g[b]) <= hp.geo_max) for b in rows}
            metrics["geo_rejected_frac"] = per_row(sum(w == 0.0 for w in w_i.values()))
        weight = {bt: w_i[bt[0]] for bt in valid}
        keep = {bt: name == "geo_tis" or w_i[bt[0]] == 1.0 for bt in valid}
    else:
        raise AssertionError(f"no slow reference for correction {name!r}")
    return weight, keep, metrics


RATES = {"tis_truncated_frac", "seq_is_truncated_frac", "rejection_rate", "geo_truncated_frac",
         "geo_rejected_frac"}


def assert_matches_slow_reference(name, old, mu, mask, rel=1e-5, **kw):
    """The registered correction of (old, mu, mask) equals `slow_correction`: weights and keep flags of
    the valid tokens (to `rel`), no mask-0 token kept, every metric (the same names)."""
    hp = CorrectionSpec(**kw)
    c = registry.get("correction", name)(old, mu, mask, hp)
    weight, keep, metrics = slow_correction(name, old, mu, mask, hp)
    for bt, w in weight.items():
        assert float(c.weight_BT[bt]) == pytest.approx(w, rel=rel, abs=0), (name, bt)
        assert bool(c.keep_BT[bt]) == keep[bt], (name, bt)
    assert not c.keep_BT[~mask.bool()].any(), name
    assert set(c.metrics) == set(metrics), name
    for k, v in metrics.items():  # rates are counts over counts, divided in torch's default float32
        tol = max(rel, 1e-6) if k in RATES else rel
        assert float(c.metrics[k]) == pytest.approx(v, rel=tol, abs=0), (name, k)
    return c


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
    assert float(e) == pytest.approx(8 / 3, rel=1e-6, abs=0) \
        and float(f) == pytest.approx(8 / 9, rel=1e-6, abs=0)
    # the same weights scaled by e^500: unchanged
    e, _ = ess_from_log_weights(torch.log(torch.tensor([1.0, 1.0, 2.0, 1.0], dtype=torch.float64)) + 500,
                                valid)
    assert float(e) == pytest.approx(8 / 3, rel=1e-12, abs=0)
    # every weight 0 (log w = -inf), or nothing valid: 0
    e, f = ess_from_log_weights(torch.full((3,), float("-inf")), torch.ones(3, dtype=torch.bool))
    assert float(e) == 0.0 and float(f) == 0.0
    e, f = ess_from_log_weights(torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    assert float(e) == 0.0 and float(f) == 0.0


@pytest.mark.parametrize("name", registry.names("correction"))
def test_corrections_compute_half_precision_inputs_in_float32(name):
    assert name in registry.names("correction")
    g = torch.Generator().manual_seed(3)
    mu = -torch.rand(3, 7, generator=g) * 2
    old = mu + 0.7 * torch.randn(3, 7, generator=g)
    mask = torch.rand(3, 7, generator=g) < 0.7
    kw = dict(is_cap=1.5, seq_is_cap=2.0, icepop_min=0.6, icepop_max=1.6, geo_min=0.8, geo_max=1.25)
    for dtype in (torch.bfloat16, torch.float16):
        lo = corr(name, old.to(dtype), mu.to(dtype), mask, **kw)
        hi = corr(name, old.to(dtype).float(), mu.to(dtype).float(), mask, **kw)
        assert lo.weight_BT.dtype == torch.float32
        torch.testing.assert_close(lo.weight_BT, hi.weight_BT, rtol=0, atol=0)
        assert torch.equal(lo.keep_BT, hi.keep_BT)
        for k in hi.metrics:
            torch.testing.assert_close(lo.metrics[k], hi.metrics[k], rtol=0, atol=0)
        # and the float32 result is the equation's, computed slowly in float64 from the same inputs
        assert_matches_slow_reference(name, old.to(dtype).float(), mu.to(dtype).float(), mask, **kw)
    assert corr(name, old.double(), mu.double(), mask, **kw).weight_BT.dtype == torch.float64


@pytest.mark.parametrize("name", registry.names("correction"))
def test_corrections_equal_their_equations_computed_slowly(name):
    """Random log-probs, ratios on both sides of every bound, empty rows, one all-padding batch: the fast
    path equals a Python loop over the docstring's equation (float32 to rel 1e-5, float64 to 1e-12)."""
    g = torch.Generator().manual_seed(11)
    kw = dict(is_cap=1.5, seq_is_cap=3.0, icepop_min=0.6, icepop_max=1.6, geo_min=0.8, geo_max=1.25)
    for B, T in ((5, 9), (3, 1), (8, 40)):
        mu = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
        old = mu + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
        mask = torch.rand(B, T, generator=g) < 0.6
        mask[0] = False  # a row without model tokens
        for dtype, rel in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
            assert_matches_slow_reference(name, old.to(dtype), mu.to(dtype), mask, rel=rel, **kw)
    c = assert_matches_slow_reference(name, old, mu, torch.zeros(B, T, dtype=torch.bool), **kw)
    assert all(float(v) == 0.0 for v in c.metrics.values())  # nothing valid: every rate and ESS is 0


def test_corrections_ignore_non_finite_logprobs_at_mask0_positions():
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    mu = torch.tensor([[-1.0, float("-inf"), -2.0]])
    old = torch.tensor([[-0.5, float("nan"), -2.5]])
    for name in registry.names("correction"):
        c = corr(name, old, mu, mask)
        assert torch.isfinite(c.weight_BT).all(), name
        assert all(torch.isfinite(v).all() for v in c.metrics.values()), name
        # the valid tokens' figures are those of the two valid tokens alone (log r = 0.5, -0.5)
        assert_matches_slow_reference(name, old, mu, mask)
    # by hand, default caps (c_IS 2, c_seq 10, band [0.5, 2]): both ratios e^0.5 = 1.65, e^-0.5 = 0.61 are
    # inside every bound; the sequence's log w = 0.5 - 0.5 = 0
    r = math.exp(0.5)
    ess_raw = (r + 1 / r) ** 2 / (r * r + 1 / (r * r))  # 1.78: the two ratios are unequal
    c = corr("tis_token", old, mu, mask)
    assert c.weight_BT[0, 0::2].tolist() == pytest.approx([r, 1 / r], rel=1e-6, abs=0)
    assert float(c.metrics["ess_token_raw"]) == pytest.approx(ess_raw, rel=1e-6, abs=0)
    assert float(c.metrics["tis_truncated_frac"]) == 0.0
    c = corr("tis_seq", old, mu, mask)
    assert c.weight_BT[0, 0::2].tolist() == [1.0, 1.0] and float(c.metrics["ess_seq_raw"]) == 1.0
    c = corr("icepop", old, mu, mask)
    assert c.keep_BT.tolist() == [[True, False, True]] and float(c.metrics["rejection_rate"]) == 0.0
    assert float(c.metrics["ess_token_post_rejection"]) == 2.0


def test_icepop_band():
    mu = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[0.4, 0.5, 2.0, 2.5]]))
    c = corr("icepop", old, mu, torch.ones(1, 4, dtype=torch.bool), icepop_min=0.5, icepop_max=2.0)
    assert c.keep_BT.tolist() == [[False, True, True, False]]
    assert float(c.metrics["rejection_rate"]) == 0.5
    torch.testing.assert_close(c.metrics["ess_frac_token_post_rejection"],
                               torch.tensor(0.5, dtype=torch.float64))


def test_bypass_and_none_need_no_weights():
    m = torch.ones(1, 2, dtype=torch.bool)
    for name, needs in (("none", False), ("bypass", True)):
        c = corr(name, torch.tensor([[-0.5, -2.0]]), torch.tensor([[-1.0, -1.0]]), m)  # ratios e^0.5, e^-1
        assert (c.weight_BT == 1).all() and c.keep_BT.all() \
            and registry.meta("correction", name).reads_behaviour == needs


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
