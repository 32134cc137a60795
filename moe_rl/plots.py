"""The run's pictures, drawn with matplotlib's object API on the Agg canvas (no display, no global state):
the learning curve a run writes into run.output_dir, and the expert-load heatmaps TensorBoard shows.

    learning_curve(history, evaluations, baselines, out / "learning_curve.png")
    expert_load_image({"rollout": load_LE, "trainer (free routing)": load_LE})  # [H, W, 3] uint8
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to window - 1 before it, NaNs left out (NaN where all are).

        rolling_mean([1, 3, nan, 5], 2) == [1.0, 2.0, 3.0, 5.0]"""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(seen) / len(seen) if seen else math.nan)
    return out


def learning_curve(history: list[dict[str, float]], evaluations: dict[int, dict[str, float]],
                   baselines: dict[str, dict[str, float]], path: Path) -> Path:
    """Two panels over the RL steps: the success rate (each step's training samples, its rolling mean,
    the held-out evaluations, and the reference policies on the held-out prompts as dashed lines) and
    the reward (the same four). Written as a PNG to `path`."""
    steps = list(range(1, len(history) + 1))
    window = max(1, len(history) // 20)
    fig = _figure(11, 4)
    panels = fig.subplots(1, 2)
    keys = (("reward/success_rate", "eval/success_rate", "success rate"),
            ("reward/mean", "eval/reward_mean", "reward"))
    for ax, (train_key, eval_key, title) in zip(panels, keys, strict=True):
        train = [float(h.get(train_key, math.nan)) for h in history]
        if steps:
            ax.plot(steps, train, color="tab:blue", alpha=0.25, linewidth=1, label="training, per step")
            ax.plot(steps, rolling_mean(train, window), color="tab:blue", linewidth=2,
                    label=f"training, mean of {window} steps")
        held = sorted((s, f[eval_key]) for s, f in evaluations.items() if eval_key in f)
        if held:
            ax.plot(*zip(*held, strict=True), color="tab:orange", marker="o", linewidth=2, label="held-out")
        colors = ("tab:red", "tab:green", "tab:purple", "tab:brown")
        for (name, figures), color in zip(baselines.items(), colors, strict=False):
            ax.axhline(figures[eval_key], color=color, linestyle="--", linewidth=1.5,
                       label=f"{name} (held-out): {figures[eval_key]:.2f}")
        if eval_key == "eval/success_rate":
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, format="png")
    return path


def expert_load_image(loads: dict[str, np.ndarray]) -> np.ndarray:
    """Labelled heatmaps of expert loads, side by side: per routing (name -> [L, E] shares of the tokens'
    expert choices in each layer, rows summing to 1), layers x experts with each cell's share in percent,
    one colour bar, and the even share 1/E marked on it. An RGB image, [H, W, 3] uint8."""
    from matplotlib.colors import Normalize

    loads = {name: np.asarray(x, dtype=np.float64) for name, x in loads.items()}
    layers, experts = next(iter(loads.values())).shape
    top = max(max(float(x.max()) for x in loads.values()), 1.0 / experts)
    norm = Normalize(0.0, top)
    # large type: TensorBoard shows the image fitted to a card about 450 pixels wide
    fig = _figure(1.6 + (min(0.6 * experts, 8.0) + 1.0) * len(loads), 1.6 + 0.55 * layers)
    axes = np.atleast_1d(fig.subplots(1, len(loads)))
    for ax, (name, x) in zip(axes, loads.items(), strict=True):
        im = ax.imshow(x, cmap="viridis", norm=norm, aspect="auto")
        if experts <= 16:  # each cell's share, where the cells are wide enough to hold it
            for (i, j), v in np.ndenumerate(x):
                ax.text(j, i, f"{100 * v:.0f}%", ha="center", va="center", fontsize=13,
                        color="black" if norm(v) > 0.6 else "white")
        ax.set_title(name, fontsize=15)
        ax.set_xlabel("expert", fontsize=13)
        ax.set_xticks(range(0, experts, max(1, experts // 16)))
        ax.set_yticks(range(0, layers, max(1, layers // 16)))
        ax.set_ylabel("MoE layer", fontsize=13)
        ax.tick_params(labelsize=12)
    bar = fig.colorbar(im, ax=list(axes), fraction=0.05)
    bar.set_label(f"share of choices\n(red: even, 1/{experts})", fontsize=12)
    bar.ax.axhline(1.0 / experts, color="red", linewidth=4)
    bar.ax.tick_params(labelsize=11)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
