"""The policy's learning rate by RL step: a linear warmup, then a decay from the peak to a floor.

With peak lr, floor lr_min, W warmup steps and decay ending at step D (steps counted from 0):

    lr(s) = lr * (s + 1) / W                                         s < W
    lr(s) = lr_min + (lr - lr_min) * f(t),  t = min(1, (s - W) / (D - W))   s >= W

    constant: f(t) = 1        linear: f(t) = 1 - t        cosine: f(t) = (1 + cos(pi t)) / 2

(megatron-core's OptimizerParamScheduler has the same shapes; it counts optimizer updates, this counts RL
steps, so a step's epochs and minibatches share one rate). A pure function of the step: a resumed run
takes up the schedule where it left off, with nothing to checkpoint.
"""

from __future__ import annotations

import math

DECAYS = {
    "constant": lambda t: 1.0,
    "linear": lambda t: 1.0 - t,
    "cosine": lambda t: 0.5 * (1.0 + math.cos(math.pi * t)),
}


def lr_at(step: int, lr: float, schedule: str, warmup_steps: int, decay_steps: int, lr_min: float) -> float:
    """The learning rate of RL step `step` (0-based): warmup_steps of linear warmup to `lr`, then
    DECAYS[schedule] from `lr` to `lr_min`, reached at step `decay_steps` and held after it."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return lr_min + (lr - lr_min) * DECAYS[schedule](t)
