"""Reading the experiment trackers' local stores back (tests/test_trackers.py, the reference run of
tests/test_loop.py): an offline W&B run's transaction log, MLflow's and TensorBoard's scalars."""

import struct
from pathlib import Path


def wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run (its run-ID.wandb transaction log: a 7-byte header, then
    LevelDB-log records in 32 KiB blocks, each a wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> dict[str, dict[int, object]]:
    """KEY -> {step: value} of an offline W&B run's logged history (a picture, a histogram: a dict of its
    fields)."""
    import json

    out: dict[str, dict[int, object]] = {}
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or (i.nested_key[0] if len(i.nested_key) == 1 else tuple(i.nested_key)):
                     json.loads(i.value_json) for i in r.history.item}
            step = int(items.pop("_step"))
            for k, v in items.items():
                if isinstance(k, tuple):  # a media value's fields: (*KEY, field)
                    out.setdefault("/".join(k[:-1]), {}).setdefault(step, {})[k[-1]] = v
                else:
                    out.setdefault(k, {})[step] = v
    return out


def same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN on both sides


def mlflow_scalars(tracking_uri: str, experiment: str) -> dict[str, dict[int, float]]:
    """TAG -> {step: value} of the one run of MLflow experiment `experiment`."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
            for k in run.data.metrics}


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {k: {e.step: e.value for e in acc.Scalars(k)} for k in acc.Tags()["scalars"]}
