"""What a hurried user gets wrong, refused by the driver's preflight (driver/preflight.py) before Ray, the
trainer ranks or vLLM start, each in one line naming the setting: a reward function or an environment
that fails on the first prompt, a context longer than the model has, a damaged checkpoint (naming the
file and the last good one), a run that has no steps left, a run directory of another config, an output
directory that is empty or cannot be written, actors that cannot fit the local Ray cluster. Called in
process: nothing here starts Ray (tests/test_cli.py runs some of them through the CLI)."""

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from moe_rl import config
from moe_rl.driver import preflight as driver_preflight
from moe_rl.driver.placement import PlacementError
from moe_rl.driver.report import CONFIG_FILE
from moe_rl.driver.run_checkpoints import RESUME_SINCE, write_loop_state
from moe_rl.driver.specs import env_spec
from moe_rl.schema import ConfigError
from moe_rl.weights.hf import CheckpointError

QUICK = ROOT / "configs" / "quickstart.yaml"
CUSTOM = ROOT / "examples" / "custom_reward" / "config.yaml"
CUSTOM_DATA = ROOT / "examples" / "custom_reward" / "prompts.jsonl"


def preflight(path: Path, *overrides: str, resume_with_changes: bool = False):
    cfg = config.load_config(path, list(overrides))
    env = env_spec(cfg)
    if resume_with_changes:
        return driver_preflight.preflight(cfg, Path(cfg.run.output_dir), env, resume_with_changes=True)
    return driver_preflight.preflight(cfg, Path(cfg.run.output_dir), env)


def refused(error: type, path: Path, *overrides: str, resume_with_changes: bool = False) -> str:
    """The one line preflight refuses with."""
    with pytest.raises(error) as info:
        preflight(path, *overrides, resume_with_changes=resume_with_changes)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- 1. the user's task code --------------------------------------------------------------------------

REWARDS = """\
def boom(row, response):
    return 1 / len(response)
def nan(row, response):
    return float("nan")
def text(row, response):
    return "good"
def nothing(row, response):
    pass
def fine(row, response):
    return float(len(response) > 3)
"""


@pytest.mark.parametrize("fn, expect", [
    ("boom", "rewards.py:boom raised ZeroDivisionError: division by zero ({file}:2) scoring the answer '' on "
             "the first row of {data}, before the run starts; a reward function must score every answer, the "
             "empty one too"),
    ("nan", "rewards.py:nan returned a reward of nan for the answer '' on the first row of {data}, before "
            "the run starts; rewards must be finite"),
    ("text", "rewards.py:text returned str 'good' for the answer ''"),
    ("nothing", "rewards.py:nothing returned None for the answer ''"),
])
def test_a_reward_function_that_fails_on_the_first_row_is_one_line(tmp_path, fn, expect):
    """Called once, on the first dataset row and an empty answer: its exception (type, message, and the
    line of the user's file that raised it) or its bad result, naming environment.reward_fn."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    line = refused(ConfigError, CUSTOM, f"run.output_dir={tmp_path / 'run'}",
                   f"environment.dataset={CUSTOM_DATA}",
                   f"environment.reward_fn={tmp_path / 'rewards.py'}:{fn}")
    assert line.startswith(f"environment.reward_fn: {tmp_path}/")
    assert expect.format(file=tmp_path / "rewards.py", data=CUSTOM_DATA) in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_working_reward_function_passes(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    prompts, _ = preflight(CUSTOM, f"run.output_dir={tmp_path / 'run'}", f"environment.dataset={CUSTOM_DATA}",
                           f"environment.reward_fn={tmp_path / 'rewards.py'}:fine")
    assert prompts[0]["answer"] == 7 and (tmp_path / "run").is_dir()


ENVS = """\
from moe_rl.rollout.envs import Environment, StepResult

class Done(Environment):
    async def step(self, action_text):
        return StepResult(None, done=True, final_reward=1.0)

class KeyMiss(Done):
    async def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

class Text(Done):
    async def reset(self, row):
        return row["prompt"]

