"""Benchmark: a long asynchronous run, watched for leaks and slowdown.

Runs `moe-rl train` at quickstart size for --steps asynchronous steps (default 200) with two engines
and the calculator tool (a supervised warm start on its scripted expert first, so that episodes call
the tool: its code runs in the sandbox), or --config as it is (e.g. examples/openai_agent/config.yaml:
the gateway), with any overrides (model.lora.rank=8; teacher.path=... algorithm.distill_coef=1.0), and
samples every process of the run (the driver, trainer ranks, engines, Ray's own) every step after
--warmup:

  rss_growth      resident memory of all processes at the end vs after --warmup steps (goal <= 5%),
                  the process that grew most, and every process's own figures
  private_growth  the same less file and shared-memory pages (Ray's object store, mapped by the
                  processes that put and get objects, counts in each one's resident memory)
  fds, threads    open file descriptors and threads, summed, after warm-up vs at the end (no growth)
  steps/s         from the median step time of each quarter after warm-up (no decay: last vs first)

Prints one line per figure and a JSON summary (`--json FILE` writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"


def role(p: psutil.Process, driver: int) -> str:
    if p.pid == driver:
        return "driver"
    cmd = " ".join(p.cmdline())
    for name in ("RankActor", "RolloutActor", "raylet", "gcs_server", "dashboard", "log_monitor", "IDLE"):
        if name in cmd:
            return name
    return p.name()


def snapshot(driver: int) -> dict[int, dict]:
    """Every live process of the run: its role, resident bytes, open files and threads."""
    out = {}
    try:
        procs = [psutil.Process(driver), *psutil.Process(driver).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            with p.oneshot():
                mem = p.memory_info()  # shared: file and shared-memory pages (Ray's object store)
                out[p.pid] = {"role": role(p, driver), "rss": mem.rss, "shared": mem.shared,
                              "fds": p.num_fds(), "threads": p.num_threads()}
        except psutil.Error:
            pass
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the first memory sample")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--config", default=QUICKSTART, help="the run's config (the quickstart's: with the "
                    "calculator tool after a warm start)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.prompts_per_step=16")
    return ap.parse_args()


def run_sampled(cmd: list[str], steps: int, warmup: int) -> dict[int, dict]:
    """Runs the training command, following its progress bar ("RL steps: ... 17/200") for the step, and
    snapshots its processes once in every step from `warmup` on; step -> snapshot. Exits with the output's
    tail if the run fails."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    state = {"step": 0, "tail": []}

    def follow() -> None:
        buf = ""
        while ch := proc.stderr.read(1):
            buf += ch
            if ch in "\r\n":
                m = re.search(r"RL steps:.*?\|\s*(\d+)/\d+", buf)
                if m:
                    state["step"] = int(m.group(1))
                state["tail"] = (state["tail"] + [buf])[-20:]
                buf = ""

    threading.Thread(target=follow, daemon=True).start()
    samples: dict[int, dict] = {}
    t0 = time.time()
    while proc.poll() is None:
        step = state["step"]
        if step >= warmup and step not in samples and step < steps:
            samples[step] = snapshot(proc.pid)
            if step % 10 == 0 or step == warmup:
                print(f"[soak] step {step}/{steps} ({time.time() - t0:.0f} s): "
                      f"{sum(v['rss'] for v in samples[step].values()) / 2**30:.2f} GiB resident in "
                      f"{len(samples[step])} processes", flush=True)
        time.sleep(0.2)
    if proc.returncode != 0:
        sys.exit(f"soak: the run failed (exit {proc.returncode}):\n{''.join(state['tail'])}")
    return samples


