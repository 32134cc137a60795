"""A non-finite loss or gradient skips the optimizer step on every rank of the model (the NaN is in one
data-parallel rank's shard only), leaves the weights untouched and is counted; the next step trains."""

import math

import pytest
from train_jobs import nonfinite_job

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow


def test_a_nan_in_one_shard_skips_the_step_on_every_rank(tiny_qwen):
    for r in run_ranks(nonfinite_job, 2, (str(tiny_qwen),)):
        assert r["bad"]["skipped_nonfinite"] == 1.0 and r["bad"]["update_ok"] == 0.0 and r["untouched"]
        assert r["good"]["skipped_nonfinite"] == 0.0 and r["good"]["update_ok"] == 1.0
        assert math.isfinite(r["good"]["grad_norm"]) and r["finite"] and r["moved"]

