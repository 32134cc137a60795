"""Benchmark: data-parallel shards cut by row count vs by estimated compute, on long-tailed episodes.

Two data-parallel Megatron ranks (gloo, one CPU thread each) train a small MoE on the same batch of
long-tailed lengths (most rows short, a few --long rows), its rows cut into the two shards the
production way (train.parallel.dp_partition: trainer.dp_balance=count, consecutive runs of equal count;
=cost, balanced by train.parallel.row_cost, tokens plus attention's quadratic term). The two cuts
alternate round by round (noise hits both alike); medians over --rounds:

  step_s_count / step_s_cost   a training step (forward + backward over the shard, the gradient
                               all-reduce, Adam): the slower replica sets it
  step_time_ratio              step_s_count / step_s_cost (> 1: balancing saves that factor)
  imbalance_estimated_*        max / mean of the replicas' estimated cost (1: balanced)
  imbalance_measured_*         max / mean of the replicas' wall time of a scoring pass over their shard
                               (forward only: replicas do not wait for each other)

Prints one JSON line with these.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def lengths_of(rows: int, long_rows: int, short: int, long: int, seed: int) -> torch.Tensor:
    """Long-tailed lengths: `rows - long_rows` rows of short..2*short tokens, `long_rows` of `long`, the long
    ones at random places."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(short, 2 * short + 1, (rows,), generator=g)
    lengths[torch.randperm(rows, generator=g)[:long_rows]] = long
    return lengths


def job(rank, world, path, lengths, rounds, hidden):
    from moe_rl.batch import Batch
    from moe_rl.config import RunConfig, TrainerSection
    from moe_rl.driver.specs import model_spec, optim_spec
    from moe_rl.train import parallel
    from moe_rl.train.objectives import SftLoss
    from moe_rl.train.worker import TrainWorker

    torch.set_num_threads(1)
    parallel.init_distributed(parallel.Layout())
    cfg = RunConfig(trainer=TrainerSection(micro_batch_tokens=4096))
    w = TrainWorker(model_spec(cfg, path), optim=optim_spec(cfg, lr=1e-6, lr_mult={}))
    B, S = len(lengths), int(lengths.max())
    ids = torch.randint(0, 300, (B, S), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    batch = Batch(ids, lengths, mask_BS=mask)
    cost = parallel.row_cost(lengths, 6.0 * hidden)
    shards = {b: batch.rows(parallel.dp_partition(cost, world, b)[rank]) for b in parallel.DP_BALANCE}
    denominator = mask.sum().double()
    times: dict[str, dict[str, list[float]]] = {b: {"step": [], "score": []} for b in shards}
    for b in shards:  # warm-up: one untimed step of each
        w.train_step(shards[b], SftLoss(), denominator)
    for i in range(rounds):
        for b in list(shards)[:: 1 if i % 2 == 0 else -1]:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            w.train_step(shards[b], SftLoss(), denominator)
            times[b]["step"].append(time.perf_counter() - t0)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            w.score(shards[b].model_inputs())
            times[b]["score"].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--long-rows", type=int, default=3)
    ap.add_argument("--short", type=int, default=48, help="short rows have short..2*short tokens")
    ap.add_argument("--long", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.train import parallel
    from moe_rl.train.launch_local import run_ranks

    spec = TinyModel(hidden_size=args.hidden, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=args.hidden // 4, num_experts=4, top_k=2, moe_intermediate_size=args.hidden,
                     max_position_embeddings=max(1024, args.long))
    path = build_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "moe_rl_bench_balance"), spec, seed=0)
    lengths = lengths_of(args.rows, args.long_rows, args.short, args.long, args.seed)
    print(f"balance: DP2, {args.rows} rows ({args.long_rows} of {args.long} tokens, the rest "
          f"{args.short}..{2 * args.short}), Qwen3-MoE hidden {args.hidden}, {args.rounds} rounds",
          flush=True)
    per_rank = run_ranks(job, 2, args=(str(path), lengths, args.rounds, args.hidden),
                         timeout=1800, dist_env=True)
    cost = parallel.row_cost(lengths, 6.0 * args.hidden)
    out = {"rows": args.rows, "long_rows": args.long_rows, "long": args.long, "short": args.short,
           "hidden": args.hidden, "rounds": args.rounds}
    for b in parallel.DP_BALANCE:
        # a step: the slower replica's time, round by round; scoring: each replica's own
        steps = [max(r[b]["step"][i] for r in per_rank) for i in range(args.rounds)]
        scores = [[r[b]["score"][i] for r in per_rank] for i in range(args.rounds)]
        out[f"step_s_{b}"] = round(statistics.median(steps), 4)
        out[f"imbalance_estimated_{b}"] = round(parallel.imbalance(
            cost, parallel.dp_partition(cost, 2, b)), 3)
        spread = [max(s) / (sum(s) / len(s)) for s in scores]
        out[f"imbalance_measured_{b}"] = round(statistics.median(spread), 3)
    out["step_time_ratio"] = round(out["step_s_count"] / out["step_s_cost"], 3)
    print(f"step: count {out['step_s_count']:.3f} s, cost {out['step_s_cost']:.3f} s "
          f"(x{out['step_time_ratio']}); imbalance estimated {out['imbalance_estimated_count']} -> "
          f"{out['imbalance_estimated_cost']}, measured {out['imbalance_measured_count']} -> "
          f"{out['imbalance_measured_cost']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
