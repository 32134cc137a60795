"""GPU path: Transformer Engine layer spec, FP8 recipes, NCCL, vLLM's routes and weight transfers.
Skipped on CPU machines; run on a GPU machine with `python -m pytest -m gpu tests/train/test_gpu.py`.

Each test is skipped where it cannot pass: too few GPUs for what it starts (its ranks, or its run's
`cfg.gpus`), or no Transformer Engine / vLLM where it needs them. The runs' configs are module
constants: tests/train/test_gpu_configs.py loads them on the CPU and checks each one's GPU count
against the count its skip condition admits."""

import importlib

import pytest
import torch
from glossary_check import assert_tags_in_glossary

from moe_rl.train.hf_parity import exact_fp32_matmuls, hf_token_logprobs
from moe_rl.train.launch_local import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def needs_gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPU{'s' if n > 1 else ''}")


def needs(module: str):
    """Import `module` or skip: Transformer Engine and vLLM's GPU build are the `gpu` extra's."""
    return pytest.importorskip(module, reason=f"needs {module} (pip install 'moe-rl[gpu]')")

# Transformer Engine runs every fp32 GEMM in TF32 (cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32, whatever torch's
# flags say): 10 mantissa bits. Rounding the inputs of this model's layer GEMMs to TF32 on the CPU moves its
# log-probs of the test batch by 5.7e-4 at most (1.8e-4 on average) from fp32's.
TF32_GAP = 1e-3


def te_ids() -> torch.Tensor:
    """The batch te_job scores: [4, 32] token ids, every row whole."""
    return torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))


