"""A setting that nothing in the run reads is refused (config.reads.check_settings_are_read).

Every config field and every registered method are enumerated, so a field added later without a
reader, or a method whose declared settings are wrong, fails here:
- each registered method accepts exactly the algorithm settings it declares (`params`, which
  tests/algos/test_registry.py checks against what the function computes) and refuses the others of
  its kind's methods;
- each Switch's settings are accepted where it is on and refused where it is off;
- every other field is read by some code outside the config modules."""

import ast
import dataclasses
import subprocess
import typing
from pathlib import Path

import pytest
from conftest import ROOT, moe_rl_cli

from moe_rl.algos import registry
from moe_rl.config import ConfigError, RunConfig, from_dict
from moe_rl.config.reads import SWITCHES, conditional_readers, leaf_paths

DEFAULTS = leaf_paths(RunConfig())

# overrides that turn each Switch on and off (starting from RunConfig's defaults)
SWITCH_CASES = {
    "algorithm.aggregation=seq_sum_const": (["algorithm.aggregation=seq_sum_const"], [[]]),
    "algorithm.anchor=ewma": (["algorithm.anchor=ewma", "algorithm.correction=tis_token"], [[]]),
    "algorithm.overlong_buffer > 0": (["algorithm.overlong_buffer=8"], [[]]),
    "algorithm.kl_reward_coef > 0": (["algorithm.kl_reward_coef=0.1"], [[]]),
    "algorithm.kl_loss_coef > 0": (["algorithm.kl_loss_coef=0.1"], [[]]),
    "a critic (algorithm.advantage=gae)": ([],
                                           [["algorithm.advantage=grpo", "rollout.samples_per_prompt=2"]]),
    "the tiny model (model.path empty)": ([], [["model.path=/checkpoints/base"]]),
    "rollout.async_mode=true": (["rollout.async_mode=true", "rollout.max_staleness=4"], [[]]),
    "logging.samples > 0": ([], [["logging.samples=0"]]),
    "trainer.precision_aware_optimizer=true": (
        ["model.dtype=bfloat16", "trainer.precision_aware_optimizer=true"], [[]]),
    "logging.backends with wandb": (["logging.backends=[wandb]"], [[]]),
    "logging.backends with mlflow": (["logging.backends=[tensorboard,mlflow]"], [[]]),
    "algorithm.distill_coef > 0": (["algorithm.distill_coef=1", "teacher.path=/teachers/one"], [[]]),
    "environment.dynamic_sampling=true": (["environment.dynamic_sampling=true"], [[]]),
    "trainer.warm_start_steps > 0": (["trainer.warm_start_steps=1"], [[]]),
    "trainer.lr_schedule=linear or cosine": (["trainer.lr_schedule=cosine"], [[]]),
    "evaluation (trainer.eval_prompts > 0)": (["trainer.eval_prompts=4"], [[]]),
    "parallel.cp=1 without model.moe_dispatcher=allgather under parallel.ep > 1": (
        [], [["parallel.cp=2", "parallel.world_size=2"],
             ["model.moe_dispatcher=allgather", "parallel.ep=2", "parallel.world_size=2"]]),
    "reward_model.path": (["reward_model.path=/checkpoints/rm"], [[]]),
    "parallel.dp > 1": (["parallel.world_size=2"], [[], ["parallel.tp=2", "parallel.world_size=2"]]),
    "model.lora.rank > 0": (["model.lora.rank=4"], [[]]),
    "an environment whose tools read it (Environment.reads_tool_timeout: calculator)": (
        ["environment.name=calculator"], [[]]),
    "rollout.record_routes=true (the routes they show)": ([], [["rollout.record_routes=false"]]),
    "rollout.record_routes=false (replayed routes keep the expert bias frozen)": (
        ["model.tiny.arch=glm4_moe", "rollout.record_routes=false"], [["model.tiny.arch=glm4_moe"]]),
    "a run that writes checkpoints (checkpoint.every > 0 or checkpoint.at_end=true)": (
        [], [["checkpoint.at_end=false"]]),
    "a dataset (environment.dataset or trainer.eval_dataset)": (
        ["trainer.eval_prompts=4", "trainer.eval_dataset=held_out.jsonl"], [[]]),
}

