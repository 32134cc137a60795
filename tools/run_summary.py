"""The figures the README reports for a finished run, read from its output directory.

    .venv/bin/python tools/run_summary.py RUN_DIR [--window 50] [--figure env/boxed ...]

RUN_DIR is a run's run.output_dir: its summary.json (evaluations) and history.pt (the per-step figures
the driver writes at the end of a run). Prints, then one JSON line with the same figures:
- every held-out figure before RL and after the last step (eval/*_before, eval/*_after: reward,
  success rate, pass@k, ...);
- the training reward's mean over consecutive windows of --window steps (and each --figure's);
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


def summarize(run_dir: Path, window: int, figures: list[str] = ()) -> dict:
    import torch

    hist = torch.load(run_dir / "history.pt", weights_only=False)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() \
        else {}
    out = {"run": str(run_dir), "steps": len(hist)}
    out |= {k: round(v, 4) for k, v in summary.items()
            if k.startswith("eval/") and k.endswith(("_before", "_after")) and isinstance(v, (int, float))}

    def windows(name: str) -> list[float]:
        values = [h[name] for h in hist if name in h]
        return [round(statistics.fmean(values[i:i + window]), 4) for i in range(0, len(values), window)]

    out["train_reward_windows"] = windows("reward/mean")
    out |= {f"{name}_windows": windows(name) for name in figures}
    mism = [h for h in hist if "correction/logp_mismatch_mean" in h]
    if mism:
        out["logp_mismatch_mean"] = float(
            f"{statistics.fmean(h['correction/logp_mismatch_mean'] for h in mism):.3g}")
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
    p.add_argument("--figure", action="append", default=[], help="another logged figure to average per "
                   "window (e.g. env/boxed); repeatable")
    args = p.parse_args(argv)
    if not (args.run_dir / "history.pt").is_file():
        print(f"run_summary: {args.run_dir} has no history.pt (a finished run's output directory?)",
              file=sys.stderr)
        return 2
    s = summarize(args.run_dir, args.window, args.figure)
    for when in ("before", "after"):
        held = {k[len("eval/"):-len(when) - 1]: v for k, v in s.items() if k.startswith("eval/")
                and k.endswith(when)}
        if held:
            print(f"held-out {when}: " + ", ".join(f"{k} {v}" for k, v in held.items()))
    print(f"training reward, {args.window}-step windows: {', '.join(map(str, s['train_reward_windows']))}")
    for name in args.figure:
        print(f"{name}, {args.window}-step windows: {', '.join(map(str, s[f'{name}_windows']))}")
    if "logp_mismatch_mean" in s:
        print(f"R3 log-prob mismatch (trainer vs engine): mean {s['logp_mismatch_mean']}, max "
              f"{s['logp_mismatch_max']}")
    if "explained_variance_mean" in s:
        print(f"critic explained variance, mean over steps: {s['explained_variance_mean']}")
    print(f"{s['steps']} steps, {s['steps_time_s']} s of step time")
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
