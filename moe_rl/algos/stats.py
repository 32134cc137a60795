"""Diagnostics returned as tensors (no host synchronisation)."""

from __future__ import annotations

import torch


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """1 - Var[G - V] / Var[G] over valid tokens (1: perfect critic, <= 0: no better than a constant)."""
    m = mask_BT.to(torch.float64)
    n = m.sum().clamp(min=1)
    g, v = returns_BT.to(torch.float64), values_BT.to(torch.float64)

    def var(x):
        mean = (x * m).sum() / n
        return (((x - mean) * m).square()).sum() / n

    vg = var(g)
    return torch.where(vg > 0, 1 - var(g - v) / vg.clamp(min=1e-300), torch.zeros_like(vg))


def masked_summary(x_BT: torch.Tensor, mask_BT: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    m = mask_BT.bool()
    x = x_BT.detach().to(torch.float64)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    big = torch.finfo(torch.float64).max
    return {f"{prefix}_mean": mean, f"{prefix}_max": torch.where(m, x, -big).max(),
            f"{prefix}_min": torch.where(m, x, big).min()}
