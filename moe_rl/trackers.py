"""Experiment trackers (logging.backends): one small writer interface, the same scalars, histograms,
pictures and texts to each. `metrics.Metrics` fans a step out to the writers `open_writers` gives.

A writer has `scalars(values, step)`, `histogram(tag, values, step)` (a tracker without histograms ignores
it), `image(tag, hwc_uint8, step)`, `text(tag, text, step)`, `flush()` and `close()`. Each tracker keeps its
local store in the run directory unless a setting points elsewhere:

- tensorboard: event files under run.output_dir/tensorboard/run.name;
- wandb: an offline run under run.output_dir/wandb (logging.wandb_dir), project and name run.name (upload it
  later with `wandb sync`);
- mlflow: a run in experiment run.name of the tracking store `sqlite:///run.output_dir/mlflow.db`
  (logging.mlflow_tracking_uri), its artifacts (pictures, texts) under run.output_dir/mlflow_artifacts.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the config's check (missing_packages) imports this module: kept light
    import numpy as np
    import torch

# each backend's Python packages (the `trackers` extra: pip install 'moe_rl[trackers]')
PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",),
            "mlflow": ("mlflow", "sqlalchemy", "alembic")}


def missing_packages(backend: str) -> list[str]:
    """The packages `backend` needs that this environment lacks."""
    return [p for p in PACKAGES[backend] if importlib.util.find_spec(p) is None]


class Writer(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None: ...

    def image(self, tag: str, image_HWC: np.ndarray, step: int) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self.w.add_histogram(tag, values.double(), step)

    def image(self, tag: str, image_HWC: np.ndarray, step: int) -> None:
        self.w.add_image(tag, image_HWC, step, dataformats="HWC")

    def text(self, tag: str, text: str, step: int) -> None:
        self.w.add_text(tag, text, step)

    def flush(self) -> None:
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class WandbWriter:
    """An offline W&B run in `directory` (nothing leaves the machine; `wandb sync DIR/wandb/offline-run-*`
    uploads it)."""

    def __init__(self, directory: str | Path, project: str, name: str):
        import wandb

        self.wandb = wandb
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(directory), project=project, name=name,
                              settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False))

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self.run.log({tag: self.wandb.Histogram(values.double().numpy())}, step=step)

    def image(self, tag: str, image_HWC: np.ndarray, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image_HWC)}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        import html

        self.run.log({tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^\w\-. /]")  # what MLflow accepts in a metric name


def mlflow_key(tag: str) -> str:
    """`tag` as an MLflow metric name (characters MLflow refuses become _)."""
    return _MLFLOW_BAD.sub("_", tag)


class MlflowWriter:
    """A run (named `name`) in MLflow experiment `experiment` of tracking store `tracking_uri`; pictures and
    texts as the run's artifacts (an experiment this creates keeps them in `artifact_dir`; None: the
    tracking server's default). MLflow has no histograms: they are left out."""

    def __init__(self, tracking_uri: str, experiment: str, name: str, artifact_dir: Path | None):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            experiment, artifact_location=artifact_dir.resolve().as_uri() if artifact_dir else None)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        pass

    def image(self, tag: str, image_HWC: np.ndarray, step: int) -> None:
        self.client.log_image(self.run_id, image_HWC, artifact_file=f"{mlflow_key(tag)}/step_{step:06d}.png")

    def text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{mlflow_key(tag)}/step_{step:06d}.txt")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_tracking_uri(logging, out: Path) -> str:
    """logging.mlflow_tracking_uri, else the SQLite store run.output_dir/mlflow.db."""
    return logging.mlflow_tracking_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"


def open_writers(cfg, out: Path) -> list[Writer]:
    """The writers of the run's logging.backends, in their order."""
    lg, name, writers = cfg.logging, cfg.run.name, []
    for backend in lg.backends:
        if backend == "tensorboard":
            writers.append(TensorBoardWriter(out / "tensorboard" / name))
        elif backend == "wandb":
            writers.append(WandbWriter(Path(lg.wandb_dir) if lg.wandb_dir else out, name, name))
        elif backend == "mlflow":
            local = not lg.mlflow_tracking_uri or not lg.mlflow_tracking_uri.startswith(("http:", "https:"))
            writers.append(MlflowWriter(mlflow_tracking_uri(lg, out), name, name,
                                        out / "mlflow_artifacts" if local else None))
        else:  # LoggingSection.check refuses it first
            raise ValueError(f"unknown logging backend {backend!r}")
    return writers