class NoStep(Environment):
    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

class NoReset(Done):
    pass

class Plain(Done):
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

class NoOptions(KeyMiss):
    pass
"""


def env_overrides(tmp_path: Path, name: str) -> list[str]:
    (tmp_path / "envs.py").write_text(ENVS)
    return [f"run.output_dir={tmp_path / 'run'}", f"environment.name={tmp_path / 'envs.py'}:{name}",
            f"environment.dataset={CUSTOM_DATA}", "environment.reward_fn="]


def test_an_environment_whose_reset_fails_is_one_line(tmp_path):
    line = refused(ConfigError, CUSTOM, *env_overrides(tmp_path, "KeyMiss"))
    assert line == (f"environment.name: KeyMiss.reset failed on the first row of {CUSTOM_DATA} before the "
                    f"run starts: KeyError: 'question' ({tmp_path / 'envs.py'}:9)")
    line = refused(ConfigError, CUSTOM, *env_overrides(tmp_path, "Text"))
    assert line.startswith("environment.name: Text.reset returned str 'What is 5+2? Answer with a number.' "
                           f"on the first row of {CUSTOM_DATA}, before the run starts; reset returns the "
                           "chat messages")


@pytest.mark.parametrize("name, expect", [
    ("NoStep", "does not implement step: an Environment defines `async def reset"),
    ("NoReset", "does not implement reset: an Environment defines"),
    ("Plain", "Plain.reset must be `async def` (the agent awaits it)"),
])
def test_an_environment_without_reset_or_step_is_refused_at_load(tmp_path, name, expect):
    with pytest.raises(ConfigError, match="^environment.name: ") as info:
        config.load_config(CUSTOM, env_overrides(tmp_path, name))
    assert expect in str(info.value)


def test_options_for_an_environment_that_takes_none(tmp_path):
    with pytest.raises(ConfigError) as info:
        config.load_config(CUSTOM, [*env_overrides(tmp_path, "NoOptions"), "environment.options.max_len=3"])
    assert str(info.value) == ("environment.options.max_len: unknown key; allowed: none (NoOptions takes no "
                               "options: it declares no Options dataclass); remove environment.options")


# -- 2. what would fail inside the actors -------------------------------------------------------------

def test_a_context_longer_than_the_model_has(tmp_path):
    """vLLM refuses rollout.max_model_len above max_position_embeddings when an engine starts (after the
    whole start-up, in an actor): the tiny model's, and model.path's (times a RoPE factor)."""
    out = f"run.output_dir={tmp_path / 'run'}"
    assert refused(ConfigError, QUICK, out, "rollout.max_model_len=1024") == (
        "rollout.max_model_len: 1024 is above the 512 positions the model has "
        "(model.tiny.max_position_embeddings); vLLM refuses such an engine: lower rollout.max_model_len, or "
        "raise model.tiny.max_position_embeddings")
    preflight(QUICK, out, "rollout.max_model_len=1024", "model.tiny.max_position_embeddings=1024")
    from moe_rl.tiny import VOCAB_SIZE, hf_config

    model = tmp_path / "model"
    model.mkdir()
    hf = hf_config(config.TinyModel(), eos_token_id=VOCAB_SIZE - 1, pad_token_id=VOCAB_SIZE - 2).to_dict()
    (model / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 128}))
    line = refused(ConfigError, QUICK, out, f"model.path={model}")
    assert line == ("rollout.max_model_len: 256 is above the 128 positions the model has "
                    f"(max_position_embeddings in {model}/config.json); vLLM refuses such an engine: lower "
                    "rollout.max_model_len")
    (model / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 128,
                                                   "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    preflight(QUICK, out, f"model.path={model}")


def test_latent_attention_whose_rope_is_not_interleaved(tmp_path):
    """DeepSeek-V3's config.json may say rope_interleave=false (transformers then rotates the halves);
    vLLM and megatron-core always rotate interleaved pairs: refused before anything starts, true or
    absent (DeepSeek-V3's own files) accepted."""
    from moe_rl.tiny import VOCAB_SIZE, hf_config

    out = f"run.output_dir={tmp_path / 'run'}"
    model = tmp_path / "model"
    model.mkdir()
    hf = hf_config(config.TinyModel(arch="deepseek_v3"), eos_token_id=VOCAB_SIZE - 1,
                   pad_token_id=VOCAB_SIZE - 2).to_dict()
    (model / "config.json").write_text(json.dumps({**hf, "rope_interleave": False}))
    assert refused(ConfigError, QUICK, out, f"model.path={model}") == (
        "model.path: a 'deepseek_v3' checkpoint with rope_interleave=false: vLLM and megatron-core apply "
        "latent attention's RoPE interleaved, as DeepSeek-V3 does, so both would compute a different model "
        "from the one it describes")
    for fields in ({"rope_interleave": True}, {}):
        others = {k: v for k, v in hf.items() if k != "rope_interleave"}
        (model / "config.json").write_text(json.dumps({**others, **fields}))
        preflight(QUICK, out, f"model.path={model}")


def dist_checkpoint(path: Path) -> None:
    """A small dist checkpoint as train/checkpoint.py writes them (torch_dist: .metadata, a shard file,
    the record beside), written by torch.distributed.checkpoint in this process."""
    import torch.distributed.checkpoint as dcp

    from moe_rl.train.checkpoint import EXTRA_FILE

    dcp.save({"w": torch.arange(256.0), "b": torch.ones(8)}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    # torch's own writer records its path object; megatron's does not
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.storage_meta = None
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    torch.save({"extra": {}, "steps": 1, "optimizer": "plain", "role": "policy"}, path / EXTRA_FILE)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                    "sharded_backend_version": 1}))


