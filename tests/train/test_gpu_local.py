"""GPU path of the local layer spec (megatron-core's own layers, torch SDPA attention; no Transformer
Engine, vLLM or Ray): one rank on cuda:0, started by run_ranks, scores like transformers on the GPU,
trains the policy and the critic, replays the routes it recorded on packed microbatches as on unpacked
ones, hands its memory to the host and back bitwise (HostCopies), gathers a context-parallel sequence
on CUDA, compiles nothing (torch.compile), and runs in bf16. Skipped on CPU machines; run on a GPU
machine with `python -m pytest -m gpu tests/train/test_gpu_local.py` (part of `tools/gpu_check.sh`)."""

from dataclasses import replace

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


def state(worker) -> dict[str, torch.Tensor]:
    """Copies of everything an offload moves: parameters and the optimizer's tensors, by name."""
    out = {f"param.{n}": p.detach().clone() for n, p in worker.module.named_parameters()}
    for c, opt in enumerate(getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])):
        inner = opt.optimizer
        for i, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"opt.{c}.{i}.{j}"] = p.detach().clone()
                for k, v in inner.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"opt.{c}.{i}.{j}.{k}"] = v.clone()
    return out


def offload_round_trip(worker) -> dict:
    """offload (device memory freed: on CUDA, counted) then onload: every tensor back bitwise, where it
    was."""
    cuda = worker.device.type == "cuda"
    before, held = state(worker), torch.cuda.memory_allocated() if cuda else 0
    moved = worker.offload()
    freed = held - torch.cuda.memory_allocated() if cuda else None
    worker.onload()
    after = state(worker)
    return {"moved": moved, "freed": freed, "same": all(torch.equal(before[k], after[k]) for k in before),
            "elsewhere": [k for k in before if before[k].device != after[k].device], "names": len(before),
            "params_on": sorted({str(t.device) for k, t in after.items() if k.startswith("param.")})}


def cp_gather_round_trip(device: torch.device) -> dict:
    """train/context.py's gather over this rank's (one-rank) context-parallel group, on `device`:
    forward and backward, through the indices it builds."""
    from megatron.core import parallel_state as ps

    from moe_rl.train.context import gather_sequence

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 8, 3, device=device, generator=g, requires_grad=True)
    upstream = torch.randn(2, 8, 3, device=device, generator=g)
    out = gather_sequence(x, 1, ps.get_context_parallel_group())
    out.backward(upstream)
    return {"device": str(out.device), "forward": torch.equal(out, x),
            "backward": torch.equal(x.grad, upstream)}


def attempt(fn, *args):
    """fn(*args), or {"error": ...}: one failing check reports as its own test, not as all of them."""
    import traceback

    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc(limit=-4)}


def unpacked_replay(hf_path, dtype, optim, batch) -> dict:
    from conftest import model_spec

    from moe_rl.train.worker import TrainWorker

    unpacked = TrainWorker(model_spec(hf_path, dtype=dtype), optim=replace(optim, pack_sequences=False))
    return {"logp": unpacked.score(batch).logp_BS, "packs": unpacked._packs()}


