"""GPU path: Transformer Engine layer spec, FP8 recipes and NCCL. Skipped on CPU machines; run on a
GPU machine with `python -m pytest -m gpu tests/train/test_gpu.py`."""

import pytest
import torch

from moe_rl.train.launch_local import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def te_job(rank, world, hf_path, fp8, tp):
    from conftest import model_spec, optim_settings

    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(tp=tp))
    assert torch.distributed.get_backend() == "nccl"
    spec = model_spec(hf_path, layer_spec="transformer_engine", fp8=fp8, dtype="bfloat16" if fp8 != "none" else "float32")
    w = TrainWorker(spec, optim=optim_settings(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (4, 32), generator=g)  # on the CPU, as from Ray: the worker moves it
    lengths = torch.full((4,), 32)
    out = w.score(Batch(ids, lengths))
    return {k: v.cpu() for k, v in out.items() if k != "routes"}


def test_te_spec_matches_transformers(tiny_qwen):
    from transformers import AutoModelForCausalLM

    res = run_ranks(te_job, 1, (str(tiny_qwen), "none", 1))[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (4, 32), generator=g)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), -1)
    ref = lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert float((res["logp"][:, 1:] - ref).abs().max()) < 1e-3  # TF32 / TE kernels


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_recipe_runs(tiny_qwen, recipe):
    # Transformer Engine's own requirements: MXFP8 runs on Blackwell (compute capability 10.0) and
    # newer; blockwise scaling needs Hopper and a CUDA 12.9+ build
    major = torch.cuda.get_device_capability()[0]
    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if recipe == "mxfp8" and major < 10:
        pytest.skip("MXFP8 needs compute capability 10.0 (Blackwell) or newer")
    if recipe == "blockwise" and (major < 9 or cuda < (12, 9)):
        pytest.skip("blockwise FP8 needs Hopper or newer and CUDA 12.9+")
    res = run_ranks(te_job, 1, (str(tiny_qwen), recipe, 1))[0]
    assert torch.isfinite(res["logp"]).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_tp2(tiny_qwen):
    one = run_ranks(te_job, 1, (str(tiny_qwen), "none", 1))[0]
    two = run_ranks(te_job, 2, (str(tiny_qwen), "none", 2))
    assert float((two[0]["logp"] - one["logp"]).abs().max()) < 1e-3


def vllm_routes_job(rank, world, model_path):
    from conftest import engine_settings

    from moe_rl.rollout.engine import RolloutEngine, Sampling

    engine = RolloutEngine(engine_settings(model_path, route_source="vllm", seed=0))
    first = engine.generate([[257, 84, 82, 68]], Sampling(max_tokens=6, seed=1))[0]
    start = first.routes.num_positions
    nxt = engine.generate([first.prompt_ids + first.token_ids + [198]], Sampling(max_tokens=4, seed=2, routes_from=start))[0]
    return {"first": first, "next": nxt, "start": start, "source": engine.route_source}


def test_vllm_returns_routes_from_the_requested_position(tiny_qwen):
    from moe_rl.train.launch_local import run_in_process

    out = run_in_process(vllm_routes_job, (str(tiny_qwen),))
    first, nxt, start = out["first"], out["next"], out["start"]
    assert out["source"] == "vllm"
    assert first.routes.computed_P.all() and start == len(first.prompt_ids) + len(first.token_ids) - 1
    end = len(nxt.prompt_ids) + len(nxt.token_ids) - 1
    assert not nxt.routes.computed_P[:start].any() and nxt.routes.computed_P[start:end].all()


@pytest.mark.parametrize("transfer", ["nccl", "ipc"])
def test_loop_with_vllm_weight_transfer(tmp_path, transfer):
    import subprocess
    import sys

    from conftest import ROOT
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "configs/quickstart.yaml", f"run.output_dir={tmp_path}",
           "run.steps=2", "trainer.warm_start_steps=1", "trainer.eval_prompts=0", "rollout.prompts_per_step=4",
           "rollout.samples_per_prompt=2", "logging.progress_bar=false", f"rollout.weight_transfer={transfer}",
           "rollout.route_source=vllm",
           # GPU kernels of vLLM and the trainer differ by more than the synchronous check's 1e-3
           "algorithm.correction=tis_token"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"weight sync: {transfer}" in proc.stdout
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "quickstart"))  # run.name
    acc.Reload()
    # after the syncs the engine scores like the trainer (R3 routes from vLLM itself)
    assert max(e.value for e in acc.Scalars("correction/logp_mismatch_mean")) < 1e-2
