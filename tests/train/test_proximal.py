"""pi_old from the update's own forward (a step of one update, trainer.proximal_pass=auto): the loss,
the gradients (through the update they make) and the log-probs it keeps equal the path that scores
pi_old in a forward of its own first, bitwise, on two data-parallel ranks with routes replayed and
packed microbatches; mu = pi_old is still checked before the update."""

import pytest
import torch
from train_jobs import proximal_job

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow


def test_the_update_forward_gives_pi_old_bitwise(tiny_qwen):
    separate = run_ranks(proximal_job, 2, (str(tiny_qwen), False))
    fused = run_ranks(proximal_job, 2, (str(tiny_qwen), True))
    for s, f in zip(separate, fused, strict=True):
        assert "logp_old_BS" in s["fields"] and "logp_old_BS" not in f["fields"]  # nothing of pi_old is sent
        sf, ff = s["step"].figures, f["step"].figures
        assert sf["loss"] == ff["loss"] and sf["grad_norm"] == ff["grad_norm"]
        assert sf["update_ok"] == ff["update_ok"] == 1.0 and s["moved"] == f["moved"] > 10
        assert all(torch.equal(a, b) for a, b in zip(s["params"], f["params"], strict=True))
        kept = f["step"].logp_BS  # the forward's log-probs before the update, as the shard is long
        assert torch.equal(kept, f["scored"][:, :kept.shape[1]]) and not f["scored"][:, kept.shape[1]:].any()


def test_mu_unequal_to_pi_old_is_refused_before_the_update(tiny_qwen):
    for r in run_ranks(proximal_job, 2, (str(tiny_qwen), True, 0.01)):
        assert r["refused"].startswith("batch check 'sync_roles' failed: sample 0: mu and pi_old differ by "
                                       "0.01")
        assert r["untouched"]