def summarize(samples: dict[int, dict], hist: list[dict], warmup: int) -> dict:
    """Memory, descriptors and threads of the processes alive at both the first and the last sampled step,
    and the steps' rate by quarter (after the warmup)."""
    first, last = min(samples), max(samples)
    a, b = samples[first], samples[last]
    both = sorted(set(a) & set(b))
    rss_a, rss_b = sum(a[p]["rss"] for p in both), sum(b[p]["rss"] for p in both)
    worst = max(both, key=lambda p: b[p]["rss"] / a[p]["rss"])
    # resident memory less its file and shared-memory pages
    private_a, private_b = (sum(s[p]["rss"] - s[p]["shared"] for p in both) for s in (a, b))

    times = [h["timing/step_s"] for h in hist[warmup:]]
    q = max(1, len(times) // 4)
    summary = {
        "steps": len(hist), "sampled_steps": [first, last], "processes": len(both),
        "processes_started_between": len(set(b) - set(a)), "processes_ended_between": len(set(a) - set(b)),
        "rss_gib": [rss_a / 2**30, rss_b / 2**30], "rss_growth": rss_b / rss_a - 1,
        "worst_process": {"role": b[worst]["role"], "growth": b[worst]["rss"] / a[worst]["rss"] - 1},
        "fds": [sum(a[p]["fds"] for p in both), sum(b[p]["fds"] for p in both)],
        "threads": [sum(a[p]["threads"] for p in both), sum(b[p]["threads"] for p in both)],
        "steps_per_s": [1 / statistics.median(times[:q]), 1 / statistics.median(times[-q:])],
        "steps_per_s_by_quarter": [1 / statistics.median(times[i * q:(i + 1) * q]) for i in range(4)
                                   if times[i * q:(i + 1) * q]],
        "private_growth": private_b / private_a - 1,
        "per_process": [{"role": b[p]["role"], "pid": p,
                         "rss_mib": [a[p]["rss"] / 2**20, b[p]["rss"] / 2**20],
                         "private_mib": [(a[p]["rss"] - a[p]["shared"]) / 2**20,
                                         (b[p]["rss"] - b[p]["shared"]) / 2**20],
                         "growth": b[p]["rss"] / a[p]["rss"] - 1, "fds": [a[p]["fds"], b[p]["fds"]],
                         "threads": [a[p]["threads"], b[p]["threads"]]} for p in both],
        "reward_mean": [hist[0]["reward/mean"], hist[-1]["reward/mean"]],
        "tool_errors": sum(h.get("rollout/tool_errors", 0) for h in hist),
        "engine_restarts": hist[-1].get("rollout/engine_restarts", 0),
    }
    summary["steps_per_s_ratio"] = summary["steps_per_s"][1] / summary["steps_per_s"][0]
    return summary


def report(summary: dict, what: str) -> None:
    first, last = summary["sampled_steps"]
    rss_a, rss_b = summary["rss_gib"]
    print(f"soak: {summary['steps']} asynchronous steps, 2 engines, {what}; processes sampled at steps "
          f"{first} and {last} ({summary['processes']} in both)")
    print(f"  rss_growth      {summary['rss_growth']:+.2%}  ({rss_a:.2f} -> {rss_b:.2f} GiB; "
          f"most: {summary['worst_process']['role']} {summary['worst_process']['growth']:+.2%})   "
          "goal <= +5%")
    print(f"  private_growth  {summary['private_growth']:+.2%}  (resident less file and shared-memory pages, "
          "such as Ray's object store that processes map)")
    for row in sorted(summary["per_process"], key=lambda r: -r["rss_mib"][1]):
        print(f"    {row['role']:<14} pid {row['pid']:<8} {row['rss_mib'][0]:8.1f} -> "
              f"{row['rss_mib'][1]:8.1f} MiB ({row['growth']:+.2%}; private {row['private_mib'][0]:.1f} -> "
              f"{row['private_mib'][1]:.1f})  fds {row['fds'][0]} -> {row['fds'][1]}  "
              f"threads {row['threads'][0]} -> {row['threads'][1]}")
    print(f"  fds             {summary['fds'][0]} -> {summary['fds'][1]}")
    print(f"  threads         {summary['threads'][0]} -> {summary['threads'][1]}")
    print(f"  steps/s         {summary['steps_per_s'][0]:.3f} -> {summary['steps_per_s'][1]:.3f} "
          f"(last / first quarter {summary['steps_per_s_ratio']:.3f}; by quarter "
          f"{', '.join(f'{x:.3f}' for x in summary['steps_per_s_by_quarter'])})")
    print(json.dumps(summary))


def main() -> None:
    args = parse_args()
    out = Path(tempfile.mkdtemp(prefix="moe_rl_soak_"))
    # the quickstart's soak: the calculator's expert teaches the tool's format first, so that RL episodes
    # call it (its code runs in the sandbox); another config runs as it is
    recipe = ["environment.name=calculator", "environment.options={}", "environment.token_budget=192",
              "rollout.max_new_tokens=24", "trainer.warm_start_steps=60"] if args.config == QUICKSTART else []
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", args.config, f"run.output_dir={out}",
           f"run.steps={args.steps}", *recipe, "trainer.eval_prompts=0", "trainer.eval_every=0",
           "rollout.async_mode=true", "rollout.num_engines=2",
           "checkpoint.every=0", "logging.progress_bar=true", *args.overrides]
    samples = run_sampled(cmd, args.steps, args.warmup)
    import torch

    summary = summarize(samples, torch.load(out / "history.pt", weights_only=False), args.warmup)
    what = "the calculator tool" if args.config == QUICKSTART else args.config
    report(summary, what + (" with " + " ".join(args.overrides) if args.overrides else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
