"""Settings honest in every combination: each accepted setting takes effect, or is refused in one line
before anything starts (config rules, the driver's preflight, `moe-rl convert`), or, where the command
line switched off what a config file's setting needs, named in one warning line."""

import json
import warnings

import pytest
from conftest import ROOT

from moe_rl.config import from_dict, load_config, read_yaml
from moe_rl.driver.specs import convert_spec, env_spec
from moe_rl.schema import ConfigError, ConfigWarning

CONVERT = convert_spec()  # the model settings `moe-rl convert` builds with

QUICK = ROOT / "configs" / "quickstart.yaml"


def refused(overrides, data=None) -> str:
    with pytest.raises(ConfigError) as err:
        from_dict(data or {}, overrides, cuda_available=False)
    return str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["environment.tool_timeout_s=30"], "environment.tool_timeout_s: 30.0 has no effect in this run: only an "
     "environment whose tools read it (Environment.reads_tool_timeout: calculator) reads it"),
    (["rollout.record_routes=false", "logging.heatmap_every=5"], "logging.heatmap_every: 5 has no effect in "
     "this run: only rollout.record_routes=true (the routes they show) reads it"),
    (["rollout.record_routes=false", "logging.routing_diagnostics_every=3"],
     "logging.routing_diagnostics_every: 3 has no effect in this run: only rollout.record_routes=true"),
    (["checkpoint.at_end=false", "checkpoint.keep=5"], "checkpoint.keep: 5 has no effect in this run: only a "
     "run that writes checkpoints (checkpoint.every > 0 or checkpoint.at_end=true) reads it"),
    (["trainer.minibatches=9", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2"],
     "trainer.minibatches: 9 minibatches of a step's 8 samples (rollout.prompts_per_step x "
     "samples_per_prompt): at most one per sample; use 8 or fewer"),
    (["model.lora.rank=65"], "model.lora.rank: 65 is above linear_qkv's width (64: the smaller of its input "
     "and output sizes), which bounds an adapter's rank; use at most 64"),
    (["model.lora.rank=8", "model.lora.targets=[router]"], "model.lora.rank: 8 is above router's width (4"),
    (["model.tiny.arch=glm4_moe", "model.expert_bias_update_rate=0.001"],
     "model.expert_bias_update_rate: 0.001 has no effect in this run: only rollout.record_routes=false "
     "(replayed routes keep the expert bias frozen) reads it"),
    (["rollout.record_routes=false", "model.expert_bias_update_rate=0.001"], "model.expert_bias_update_rate: "
     "a 'qwen3_moe' model's routers have no expert bias to update"),
    (["model.tiny.arch=deepseek_v3", "parallel.tp=2", "parallel.world_size=2"], "parallel.tp: 2 splits a "
     "'deepseek_v3' model's multi-latent attention, which trains right only with model.layer_spec="
     "transformer_engine"),
    (["model.tiny.arch=deepseek_v3", "model.lora.rank=8"], "model.lora.rank: a 'deepseek_v3' model's "
     "multi-latent attention takes no LoRA adapters here yet"),
    (["model.experts=grouped", "model.tiny.moe_intermediate_size=62"], "model.experts: grouped: torch's "
     "grouped GEMM needs rows of whole 16-byte units in float32, and expert width per expert-TP rank 62 is "
     "not; use model.experts=auto or sequential"),
    (["model.experts=grouped", "model.dtype=bfloat16", "model.tiny.moe_intermediate_size=60"],
     "model.experts: grouped: torch's grouped GEMM needs rows of whole 16-byte units in bfloat16, and expert "
     "width per expert-TP rank 60 is not"),
    (["cluster.gpu_memory_gb=81920"], "cluster.gpu_memory_gb: 81920 GB is not one GPU's memory: the unit is "
     "GB as the maker names it (80 for an H100 80GB, 141 for an H200), and no GPU has more than 1024 GB"),
])
def test_a_setting_without_effect_is_refused_in_one_line(overrides, message):
    assert refused(overrides).startswith(message)


