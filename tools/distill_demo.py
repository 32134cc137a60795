"""On-policy distillation vs RL on the quickstart's task, side by side: the same student (the quickstart's
tiny policy after its warm start), the same steps and samples per step; distillation alone, RL alone and
both; per seed, the held-out success every eval_every steps and the per-token reverse KL to the teacher.

    .venv/bin/python tools/distill_demo.py                          # teacher = the quickstart, trained here
    .venv/bin/python tools/distill_demo.py --teacher runs/quickstart/teacher_hf --seeds 1
    .venv/bin/python tools/distill_demo.py --larger-teacher         # a teacher of another shape

The teacher: `moe-rl train configs/quickstart.yaml` (480 steps; --larger-teacher: hidden 96 and 8 experts
instead of 64 and 4), its last checkpoint exported to Hugging Face format (`moe-rl convert mcore-to-hf`),
unless --teacher names one. Its held-out success is measured by the same evaluation (summary.json). The
students: configs/distill_quickstart.yaml (distill: the teacher's signal alone), the same with
algorithm.advantage=gae and the quickstart's critic (both), and configs/quickstart.yaml (rl), each for
--steps steps. Runs go one after another (tools/quickstart_sweep.run_one); prints a markdown table and one
JSON line with every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart_sweep import CONFIG, ROOT, add_demo_arguments, run_all, train_and_export  # noqa: E402

DISTILL = ROOT / "configs" / "distill_quickstart.yaml"
CRITIC = ["algorithm.advantage=gae", "algorithm.lam=0.95", "critic.lr=3.0e-3", "critic.value_clip=0.5"]
MODES = {"distill": (DISTILL, []), "both": (DISTILL, CRITIC), "rl": (CONFIG, [])}
LARGER = ["model.tiny.hidden_size=96", "model.tiny.num_experts=8"]


def train_teacher(out: Path, larger: bool) -> tuple[Path, float]:
    """The quickstart trained (480 steps) and exported to out/teacher*/hf; its held-out success after."""
    hf, row = train_and_export(out, "teacher_larger" if larger else "teacher", LARGER if larger else [])
    return hf, row["success_after"]


def kl_by_step(run_dir: Path) -> list[float]:
    hist = torch.load(run_dir / "history.pt", weights_only=False)
    return [h["distill/reverse_kl_mean"] for h in hist if "distill/reverse_kl_mean" in h]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", type=Path, help="a Hugging Face checkpoint; default: train the quickstart")
    p.add_argument("--teacher-success", type=float, help="its held-out success, with --teacher")
    p.add_argument("--larger-teacher", action="store_true", help="train a teacher of hidden 96, 8 experts")
    add_demo_arguments(p, MODES, steps=120, eval_every=20, out="distill_demo")
    args = p.parse_args(argv)
    if args.teacher:
        teacher, teacher_success = args.teacher.resolve(), args.teacher_success
    else:
        print("training the teacher (the quickstart) ...", flush=True)
        teacher, teacher_success = train_teacher(args.out, args.larger_teacher)
    print(f"teacher: {teacher} (held-out success {teacher_success})", flush=True)
    common = [f"run.steps={args.steps}", f"trainer.eval_every={args.eval_every}"]
    def setup(mode: str) -> tuple[Path, list[str]]:
        config, extra = MODES[mode]
        return config, common + extra + ([f"teacher.path={teacher}"] if config == DISTILL else [])

    def add_kl(row: dict, run_dir: Path) -> None:
        row["reverse_kl_by_step"] = kl_by_step(run_dir)

    runs = [(m, s) for m in args.mode or list(MODES) for s in args.seeds]
    rows = run_all(runs, setup, args.out, add_kl)
    target = 0.9 * teacher_success if teacher_success else None
    print(f"teacher held-out success: {teacher_success}")
    print("| mode | seed | held-out success by step | first step at >= 90% of the teacher's | reverse KL per "
          "token, first -> last 10 steps |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if r["rc"]:
            print(f"| {r['variant']} | {r['seed']} | failed (exit {r['rc']}) | | |")
            continue
        by_step = sorted(r["success_by_step"].items(), key=lambda kv: int(kv[0]))
        success = ", ".join(f"{v:.3f}" for _, v in by_step)
        reached = next((int(k) for k, v in by_step if target is not None and v >= target), None)
        kl = r["reverse_kl_by_step"]
        kls = f"{statistics.mean(kl[:10]):.3f} -> {statistics.mean(kl[-10:]):.3f}" if kl else "-"
        print(f"| {r['variant']} | {r['seed']} | {success} | {reached if reached is not None else 'not'} "
              f"| {kls} |")
    print(json.dumps({"teacher": str(teacher), "teacher_success": teacher_success, "runs": rows}))
    return 1 if any(r["rc"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