def local_job(rank, world, hf_path, dtype, checks=False):
    """One rank in `dtype`, batches given on the CPU (as from Ray: the worker moves them). Free scores
    with the routes they took, the same batch with those routes replayed, one PPO step on the replayed
    routes, then a critic and one value step; with how far each step moved the weights. `checks`: also
    replay on unpacked microbatches, an offload round trip followed by a second step, a CP gather, and
    torch.compile's counters at the end."""
    from conftest import model_spec, optim_spec
    from torch._dynamo.utils import counters

    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.objectives import ValueLoss
    from moe_rl.train.worker import TrainWorker

    exact_fp32_matmuls()
    parallel.init_distributed(parallel.Layout())
    ids, lengths, mask, adv = batch_tensors()
    # production's packed microbatches, two of them here; eps 1e-4 as the CPU tests
    optim = optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24)
    policy = TrainWorker(model_spec(hf_path, dtype=dtype), optim=optim)
    free = policy.score(Batch(ids, lengths), record_routes=True)
    replay = policy.score(Batch(ids, lengths, free.routes_BSLK))
    out = {"device": str(policy.device), "free": free, "replay": replay}
    if checks:  # the same weights, each row its own microbatch row (right-padded), the routes replayed
        out["replay_unpacked"] = attempt(unpacked_replay, hf_path, dtype, optim,
                                         Batch(ids, lengths, free.routes_BSLK))
        out["packs"] = policy._packs()
    before = snapshot(policy)
    shard = Batch(ids, lengths, free.routes_BSLK, **policy_tensors(replay.logp_BS, mask, adv))
    out["policy_step"] = policy.train_step(shard, policy_loss(), Denominator(mask)).figures
    out["policy_moved"] = largest_change(policy, before)
    if checks:
        out["offload"] = attempt(offload_round_trip, policy)
        out["step_after_onload"] = attempt(lambda: policy.train_step(shard, policy_loss(),
                                                                     Denominator(mask)).figures)
        out["cp_gather"] = attempt(cp_gather_round_trip, policy.device)

    critic = TrainWorker(model_spec(hf_path, dtype=dtype, routing_replay=False), role="critic", optim=optim)
    before = snapshot(critic)
    values = Batch(ids, lengths, mask_BS=mask, returns_BS=critic_returns(), values_old_BS=torch.zeros(B, S))
    out["critic_step"] = critic.train_step(values, ValueLoss(None), Denominator(mask)).figures
    out["critic_moved"] = largest_change(critic, before)
    out["compiled"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "inductor", "aot_autograd")}
    return out


@pytest.fixture(scope="module")
def fp32(tiny_qwen):
    return run_ranks(local_job, 1, (str(tiny_qwen), "float32", True))[0]


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
    assert largest_gap(fp32["free"].logp_BS, hf_token_logprobs(tiny_qwen, ids, device="cuda")) <= 1e-5


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_steps_change_the_weights(fp32, role):
    step = fp32[f"{role}_step"]
    assert step["update_ok"] == 1.0
    assert torch.isfinite(torch.tensor([step["loss"], step["grad_norm"]])).all() and step["grad_norm"] > 0
    assert 0 < fp32[f"{role}_moved"] < float("inf")


def test_replaying_recorded_routes_equals_free_routing(fp32):
    routes = fp32["free"].routes_BSLK
    assert routes.shape == (B, S, 2, 2) and int(routes.max()) < 4  # 2 MoE layers, top-2 of 4 experts
    assert largest_gap(fp32["replay"].logp_BS, fp32["free"].logp_BS) <= 1e-6


def test_bf16_runs_near_fp32(fp32, bf16):
    valid = valid_positions()
    gap_BS = (bf16["free"].logp_BS - fp32["free"].logp_BS).abs() * valid
    mean, largest = float(gap_BS.sum() / valid.sum()), float(gap_BS.max())
    print(f"\nbf16 vs fp32 log-probs on the GPU: mean |gap| {mean:.3g}, max {largest:.3g}")
    for role in ("policy", "critic"):
        assert torch.isfinite(torch.tensor(bf16[f"{role}_step"]["loss"])) and bf16[f"{role}_moved"] > 0
    assert mean < 0.05 and largest < 0.5  # loose: bf16 keeps 8 bits of mantissa


def test_packed_microbatches_replay_as_unpacked_ones(fp32):
    unpacked = fp32["replay_unpacked"]
    assert "error" not in unpacked, unpacked.get("error")
    assert fp32["packs"] and not unpacked["packs"]  # production packs; the reference does not
    assert largest_gap(fp32["replay"].logp_BS, unpacked["logp"]) <= 1e-5


