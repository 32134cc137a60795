"""Metrics: TensorBoard scalars (namespaced rollout/, reward/, policy/, critic/, correction/, routing/,
timing/, perf/, memory/) and a console progress bar with ETA."""

from __future__ import annotations

import math
from pathlib import Path

import psutil
import torch


def scalar(v) -> float | None:
    if isinstance(v, torch.Tensor):
        v = v.detach().float()
        if v.numel() != 1:
            return None
        v = v.item()
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class Metrics:
    def __init__(self, log_dir: str | Path, enabled: bool = True, total_steps: int = 0, progress: bool = True,
                 start_step: int = 0):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir))
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="RL steps", unit="step", dynamic_ncols=True)

    def log(self, step: int, values: dict[str, object], advance: bool = True) -> dict[str, float]:
        clean = {}
        for k, v in values.items():
            f = scalar(v)
            if f is not None:
                clean[k] = f
        clean["memory/rss_gib"] = psutil.Process().memory_info().rss / 2**30
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.bar is not None and advance:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{clean.get('reward/mean', float('nan')):.3f}",
                                 len=f"{clean.get('rollout/length_mean', float('nan')):.0f}")
        return clean

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
