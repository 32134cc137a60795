"""The proximal policy in the RL loop (through the CLI's main on a module-local Ray, `run_train`): the
PPO-EWMA anchor across a resume, pi_old taken from the update's own forward, and the pre-update check of
mu = pi_old (split from test_loop.py)."""

import shutil

import pytest
import torch
from cli_runs import NO_CRITIC, NO_WARM_START, run_train

pytestmark = pytest.mark.slow


def test_ewma_anchor_in_the_loop_and_across_resume(tmp_path):
    """PPO-EWMA: the anchor equals the policy at the first RL step (it starts after the warm start),
    then lags behind it; a resumed run restores the anchor (each rank its own shards) and reproduces
    the uninterrupted step 2.

    The anchor moves after every update (2 per step here: 2 epochs x 1 minibatch), and each update
    scores its minibatch under the anchor as it is then. At step 1 the first update's anchor is the
    behaviour policy itself (w = pi_anchor / mu = 1), the second's is not: the step's token ESS is
    below 1. Scoring the anchor once per step would give w = 1 for both (ESS fraction 1)."""
    # two tensor-parallel ranks: each holds its own shards of the anchor, saved and restored per rank; the
    # policy's anchor: no critic
    ewma = ["algorithm.anchor=ewma", "algorithm.ewma_decay=0.5", "algorithm.correction=tis_token",
            "parallel.tp=2", "parallel.world_size=2", "run.steps=2", *NO_CRITIC]
    full = tmp_path / "full"
    run_train(full, *ewma)
    hist = torch.load(full / "history.pt", weights_only=False)
    gaps = [h["policy/anchor_logp_gap"] for h in hist]
    assert len(gaps) == 2 and gaps[0] == 0.0 and gaps[1] > 0, gaps
    assert hist[0]["correction/ess_frac_token_raw"] < 1 - 1e-4
    split = tmp_path / "split"  # the full run's step-1 checkpoint, resumed (resume: auto) for step 2
    shutil.copytree(full / "checkpoints" / "step_000001", split / "checkpoints" / "step_000001")
    run_train(split, *ewma)
    resumed = torch.load(split / "history.pt", weights_only=False)
    assert len(resumed) == 1
    assert resumed[0]["policy/anchor_logp_gap"] == pytest.approx(gaps[1], rel=1e-4, abs=1e-6)




def test_pi_old_from_the_update_equals_a_separate_pass_step_for_step(tmp_path):
    """One update per step (epochs=1, minibatches=1), two data-parallel ranks: pi_old taken from the
    update's own forward (trainer.proximal_pass=auto) trains exactly like scoring it first (separate),
    step for step, with the replayed log-probs' figures the same; only the scoring pass's route bytes
    are gone."""
    # the policy's pi_old
    one = ["trainer.epochs=1", "trainer.minibatches=1", "parallel.world_size=2", "run.steps=2",
           "checkpoint.every=0", "checkpoint.at_end=false", "logging.routing_diagnostics_every=2", *NO_CRITIC]
    run_train(tmp_path / "auto", *one)
    run_train(tmp_path / "separate", *one, "trainer.proximal_pass=separate")
    hist, ref = (torch.load(tmp_path / m / "history.pt", weights_only=False) for m in ("auto", "separate"))
    # at_end=false: none
    assert len(hist) == len(ref) == 2 and not (tmp_path / "auto" / "checkpoints").exists()
    for h, r in zip(hist, ref, strict=True):
        for key in ("reward/mean", "policy/loss", "policy/grad_norm", "policy/ratio_mean",
                    "policy/clipfrac_high", "correction/logp_mismatch_mean", "correction/logp_mismatch_max"):
            assert h[key] == r[key], key
        assert h["routing/score_route_bytes_per_rank"] < r["routing/score_route_bytes_per_rank"]
        # R3: the update's forward replays the rollout's routes
        assert h["correction/logp_mismatch_max"] < 1e-4
    assert hist[1]["routing/agreement"] == ref[1]["routing/agreement"]  # the free-routing diagnostic, step 2


def test_synchronous_check_runs_before_the_update(tmp_path):
    """The pre-update checklist verifies mu = pi_old in a synchronous step whose objective has no
    off-policy correction. bf16 trainer and vLLM kernels differ (by ~4e-3 here, above the 1e-3
    tolerance). With one update per step pi_old is the update's own forward and its loss checks it
    before the backward pass, on the rank: refused in one line, exit 2 (the driver's check of a separate
    pass: tests/algos/test_targets.py). With token TIS the same run trains (here with megatron's
    load-balancing and z-loss on, whose values are logged)."""
    bf16 = ["model.dtype=bfloat16", "run.steps=1", "checkpoint.every=0", *NO_WARM_START]
    proc = run_train(tmp_path / "none", *bf16, "trainer.epochs=1", "trainer.minibatches=1", expect=2)
    assert "Traceback" not in proc.stderr  # the driver's output: one line
    assert proc.stderr.strip().splitlines()[-1].startswith("moe-rl: error: batch check 'sync_roles' failed")
    run_train(tmp_path / "tis", *bf16, "algorithm.correction=tis_token", "model.moe_aux_loss_coeff=0.01",
              "model.moe_z_loss_coeff=0.001")
    figures = torch.load(tmp_path / "tis" / "history.pt", weights_only=False)[0]
    assert figures["policy/moe_aux_loss"] > 0 and figures["policy/moe_z_loss"] > 0
