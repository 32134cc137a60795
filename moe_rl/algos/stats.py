"""Diagnostics returned as tensors (no host synchronisation); values at mask-0 positions are never read."""

from __future__ import annotations

import torch


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
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
