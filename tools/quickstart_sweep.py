"""Runs the quickstart for several settings and seeds, one run after another, and prints a results table.

    .venv/bin/python tools/quickstart_sweep.py                      # the config as it is, seeds 1234 1 2
    .venv/bin/python tools/quickstart_sweep.py --variant config --variant batch64 --seeds 1 2
    .venv/bin/python tools/quickstart_sweep.py --list               # the variants and their overrides
    .venv/bin/python tools/quickstart_sweep.py --set run.steps=100  # extra overrides for every run

Each run is `moe-rl train CONFIG run.seed=S run.output_dir=OUT/VARIANT/seed_S checkpoint.every=0
OVERRIDES...`, as `make quickstart` runs it (the machine's thread counts, no OMP_NUM_THREADS set by this
script); its wall clock is measured here, start-up included. The table: held-out success rate before RL
(after the warm start) and after the last step, the best evaluation, the reference policies on the same
held-out prompts (summary.json's baselines) and the wall clock; then one JSON line with every run.
Runs share the machine with nothing else of this script's: never run two sweeps (or a sweep and the
tests) at once on a 2-core box, the timings would mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "quickstart.yaml"

# the settings tried while tuning the quickstart (README: "The quickstart"); `config` is the file as it is
VARIANTS: dict[str, list[str]] = {
    "config": [],
    "entropy": ["algorithm.entropy_coef=0.01"],
    "lam1": ["algorithm.lam=1.0"],
    "lam1_entropy": ["algorithm.lam=1.0", "algorithm.entropy_coef=0.01"],
    # one update a step (pi_old from the update's own forward pass): more, cheaper steps in the same time
    "one_epoch": ["trainer.epochs=1", "algorithm.lam=1.0", "run.steps=800", "trainer.eval_every=200"],
    "lam1_greedy": ["algorithm.lam=1.0", "trainer.eval_greedy=true"],  # evaluated on the most likely answers
    # the game's feedback also tells the range the answers so far leave: the state in the last message
    "range_feedback": ["algorithm.lam=1.0", "trainer.eval_greedy=true", "environment.options.feedback=range"],
    "lam1_greedy_lr2": ["algorithm.lam=1.0", "trainer.eval_greedy=true", "trainer.lr=2e-3"],
    # eight numbers instead of nine, four guesses still: random guesses win 0.414, binary search always
    "lam1_greedy_high8": ["algorithm.lam=1.0", "trainer.eval_greedy=true", "environment.options.high=8"],
    # seven numbers and three guesses: random guesses win 3/7 = 0.43, binary search always; shorter games
    "lam1_greedy_7x3": ["algorithm.lam=1.0", "trainer.eval_greedy=true", "environment.options.high=7",
                        "environment.options.guesses=3", "environment.max_turns=3"],
    "one_epoch_lr": ["trainer.epochs=1", "algorithm.lam=1.0", "run.steps=800", "trainer.eval_every=200",
                     "trainer.lr=2.5e-3"],
    # LoRA (rank 16 of hidden 64) on the policy, the warm start included; the critic trains whole (measured:
    # on the random base the warm start through the adapters does not teach the format; tools/lora_demo.py
    # starts from a warm-started base instead)
    "lora": ["model.lora.rank=16", "model.lora.alpha=32", "trainer.lr=5e-3", "trainer.warm_start_lr=1e-2"],
}


def run_one(config: Path, variant: str, overrides: list[str], seed: int, out: Path) -> dict:
    """One training run; its figures (summary.json) and wall clock. A failed run gives its exit code and
    the tail of its output instead."""
    run_dir = out / variant / f"seed_{seed}"
    cmd = [str(Path(sys.executable).parent / "moe-rl"), "train", str(config), f"run.seed={seed}",
           f"run.output_dir={run_dir}", "checkpoint.every=0", "checkpoint.resume=never", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    row = {"variant": variant, "seed": seed, "overrides": overrides, "wall_s": round(wall, 1),
           "rc": proc.returncode}
    (out / variant).mkdir(parents=True, exist_ok=True)
    (out / variant / f"seed_{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return row | {"error": (proc.stdout + proc.stderr)[-1500:]}
    return row | figures(run_dir)


def figures(run_dir: Path) -> dict:
    """A finished run's held-out success by step and its baselines (its summary.json)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = {int(k): v for k, v in summary.get("evaluations", {}).items()}
    success = {k: v["eval/success_rate"] for k, v in sorted(evals.items())}
    last = max(success)
    return {"success_before": success.get(0), "success_after": success[last], "steps": last,
            "success_best": max((v for k, v in success.items() if k > 0), default=None),
            "success_by_step": success,
            "baselines": {n: b["eval/success_rate"] for n, b in summary.get("baselines", {}).items()}}


