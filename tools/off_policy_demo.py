"""Off-policy training on the quickstart's task: PPO's clip alone vs M2PO vs OPSM on stale data, seeds one
after another, and a results table.

    .venv/bin/python tools/off_policy_demo.py                       # every method, seeds 1234 1 2
    .venv/bin/python tools/off_policy_demo.py --method m2po --seeds 1

The data is stale by design: four steps' rollouts run ahead of the trainer (rollout.async_depth=4), so
once the pipeline is full every batch was sampled four weight versions before the policy that trains on
it; each step makes one update (so a version is an optimizer update), and pi_old is the behaviour
policy itself (algorithm.correction=bypass, M2PO's setting: no proximal pass), so the ratio the clip and
the masks see is pi_theta / mu across those four updates.
Each run is `moe-rl train configs/quickstart.yaml` with STALE, the method's settings and --set overrides
(tools/quickstart_sweep.run_one: its wall clock, summary.json's held-out evaluations); from its
history.pt, per step means of the policy's clip and mask fractions and the staleness. Prints a
markdown table and one JSON line with every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart_sweep import CONFIG, ROOT, run_all  # noqa: E402

STALE = ["rollout.async_mode=true", "rollout.async_depth=4", "rollout.max_staleness=4",
         "algorithm.correction=bypass", "trainer.epochs=1", "trainer.minibatches=1", "run.steps=300",
         "trainer.eval_every=100"]
METHODS = {"ppo_clip": [], "m2po": ["algorithm.policy_mask=m2po"], "opsm": ["algorithm.policy_mask=opsm"]}
FIGURES = ("policy/clipfrac_low", "policy/clipfrac_high", "policy/m2po_masked_frac",
           "policy/opsm_masked_frac", "policy/opsm_masked_of_negative", "policy/m2po_m2_before",
           "correction/staleness_mean", "reward/mean")


def run_figures(run_dir: Path) -> dict[str, float]:
    """The mean over the run's steps of each of FIGURES it logged."""
    hist = torch.load(run_dir / "history.pt", weights_only=False)
    return {k: statistics.mean(h[k] for h in hist if k in h) for k in FIGURES if any(k in h for h in hist)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", choices=sorted(METHODS), help="repeatable; default: all")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "off_policy")
    args = p.parse_args(argv)
    def add_figures(row: dict, run_dir: Path) -> None:
        summary = json.loads((run_dir / "summary.json").read_text())
        row["reward_by_step"] = {int(k): v["eval/reward_mean"] for k, v in summary["evaluations"].items()}
        row["figures"] = run_figures(run_dir)

    runs = [(m, s) for m in args.method or list(METHODS) for s in args.seeds]
    rows = run_all(runs, lambda m: (CONFIG, STALE + METHODS[m] + args.set), args.out, add_figures)
    print("| method | seed | held-out reward by step | held-out success by step | clip low / high | "
          "masked (M2PO tokens / OPSM sequences) | staleness |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["rc"]:
            print(f"| {r['variant']} | {r['seed']} | failed (exit {r['rc']}) | | | | |")
            continue
        f = r["figures"]
        reward = ", ".join(f"{v:.3f}" for _, v in sorted(r["reward_by_step"].items()))
        success = ", ".join(f"{v:.3f}" for _, v in sorted(r["success_by_step"].items()))
        masked = f"{f.get('policy/m2po_masked_frac', 0):.4f} / {f.get('policy/opsm_masked_frac', 0):.3f}"
        print(f"| {r['variant']} | {r['seed']} | {reward} | {success} | {f['policy/clipfrac_low']:.4f} / "
              f"{f['policy/clipfrac_high']:.4f} | {masked} | {f['correction/staleness_mean']:.2f} |")
    print(json.dumps(rows))
    return 1 if any(r["rc"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
