"""Benchmark: how long run_ranks takes to start ranks that import what a Megatron job imports, with
ranks forked from the fork server (the default) and with a fresh interpreter per rank (spawn). The two
are timed in interleaved rounds (forkserver, spawn, forkserver, ...) so machine noise hits them alike;
the first forkserver call, which starts the server and pays its imports once, is timed on its own.

  spawn_s               median wall time of run_ranks(job, world_size, start="spawn")
  forkserver_s          the same with the default start
  forkserver_first_s    the first forkserver call of the process (the server's start and imports)
  spawn_vs_forkserver   spawn_s / forkserver_s (what each later call saves, as a ratio)

Each rank's job imports megatron-core's GPT model and optimizer, as the test and convert jobs do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from moe_rl.train.launch_local import run_ranks


def job(rank, world_size):
    import megatron.core.models.gpt.gpt_model  # noqa: F401  (what a Megatron job imports first)
    import megatron.core.optimizer  # noqa: F401

    return rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    def timed(start: str) -> float:
        t0 = time.perf_counter()
        assert run_ranks(job, args.world_size, start=start) == list(range(args.world_size))
        return time.perf_counter() - t0

    first = timed("forkserver")
    times: dict[str, list[float]] = {"forkserver": [], "spawn": []}
    for i in range(args.rounds):
        for start in times:
            times[start].append(timed(start))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
              flush=True)
    spawn, fork = statistics.median(times["spawn"]), statistics.median(times["forkserver"])
    result = {"world_size": args.world_size, "rounds": args.rounds, "spawn_s": round(spawn, 3),
              "forkserver_s": round(fork, 3), "forkserver_first_s": round(first, 3),
              "spawn_vs_forkserver": round(spawn / fork, 1)}
    print(f"spawn {spawn:.2f} s, forkserver {fork:.3f} s per call ({result['spawn_vs_forkserver']}x); "
          f"the first forkserver call {first:.2f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