def te_job(rank, world, hf_path, fp8, tp):
    from conftest import model_spec, optim_spec

    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    exact_fp32_matmuls()  # torch's own products (router, output layer) in full fp32: only TE's GEMMs are TF32
    parallel.init_distributed(parallel.Layout(tp=tp))
    assert torch.distributed.get_backend() == "nccl"
    spec = model_spec(hf_path, layer_spec="transformer_engine", fp8=fp8,
                      dtype="bfloat16" if fp8 != "none" else "float32")
    w = TrainWorker(spec, optim=optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    ids = te_ids()  # on the CPU, as from Ray: the worker moves it
    lengths = torch.full((4,), 32)
    out = w.score(Batch(ids, lengths))
    return {k: v.cpu() for k, v in out.items() if k != "routes"}


def test_te_spec_matches_transformers(tiny_qwen):
    needs("transformer_engine.pytorch")
    res = run_ranks(te_job, 1, (str(tiny_qwen), "none", 1))[0]
    ref = hf_token_logprobs(tiny_qwen, te_ids())  # transformers in fp32 on the CPU
    assert float((res.logp_BS[:, 1:] - ref[:, 1:]).abs().max()) < TF32_GAP  # TE's TF32 GEMMs


def fp8_support(recipe: str) -> tuple[bool, str]:
    """Transformer Engine's own answer for this GPU (FP8 itself needs compute capability 8.9+, MXFP8
    Blackwell, blockwise scaling Hopper with CUDA 12.9+; TE knows its exceptions)."""
    needs("transformer_engine.pytorch")
    check = {"delayed": "check_fp8_support", "tensorwise": "check_fp8_support",
             "blockwise": "check_fp8_block_scaling_support", "mxfp8": "check_mxfp8_support"}[recipe]
    # TE 2.8+, before
    for where in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            return getattr(importlib.import_module(where), check)()
        except (ImportError, AttributeError):
            continue
    return False, f"this Transformer Engine has no {check}"


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_recipe_scores_near_fp32(tiny_qwen, recipe):
    supported, why = fp8_support(recipe)
    if not supported:
        pytest.skip(f"FP8 {recipe} on this GPU: {why}")
    res = run_ranks(te_job, 1, (str(tiny_qwen), recipe, 1))[0]
    assert torch.isfinite(res.logp_BS).all()
    gap = (res.logp_BS - hf_token_logprobs(tiny_qwen, te_ids()))[:, 1:].abs()  # vs transformers in fp32
    print(f"\nFP8 {recipe} vs fp32 log-probs: mean |gap| {float(gap.mean()):.3g}, max {float(gap.max()):.3g}")
    # FP8 (E4M3 forward: 3 mantissa bits, rounding 2^-4 relative) in the layers' GEMMs, bf16 (2^-8) the
    # compute dtype elsewhere: loose bounds, by the figures of a CPU simulation on this model and batch
    # (E4M3 quantisation of every layer GEMM's inputs and weights, per tensor or per 32 values, in bf16):
    # |gap| 0.028 on average, 0.2 at most (where a near-tie of the router flips an expert). The reference's
    # log-probs lie 0.33 from their mean on average: a path that lost the model's signal fails the mean.
    assert float(gap.mean()) < 0.1 and float(gap.max()) < 1.0


@needs_gpus(2)
def test_nccl_tp2(tiny_qwen):
    needs("transformer_engine.pytorch")
    one = run_ranks(te_job, 1, (str(tiny_qwen), "none", 1))[0]
    two = run_ranks(te_job, 2, (str(tiny_qwen), "none", 2))
    assert float((two[0].logp_BS - one.logp_BS).abs().max()) < TF32_GAP
    ref = hf_token_logprobs(tiny_qwen, te_ids())  # and each rank scores as transformers in fp32 does
    for r in two:
        assert float((r.logp_BS[:, 1:] - ref[:, 1:]).abs().max()) < TF32_GAP


def vllm_routes_job(rank, world, model_path):
    from conftest import engine_spec

    from moe_rl.rollout.engine import RolloutEngine, Sampling

    engine = RolloutEngine(engine_spec(model_path, route_source="vllm", seed=0))
    first = engine.generate([[257, 84, 82, 68]], Sampling(max_tokens=6, seed=1))[0]
    start = first.routes.num_positions
    nxt = engine.generate([first.prompt_ids + first.token_ids + [198]],
                          Sampling(max_tokens=4, seed=2, routes_from=start))[0]
    return {"first": first, "next": nxt, "start": start, "source": engine.route_source}


def test_vllm_returns_routes_from_the_requested_position(tiny_qwen):
    from moe_rl.train.launch_local import run_in_process

    needs("vllm")
    out = run_in_process(vllm_routes_job, (str(tiny_qwen),))
    first, nxt, start = out["first"], out["next"], out["start"]
    assert out["source"] == "vllm"
    assert first.routes.computed_P.all() and start == len(first.prompt_ids) + len(first.token_ids) - 1
    end = len(nxt.prompt_ids) + len(nxt.token_ids) - 1
    assert not nxt.routes.computed_P[:start].any() and nxt.routes.computed_P[start:end].all()


# quickstart.yaml's critic settings back to their defaults: without a critic nothing reads them (refused)
NO_CRITIC = ["algorithm.advantage=grpo", "critic.lr=1e-5", "critic.value_clip=0.2"]
# the quickstart, two short steps of GRPO (no critic: two policy ranks fewer), routes from vLLM
LOOP = ["run.steps=2", "trainer.warm_start_steps=1", "trainer.eval_prompts=0", "trainer.eval_every=0",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2", "logging.progress_bar=false", "rollout.route_source=vllm",
        # GPU kernels of vLLM and the trainer differ by more than the synchronous check's 1e-3
        "algorithm.correction=tis_token", *NO_CRITIC]
# rollout.weight_transfer -> (the run's overrides of configs/quickstart.yaml, the GPUs it needs: cfg.gpus)
TRANSFER_RUNS = {
    # trainer rank 0 and the engine join one NCCL group, which refuses two ranks on one GPU: each on its own
    "nccl": ([*LOOP, "rollout.weight_transfer=nccl", "cluster.colocate=false"], 2),
    # CUDA IPC hands the engine handles to the trainer's memory: both on the one GPU
    "ipc": ([*LOOP, "rollout.weight_transfer=ipc", "cluster.colocate=true"], 1),
}


@pytest.mark.parametrize("transfer", [pytest.param(name, marks=needs_gpus(gpus))
                                      for name, (_, gpus) in TRANSFER_RUNS.items()])
def test_loop_with_vllm_weight_transfer(tmp_path, transfer):
    import subprocess
    import sys

    from conftest import ROOT
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    needs("vllm")
    overrides, _ = TRANSFER_RUNS[transfer]
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "configs/quickstart.yaml",
           f"run.output_dir={tmp_path}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"weight sync: {transfer}" in proc.stdout
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "quickstart"))  # run.name
    acc.Reload()
    assert_tags_in_glossary(tmp_path / "tensorboard" / "quickstart")
    # after the syncs the engine scores like the trainer (R3 routes from vLLM itself). Both compute in fp32:
    # the trainer's products in full fp32, vLLM's dense layers too (VLLM_FLOAT32_MATMUL_PRECISION=highest);
    # its Triton attention and fused-MoE kernels' tl.dot take fp32 in TF32, whose rounding moves this
    # model's log-probs by ~2e-4 on average (see TF32_GAP). A bf16 path would show ~4e-3 (CPU simulation).
    assert max(e.value for e in acc.Scalars("correction/logp_mismatch_mean")) < 2e-3
