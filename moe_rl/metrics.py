"""Metrics: TensorBoard scalars (namespaced rollout/, reward/, policy/, critic/, correction/, routing/,
timing/, perf/, memory/) and a console progress bar with ETA."""

from __future__ import annotations

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
        return float(v)  # NaN and inf are kept: a diverging run must show it
    except (TypeError, ValueError):
        return None


def reduce_updates(updates: list[dict[str, object]]) -> dict[str, float]:
    """One step's figures from its updates (every minibatch of every epoch): the mean of each key,
    except max-like keys (`*_max`, `*max`) take the maximum and min-like keys (`*_min`) the minimum.
    Keys missing from some updates are reduced over the updates that have them. A non-finite value
    is kept (a NaN loss in one update makes the step's NaN), never averaged away."""
    seen: dict[str, list[float]] = {}
    for u in updates:
        for k, v in u.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                seen.setdefault(k, []).append(float(v))
    out = {}
    for k, vs in seen.items():
        if k.endswith("max"):
            out[k] = max(vs)
        elif k.endswith("min"):
            out[k] = min(vs)
        else:
            out[k] = sum(vs) / len(vs)
    return out


class Metrics:
    """TensorBoard scalars under `log_dir`, written every `every` steps (and at the last step), and a
    progress bar advanced every step."""

    def __init__(self, log_dir: str | Path, enabled: bool = True, total_steps: int = 0, progress: bool = True,
                 start_step: int = 0, every: int = 1):
        self.writer = None
        self.every, self.total = every, total_steps
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
        if self.writer is not None and (step % self.every == 0 or step == self.total or not advance):
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
