"""The experiment trackers of logging.backends for real, without a network: the same scalars, histograms,
pictures and texts through metrics.Metrics to TensorBoard, an offline W&B run and MLflow on a local SQLite
store, each read back with its own reader (TensorBoard's EventAccumulator, the W&B run's transaction log
parsed with wandb's own protobuf records, MlflowClient)."""

from types import SimpleNamespace

import pytest
import torch
from tracker_files import same, wandb_history

from moe_rl.config import ConfigError, from_dict
from moe_rl.metrics import Metrics, progress_figures
from moe_rl.trackers import open_writers

STEPS = {1: {"reward/mean": 0.25, "policy/loss": -1.5, "moe/rollout_load_imbalance_max": 2.0},
         2: {"reward/mean": 0.5, "policy/loss": float("nan"), "moe/rollout_load_imbalance_max": 1.5},
         3: {"reward/mean": 0.75, "policy/loss": 0.125, "moe/rollout_load_imbalance_max": 1.25}}


def test_the_same_figures_reach_every_tracker(tmp_path):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = SimpleNamespace(run=SimpleNamespace(name="trk"), logging=SimpleNamespace(
        backends=["tensorboard", "wandb", "mlflow"], wandb_dir="", mlflow_tracking_uri=""))
    m = Metrics(total_steps=3, progress=False, heatmap_every=2, writers=open_writers(cfg, tmp_path))
    m.text("config", "run:\n  name: trk\n")
    load = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.6, 0.4]])
    for step, figures in STEPS.items():
        logged = m.log(step, {**figures, "hist/reward/score": torch.tensor([0.0, 1.0, 1.0]),
                              "heatmap/moe/expert_load/rollout (vLLM)": load})
    m.close()
    names = set(STEPS[1]) | {"memory/rss_gib"}
    assert set(logged) == names

    acc = EventAccumulator(str(tmp_path / "tensorboard" / "trk"),
                           size_guidance={"images": 0, "histograms": 0})
    acc.Reload()
    tb = {k: {e.step: e.value for e in acc.Scalars(k)} for k in names}
    assert [i.step for i in acc.Images("moe/expert_load")] == [2]
    assert [h.step for h in acc.Histograms("reward/score")] == [1, 2, 3]
    assert "config/text_summary" in acc.Tags()["tensors"]  # the text

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    assert run.info.run_name == "trk" and run.info.status == "FINISHED"
    ml = {k: {h.step: h.value for h in client.get_metric_history(run.info.run_id, k)} for k in names}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "moe/expert_load")}
    assert artifacts == {"moe/expert_load/step_000002.png"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "config")] == ["config/step_000000.txt"]
    assert (tmp_path / "mlflow_artifacts").is_dir()  # the artifacts in the run directory too

    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    history = wandb_history(wandb_run)
    wb = {k: history[k] for k in names}
    assert history["moe/expert_load"].keys() == {2} and history["moe/expert_load"][2]["_type"] == "image-file"
    assert list(wandb_run.glob("files/media/images/moe/expert_load_*.png"))
    assert history["reward/score"].keys() == {1, 2, 3} and history["config"].keys() == {0}

    for k in names:  # the same scalars, steps and values, in each tracker
        assert tb[k].keys() == ml[k].keys() == wb[k].keys() == {1, 2, 3}, k
        for step in (1, 2, 3):
            want = logged[k] if step == 3 else STEPS[step].get(k, tb[k][step])
            # TensorBoard stores float32
            assert same(ml[k][step], wb[k][step]) and (same(tb[k][step], want) or
                                                       tb[k][step] == pytest.approx(ml[k][step], rel=1e-6))
            assert same(ml[k][step], want) or k == "memory/rss_gib", (k, step)


def test_backends_on_the_command_line_and_their_checks(monkeypatch):
    cfg = from_dict({}, ["logging.backends=[tensorboard,mlflow]"], cuda_available=False)
    assert cfg.logging.backends == ["tensorboard", "mlflow"]
    assert from_dict({}, ["logging.backends=[]"], cuda_available=False).logging.backends == []

    def err(*overrides) -> str:
        with pytest.raises(ConfigError) as info:
            from_dict({}, list(overrides), cuda_available=False)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "choose one of tensorboard, wandb, mlflow" in err("logging.backends=[tensorbord]")
    assert "names a tracker twice" in err("logging.backends=[mlflow,mlflow]")
    assert "only logging.backends with mlflow reads it" in err("logging.mlflow_tracking_uri=http://h:5000")
    assert err("logging.tensorboard=false").startswith(
        "logging.tensorboard: unknown key (removed: logging.backends")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "alembic")
                        else real(name, *a))
    assert err("logging.backends=[wandb]") == ("logging.backends: wandb needs the Python package(s) wandb, "
                                               "not installed here: pip install 'moe_rl[trackers]'")
    assert "mlflow needs the Python package(s) alembic" in err("logging.backends=[tensorboard,mlflow]")
    from_dict({}, [], cuda_available=False)  # TensorBoard alone needs neither


def test_the_progress_bar_shows_the_step_time_and_a_success_rate_where_the_environment_has_one():
    base = {"reward/mean": 0.5, "rollout/length_mean": 12.0, "timing/step_s": 3.25}
    assert progress_figures(base) == {"reward": "0.500", "len": "12", "step": "3.2s"}
    assert progress_figures({**base, "env/success": 0.75})["success"] == "75%"
