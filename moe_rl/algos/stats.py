"""Diagnostics returned as tensors (no host synchronisation); values at mask-0 positions are never read."""

from __future__ import annotations

import math

import torch


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> torch.Tensor:
    """1 - Var[G - V] / Var[G] over valid tokens (1: perfect critic, <= 0: no better than a constant;
    0 when Var[G] = 0). values_BT, returns_BT, mask_BT: [B, T]. Returns a 0-dim float64 tensor."""
    mb = mask_BT.bool()
    m = mb.to(torch.float64)
    n = m.sum().clamp(min=1)
    g = torch.where(mb, returns_BT.to(torch.float64), 0.0)
    v = torch.where(mb, values_BT.to(torch.float64), 0.0)

    def var(x):
        mean = (x * m).sum() / n
        return (((x - mean) * m).square()).sum() / n

    vg = var(g)
    return torch.where(vg > 0, 1 - var(g - v) / vg.clamp(min=1e-300), torch.zeros_like(vg))


def expert_load(routes_BSLK: torch.Tensor, valid_BS: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The share of routed (token, slot) pairs each expert received, per MoE layer:

        load[l, e] = #{(b, s, k) : valid[b, s], routes[b, s, l, k] = e} / (K * #valid)

    routes_BSLK: [B, S, L, K] global expert ids (any integer dtype); valid_BS: [B, S] bool, the positions
    to count. Returns [L, E] float64; each row sums to 1 (0 with no valid position)."""
    r = routes_BSLK[valid_BS.bool()].long()  # [N, L, K]
    N, L, K = r.shape
    counts = torch.zeros(L, num_experts, dtype=torch.float64)
    counts.scatter_add_(1, r.permute(1, 0, 2).reshape(L, N * K), torch.ones(L, N * K, dtype=torch.float64))
    return counts / max(1, N * K)


def load_imbalance(load_LE: torch.Tensor) -> torch.Tensor:
    """max_e load / mean_e load per layer (1: perfectly even; E: every token on one expert). [L, E] -> [L]."""
    return load_LE.max(-1).values * load_LE.shape[-1]


def usage_entropy(load_LE: torch.Tensor) -> torch.Tensor:
    """The entropy of expert usage per layer over its maximum, log E (1: even; 0: one expert).
    [L, E] -> [L]."""
    p = load_LE.clamp(min=0)
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1) / math.log(max(2, load_LE.shape[-1]))


def pass_at_k(success_PN: torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased pass@k estimate over prompts (Chen et al., 2021): with n samples of a prompt of
    which c succeed,

        pass@k = 1 - C(n - c, k) / C(n, k),   averaged over prompts

    success_PN: [P, N] bool, N >= k samples per prompt. Returns a 0-dim float64 tensor."""
    n = success_PN.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= {n} samples per prompt")
    c = success_PN.to(torch.float64).sum(1)
    # C(n - c, k) / C(n, k) = prod_{i=0}^{k-1} (n - c - i) / (n - i), 0 once n - c < k
    i = torch.arange(k, dtype=torch.float64)
    fail_all = ((n - c.unsqueeze(1) - i) / (n - i)).clamp(min=0).prod(1)
    return (1 - fail_all).mean()
