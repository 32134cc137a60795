"""What a run tells its user: progress lines, summary.json (the warm start and every evaluation, written
as they come), and the closing lines."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "config.yaml"  # the resolved config of the run, in run.output_dir


def say(msg: str) -> None:
    print(f"[moe-rl] {msg}", flush=True)


SUMMARY_FILE = "summary.json"
CURVE_FILE = "learning_curve.png"
TIMELINE_FILE = "timeline.json"  # the driver's timeline of this try (metrics.Timeline)


def write_summary(out: Path, summary: dict, evals: dict[int, dict]) -> dict:
    """summary.json: the warm start's figures, every evaluation by step, the first's and the last's as
    eval/KEY_before and _after, and the best step after RL began (by eval/reward_mean). Written after
    every evaluation, so a run that stops keeps them. Returns what it wrote."""
    out_summary = dict(summary)
    if evals:
        first, last = min(evals), max(evals)
        out_summary |= {f"{k}_before": v for k, v in evals[first].items()} if first == 0 else {}
        out_summary |= {f"{k}_after": v for k, v in evals[last].items()}
        out_summary["evaluations"] = {str(k): v for k, v in sorted(evals.items())}
        best = best_eval_step(evals)
        if best is not None:
            out_summary["best_eval_step"] = best
    (out / SUMMARY_FILE).write_text(json.dumps(out_summary, indent=1))
    return out_summary


def best_eval_step(evals: dict[int, dict]) -> int | None:
    """The step after RL began whose held-out evaluation scored best (eval/reward_mean, NaN left out)."""
    scored = [k for k in evals if k > 0 and evals[k]["eval/reward_mean"] == evals[k]["eval/reward_mean"]]
    return max(scored, key=lambda k: evals[k]["eval/reward_mean"]) if scored else None


def earlier_summary(out: Path, step: int) -> tuple[dict, dict[int, dict]]:
    """What a resumed run keeps of the earlier tries' summary.json: the warm start's figures and the
    evaluations up to `step` (its checkpoint); nothing if there is none."""
    try:
        saved = json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}, {}
    evals = {int(k): v for k, v in saved.get("evaluations", {}).items() if int(k) <= step}
    return {k: v for k, v in saved.items() if k.startswith("warm_start/")}, evals


def report(out: Path, summary: dict, evals: dict[int, dict], history: list[dict], steps: int,
           baselines: dict[str, dict[str, float]] | None = None) -> None:
    """summary.json (`write_summary`, with the environment's reference policies on the same held-out
    prompts: `baselines`, Rollouts.baselines), learning_curve.png (plots.learning_curve) and the
    closing lines."""
    from moe_rl.plots import learning_curve

    summary = write_summary(out, summary | ({"baselines": baselines} if baselines else {}), evals)
    lines = [f"run finished: {steps} steps, output in {out}"]
    if "best_eval_step" in summary:
        best = summary["best_eval_step"]
        ckpt = out / "checkpoints" / f"step_{best:06d}"
        reward, before = (evals[best]["eval/reward_mean"],
                          evals.get(0, {}).get("eval/reward_mean", float("-inf")))
        lines.append(f"best evaluation: step {best} (held-out reward {reward:.3f}"
                     + (f", below the {before:.3f} before RL" if before > reward else "")
                     + f"; checkpoint {ckpt if ckpt.is_dir() else 'not kept'})")
    if "eval/reward_mean_before" in summary and "eval/reward_mean_after" in summary:
        lines.append(f"held-out reward: {summary['eval/reward_mean_before']:.3f} -> "
                     f"{summary['eval/reward_mean_after']:.3f}   success rate: "
                     f"{summary['eval/success_rate_before']:.3f} -> {summary['eval/success_rate_after']:.3f}")
    if baselines:
        lines.append("baselines on the same held-out prompts, success rate: " + ", ".join(
            f"{name} {figures['eval/success_rate']:.3f}" for name, figures in baselines.items()))
    if history or evals:
        lines.append(f"learning curve: {learning_curve(history, evals, baselines or {}, out / CURVE_FILE)}")
    lines.append(f"driver timeline: {out / TIMELINE_FILE} (https://ui.perfetto.dev or chrome://tracing)")
    if history:
        lines.append(f"training reward: first step {history[0].get('reward/mean', float('nan')):.3f}, "
                     f"last step {history[-1].get('reward/mean', float('nan')):.3f}")
    print("\n".join(lines), flush=True)
