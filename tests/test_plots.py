"""The run's pictures (moe_rl.plots), read back as images: what they must show is there."""

import math

import numpy as np
import pytest
import torch

from moe_rl.plots import expert_load_image, learning_curve, rolling_mean

TAB = {"blue": (31, 119, 180), "orange": (255, 127, 14), "red": (214, 39, 40), "green": (44, 160, 44)}


def share_of(image: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> float:
    """The share of an RGB image's pixels within `tol` of colour `rgb`."""
    return float((np.abs(image[..., :3].astype(int) - np.array(rgb)).max(-1) <= tol).mean())


def test_rolling_mean_by_hand():
    assert rolling_mean([1.0, 3.0, math.nan, 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert math.isnan(rolling_mean([math.nan], 3)[0])


def test_the_learning_curve_shows_training_held_out_and_each_baseline(tmp_path):
    import matplotlib.image

    history = [{"reward/success_rate": min(1.0, 0.3 + 0.02 * i), "reward/mean": -0.2 + 0.02 * i}
               for i in range(40)]
    evals = {0: {"eval/success_rate": 0.35, "eval/reward_mean": -0.1},
             40: {"eval/success_rate": 0.9, "eval/reward_mean": 0.7}}
    baselines = {"random guesses": {"eval/success_rate": 0.376, "eval/reward_mean": 0.19},
                 "binary search": {"eval/success_rate": 1.0, "eval/reward_mean": 0.92}}
    path = learning_curve(history, evals, baselines, tmp_path / "curve.png")
    image = (matplotlib.image.imread(path) * 255).round().astype(np.uint8)
    assert image.shape[:2] == (400, 1100)
    for colour in ("blue", "orange", "red", "green"):  # training, held-out, the two baselines: in both panels
        for panel in (image[:, :550], image[:, 550:]):
            assert share_of(panel, TAB[colour]) > 5e-4, colour
    bare = matplotlib.image.imread(learning_curve(history, evals, {}, tmp_path / "bare.png"))
    bare = (bare * 255).round().astype(np.uint8)
    assert share_of(bare, TAB["red"]) < 1e-4 and share_of(bare, TAB["green"]) < 1e-4  # no baselines: no lines


@pytest.mark.parametrize("panels", [1, 2])
def test_the_expert_load_heatmap_is_labelled_and_puts_routings_side_by_side(panels):
    load = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]]).numpy()
    image = expert_load_image({f"routing {i}": load for i in range(panels)})
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[1] > (330 if panels == 2 else 200) and image.shape[0] >= 150
    assert share_of(image, (253, 231, 37), tol=30) > 1e-3  # viridis' top: the 0.5 cells
    assert share_of(image, (68, 1, 84), tol=30) > 1e-3  # viridis' bottom: the empty experts
    assert share_of(image, (255, 0, 0), tol=40) > 1e-4  # the even share marked in red on the colour bar