# a valid value other than the default, where the type alone does not give one
OTHER = {"algorithm.dual_clip": 3.0, "algorithm.geo_max": 1.5, "model.tiny.num_attention_heads": 4,
         "model.tiny.num_key_value_heads": 1, "model.expert_bias_update_rate": 0.001,
         "model.tiny.top_k": 1, "model.tiny.first_dense_layers": 1, "model.tiny.head_dim": 64,
         "teacher.named": "{big: /teachers/big}", "teacher.tp": 1, "teacher.pp": 1, "teacher.ep": 1,
         "teacher.dtype": "bfloat16", "model.lora.targets": "[linear_qkv]",
         "model.lora.sync": "merged", "trainer.lr_min": 1e-6,
         "environment.dataset_fields": "{secret: number}", "critic.lr_mult": "{\"*\": 0.5}",
         "trainer.warm_start_policy": "binary search"}


def field_type(path: str):
    cls = RunConfig
    *sections, name = path.split(".")
    for s in sections:
        cls = typing.get_type_hints(cls)[s]
    return typing.get_type_hints(cls)[name]


def other_value(path: str, tmp_path: Path):
    """A valid value of the field other than its default."""
    default, tp = DEFAULTS[path], field_type(path)
    if path in OTHER:
        return OTHER[path]
    if path == "critic.init_from":  # a Hugging Face checkpoint directory
        (tmp_path / "rm").mkdir(exist_ok=True)
        (tmp_path / "rm" / "config.json").write_text("{}")
        return str(tmp_path / "rm")
    if typing.get_origin(tp) is typing.Literal:
        return next(v for v in typing.get_args(tp) if v != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2
    if isinstance(default, str):
        return "somewhere.jsonl"
    if default is None:  # an optional float that is off by default
        return 0.5
    raise AssertionError(f"no other value for {path} ({tp})")


# switches of GPU-only settings: checked as on a GPU machine
ON_GPU = {"trainer.precision_aware_optimizer=true"}


def load(overrides: list[str], cuda: bool = False) -> RunConfig:
    return from_dict({}, overrides, cuda_available=cuda)


def refused(overrides: list[str], path: str, cuda: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        load(overrides, cuda)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "has no effect in this run: only " in msg and "\n" not in msg, msg
    return msg


def test_every_registered_method_reads_exactly_its_declared_settings(tmp_path):
    algorithm_fields = {f.name for f in dataclasses.fields(RunConfig().algorithm)}
    for kind in registry.KINDS:
        declared = {p for n in registry.names(kind) for p in registry.meta(kind, n).params} & algorithm_fields
        for name in registry.names(kind):
            meta = registry.meta(kind, name)
            base = [f"algorithm.{kind}={name}"]
            if getattr(meta, "min_group_size", 1) > 1:
                base.append(f"rollout.samples_per_prompt={meta.min_group_size}")
            if getattr(meta, "sequence_level", False):
                base.append("algorithm.aggregation=seq_mean")
            if getattr(meta, "reads_old", False):  # nothing to mask with one update from pi_old itself
                base.append("trainer.epochs=2")
            if not getattr(meta, "reads_reward", True):  # a teacher's signal instead
                base += ["algorithm.distill_coef=1", "teacher.path=/teachers/one"]
            load(base)
            for param in sorted(declared):
                path = f"algorithm.{param}"
                overrides = [*base, f"{path}={other_value(path, tmp_path)}"]
                if param in meta.params:
                    load(overrides)
                else:
                    assert f"only algorithm.{kind}=" in refused(overrides, path)


def test_every_switch_turns_its_settings_on_and_off(tmp_path):
    assert set(SWITCH_CASES) == {s.choice for s in SWITCHES}  # a new Switch needs its cases here
    readers = conditional_readers(RunConfig())
    for switch in SWITCHES:
        on, offs = SWITCH_CASES[switch.choice]
        paths = [p for p, rs in readers.items() if any(choice == switch.choice for choice, _ in rs)]
        assert paths, switch.choice
        for path in paths:
            value = f"{path}={other_value(path, tmp_path)}"
            cuda = switch.choice in ON_GPU
            assert load([*on, value], cuda)  # read where the switch is on
            for off in offs:
                assert switch.choice in refused([*off, value], path, cuda)


def _attributes_read_outside_the_config() -> set[str]:
    """Attribute names read by the code outside the config modules, and by the config's properties (which
    that code reads: RolloutSection.engine_restarts, RunConfig.proximal_from_update, ...)."""
    names = set()
    for file in (ROOT / "moe_rl").rglob("*.py"):
        tree = ast.parse(file.read_text())
        if file.relative_to(ROOT / "moe_rl").as_posix() in ("config/__init__.py", "config/rules.py",
                                                             "config/reads.py", "schema.py"):
            tree = ast.Module([node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                               and any(getattr(d, "id", "") == "property" for d in node.decorator_list)], [])
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return names


def test_every_setting_has_a_reader():
    """A field is read under conditions (a registered method's or a Switch's) or by code outside the
    config modules: a field nothing reads fails here."""
    conditional, attributes = set(conditional_readers(RunConfig())), _attributes_read_outside_the_config()
    unread = [p for p in DEFAULTS if p not in conditional and p.rsplit(".", 1)[1] not in attributes]
    assert not unread, f"config fields that no code reads: {unread}"


@pytest.mark.parametrize("overrides, path", [
    (["algorithm.advantage=grpo", "rollout.samples_per_prompt=2", "algorithm.lam=0.9"], "algorithm.lam"),
    (["algorithm.advantage=grpo", "rollout.samples_per_prompt=2", "algorithm.gamma=0.99"], "algorithm.gamma"),
    (["algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean", "algorithm.dual_clip=3"],
     "algorithm.dual_clip"),
    (["algorithm.correction=tis_seq", "algorithm.is_cap=3"], "algorithm.is_cap"),
    (["algorithm.correction=tis_token", "algorithm.seq_is_cap=3"], "algorithm.seq_is_cap"),
    (["algorithm.correction=tis_token", "algorithm.icepop_min=0.4"], "algorithm.icepop_min"),
    (["algorithm.correction=bypass", "algorithm.icepop_max=3"], "algorithm.icepop_max"),
    (["algorithm.anchor=old", "algorithm.ewma_decay=0.5"], "algorithm.ewma_decay"),
    (["algorithm.aggregation=token_mean", "algorithm.loss_constant=100"], "algorithm.loss_constant"),
    (["algorithm.overlong_buffer=0", "algorithm.overlong_penalty=0.5"], "algorithm.overlong_penalty"),
    (["environment.max_resample_rounds=2"], "environment.max_resample_rounds"),
    (["rollout.async_mode=false", "rollout.max_staleness=2"], "rollout.max_staleness"),
    (["rollout.async_mode=false", "rollout.async_depth=2"], "rollout.async_depth"),
    (["algorithm.advantage=rloo", "rollout.samples_per_prompt=2", "critic.value_clip=0.5"],
     "critic.value_clip"),
    (["model.path=/checkpoints/base", "model.tiny.hidden_size=128"], "model.tiny.hidden_size"),
    (["trainer.warm_start_steps=0", "trainer.warm_start_lr=0.01"], "trainer.warm_start_lr"),
    (["trainer.warm_start_steps=0", "trainer.warm_start_batch=8"], "trainer.warm_start_batch"),
    (["trainer.lr_min=1e-6"], "trainer.lr_min"),
    (["trainer.lr_schedule=constant", "trainer.lr_decay_steps=100"], "trainer.lr_decay_steps"),
    (["parallel.cp=2", "parallel.world_size=2", "trainer.pack_sequences=false"], "trainer.pack_sequences"),
    (["model.moe_dispatcher=allgather", "parallel.ep=2", "parallel.world_size=2",
      "trainer.pack_sequences=false"],
     "trainer.pack_sequences"),
])
def test_the_settings_without_effect_are_refused(overrides, path):
    refused(overrides, path)


def test_a_token_budget_below_a_turn_is_refused():
    msg = str(pytest.raises(ConfigError, load,
                            ["environment.token_budget=8", "rollout.max_new_tokens=16"]).value)
    assert msg.startswith("environment.token_budget: 8 is below rollout.max_new_tokens=16")
    load(["environment.token_budget=16", "rollout.max_new_tokens=16"])


def test_check_config_refuses_one_in_one_line():
    out = subprocess.run([*moe_rl_cli(), "check-config", "configs/quickstart.yaml",
                          "algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean",
                          "algorithm.dual_clip=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["moe-rl: error: algorithm.dual_clip: 3.0 has no effect in "
                                               "this run: only algorithm.policy_loss=ppo reads it (leave it "
                                               "at its default, None)"]
