"""Benchmark: how fast moe_rl learns against TRL's GRPOTrainer, on the same task, from the same start.

For each seed, the same random Qwen3-MoE checkpoint (the quickstart's tiny model, built from the seed), the
same prompts in the same order (drawn from the seed) and the same reward function train with GRPO in both
systems, each started as a user starts it, in its own process: `moe-rl train CONFIG` with the single_turn
environment and `environment.reward_fn` pointing at a reward file this script writes; a Python script
around `trl.GRPOTrainer` whose reward function calls that same file's function on each completion.

The task, one a random model can learn: "Reply in lowercase letters."; the reward is the fraction of the
answer's characters that are ASCII lowercase letters (0 for an empty answer; maximum 1). A random model's
answers score about 0.1-0.15 (26 of the model's 384 token ids; the padding ids beyond the byte-level
tokenizer's 259 decode to nothing, so answers have fewer characters than tokens); the reward is
continuous, so every group of samples has spread; and the policy gets to 1 by moving probability onto 26
tokens: 20-30 steps at the default learning rate (5e-3, high because the model starts from random
weights; at 1e-3 moe_rl is still below 0.5 after 40 steps).

The same hyper-parameters in both: learning rate (constant, no warm-up), 8 prompts x 4 samples per step,
8 new tokens, temperature 1.0, top-p 1, 1 epoch and 1 minibatch (one optimizer step per generation, so
the PPO ratio is 1 and the clip idle), Adam (0.9, 0.999, no weight decay), gradient clipping at 1.0, no KL
(TRL beta=0.0), no MoE load-balancing loss, truncated answers scored and trained on like the others.
Advantages: GRPO's (R - group mean) / group std in both (moe_rl's extra whitening over the batch is off, as
TRL has none). Loss aggregation: moe_rl's token_mean (the mean over the step's model tokens) against TRL's
loss_type="dapo", which divides by the active tokens of the global accumulated batch: with one process
and no gradient accumulation, the same mean over the same tokens ("grpo" would average per sequence
first, "dr_grpo" divide by a constant). What differs: the sampler (vLLM in moe_rl, HF generate in TRL)
and so the random draws, and the training kernels (Megatron-core against transformers).

Each system's per-step training reward (the mean over the step's 8 x 4 samples) is its learning curve:
moe_rl's TensorBoard scalar reward/mean, TRL's logged `reward` (logging_steps=1). From each curve:

  steps to 50% / 90%   the first step at which the mean of the last --window steps' rewards (3) reaches
                       that fraction of the maximum reward (1.0); "-" (null) when it never does
  AUC                  the area under the curve per step: the mean reward over the run (0 to 1)

Target: moe_rl's median steps to each level <= TRL's median (`verdict`, per level; null when neither
system reaches the level: run more steps); `within_noise` loosens that to TRL's slowest seed.

Prints progress lines (system, seed, step, reward), the curves and a table, and, last, one JSON line: the
curves per seed, steps to each level per seed and their medians, AUC, seconds per step, the verdicts and
the versions. Run from the repository root (TRL is the bench extra: `pip install -e '.[bench]'`):

  .venv/bin/python tools/bench/learn_vs_trl.py           # the full benchmark: 50 steps, 3 seeds, 2 systems
  .venv/bin/python tools/bench/learn_vs_trl.py --smoke   # 2 steps, 1 seed: does it work
  .venv/bin/python tools/bench/learn_vs_trl.py --steps 60 --seeds 0 1 2 3 4 --lr 3e-3 --only moe_rl

(or `moe-rl bench learn_vs_trl ARGS`). A run takes about a minute of start-up per moe_rl run (Ray, the
trainer rank, the vLLM engine) and ten seconds per TRL run, then a fraction of a second per step.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import ROOT, TINY, versions  # noqa: E402  (tools/bench is not a package)

STEPS, SEEDS = 50, (0, 1, 2)
PROMPTS, SAMPLES, NEW_TOKENS, LR = 8, 4, 8, 5e-3
LEVELS, MAX_REWARD, WINDOW = (0.5, 0.9), 1.0, 3
SYSTEMS = ("moe_rl", "TRL")
REWARD_FN = "lowercase_fraction"
REWARD_FILE = f'''"""learn_vs_trl's task: reply in lowercase letters."""


def {REWARD_FN}(row: dict, response: str) -> float:
    """The fraction of the answer's characters that are ASCII lowercase letters (0 for an empty answer)."""
    return sum("a" <= c <= "z" for c in response) / len(response) if response else 0.0
