"""Helpers of tests/test_loop.py: a rank job scoring a run's checkpoints, a hand count of a step's expert
load, the engine processes of a run, the wait for a run's checkpoint."""

import subprocess
import time
from pathlib import Path

import pytest
import torch


def score_checkpoint_job(rank, world, step_dir, ids_BS):
    """One rank (spawned by run_ranks): the run's own trainers, policy and critic, built without HF
    weights and loaded from a checkpoint of the run, score whole rows of ids_BS (routers choosing
    freely, as transformers does): {"logp_BS": the policy's [B, S], "critic_out_BS": the critic's [B, S]}."""
    from conftest import model_spec, optim_spec

    from moe_rl.batch import Batch
    from moe_rl.train import checkpoint, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    batch = Batch(ids_BS, torch.full((ids_BS.shape[0],), ids_BS.shape[1]))
    optim = optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False)
    out = {}
    for role, key in (("policy", "logp_BS"), ("critic", "critic_out_BS")):
        ckpt = Path(step_dir) / role
        spec = model_spec(ckpt / "hf_config", routing_replay=False)
        worker = TrainWorker(spec, role=role, load_weights=False, optim=optim)
        checkpoint.load(worker, ckpt, optimizer=False)
        out[key] = getattr(worker.score(batch), key)
    return out


def hand_counted_expert_load(figures: dict, checkpoint: Path, num_experts: int) -> None:
    """The step's logged expert load equals a count, in plain Python, of the routes the engine computed
    in the checkpoint's kept rollout (every (position, slot) with a route, per layer)."""
    import math

    from moe_rl.driver.run_checkpoints import read_in_flight

    trajs = [t for ts, _ in read_in_flight(checkpoint)[0].results for t in ts]
    layers = trajs[0].routes.experts_PLK.shape[1]
    for layer in range(layers):
        counts = [0] * num_experts
        for t in trajs:
            for p, computed in enumerate(t.routes.computed_P[:len(t.token_ids)]):
                for e in (t.routes.experts_PLK[p, layer].tolist() if computed else []):
                    counts[e] += 1
        share = [c / sum(counts) for c in counts]
        entropy = -sum(x * math.log(x) for x in share if x > 0) / math.log(num_experts)
        assert figures[f"moe/rollout_layer{layer:02d}_load_imbalance"] == pytest.approx(max(share)
                                                                                        * num_experts)
        assert figures[f"moe/rollout_layer{layer:02d}_usage_entropy"] == pytest.approx(entropy)


def descendants(pid: int) -> list:
    """[(process, its command line as a list)] of `pid`'s descendants. A descendant may end while they are
    listed (Ray's short-lived helpers: a CI run met one as a zombie): it is left out."""
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out.append((p, p.cmdline()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return out


def engine_processes(pid: int) -> list:
    """The engine actors' processes among the run's (`pid`'s) descendants."""
    return [p for p, cmd in descendants(pid) if "RolloutActor" in " ".join(cmd)]


def wait_for_checkpoint(proc: subprocess.Popen, path: Path, poll_s: float, timeout_s: float = 600) -> None:
    """Until the run `proc` has written `path`; a run that ends first, or outlasts `timeout_s`, fails the
    test with the end of its stderr."""
    deadline = time.time() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"run ended before {path.name} (exit {proc.poll()}):\n"
                        + (proc.communicate(timeout=60)[1] if proc.poll() is not None else "")[-3000:])
        time.sleep(poll_s)
