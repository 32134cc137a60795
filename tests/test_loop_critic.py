"""The critic in the RL loop (through the CLI's main, on a local Ray kept for the module): it learns a
value the prompt states, and it can start from another model's checkpoint (a reward model of another
shape) beside a reference policy."""

import re

import pytest
import torch
from cli_runs import NO_WARM_START, run_train
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_critic_learns_a_value_written_in_the_prompt(tmp_path):
    """stated_reward: each prompt states its reward, so V(s) is learnable exactly; the critic (actor
    held back by critic.warmup_steps) must explain > 80% of the return variance within 10 steps.
    The trainer ranks compute with the threads cluster.trainer_threads gives them, the engine with its
    automatic count (OMP_NUM_THREADS=1 bounds it), as each process reports."""
    out = tmp_path / "stated"
    proc = run_train(out, "environment.name=stated_reward", "environment.options={}", *NO_WARM_START,
                     "rollout.prompts_per_step=16", "rollout.samples_per_prompt=1", "run.steps=10",
                     "critic.warmup_steps=10", "checkpoint.every=0", "cluster.trainer_threads=2")
    ev = [h["critic/explained_variance"] for h in torch.load(out / "history.pt", weights_only=False)]
    assert ev[-1] > 0.8 and max(ev[-3:]) > 0.9, ev
    assert re.search(r"placement: policy ranks on \S+ \(2 threads\); critic ranks on \S+ \(2 threads\); "
                     r"engines on \S+ \(1 thread\)", proc.stdout), proc.stdout


def test_critic_starts_from_another_checkpoint(tmp_path):
    """critic.init_from: a reward model, here of another shape (1 layer, 8 experts; the policy has 2
    layers, 4 experts), whose score head becomes the value head. The critic routes freely (the
    policy's rollout routes do not fit its routers). Our own critic's head starts at zero (V = 0
    before its first update); this one's values are not, and its checkpoint carries its own config.
    A KL loss term brings the reference policy in: a third group, whose memory is reported too."""
    import dataclasses
    import json

    from safetensors.torch import load_file, save_file

    from moe_rl.config import load_config
    from moe_rl.tiny import build_tiny_checkpoint

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    rm = build_tiny_checkpoint(tmp_path / "reward_model",
                               dataclasses.replace(cfg.model.tiny, num_layers=1, num_experts=8), seed=7)
    weights = load_file(rm / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    weights["score.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    save_file(weights, rm / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "init_from"
    run_train(out, f"critic.init_from={rm}", "run.steps=1", "trainer.epochs=1", "trainer.minibatches=1",
              "algorithm.kl_loss_coef=0.01", *NO_WARM_START)
    figures = torch.load(out / "history.pt", weights_only=False)[0]
    assert abs(figures["critic/value_mean"]) > 1e-3, figures["critic/value_mean"]
    assert 0.1 < figures["memory/reference_rss_gib_max"] < 20
    saved = json.loads((out / "checkpoints" / "step_000001" / "critic" / "hf_config"
                        / "config.json").read_text())
    assert (saved["num_hidden_layers"], saved["num_local_experts"]) == (1, 8)