'''


def write_task(out: Path, seed: int, steps: int) -> tuple[Path, Path]:
    """The reward file (shared by all seeds) and this seed's prompts, in the order both systems read them."""
    reward = out / "rewards.py"
    reward.write_text(REWARD_FILE)
    rng = random.Random(seed)
    rows = [{"prompt": f"Reply in lowercase letters. ({rng.randrange(10_000):04d})"}
            for _ in range(PROMPTS * steps)]
    prompts = out / f"prompts_s{seed}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return reward, prompts


def build_model(out: Path, seed: int) -> Path:
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(out / f"model_s{seed}", TinyModel(**TINY), seed=seed)


class Progress:
    """Progress lines, one per step: `see` the step's figures as they come (several times a step)."""

    def __init__(self, label: str):
        self.label, self.last, self.shown = label, None, set()

    def see(self, step: int, total: int, reward: str) -> None:
        if self.last is not None and step != self.last[0]:
            self.show()
        self.last = (step, total, reward)

    def finish(self, reward: float | None = None) -> None:
        """The last step's line (with `reward`, where the output shows a stale one)."""
        if self.last is not None and reward is not None:
            self.last = (*self.last[:2], f"{reward:.3f}")
        self.show()

    def show(self) -> None:
        if self.last is not None and self.last[0] not in self.shown:
            self.shown.add(self.last[0])
            step, total, reward = self.last
            print(f"  {self.label}: step {step}/{total}  reward {reward}", flush=True)


def stream(cmd: list[str], progress: Progress, pattern: re.Pattern) -> float:
    """Run cmd with this process's environment (the same thread budget for both systems), `progress` seeing
    each step in its output (`pattern`: step, total, reward); exit with its output's tail if it fails.
    Returns its wall time."""
    t0, tail, buf = time.time(), "", ""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode  # a character across two reads
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for chunk in iter(lambda: proc.stdout.read1(4096), b""):
        text = decode(chunk)
        tail = (tail + text)[-6000:]
        *parts, buf = re.split(r"[\r\n]", buf + text)
        for part in parts:
            if m := pattern.search(part):
                progress.see(int(m.group(1)), int(m.group(2)), m.group(3))
    if proc.wait():
        sys.exit(f"{progress.label} failed ({proc.returncode}):\n{tail}")
    return time.time() - t0


OURS_PROGRESS = re.compile(r"RL steps:.*?\|\s*(\d+)/(\d+) .*reward=(\S+?)\]")
TRL_PROGRESS = re.compile(r"^@learn_vs_trl step (\d+)/(\d+) reward (\S+)")


def run_ours(out: Path, model: Path, reward: Path, prompts: Path, seed: int, steps: int, lr: float) -> dict:
    import yaml

    name = f"learn_s{seed}"
    cfg = {"run": {"name": name, "seed": seed, "output_dir": str(out / f"ours_s{seed}"), "steps": steps},
           "model": {"path": str(model), "dtype": "float32"},
           "rollout": {"max_model_len": 256, "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "top_p": 1.0,
                       "prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES},
           "environment": {"name": "single_turn", "dataset": str(prompts),
                           "reward_fn": f"{reward}:{REWARD_FN}", "max_turns": 1, "token_budget": NEW_TOKENS},
           "algorithm": {"advantage": "grpo", "whiten_advantages": False, "policy_loss": "ppo",
                         "clip_low": 0.2, "clip_high": 0.2, "aggregation": "token_mean",
                         "correction": "none"},
           "trainer": {"lr": lr, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
                       "grad_clip": 1.0, "epochs": 1, "minibatches": 1, "warm_start_steps": 0,
                       "eval_prompts": 0},
           "checkpoint": {"every": 0, "at_end": False, "resume": "never"},
           "logging": {"progress_bar": True}}  # its progress bar is where the progress lines come from
    path = out / f"ours_s{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    progress = Progress(f"moe_rl seed {seed}")
    wall = stream([str(Path(sys.executable).parent / "moe-rl"), "train", str(path)], progress, OURS_PROGRESS)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / f"ours_s{seed}" / "tensorboard" / name), size_guidance={"scalars": 0})
    ea.Reload()

    def curve(tag):
        return [e.value for e in sorted(ea.Scalars(tag), key=lambda e: e.step)]

    rewards = curve("reward/mean")
    progress.finish(rewards[-1] if rewards else None)  # the bar closes before it shows the last reward
    return {"curve": rewards, "step_s": curve("timing/step_s"), "wall_s": wall}


def run_trl(out: Path, model: Path, reward: Path, prompts: Path, seed: int, steps: int, lr: float) -> dict:
    result = out / f"trl_s{seed}.json"
    job = {"model": str(model), "reward": str(reward), "prompts": str(prompts), "seed": seed, "steps": steps,
           "lr": lr, "out": str(out / f"trl_s{seed}"), "result": str(result)}
    progress = Progress(f"TRL    seed {seed}")
    wall = stream([sys.executable, __file__, "--trl-worker", json.dumps(job)], progress, TRL_PROGRESS)
    progress.finish()
    return {**json.loads(result.read_text()), "wall_s": wall}


def trl_worker(job: dict) -> None:
    """TRL's GRPO as a user writes it: a dataset of chat prompts, a reward function, GRPOTrainer."""
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("learn_vs_trl_rewards", job["reward"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    score = getattr(module, REWARD_FN)
    rows = [json.loads(line) for line in Path(job["prompts"]).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "row": json.dumps(r)}
                              for r in rows])

    def reward(completions, row, **_):  # the same function, on the same (row, answer text)
        values = [score(json.loads(r), c[0]["content"]) for c, r in zip(completions, row, strict=True)]
        return [float(v["reward"] if isinstance(v, dict) else v) for v in values]

    curve, begins, step_s = [], [], []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begins.append(time.time())

        def on_step_end(self, args, state, control, **kw):
            step_s.append(time.time() - begins[-1])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                curve.append(logs["reward"])
                print(f"@learn_vs_trl step {state.global_step}/{job['steps']} reward {logs['reward']:.3f}",
                      flush=True)

    args = GRPOConfig(output_dir=job["out"], per_device_train_batch_size=PROMPTS * SAMPLES,
                      gradient_accumulation_steps=1, num_generations=SAMPLES,
                      max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, learning_rate=job["lr"],
                      lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                      max_grad_norm=1.0, max_steps=job["steps"], num_iterations=1, beta=0.0,
                      epsilon=0.2, loss_type="dapo", scale_rewards="group", router_aux_loss_coef=0.0,
                      mask_truncated_completions=False, use_cpu=True, bf16=False, shuffle_dataset=False,
                      gradient_checkpointing=False, save_strategy="no", report_to="none", logging_steps=1,
                      seed=job["seed"], data_seed=job["seed"], disable_tqdm=True)
    trainer = GRPOTrainer(model=job["model"], reward_funcs=reward, args=args, train_dataset=data,
                          callbacks=[Record()])
    trainer.train()
    result = {"curve": curve, "step_s": step_s, "threads": torch.get_num_threads()}
    Path(job["result"]).write_text(json.dumps(result))


def steps_to(curve: list[float], level: float, window: int) -> int | None:
    """The first step (1-based) at which the mean of the last `window` steps' rewards reaches `level`."""
    for i in range(window - 1, len(curve)):
        if statistics.fmean(curve[i - window + 1:i + 1]) >= level:
            return i + 1
    return None


def median_steps(values: list[int | None]) -> float | None:
    """The median over seeds, a seed that never reached the level counting as slower than all others."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def summarise(runs: dict[int, dict], window: int) -> dict:
    out = {"curves": {str(s): [round(v, 4) for v in r["curve"]] for s, r in runs.items()}}
    for level in LEVELS:
        key = f"{level:.0%}"
        per_seed = {str(s): steps_to(r["curve"], level * MAX_REWARD, window) for s, r in runs.items()}
        out[f"steps_to_{key}"] = per_seed
        out[f"median_steps_to_{key}"] = median_steps(list(per_seed.values()))
        reached = [v for v in per_seed.values() if v is not None]
        out[f"max_steps_to_{key}"] = max(reached) if reached and len(reached) == len(per_seed) else None
    out["auc"] = {str(s): round(statistics.fmean(r["curve"]), 4) if r["curve"] else None
                  for s, r in runs.items()}
    aucs = [v for v in out["auc"].values() if v is not None]
    out["median_auc"] = round(statistics.median(aucs), 4) if aucs else None
    steady = [t for r in runs.values() for t in r["step_s"][1:]]  # after each run's first step
    steady = steady or [t for r in runs.values() for t in r["step_s"]]
    out["step_s"] = round(statistics.median(steady), 3) if steady else None
    out["wall_s"] = {str(s): round(r["wall_s"], 1) for s, r in runs.items()}
    return out


def compare(ours: float | None, theirs: float | None) -> bool | None:
    """ours <= theirs in steps, None counting as never (null when neither reached the level)."""
    if ours is None and theirs is None:
        return None
    return theirs is None or (ours is not None and ours <= theirs)


def show(results: dict, seeds: list[int]) -> None:
    fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    names = [n for n in SYSTEMS if n in results]
    head = "  ".join(f"{n} s{s}".rjust(9) for n in names for s in seeds)
    print(f"\nreward per step (mean over the step's {PROMPTS}x{SAMPLES} samples)\n step  {head}")
    length = max(len(c) for n in names for c in results[n]["curves"].values())
    for i in range(length):
        cells = [results[n]["curves"][str(s)] for n in names for s in seeds]
        print(f" {i + 1:4d}  " + "  ".join((f"{c[i]:.3f}" if i < len(c) else "").rjust(9) for c in cells))
    print(f"\n{'':8s}" + "".join(f"steps to {level:.0%} (per seed; median)".ljust(36) for level in LEVELS)
          + "AUC (per seed; median)       s/step")
    for n in names:
        r = results[n]
        cells = [f"{' '.join(fmt(r[f'steps_to_{level:.0%}'][str(s)]) for s in seeds)}; "
                 f"{fmt(r[f'median_steps_to_{level:.0%}'])}".ljust(36) for level in LEVELS]
        auc = f"{' '.join(fmt(r['auc'][str(s)]) for s in seeds)}; {fmt(r['median_auc'])}".ljust(29)
        print(f"{n:8s}" + "".join(cells) + auc + fmt(r["step_s"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS, help=f"GRPO steps per run (default {STEPS})")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds (default 0 1 2)")
    ap.add_argument("--window", type=int, default=WINDOW,
                    help=f"steps averaged for steps-to-level (default {WINDOW})")
    ap.add_argument("--lr", type=float, default=LR, help=f"learning rate, both systems (default {LR})")
    ap.add_argument("--smoke", action="store_true", help="2 steps, 1 seed: check that both systems run")
    ap.add_argument("--only", choices=["moe_rl", "trl"], help="one system only")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(json.loads(args.trl_worker))
    if args.smoke:
        args.steps, args.seeds = 2, args.seeds[:1]
    if args.only != "moe_rl":
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("learn_vs_trl needs TRL: pip install -e '.[bench]'")
    print("versions:", versions(), flush=True)
    print(f"task: {REWARD_FN} (maximum {MAX_REWARD}); GRPO, {args.steps} steps, {PROMPTS} prompts x "
          f"{SAMPLES} samples, {NEW_TOKENS} new tokens, lr {args.lr}; seeds {args.seeds}", flush=True)
    out = Path(tempfile.mkdtemp(prefix="moe_rl_bench_learn_vs_trl_"))
    runs: dict[str, dict[int, dict]] = {n: {} for n in SYSTEMS if args.only in (None, n.lower())}
    for seed in args.seeds:
        model = build_model(out, seed)
        reward, prompts = write_task(out, seed, args.steps)
        for name, run in (("moe_rl", run_ours), ("TRL", run_trl)):
            if name in runs:
                runs[name][seed] = run(out, model, reward, prompts, seed, args.steps, args.lr)
    results = {name: summarise(r, args.window) for name, r in runs.items()}
    show(results, args.seeds)
    line = {"task": REWARD_FN, "max_reward": MAX_REWARD, "levels": list(LEVELS), "window": args.window,
            "steps": args.steps, "seeds": args.seeds,
            "hyper": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                      "max_new_tokens": NEW_TOKENS, "lr": args.lr, "temperature": 1.0, "epochs": 1,
                      "minibatches": 1, "kl": 0.0, "trl_loss_type": "dapo",
                      "moe_rl_aggregation": "token_mean"},
            **{name.lower(): r for name, r in results.items()}}
    if len(results) == 2:
        ours, theirs = results["moe_rl"], results["TRL"]
        for key, bound in (("verdict", "median"), ("within_noise", "max")):
            line[key] = {f"{level:.0%}": compare(ours[f"median_steps_to_{level:.0%}"],
                                                 theirs[f"{bound}_steps_to_{level:.0%}"]) for level in LEVELS}
        verdicts = list(line["verdict"].values())
        line["pass"] = None if None in verdicts else all(verdicts)
    print(f"\nfiles: {out}")
    print(json.dumps({**line, "versions": versions()}))


if __name__ == "__main__":
    main()
