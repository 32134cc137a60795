import dataclasses

import pytest
from conftest import ROOT

from moe_rl.config import ConfigError, RunConfig, from_dict, load_config, parse_overrides

QUICKSTART = "configs/quickstart.yaml"


def _err(overrides, data=None, cuda=False) -> str:
    with pytest.raises(ConfigError) as info:
        from_dict(data or {}, overrides, cuda_available=cuda)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_quickstart_loads_and_is_frozen():
    cfg = load_config(QUICKSTART, cuda_available=False)
    assert isinstance(cfg, RunConfig)
    assert cfg.environment.options == {"low": 1, "high": 9}
    assert cfg.critic_enabled  # GAE needs a critic
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.steps = 3


def test_overrides_are_typed_and_nested():
    cfg = load_config(QUICKSTART, ["algorithm.gamma=0.99", "parallel.tp=2", "parallel.world_size=2",
                                   "algorithm.dual_clip=3", "critic.value_clip=null"], cuda_available=False)
    assert cfg.algorithm.gamma == 0.99 and cfg.parallel.tp == 2 and cfg.parallel.dp == 1
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)
    assert cfg.critic.value_clip is None
    assert load_config(QUICKSTART, ["trainer.lr=1e-3"], cuda_available=False).trainer.lr == 1e-3  # YAML 1.1 quirk


def test_unknown_key_suggests_the_closest():
    assert _err(["algorithm.gama=0.9"]).startswith("algorithm.gama: unknown key (did you mean 'gamma'?)")
    assert "did you mean 'rollout'" in _err(["rolout.temperature=1"])


def test_wrong_type():
    assert _err(["rollout.top_p=abc"]) == "rollout.top_p: expected float, got 'abc' (str)"
    assert "expected int" in _err(["parallel.tp=1.5"])
    assert "expected bool" in _err(["logging.tensorboard=3"])
    assert "not allowed" in _err(["model.dtype=float16"])


def test_out_of_range():
    assert "algorithm.gamma: 1.5 is outside the allowed range [0.0, 1.0]" == _err(["algorithm.gamma=1.5"])
    assert _err(["algorithm.dual_clip=0.5"]).startswith("algorithm.dual_clip: 0.5 must be > 1")
    assert _err(["run.steps=0"]).startswith("run.steps:")
    assert _err(["model.tiny.head_dim=16"]).startswith("model.tiny.head_dim:")


def test_unregistered_method_names_are_rejected_with_choices():
    msg = _err(["algorithm.policy_loss=gsp"])
    assert "did you mean 'gspo'" in msg and "cispo" in msg
    assert "did you mean 'guess_number'" in _err(["environment.name=guess_numbr"])


@pytest.mark.parametrize("overrides, field", [
    (["parallel.tp=4", "parallel.world_size=4"], "parallel.tp"),  # 2 attention heads
    (["parallel.ep=3", "parallel.world_size=3"], "parallel.ep"),  # 4 experts
    (["parallel.pp=2", "parallel.world_size=2", "model.tiny.num_layers=3"], "parallel.pp"),
    (["parallel.tp=2", "parallel.world_size=3"], "parallel.world_size"),
    (["parallel.tp=2", "parallel.world_size=2", "parallel.sequence_parallel=false"], "parallel.sequence_parallel"),
    (["model.layer_spec=transformer_engine"], "model.layer_spec"),
    (["model.fp8=delayed", "model.layer_spec=transformer_engine"], "model.layer_spec"),
    (["model.fp8=mxfp8"], "model.fp8"),
    (["rollout.route_source=vllm"], "rollout.route_source"),
    (["algorithm.advantage=grpo", "rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),
    (["algorithm.advantage=grpo", "algorithm.lam_critic=0.9", "rollout.samples_per_prompt=4"], "algorithm.lam_critic"),
    (["critic.enabled=false"], "critic.enabled"),
    (["model.moe_dispatcher=allgather", "parallel.pp=2", "parallel.world_size=2"], "model.moe_dispatcher"),
])
def test_incompatible_combinations(overrides, field):
    assert _err(overrides).startswith(field + ":")


def test_gpu_features_pass_where_cuda_exists():
    cfg = from_dict({}, ["model.layer_spec=transformer_engine", "model.fp8=blockwise", "rollout.route_source=vllm"],
                    cuda_available=True)
    assert cfg.model.fp8 == "blockwise" and cfg.rollout.route_source == "vllm"


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_overrides(["algorithm.gamma"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("run: 3\n")
    with pytest.raises(ConfigError, match="^run: expected a mapping"):
        load_config(notmap)
    with pytest.raises(ConfigError, match="is a value, not a section"):
        from_dict({"run": {"steps": 3}}, ["run.steps.x=1"], cuda_available=False)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(path):
    cfg = load_config(ROOT / path, cuda_available="quickstart" not in path)  # the recipes are for GPU clusters
    assert cfg.run.steps > 0
