"""Benchmark: where the trainer's bfloat16 computation leaves the engine's, layer by layer, on the CPU.

The reference is transformers' model in bfloat16, whose MoE gate computes as vLLM's does for Qwen3-MoE and
Mixtral (a bfloat16 GEMM, softmax in float32); transformers in float32 says what bfloat16 itself costs.
For each architecture, a tiny random model (moe_rl.tiny), B x S random tokens, the Megatron trainer in
bfloat16 (one rank, gloo) with its router as production builds it (model.router_dtype) and with a float32
router:

  routes_agree          the share of (token, layer, k) expert choices of the trainer routing freely that
                        equal transformers' bfloat16 ones (as sets per token)
  free_max, free_mean   |log-prob gap| to transformers' bfloat16, the trainer routing freely
  replayed_max          the same with transformers' routes replayed (R3): the gap that is not routing
  layers_max            per decoder layer, the largest |residual stream gap| (replayed), the last layer
                        left out (transformers gives it after the final norm)

    python tools/bench/bf16_gap.py [--archs qwen3_moe,mixtral] [--rows 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch

ARCHS_WITH_TOPK_ROUTES = ("qwen3_moe", "mixtral")  # whose routes are the top-k of transformers' router logits


def hf_run(path: str, ids: torch.Tensor, dtype: torch.dtype):
    """transformers' token log-probs [B, S], residual stream after each layer, and routes [B, S, L, k]."""
    from transformers import AutoModelForCausalLM

    from moe_rl.train.hf_parity import hf_token_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    B, S = ids.shape
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_router_logits=True)
    k = model.config.num_experts_per_tok
    routes = torch.stack([r.float().topk(k, -1).indices.view(B, S, k) for r in out.router_logits], 2)
    return hf_token_logprobs(path, ids, dtype=dtype), [h.float() for h in out.hidden_states], routes


def trainer(path: str, router: str | None):
    """A bfloat16 TrainWorker with its router as built (router=None) or as `router` says, and a dict its
    decoder layers' outputs land in ([B*S, h] packed rows, by layer index)."""
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs
    from moe_rl.train.worker import TrainWorker

    cfg = RunConfig()
    w = TrainWorker(dataclasses.replace(specs.model_spec(cfg, path), dtype="bfloat16"),
                    optim=specs.optim_spec(cfg, 1e-6, {}))
    if router is not None:
        w.config.moe_router_dtype = router
    caught: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(w.module.decoder.layers):
        def keep(module, args, out, i=i):
            caught[i] = (out[0] if isinstance(out, tuple) else out).detach().float()

        layer.register_forward_hook(keep)
    return w, caught


def same_experts(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.long().sort(-1).values == b.long().sort(-1).values).float().mean())


def measure(arch: str, rows: int, seq: int, tmp: str) -> dict:
    from moe_rl.batch import Batch
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.train.model import router_dtype

    path = str(build_tiny_checkpoint(os.path.join(tmp, arch), TinyModel(arch=arch), seed=0))
    ids = torch.randint(0, 300, (rows, seq), generator=torch.Generator().manual_seed(1))
    lengths = torch.full((rows,), seq)
    hf32, _, routes32 = hf_run(path, ids, torch.float32)
    hf16, hidden16, routes16 = hf_run(path, ids, torch.bfloat16)
    gap = (hf16 - hf32).abs()[:, 1:]
    out = {"arch": arch, "hf_bf16_vs_fp32_max": float(gap.max()), "hf_bf16_vs_fp32_mean": float(gap.mean()),
           "hf_routes_bf16_vs_fp32": same_experts(routes16, routes32)}
    from transformers import AutoConfig

    built = router_dtype(AutoConfig.from_pretrained(path)) or "bf16"
    for name, router in ((f"router_{built}_as_built", None), ("router_fp32", "fp32")):
        if router == "fp32" and built == "fp32":
            continue
        w, caught = trainer(path, router)
        free = w.score(Batch(ids, lengths), record_routes=True)
        gap = (free.logp_BS - hf16).abs()[:, 1:]
        arm = {"free_max": float(gap.max()), "free_mean": float(gap.mean())}
        if arch in ARCHS_WITH_TOPK_ROUTES:
            arm["routes_agree"] = same_experts(free.routes_BSLK, routes16)
            replayed = w.score(Batch(ids, lengths, routes16.to(torch.int16)))
            arm["replayed_max"] = float((replayed.logp_BS - hf16).abs()[:, 1:].max())
            arm["layers_max"] = [float((caught[i].reshape(rows, seq, -1) - hidden16[i + 1]).abs().max())
                                 for i in range(len(caught) - 1)]
        out[name] = arm
    return out


def report(figures: dict) -> None:
    print(f"{figures['arch']}: transformers bf16 vs fp32: log-prob gap max "
          f"{figures['hf_bf16_vs_fp32_max']:.4f}, routes agree {figures['hf_routes_bf16_vs_fp32']:.4f}")
    for name, arm in figures.items():
        if not isinstance(arm, dict):
            continue
        line = f"  trainer bf16, {name}: free max {arm['free_max']:.4f} mean {arm['free_mean']:.5f}"
        if "routes_agree" in arm:
            layers = " ".join(f"{x:.4f}" for x in arm["layers_max"])
            line += (f", routes agree {arm['routes_agree']:.4f}, replayed max {arm['replayed_max']:.4f}, "
                     f"per layer {layers}")
        print(line)
    print(json.dumps({"bench": "bf16_gap", **figures}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="qwen3_moe,mixtral,qwen2_moe,deepseek_v3,glm4_moe",
                    help="each measured in a process of its own (megatron-core's MLA config leaves "
                         "settings behind in its process)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    archs = args.archs.split(",")
    if len(archs) > 1:
        for arch in archs:
            subprocess.run([sys.executable, __file__, "--archs", arch, "--rows", str(args.rows), "--seq",
                            str(args.seq)], check=True)
        return
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", "29571")
    from moe_rl.train import parallel

    parallel.init_distributed(parallel.Layout(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="moe_rl_bf16_gap_") as tmp:
        report(measure(archs[0], args.rows, args.seq, tmp))
    parallel.shutdown()


if __name__ == "__main__":
    main()
