import math

import pytest
import torch

from moe_rl.algos import registry
from moe_rl.algos.correction import CorrectionParams, ess, staleness


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


def test_sequence_is_in_log_space_does_not_underflow():
    T = 4000
    mask = torch.ones(2, T, dtype=torch.bool)
    mu = torch.full((2, T), -1.0)
    old = mu.clone()
    old[0] -= 0.05  # product of 4000 ratios exp(-0.05): exp(-200), far below float32's range in a product
    old[1] += 0.01  # exp(+40): truncated to the cap
    c = corr("tis_seq", old, mu, mask, seq_is_cap=10.0)
    assert float(c.weight_BT[1, 0]) == pytest.approx(10.0)
    w0 = float(c.weight_BT[0, 0])
    assert w0 == pytest.approx(math.exp(-200), rel=1e-3) or w0 == 0.0  # exp(-200) is 0 in float32
    assert torch.isfinite(c.weight_BT).all()
    assert float(c.metrics["seq_is_truncated_frac"]) == 0.5


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
        c = corr(name, torch.zeros(1, 2), torch.zeros(1, 2), m)
        assert (c.weight_BT == 1).all() and c.needs_behaviour == needs


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
