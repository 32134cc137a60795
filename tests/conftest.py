import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the experiment trackers (logging.backends) stay on this machine: W&B offline, no telemetry or error reports
for _key, _value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_ERROR_REPORTING", "false"),
                     ("MLFLOW_DISABLE_TELEMETRY", "true"), ("DO_NOT_TRACK", "1")):
    os.environ.setdefault(_key, _value)


# `make test` runs the suite on two workers, a file at a time each (pytest-xdist --dist loadfile), handing
# out the files longest first by their measured seconds (tests/durations.json, written from a CI run's
# report by tools/suite_durations.py), so that the two finish together; a file not measured yet counts as
# the median file
DURATIONS = json.loads((ROOT / "tests" / "durations.json").read_text())


def file_seconds(path: Path) -> float:
    return DURATIONS.get(path.relative_to(ROOT).as_posix(), statistics.median(DURATIONS.values()))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -file_seconds(item.path))  # stable: a file's tests keep their order


@pytest.fixture(scope="module", autouse=True)
def ray_of_the_module():
    """A module's in-process runs share one local Ray (tests/cli_runs.run_train starts it with the first);
    it stops after the module's last test."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def no_run_parts_left():
    """A test leaves nothing on the process's list of run parts: a later run in the same worker would shut
    down (and trip over) what it left there."""
    yield
    session = sys.modules.get("moe_rl.driver.session")
    if session is not None:
        left, session.RUN_PARTS[:] = list(session.RUN_PARTS), []
        assert not left, f"the test left run parts on session.RUN_PARTS: {left}"


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen"), TinyModel(arch="qwen3_moe"), seed=0)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory):
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), TinyModel(arch="mixtral"), seed=0)


def moe_rl_cli() -> list[str]:
    return [sys.executable, "-m", "moe_rl.cli"]


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory):
    """Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, q/k/v biases."""
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2_moe"), TinyModel(arch="qwen2_moe"),
                                 seed=0)


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory):
    """DeepSeek-V3: multi-latent attention, sigmoid routing with an expert bias in two groups (one kept),
    scaling, a shared expert, a dense first layer (moe_rl.tiny.deepseek_style_config)."""
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_deepseek_v3"), TinyModel(arch="deepseek_v3"),
                                 seed=0)


def with_mtp_layer(src, dst) -> dict:
    """A copy of the tiny DeepSeek-V3 checkpoint `src` at `dst` with one multi-token-prediction layer
    (num_nextn_predict_layers=1: random tensors numbered after the model's two layers, as DeepSeek-V3's
    layer 61 after its 61), which the trainer does not build. Returns the MTP tensors."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    g = torch.Generator().manual_seed(2)
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(64, 128, generator=g),
           "model.layers.2.enorm.weight": torch.randn(64, generator=g),
           "model.layers.2.hnorm.weight": torch.randn(64, generator=g),
           "model.layers.2.shared_head.norm.weight": torch.randn(64, generator=g),
           "model.layers.2.mlp.gate.weight": torch.randn(cfg["n_routed_experts"], 64, generator=g)}
    save_file({**weights, **mtp}, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return mtp


@pytest.fixture(scope="session")
def tiny_glm4_moe(tmp_path_factory):
    """GLM-4.5: DeepSeek-V3's routing with grouped-query attention, q/k norms, biases, half-rotary heads."""
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_glm4_moe"), TinyModel(arch="glm4_moe"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_dense(tmp_path_factory):
    """Qwen3-MoE whose first layer has a dense MLP (mlp_only_layers=[0]), then two MoE layers."""
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    spec = TinyModel(arch="qwen3_moe", num_layers=3, first_dense_layers=1)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen_dense"), spec, seed=0)


# Component settings as production builds them (moe_rl.driver.specs, from the default RunConfig: defaults
# live in the config sections), with a test's own values replacing fields. Plain functions, importable from
# rank
# functions in spawned processes (`from conftest import optim_spec`).


def model_spec(hf_path, **changes):
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs

    return dataclasses.replace(specs.model_spec(RunConfig(), str(hf_path)), **changes)


def optim_spec(lr: float, **changes):
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs

    return dataclasses.replace(specs.optim_spec(RunConfig(), lr, {}), **changes)


def engine_spec(model_path, **changes):
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs

    return dataclasses.replace(specs.engine_spec(RunConfig(), str(model_path)), **changes)


def agent_spec(**changes):
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs

    return dataclasses.replace(specs.agent_spec(RunConfig()), **changes)


def config_error(overrides, data=None, cuda=False) -> str:
    """The one-line ConfigError message `from_dict(data, overrides)` raises (it must raise)."""
    from moe_rl.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as info:
        from_dict(data or {}, overrides, cuda_available=cuda)
    msg = str(info.value)
    assert "\n" not in msg
    return msg
