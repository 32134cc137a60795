"""The run's pictures (moe_rl.plots), read back: the series each panel plots are the figures it was given
(matplotlib's line data of the figure the PNG was saved from), and the heatmap's pixels, read through
viridis, are each cell's share."""

import math

import numpy as np
import pytest
import torch

from moe_rl import plots
from moe_rl.plots import expert_load_image, learning_curve, rolling_mean

TAB = {"blue": (31, 119, 180), "orange": (255, 127, 14), "red": (214, 39, 40), "green": (44, 160, 44)}


def share_of(image: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> float:
    """The share of an RGB image's pixels within `tol` of colour `rgb`."""
    return float((np.abs(image[..., :3].astype(int) - np.array(rgb)).max(-1) <= tol).mean())


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures moe_rl.plots draws, kept to be read back."""
    drawn, make = [], plots._figure

    def keep(*args):
        drawn.append(make(*args))
        return drawn[-1]

    monkeypatch.setattr(plots, "_figure", keep)
    return drawn


def test_rolling_mean_by_hand():
    assert rolling_mean([1.0, 3.0, math.nan, 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert math.isnan(rolling_mean([math.nan], 3)[0])


def test_the_learning_curve_plots_training_held_out_and_each_baseline(tmp_path, figures):
    import matplotlib.image

    # two panels of different series: a panel plotting the other's figures, or steps from 0, shows
    history = [{"reward/success_rate": min(1.0, 0.3 + 0.02 * i), "reward/mean": -0.2 + 0.03 * i}
               for i in range(40)]
    evals = {40: {"eval/success_rate": 0.9, "eval/reward_mean": 0.7},
             0: {"eval/success_rate": 0.35, "eval/reward_mean": -0.1}}
    baselines = {"random guesses": {"eval/success_rate": 0.376, "eval/reward_mean": 0.19},
                 "binary search": {"eval/success_rate": 1.0, "eval/reward_mean": 0.92}}
    path = learning_curve(history, evals, baselines, tmp_path / "curve.png")
    image = (matplotlib.image.imread(path) * 255).round().astype(np.uint8)
    assert image.shape[:2] == (400, 1100)
    for colour in ("blue", "orange", "red", "green"):  # training, held-out, the two baselines: in both panels
        for panel in (image[:, :550], image[:, 550:]):
            assert share_of(panel, TAB[colour]) > 5e-4, colour
    (fig,) = figures
    success, reward = fig.axes[:2]
    assert (success.get_title(), reward.get_title()) == ("success rate", "reward")
    steps = list(range(1, 41))
    for ax, key, train in ((success, "success_rate", [min(1.0, 0.3 + 0.02 * i) for i in range(40)]),
                           (reward, "reward_mean", [-0.2 + 0.03 * i for i in range(40)])):
        lines = {line.get_label(): line for line in ax.get_lines()}
        # window: 40 steps // 20; the mean of each step and the one before, worked by hand
        smooth = [train[0]] + [(a + b) / 2 for a, b in zip(train[1:], train, strict=False)]
        plotted = {label: (list(line.get_xdata()), list(line.get_ydata())) for label, line in lines.items()}
        assert plotted["training, per step"] == (steps, pytest.approx(train)), ax.get_title()
        assert plotted["training, mean of 2 steps"] == (steps, pytest.approx(smooth)), ax.get_title()
        assert plotted["held-out"] == ([0, 40], [evals[0][f"eval/{key}"], evals[40][f"eval/{key}"]])
        for name, figs in baselines.items():  # a dashed line across the panel at the baseline's figure
            (line,) = [x for label, x in lines.items() if label.startswith(f"{name} (held-out): ")]
            assert list(line.get_ydata()) == [figs[f"eval/{key}"]] * 2 and line.get_linestyle() == "--"
            assert line.get_label() == f"{name} (held-out): {figs[f'eval/{key}']:.2f}"
    bare = matplotlib.image.imread(learning_curve(history, evals, {}, tmp_path / "bare.png"))
    bare = (bare * 255).round().astype(np.uint8)
    assert share_of(bare, TAB["red"]) < 1e-4 and share_of(bare, TAB["green"]) < 1e-4  # no baselines: no lines
    assert all(len(ax.get_lines()) == 3 for ax in figures[1].axes[:2])


def read_through_viridis(rgb: np.ndarray, top: float) -> np.ndarray:
    """The shares pixels of viridis (0 to `top`) stand for: the middle of the range of the nearest of its
    256 colours (colour i: [i, i + 1) * top / 256)."""
    import matplotlib

    lut = (matplotlib.colormaps["viridis"](np.arange(256))[:, :3] * 255).round()
    nearest = np.abs(rgb[..., None, :].astype(float) - lut).sum(-1).argmin(-1)
    return (nearest + 0.5) / 256 * top


@pytest.mark.parametrize("panels", [1, 2])
def test_the_expert_load_heatmap_shows_each_routings_shares(panels, figures):
    loads = {"rollout": np.array([[0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]]),
             "trainer": np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])}
    loads = dict(list(loads.items())[:panels])
    image = expert_load_image({name: torch.tensor(x).numpy() for name, x in loads.items()})
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[1] > (330 if panels == 2 else 200) and image.shape[0] >= 150
    (fig,) = figures
    *heatmaps, bar = fig.axes
    assert [ax.get_title() for ax in heatmaps] == list(loads)
    for ax, x in zip(heatmaps, loads.values(), strict=True):
        # each cell's pixels (beside its label, at a third of the cell from its centre) read back as its
        # share, to two of viridis' 256 colours: the scale's top is the largest share, 0.5
        rows = []
        for i in range(2):
            px = [ax.transData.transform((j - 0.3, i - 0.3)) for j in range(4)]
            rows.append([image[image.shape[0] - 1 - round(y), round(xx)] for xx, y in px])
        torch.testing.assert_close(read_through_viridis(np.array(rows), 0.5), x, atol=0.5 / 128, rtol=0)
        # ... and its label is its share in percent
        labels = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
        assert labels == {(i, j): f"{100 * x[i, j]:.0f}%" for i in range(2) for j in range(4)}
    # the even share, 1/4, marked in red on the colour bar
    (even,) = bar.get_lines()
    assert list(even.get_ydata()) == [0.25, 0.25] and share_of(image, (255, 0, 0), tol=40) > 1e-4
