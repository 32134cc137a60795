"""GPU path of the local layer spec (megatron-core's own layers, torch SDPA attention; no Transformer
Engine, vLLM or Ray): one rank on cuda:0, started by run_ranks, scores like transformers on the GPU,
trains the policy and the critic, replays the routes it recorded, and runs in bf16. Skipped on CPU
machines; run on a GPU machine with `python -m pytest -m gpu tests/train/test_gpu_local.py` (part of
`tools/gpu_check.sh`)."""

import pytest
import torch
from train_jobs import B, Denominator, S, batch_tensors, critic_returns, policy_loss, policy_tensors

from moe_rl.train.hf_parity import exact_fp32_matmuls, hf_token_logprobs
from moe_rl.train.launch_local import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def snapshot(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.module.named_parameters()}


def largest_change(worker, before: dict[str, torch.Tensor]) -> float:
    """The largest |change| of any parameter since `before`; NaN where a parameter became NaN."""
    changes = [(p.detach() - before[n]).abs().max().float() for n, p in worker.module.named_parameters()]
    return float(torch.stack(changes).max())


def local_job(rank, world, hf_path, dtype):
    """One rank in `dtype`, batches given on the CPU (as from Ray: the worker moves them). Free scores
    with the routes they took, the same batch with those routes replayed, one PPO step on the replayed
    routes, then a critic and one value step; with how far each step moved the weights."""
    from conftest import model_spec, optim_settings

    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.objectives import ValueLoss
    from moe_rl.train.worker import TrainWorker

    exact_fp32_matmuls()
    parallel.init_distributed(parallel.Layout())
    ids, lengths, mask, adv = batch_tensors()
    # production's packed microbatches, two of them here; eps 1e-4 as the CPU tests
    optim = optim_settings(1e-2, adam_eps=1e-4, micro_batch_tokens=24)
    policy = TrainWorker(model_spec(hf_path, dtype=dtype), optim=optim)
    free = policy.score(Batch(ids, lengths), record_routes=True)
    replay = policy.score(Batch(ids, lengths, free["routes"]))
    before = snapshot(policy)
    shard = Batch(ids, lengths, free["routes"], **policy_tensors(replay["logp"], mask, adv))
    policy_step = policy.train_step(shard, policy_loss(), Denominator(mask))
    out = {"device": str(policy.device), "free": free, "replay": replay, "policy_step": policy_step,
           "policy_moved": largest_change(policy, before)}

    critic = TrainWorker(model_spec(hf_path, dtype=dtype, routing_replay=False), role="critic", optim=optim)
    before = snapshot(critic)
    values = Batch(ids, lengths, mask_BS=mask, returns_BS=critic_returns(), values_old_BS=torch.zeros(B, S))
    out["critic_step"] = critic.train_step(values, ValueLoss(None), Denominator(mask))
    out["critic_moved"] = largest_change(critic, before)
    return out


@pytest.fixture(scope="module")
def fp32(tiny_qwen):
    return run_ranks(local_job, 1, (str(tiny_qwen), "float32"))[0]


@pytest.fixture(scope="module")
def bf16(tiny_qwen):
    return run_ranks(local_job, 1, (str(tiny_qwen), "bfloat16"))[0]


def valid_positions() -> torch.Tensor:
    _, lengths, _, _ = batch_tensors()
    return torch.arange(S).expand(B, S) < lengths.unsqueeze(1)


def largest_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() * valid_positions()).max())


def test_fp32_scores_match_transformers_on_gpu(fp32, tiny_qwen):
    exact_fp32_matmuls()
    ids, _, _, _ = batch_tensors()
    assert fp32["device"] == "cuda:0"
    assert largest_gap(fp32["free"]["logp"], hf_token_logprobs(tiny_qwen, ids, device="cuda")) <= 1e-5


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_steps_change_the_weights(fp32, role):
    step = fp32[f"{role}_step"]
    assert step["update_ok"] == 1.0
    assert torch.isfinite(torch.tensor([step["loss"], step["grad_norm"]])).all() and step["grad_norm"] > 0
    assert 0 < fp32[f"{role}_moved"] < float("inf")


def test_replaying_recorded_routes_equals_free_routing(fp32):
    routes = fp32["free"]["routes"]
    assert routes.shape == (B, S, 2, 2) and int(routes.max()) < 4  # 2 MoE layers, top-2 of 4 experts
    assert largest_gap(fp32["replay"]["logp"], fp32["free"]["logp"]) <= 1e-6


def test_bf16_runs_near_fp32(fp32, bf16):
    valid = valid_positions()
    gap_BS = (bf16["free"]["logp"] - fp32["free"]["logp"]).abs() * valid
    mean, largest = float(gap_BS.sum() / valid.sum()), float(gap_BS.max())
    print(f"\nbf16 vs fp32 log-probs on the GPU: mean |gap| {mean:.3g}, max {largest:.3g}")
    for role in ("policy", "critic"):
        assert torch.isfinite(torch.tensor(bf16[f"{role}_step"]["loss"])) and bf16[f"{role}_moved"] > 0
    assert mean < 0.05 and largest < 0.5  # loose: bf16 keeps 8 bits of mantissa
