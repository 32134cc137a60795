"""Benchmark: the CPU time a run's process spends on its start-up imports (torch, megatron-core with
mbridge, vLLM's engine), with Python's default garbage-collector thresholds (700, 10, 10) and with the
one importing moe_rl sets for start-up (moe_rl/__init__.py). Each measurement is a fresh interpreter;
the two arms alternate round by round so machine noise hits them alike.

  default_cpu_s   median CPU seconds (user + system) of the imports at Python's thresholds
  start_cpu_s     the same at moe_rl's start-up threshold
  start_vs_default  start_cpu_s / default_cpu_s (target <= 0.9)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

IMPORTS = """
import gc, resource, sys
import moe_rl
if sys.argv[1] == "default":
    gc.set_threshold(700, 10, 10)
import megatron.core.models.gpt.gpt_model, megatron.core.optimizer, mbridge  # a trainer rank's
from vllm import LLM  # an engine's
r = resource.getrusage(resource.RUSAGE_SELF)
print(r.ru_utime + r.ru_stime)
"""


def cpu_seconds(arm: str) -> float:
    out = subprocess.run([sys.executable, "-c", IMPORTS, arm], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cpu_seconds("start")  # the first interpreter reads the files from disk: not timed
    times: dict[str, list[float]] = {"default": [], "start": []}
    for i in range(args.rounds):
        for arm in times:
            times[arm].append(cpu_seconds(arm))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
              flush=True)
    default, start = statistics.median(times["default"]), statistics.median(times["start"])
    result = {"rounds": args.rounds, "default_cpu_s": round(default, 2), "start_cpu_s": round(start, 2),
              "start_vs_default": round(start / default, 2)}
    print(f"start-up imports: {default:.2f} s of CPU at Python's thresholds, {start:.2f} s at moe_rl's "
          f"({result['start_vs_default']}x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
