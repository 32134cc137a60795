import torch

from moe_rl.algos.stats import explained_variance


def test_explained_variance_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    G = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]])
    # V = G: 1; V = mean(G): Var[G - V] = Var[G] -> 0; V = G - (1, -1, 1, -1): 1 - 1 / 1.25 = 0.2
    assert float(explained_variance(G, G, mask)) == 1.0
    assert float(explained_variance(torch.full_like(G, 2.5), G, mask)) == 0.0
    V = G - torch.tensor([[1.0, -1.0, 0.0], [1.0, -1.0, 0.0]])
    torch.testing.assert_close(explained_variance(V, G, mask), torch.tensor(0.2, dtype=torch.float64))
    # constant returns: 0, not a division by zero
    assert float(explained_variance(G, torch.ones_like(G), mask)) == 0.0


def test_stats_ignore_non_finite_mask0_values():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    G = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, float("inf")]])
    V = torch.tensor([[0.0, 3.0, float("-inf")], [2.0, 5.0, float("nan")]])
    torch.testing.assert_close(explained_variance(V, G, mask), torch.tensor(0.2, dtype=torch.float64))


def test_pass_at_k_by_hand():
    """3 prompts x 4 samples with 1, 0 and 2 successes: pass@1 = mean(1/4, 0, 2/4) = 1/4; pass@2 =
    mean(1 - C(3,2)/C(4,2), 0, 1 - C(2,2)/C(4,2)) = mean(1/2, 0, 5/6) = 4/9; pass@4 = 2/3."""
    import pytest

    from moe_rl.algos.stats import pass_at_k

    s = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert float(pass_at_k(s, 1)) == pytest.approx(0.25)
    assert float(pass_at_k(s, 2)) == pytest.approx(4 / 9)
    assert float(pass_at_k(s, 4)) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="needs 1 <= k <= 4"):
        pass_at_k(s, 5)