def train_and_export(out: Path, name: str, overrides: list[str]) -> tuple[Path, dict]:
    """The quickstart (seed 1234) with `overrides`, its last checkpoint's policy exported to Hugging Face
    format (`moe-rl convert mcore-to-hf`) as out/name/hf; and the run's row. An export already there
    (from an earlier call with the same `out`) is reused."""
    hf, run_dir = out / name / "hf", out / name / "seed_1234"
    if (hf / "config.json").is_file() and (run_dir / "summary.json").is_file():
        return hf, {"variant": name, "seed": 1234, "rc": 0, **figures(run_dir)}
    row = run_one(CONFIG, name, overrides, 1234, out)
    if row["rc"]:
        raise SystemExit(f"the {name} run failed: {row['error']}")
    if not (hf / "config.json").is_file():
        policy = run_dir / "checkpoints" / f"step_{row['steps']:06d}" / "policy"
        subprocess.run([str(Path(sys.executable).parent / "moe-rl"), "convert", "mcore-to-hf", str(policy),
                        str(hf)], check=True, cwd=ROOT)
    return hf, row


def add_demo_arguments(p, modes, steps: int, eval_every: int, out: str) -> None:
    """A demonstration's common options: --mode (repeatable, of `modes`), --seeds, --steps, --eval-every,
    --out (default runs/`out`)."""
    p.add_argument("--mode", action="append", choices=sorted(modes), help="repeatable; default: all")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / out)


def run_all(runs: list[tuple[str, int]], setup, out: Path, extra=None) -> list[dict]:
    """Each (variant, seed) of `runs`, one after another, with a progress line before and after:
    run_one on setup(variant) = (config, overrides); `extra(row, run_dir)`, where given, adds to a
    finished run's row."""
    rows = []
    for i, (variant, seed) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {variant}, seed {seed} ...", flush=True)
        config, overrides = setup(variant)
        row = run_one(config, variant, overrides, seed, out)
        if row["rc"] == 0 and extra is not None:
            extra(row, out / variant / f"seed_{seed}")
        rows.append(row)
        done = (f"failed (exit {row['rc']}; log in {out / variant})" if row["rc"] else
                f"success {row['success_before']:.3f} -> {row['success_after']:.3f}")
        print(f"    {done}, {row['wall_s']:.0f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    names = sorted({n for r in rows for n in r.get("baselines", {})})
    head = ["variant", "seed", "held-out success: before RL -> after", "best evaluation", *names,
            "wall clock"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if r["rc"] != 0:
            failed = f"| {r['variant']} | {r['seed']} | failed (exit {r['rc']}) |"
            lines.append(failed + " |" * (len(head) - 3))
            continue
        best = "" if r["success_best"] is None else f"{r['success_best']:.3f}"
        cells = [r["variant"], str(r["seed"]), f"{r['success_before']:.3f} -> {r['success_after']:.3f}", best,
                 *(f"{r['baselines'][n]:.3f}" if n in r["baselines"] else "" for n in names),
                 f"{int(r['wall_s'] // 60)} min {int(r['wall_s'] % 60)} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="the config every run starts from")
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="repeatable; default: config")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "sweep", help="where the runs write")
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, overrides in VARIANTS.items():
            print(f"{name}: {' '.join(overrides) or '(the config as it is)'}")
        return 0
    runs = [(v, s) for v in args.variant or ["config"] for s in args.seeds]
    rows = run_all(runs, lambda v: (args.config, VARIANTS[v] + args.set), args.out)
    print(table(rows))
    print(json.dumps(rows))
    return 1 if any(r["rc"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
