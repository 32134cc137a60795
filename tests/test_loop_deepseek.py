"""A DeepSeek-V3 policy through the RL loop (the CLI's main on a module-local Ray, `run_train`): routing
replay in bf16, the multi-token-prediction layer kept through the run's export (split from test_loop.py)."""

import json

import pytest
import torch
from cli_runs import NO_WARM_START, run_train

pytestmark = pytest.mark.slow


def test_a_deepseek_v3_policy_trains_on_its_replayed_routes(tmp_path):
    """configs/quickstart_deepseek.yaml's model (multi-latent attention, grouped sigmoid routing with an
    expert bias, a shared expert, a dense first layer), here with 16 experts whose router scores lie close
    together (its weights scaled by 0.1, the bias at 0) and a multi-token-prediction layer, through the loop
    in bf16, where vLLM's kernels and the trainer's round differently: the trainer's own routing then picks
    other experts for some tokens, and its log-probs with the rollout's routes replayed are closer to vLLM's
    than with its own routing, every step (fp32: <= 1e-4 replayed, tests/rollout/test_engine_sync.py). The
    start-up says the MTP layer is not trained; the run's Hugging Face export carries it as the model has
    it. (With the tiny model's 4 experts in 2 groups, bf16 routing agreed with vLLM's at every position.)"""
    from conftest import with_mtp_layer
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    model = tmp_path / "model"
    tiny = build_tiny_checkpoint(tmp_path / "tiny", TinyModel(arch="deepseek_v3", num_experts=16))
    mtp = with_mtp_layer(tiny, model)
    weights = load_file(model / "model.safetensors")
    for name in [n for n in weights if n.startswith("model.layers.1.mlp.gate.")]:
        weights[name] = weights[name] * 0.1 if name.endswith(".weight") else torch.zeros_like(weights[name])
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "deepseek"
    proc = run_train(out, f"model.path={model}", "model.dtype=bfloat16", "algorithm.correction=tis_token",
                     *NO_WARM_START, "rollout.prompts_per_step=8", "run.steps=2", "checkpoint.every=2",
                     "checkpoint.export_hf_every=2", "logging.routing_diagnostics_every=1")
    assert "multi-token-prediction layer(s) (5 tensors) are neither built nor trained" in proc.stdout
    hist = torch.load(out / "history.pt", weights_only=False)
    assert len(hist) == 2 and all(h["policy/grad_norm"] > 0 for h in hist)
    for h in hist:
        assert h["routing/agreement"] < 1, h["routing/agreement"]
        assert h["correction/logp_mismatch_mean"] < h["correction/logp_mismatch_no_replay"], h
    index = json.loads((out / "hf" / "step_000002" / "model.safetensors.index.json").read_text())
    for name, tensor in mtp.items():
        with safe_open(out / "hf" / "step_000002" / index["weight_map"][name], "pt") as f:
            assert torch.equal(f.get_tensor(name), tensor), name