def test_grouped_experts_on_cuda_match_sequential_in_bf16(tiny_qwen):
    """model.experts=grouped (torch._grouped_mm, bf16 on Hopper) against SequentialMLP on the same weights
    and replayed routes: log-probs within bf16's rounding, every gradient within 2% of its norm."""
    from expert_jobs import experts_job

    out = run_ranks(experts_job, 1, (str(tiny_qwen), {}, 0, "bfloat16"))[0]
    seq, grouped = out["sequential"], out["grouped"]
    assert grouped["module"] == {"GroupedExperts"}
    assert float((grouped["logp"] - seq["logp"]).abs().max()) < 0.05
    for name, grad in seq["grads"].items():
        other = grouped["grads"][name].float()
        assert float((other - grad.float()).norm()) <= 0.02 * float(grad.float().norm()) + 1e-6, name


def test_offload_round_trip_on_cuda(fp32):
    trip, step = fp32["offload"], fp32["step_after_onload"]
    assert "error" not in trip and "error" not in step, trip.get("error") or step.get("error")
    # parameters, gradient buffers, Adam's state: off the GPU (the allocator's blocks round sizes up)
    assert trip["moved"] > 0 and trip["freed"] >= 0.9 * trip["moved"]
    # back bitwise, each tensor where it was (Adam's step counts stay on the host, as torch keeps them)
    assert trip["same"] and not trip["elsewhere"] and trip["params_on"] == ["cuda:0"]
    assert step["update_ok"] == 1.0 and torch.isfinite(torch.tensor(step["loss"]))


def test_context_parallel_gather_on_cuda(fp32):
    assert fp32["cp_gather"] == {"device": "cuda:0", "forward": True, "backward": True}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nothing_is_compiled(request, dtype):
    """The local spec's kernels are warm after the first call: no torch.compile graph (megatron's fused
    bias-activation would recompile per expert token count)."""
    compiled = request.getfixturevalue(dtype)["compiled"]
    assert compiled.get("stats", {}).get("unique_graphs", 0) == 0 and not compiled.get("inductor"), compiled


def test_optimizer_offload_takes_the_same_steps(tiny_qwen):
    """trainer.optimizer_offload=1.0: megatron's HybridDeviceOptimizer keeps every fp32 shard's Adam state in
    host memory and steps it there (torch's CPU AdamW); three updates land where the GPU's Adam lands them
    (fp32: the same loss each step to 1e-6, the log-probs after to 1e-5)."""
    from train_jobs import optimizer_offload_job

    on_gpu, on_host = (run_ranks(optimizer_offload_job, 1, (str(tiny_qwen), {}, f))[0] for f in (0.0, 1.0))
    assert on_host["inner"] == ["HybridDeviceOptimizer"] and "HybridDeviceOptimizer" not in on_gpu["inner"]
    for a, b in zip(on_gpu["figures"], on_host["figures"], strict=True):
        assert a["update_ok"] == b["update_ok"] == 1.0
        assert abs(a["loss"] - b["loss"]) <= 1e-6
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
    assert on_gpu["figures"][0]["loss"] != on_gpu["figures"][-1]["loss"]  # the steps moved the policy
    assert largest_gap(on_gpu["after"], on_host["after"]) <= 1e-5


# last: the newest, never run on a GPU yet (a run out of time cuts it alone)
def test_the_precision_aware_optimizer_under_offload_takes_offloads_steps(tiny_qwen):
    """trainer.precision_aware_optimizer with optimizer_offload=1.0 (slime's Qwen3-30B-A3B recipe; no
    Transformer Engine needed), a bf16 model: the host optimizer owns the fp32 main weights instead of the
    distributed optimizer's GPU copy, and three updates land where offload alone lands them (both keep
    fp32 main weights on the host and step them with torch's CPU AdamW)."""
    from train_jobs import optimizer_offload_job

    plain, aware = (run_ranks(optimizer_offload_job, 1, (str(tiny_qwen), {}, 1.0, 3, p, "bfloat16"))[0]
                    for p in (False, True))
    assert aware["inner"] == plain["inner"] == ["HybridDeviceOptimizer"]
    for a, b in zip(plain["figures"], aware["figures"], strict=True):
        assert a["update_ok"] == b["update_ok"] == 1.0
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"]))
    assert largest_gap(plain["after"], aware["after"]) <= 2e-2  # bf16 log-probs