def checkpoint(out: Path, step: int, roles=("policy", "critic")) -> Path:
    """A complete checkpoint of a run (loop state, a dist checkpoint per trainer group) at `step`."""
    path = out / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    for role in roles:
        dist_checkpoint(path / role)
    write_loop_state(path / "loop_state.pt", {"step": step, "version": step, "data_pos": 16 * step})
    return path


def test_a_truncated_checkpoint_names_the_file_and_the_last_good_one(tmp_path):
    out = tmp_path / "run"
    good, bad = checkpoint(out, 2), checkpoint(out, 4)
    shard = bad / "critic" / "__0_0.distcp"
    os.truncate(shard, 100)
    line = refused(CheckpointError, QUICK, f"run.output_dir={out}")
    assert line.startswith(f"{shard} is truncated (100 of its ") and line.endswith(
        f"the checkpoint is damaged; the last good checkpoint is {good}: delete {bad} "
        f"(checkpoint.resume=auto then takes it), or set checkpoint.resume={good}")
    line = refused(CheckpointError, QUICK, f"run.output_dir={out}", f"checkpoint.resume={bad}")
    assert line.endswith(f"the last good checkpoint is {good}: set checkpoint.resume={good}")
    (bad / "loop_state.pt").write_bytes((bad / "loop_state.pt").read_bytes()[:200])  # the loop state too
    line = refused(CheckpointError, QUICK, f"run.output_dir={out}")
    assert "loop_state.pt is not a loop state this program wrote" in line \
        and f"last good checkpoint is {good}" in line
    (good / "policy" / "__0_0.distcp").unlink()  # nothing good left: the damage alone
    assert refused(CheckpointError, QUICK, f"run.output_dir={out}", f"checkpoint.resume={good}") == (
        f"{good / 'policy' / '__0_0.distcp'} is missing (the checkpoint index points into it); the "
        "checkpoint is incomplete")
    preflight(QUICK, f"run.output_dir={out}", "checkpoint.resume=never")


def test_a_run_that_reached_its_steps(tmp_path, monkeypatch):
    out = tmp_path / "run"
    path = checkpoint(out, 3)
    assert refused(ConfigError, QUICK, f"run.output_dir={out}", "run.steps=3") == (
        f"run.steps: 3: this run already reached it ({path} is step 3); raise run.steps to continue it, or "
        "start over in a new run.output_dir")
    preflight(QUICK, f"run.output_dir={out}", "run.steps=4")
    # a launcher's retry of a try that saved its last step and died after it finishes that try's work
    monkeypatch.setenv(RESUME_SINCE, str(time.time() - 60))
    preflight(QUICK, f"run.output_dir={out}", "run.steps=3")