def test_the_settings_take_where_they_have_an_effect():
    assert from_dict({}, ["environment.name=calculator", "environment.tool_timeout_s=30"],
                     cuda_available=False).environment.tool_timeout_s == 30
    assert from_dict({}, ["checkpoint.every=5", "checkpoint.at_end=false", "checkpoint.keep=5"],
                     cuda_available=False).checkpoint.keep == 5
    eight = ["trainer.minibatches=8", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    assert from_dict({}, eight, cuda_available=False).trainer.minibatches == 8
    assert from_dict({}, ["model.lora.rank=64", "model.lora.targets=[linear_qkv]"],
                     cuda_available=False).model.lora.rank == 64
    assert from_dict({}, ["cluster.gpu_memory_gb=141"], cuda_available=False).cluster.gpu_memory_gb == 141
    assert from_dict({}, ["model.experts=grouped", "model.tiny.moe_intermediate_size=60"],
                     cuda_available=False).model.experts == "grouped"  # 240 bytes: 15 units in float32
    glm = ["model.tiny.arch=glm4_moe", "rollout.record_routes=false", "model.expert_bias_update_rate=0.001"]
    assert from_dict({}, glm, cuda_available=False).model.expert_bias_update_rate == 0.001


def test_a_file_setting_the_command_line_made_inert_is_a_warning(capsys):
    """configs/quickstart.yaml sets a warm start (trainer.warm_start_steps and its trainer.warm_start_lr):
    turning the warm start off on the command line names warm_start_lr in one warning and runs; the same
    setting given on the command line beside it, or inert in the file alone, is still refused."""
    data = read_yaml(QUICK)
    assert data["trainer"]["warm_start_steps"] > 0 and data["trainer"]["warm_start_lr"]
    with pytest.warns(ConfigWarning) as seen:
        cfg = from_dict(data, ["trainer.warm_start_steps=0"], cuda_available=False)
    assert cfg.trainer.warm_start_steps == 0
    assert [str(w.message) for w in seen] == [
        f"trainer.warm_start_lr: {data['trainer']['warm_start_lr']!r} from the config file has no effect "
        "now that the command line (trainer.warm_start_steps) turned off what reads it "
        "(trainer.warm_start_steps > 0); ignored"]
    with pytest.raises(ConfigError, match="trainer.warm_start_lr: 0.01 has no effect"):
        from_dict(data, ["trainer.warm_start_steps=0", "trainer.warm_start_lr=0.01"], cuda_available=False)
    inert = {**data, "trainer": {**data["trainer"], "warm_start_steps": 0}}
    with pytest.raises(ConfigError, match="trainer.warm_start_lr: .* has no effect"), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        from_dict(inert, ["run.steps=3"], cuda_available=False)
    # through the CLI: one line, `moe-rl: warning: ...`, and the config is accepted
    from moe_rl.cli import main

    assert main(["check-config", str(QUICK), "trainer.warm_start_steps=0"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("moe-rl: warning: trainer.warm_start_lr: ")
    assert "Traceback" not in err


def test_a_teacher_without_an_lm_head_is_refused_before_start(tmp_path, tiny_qwen):
    """A reward model (a score head, no LM head) named as the distillation teacher: refused by the driver's
    preflight, naming the field, before Ray starts (it failed after start-up before)."""
    from moe_rl.config import TinyModel
    from moe_rl.driver.preflight import preflight
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.weights.hf import CheckpointError

    rm = build_tiny_checkpoint(tmp_path / "rm", TinyModel(), seed=0, reward_model=True)
    cfg = load_config(QUICK, ["algorithm.distill_coef=1", f"teacher.path={rm}", f"model.path={tiny_qwen}"],
                      cuda_available=False)
    with pytest.raises(CheckpointError, match=r"teacher.path: '.*' has no LM head \(lm_head.weight\), but a "
                                              r"score head \(score.weight\): a reward model; a distillation "
                                              r"teacher is a causal language model"):
        preflight(cfg, tmp_path / "run", env_spec(cfg))


def test_convert_names_the_right_path_or_direction(tmp_path, tiny_qwen):
    from moe_rl.train.convert import hf_to_mcore, mcore_to_hf
    from moe_rl.weights.hf import CheckpointMismatch

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000020"
    for role in ("policy", "critic"):
        (step / role).mkdir(parents=True)
        (step / role / ".metadata").write_bytes(b"")
    (run / "config.yaml").write_text("{}")
    with pytest.raises(CheckpointMismatch, match=f"{run} is a run directory: convert one of its checkpoints, "
                                                 f".* \\(newest: {step / 'policy'}\\)"):
        mcore_to_hf(CONVERT, run, tmp_path / "out")
    with pytest.raises(CheckpointMismatch, match=f"{step} holds a step's checkpoints: convert "
                                                 f"{step / 'policy'} or {step / 'critic'}"):
        mcore_to_hf(CONVERT, step, tmp_path / "out")
    with pytest.raises(CheckpointMismatch, match="is a Megatron checkpoint, not a Hugging Face model: the "
                                                 "direction is mcore-to-hf"):
        hf_to_mcore(CONVERT, step / "policy", tmp_path / "out")
    with pytest.raises(CheckpointMismatch, match="is a Hugging Face model, not a Megatron checkpoint: the "
                                                 "direction is hf-to-mcore"):
        mcore_to_hf(CONVERT, tiny_qwen, tmp_path / "out")
    assert json.loads((tiny_qwen / "config.json").read_text())  # untouched
