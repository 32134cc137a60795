"""The figures the README reports for a finished run, read from its output directory.

    .venv/bin/python tools/run_summary.py RUN_DIR [--window 50]

RUN_DIR is a run's run.output_dir: its summary.json (evaluations) and history.pt (the per-step figures
the driver writes at the end of a run). Prints, then one JSON line with the same figures:
- held-out reward and success rate before RL and after the last step (eval/*_before, eval/*_after);
- the training reward's mean over consecutive windows of --window steps;
- R3: the trainer's replayed log-probs against the engine's, the mean of the per-step means and the
  largest per-step maximum (correction/logp_mismatch_mean, _max);
- the critic's explained variance, mean over the steps (where the run has a critic);
- the steps' summed time (timing/step_s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def summarize(run_dir: Path, window: int) -> dict:
    import torch

    hist = torch.load(run_dir / "history.pt", weights_only=False)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    rewards = [h["reward/mean"] for h in hist]
    out = {"run": str(run_dir), "steps": len(hist)}
    for key in ("eval/reward_mean", "eval/success_rate"):
        for when in ("before", "after"):
            if f"{key}_{when}" in summary:
                out[f"{key}_{when}"] = round(summary[f"{key}_{when}"], 4)
    out["train_reward_windows"] = [round(statistics.fmean(rewards[i:i + window]), 4)
                                   for i in range(0, len(rewards), window)]
    mism = [h for h in hist if "correction/logp_mismatch_mean" in h]
    if mism:
        out["logp_mismatch_mean"] = float(f"{statistics.fmean(h['correction/logp_mismatch_mean'] for h in mism):.3g}")
        out["logp_mismatch_max"] = float(f"{max(h['correction/logp_mismatch_max'] for h in mism):.3g}")
    ev = [h["critic/explained_variance"] for h in hist if "critic/explained_variance" in h]
    if ev:
        out["explained_variance_mean"] = round(statistics.fmean(ev), 4)
    out["steps_time_s"] = round(sum(h.get("timing/step_s", 0.0) for h in hist), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run's output directory (run.output_dir)")
    p.add_argument("--window", type=int, default=50, help="steps per training-reward window (default 50)")
    args = p.parse_args(argv)
    if not (args.run_dir / "history.pt").is_file():
        print(f"run_summary: {args.run_dir} has no history.pt (a finished run's output directory?)", file=sys.stderr)
        return 2
    s = summarize(args.run_dir, args.window)
    for when in ("before", "after"):
        if f"eval/reward_mean_{when}" in s:
            print(f"held-out {when}: reward {s[f'eval/reward_mean_{when}']}, success {s.get(f'eval/success_rate_{when}')}")
    print(f"training reward, {args.window}-step windows: {', '.join(map(str, s['train_reward_windows']))}")
    if "logp_mismatch_mean" in s:
        print(f"R3 log-prob mismatch (trainer vs engine): mean {s['logp_mismatch_mean']}, max {s['logp_mismatch_max']}")
    if "explained_variance_mean" in s:
        print(f"critic explained variance, mean over steps: {s['explained_variance_mean']}")
    print(f"{s['steps']} steps, {s['steps_time_s']} s of step time")
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