def test_actors_that_cannot_fit_the_local_ray_cluster(tmp_path, monkeypatch):
    """Separate placement: policy, critic and engine each need a CPU of their own."""
    apart = [f"run.output_dir={tmp_path / 'run'}", "cluster.colocate=false", "trainer.warm_start_steps=0",
             "trainer.warm_start_lr=1e-3", "trainer.warm_start_batch=16"]
    line = refused(PlacementError, QUICK, *apart, "cluster.num_cpus=2")
    assert line.startswith("the run needs 3 CPU for 3 actors ({'policy': 1, 'critic': 1, 'engine': 1}), the "
                           "local Ray cluster would have 2 (cluster.num_cpus=2); use cluster.colocate=true")
    preflight(QUICK, *apart, "cluster.num_cpus=3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # this process's share of the machine
    assert "would have 2 (the CPUs this process may use)" in refused(PlacementError, QUICK, *apart)
    preflight(QUICK, *apart, "cluster.address=10.0.0.1:6379")  # an existing cluster: sized once connected


# -- 4. the run's output directory --------------------------------------------------------------------

def test_the_output_directory_must_be_given_and_writable(tmp_path):
    assert refused(ConfigError, QUICK, "run.output_dir=") == (
        "run.output_dir: is empty: the run would write into the current directory; give it a directory of "
        "its own, e.g. run.output_dir=runs/NAME")
    for where in ("/proc/moe_rl_run", "/sys/moe_rl_run", "/proc/self/moe_rl_run"):
        line = refused(ConfigError, QUICK, f"run.output_dir={where}")
        assert line.startswith(f"run.output_dir: cannot write to '{where}' ("), line
    preflight(QUICK, f"run.output_dir={tmp_path / 'a' / 'b'}")  # made with its parents
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())


def test_a_run_directory_of_another_config_is_not_resumed_silently(tmp_path, capsys):
    """An old GAE + critic run resumed as GRPO: refused, naming the fields; run.steps, logging.*, ... may
    change; --resume-with-changes resumes and says what changed."""
    out = tmp_path / "run"
    checkpoint(out, 2)
    (out / CONFIG_FILE).write_text(config.dump_yaml(config.load_config(QUICK, [f"run.output_dir={out}"])))
    grpo = ["algorithm.advantage=grpo", "rollout.samples_per_prompt=2", "critic.lr=1e-5",
            "critic.value_clip=0.2"]
    changes = "rollout.samples_per_prompt: 1 -> 2; algorithm.advantage: gae -> grpo; critic.lr: 0.003 -> " \
        "1e-05; critic.value_clip: 0.5 -> 0.2"
    line = refused(ConfigError, QUICK, f"run.output_dir={out}", *grpo)
    assert line.startswith(f"run.output_dir: '{out}' holds a run of another config, to be resumed from "
                           f"step_000002: {changes} (its config.yaml against this one)")
    assert "moe-rl train --resume-with-changes (run.steps, logging.*" in line
    preflight(QUICK, f"run.output_dir={out}", *grpo, resume_with_changes=True)
    assert f"resuming from {out / 'checkpoints' / 'step_000002'} with settings changed since config.yaml: " \
        f"{changes}" in capsys.readouterr().out
    preflight(QUICK, f"run.output_dir={out}", "run.steps=400", "logging.log_every=5",
              "cluster.call_timeout_s=60")
    assert "run.steps: 480 -> 400; logging.log_every: 1 -> 5; cluster.call_timeout_s: 3600.0 -> 60.0" \
        in capsys.readouterr().out
    # nothing resumed: a fresh start
    preflight(QUICK, f"run.output_dir={out}", *grpo, "checkpoint.resume=never")
