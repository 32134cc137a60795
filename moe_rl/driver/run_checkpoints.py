"""Checkpoints of a run: the trainer groups' Megatron checkpoints, the loop's position and RNG state.

    ckpt = Checkpoints(cfg, out_dir, models, rollouts)
    step = ckpt.resume()        # None: a fresh run (checkpoint.resume never, or nothing to resume)
    if ckpt.due(step):          # every checkpoint.every steps and at the last step
        ckpt.save(step, in_flight)  # in_flight: an asynchronous run's next rollouts, finished

A checkpoint is written under a temporary name and renamed into place: a crash mid-save leaves the
previous one as it was, and `resume: auto` takes the newest complete one. The newest checkpoint.keep are
kept, and always the best held-out evaluation's (`prune`); with checkpoint.export_hf_every, the policy is
also written in Hugging Face format under hf/step_N (`export_hf`). Nothing in it is unpickled
beyond plain types and tensors (`read_loop_state`, and train/checkpoint.py for the weights).

Before anything starts, the driver checks the checkpoint it will resume from (`check_resume`): its
loop state, and every file of its trainer groups there and whole (a truncated shard is one line naming
the file, and the last good checkpoint beside it); and the config the run was started with against
this one (`config_changes`: only RESUMABLE_CHANGES may differ unless the user says so).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.config import RunConfig
from moe_rl.driver.remote import last_line
from moe_rl.driver.report import best_eval_step
from moe_rl.driver.rollout_manager import Collected, InFlight
from moe_rl.weights.hf import HF_CONFIG_DIR, MTP_DIR, CheckpointError, copy_hf_config, keep_mtp

LOOP_STATE = "loop_state.pt"
IN_FLIGHT = "rollout_in_flight.pt"  # asynchronous runs: the rollouts started before the checkpoint
# set by launch/retry.sh (seconds since the epoch when the first try started): a retry resumes from the
# newest checkpoint written since, and as checkpoint.resume says when there is none
RESUME_SINCE = "MOE_RL_RESUME_SINCE"


class Checkpoints:
    def __init__(self, cfg: RunConfig, out: Path, models, rollouts):
        self.cfg, self.root, self.models, self.rollouts = cfg, out / "checkpoints", models, rollouts
        self.exports = out / "hf"  # checkpoint.export_hf_every: the policy in Hugging Face format, by step
        self._mtp_dir: Path | None | bool = False  # `_mtp`'s answer, once known
        self.in_flight: list[Collected] = []  # set by `resume` where the checkpoint holds any
        self.evals: dict[int, dict] = {}  # the held-out evaluations by step (the loop's): the best is kept

    def _groups(self) -> dict:
        """The trainer groups a checkpoint holds, by directory name."""
        return {"policy": self.models.policy,
                **({"critic": self.models.critic} if self.models.critic else {})}

    def _mtp(self) -> Path | None:
        """The run's one copy of its model's multi-token-prediction layers (run.output_dir/mtp), made at
        the first checkpoint; None for a model without them."""
        kept = self.root.parent / MTP_DIR
        if self._mtp_dir is False:
            self._mtp_dir = kept if kept.is_dir() or keep_mtp(self.rollouts.model_path, kept) else None
        return self._mtp_dir

    def due(self, step: int) -> bool:
        every, at_end = self.cfg.checkpoint.every, self.cfg.checkpoint.at_end
        return bool(every and step % every == 0 or at_end and step == self.cfg.run.steps)

    def save(self, step: int, in_flight: Sequence[InFlight] = ()) -> Path:
        """The run after `step` steps; `in_flight`: the finished rollouts an asynchronous run started
        before the checkpoint, oldest first (the next steps train on them, after a resume too)."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".step_{step:06d}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {"step": step, "version": self.rollouts.version, "data_pos": self.rollouts.data_pos}
        sources = {"policy": self.rollouts.model_path, "critic": getattr(self.models.critic, "path", None)}
        for role, group in self._groups().items():
            group.call("save", str(tmp / role), state)
            copy_hf_config(sources[role], tmp / role / HF_CONFIG_DIR)  # exportable with `moe-rl convert`
        if self._mtp():  # the model's multi-token-prediction layers, untrained: one copy for the run
            (tmp / "policy" / MTP_DIR).symlink_to(os.path.relpath(self._mtp(), tmp / "policy"))
        if in_flight:
            torch.save({"rollouts": [r.done.state() for r in in_flight]}, tmp / IN_FLIGHT)
        write_loop_state(tmp / LOOP_STATE, state)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: a crash before this line leaves the previous checkpoint as it was
        every = self.cfg.checkpoint.export_hf_every
        if every and (step % every == 0 or step == self.cfg.run.steps):
            export_hf(final / "policy", self.exports / final.name)
        prune(self.root, self.cfg.checkpoint.keep, best_eval_step(self.evals))
        return final

    def resume(self) -> int | None:
        """Load the checkpoint to resume from (weights, optimizer, EWMA anchor, prompt position, RNG)
        and sync the engines; its step, or None when there is none."""
        path = resume_dir(self.cfg, self.root)
        if path is None:
            return None
        print(f"[moe-rl] resuming from {path}", flush=True)
        # first: a bad file fails before the weights are loaded
        st = check_resumable(path, list(self._groups()))
        self.in_flight = read_in_flight(path)
        self.models.policy.init_anchor()  # its state comes back with the checkpoint
        for role, group in self._groups().items():
            group.call("load", str(path / role))
        self.rollouts.data_pos = st["data_pos"]
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        np.random.set_state(numpy_rng_state(st["np_rng"]))
        self.rollouts.sync(self.models.policy, st["version"])
        return st["step"]


def prune(root: Path, keep: int, best: int | None) -> list[Path]:
    """Delete all but the newest `keep` checkpoints under `root`, never the one of the `best` held-out
    evaluation (report.best_eval_step) while it exists. Returns what it deleted."""
    kept_best = root / f"step_{best:06d}" if best is not None else None
    gone = [old for old in sorted(root.glob("step_*"))[:-keep] if old != kept_best]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone


def export_hf(policy: Path, out: Path) -> None:
    """The policy checkpoint in Hugging Face format at `out` (`moe-rl convert mcore-to-hf`, in a process of
    its own; a LoRA policy as its PEFT adapter), written under a temporary name and renamed. A failed export
    is said in one line and the run goes on: the checkpoint it came from is there to convert again."""
    import subprocess
    import sys

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "mcore-to-hf", str(policy),
                           str(tmp)], capture_output=True, text=True)
    if proc.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"[moe-rl] export of {policy} in Hugging Face format failed ({last_line(proc.stderr)}); the "
              "checkpoint is kept: moe-rl convert mcore-to-hf can export it later", flush=True)
        return
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"[moe-rl] policy exported in Hugging Face format: {out}", flush=True)


def read_in_flight(path: Path) -> list[Collected]:
    """The rollouts an asynchronous run's checkpoint kept, oldest first (weights_only: plain types and
    tensors); a checkpoint of before rollout.async_depth holds one rollout's state alone."""
    if not (path / IN_FLIGHT).is_file():
        return []
    try:
        state = torch.load(path / IN_FLIGHT, weights_only=True)
        return [Collected.from_state(s) for s in (state["rollouts"] if "rollouts" in state else [state])]
    except Exception as err:
        raise CheckpointError(f"{path / IN_FLIGHT} is not a rollout this program saved; refused "
                              f"({last_line(err)})") from None


def resume_dir(cfg: RunConfig, root: Path) -> Path | None:
    """The checkpoint a run resumes from (checkpoint.resume: auto -> the newest complete one under
    `root`, never -> None, or a directory), or None."""
    since = os.environ.get(RESUME_SINCE)
    if since:  # a launcher's retry: this run's own newest checkpoint, if it wrote one
        ours = sorted(p for p in root.glob("step_*") if (p / LOOP_STATE).is_file()
                      and (p / LOOP_STATE).stat().st_mtime >= float(since))
        if ours:
            return ours[-1]
    r = cfg.checkpoint.resume
    if r == "never":
        return None
    if r != "auto":
        if not (Path(r) / LOOP_STATE).is_file():
            raise CheckpointError(f"checkpoint.resume: {r} is not a complete checkpoint (no {LOOP_STATE})")
        return Path(r)
    done = sorted(p for p in root.glob("step_*") if (p / LOOP_STATE).is_file())
    return done[-1] if done else None


def check_resumable(path: Path, roles: list[str]) -> dict:
    """A checkpoint's loop state (`read_loop_state`), once its trainer groups' directories are there and
    every file in them whole (`train.checkpoint.check_files`, which loads no tensor)."""
    from moe_rl.train.checkpoint import check_files

    st = read_loop_state(path / LOOP_STATE)
    missing = [role for role in roles if not (path / role).is_dir()]
    if missing:
        raise CheckpointError(f"{path} has no {' or '.join(missing)} checkpoint; it was saved by a run "
                              f"without {' or '.join(missing)}, or is incomplete")
    for role in roles:
        check_files(path / role)
    return st


def check_resume(path: Path, roles: list[str], auto: bool) -> dict:
    """`check_resumable`, its error naming the newest good checkpoint beside a damaged one (in the same
    directory, an earlier step), if there is one; `auto`: the run would take `path` by checkpoint.resume=auto
    (deleting it lets auto take the good one)."""
    try:
        return check_resumable(path, roles)
    except CheckpointError as err:
        for other in sorted(path.parent.glob("step_*"), reverse=True):
            if other.name >= path.name or not (other / LOOP_STATE).is_file():
                continue
            try:
                check_resumable(other, roles)
            except CheckpointError:
                continue
            how = f"delete {path} (checkpoint.resume=auto then takes it), or set" if auto else "set"
            raise CheckpointError(f"{err}; the last good checkpoint is {other}: {how} "
                                  f"checkpoint.resume={other}") from None
        raise


def written_by_this_try(path: Path) -> bool:
    """Whether a launcher's retry is resuming a checkpoint its own earlier tries wrote (RESUME_SINCE)."""
    since = os.environ.get(RESUME_SINCE)
    return bool(since) and (path / LOOP_STATE).is_file() \
        and (path / LOOP_STATE).stat().st_mtime >= float(since)


# What a resumed run may change without `moe-rl train --resume-with-changes`: how long it runs (run.steps
# extends it), what it logs and keeps, and where and how long it waits on the machine. Anything else
# makes it another run than the one its checkpoints hold. Entries ending in "." are sections.
RESUMABLE_CHANGES = ("run.steps", "run.output_dir", "logging.", "checkpoint.every", "checkpoint.keep",
                     "checkpoint.at_end", "checkpoint.resume", "cluster.address", "cluster.node_ip",
                     "cluster.call_timeout_s", "cluster.start_timeout_s", "cluster.num_cpus",
                     "cluster.trainer_threads", "cluster.engine_threads", "cluster.gpus_per_node",
                     "cluster.gpu_memory_gb")


def resumable_change(key: str) -> bool:
    return any(key == k or k.endswith(".") and key.startswith(k) for k in RESUMABLE_CHANGES)


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out = {}
    for k, v in data.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_changes(stored: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(field, stored value, new value) for each field whose value differs between two configs as plain
    data (YAML as config.yaml holds it). A field only one of them has (added to or removed from the
    schema between the two) is not compared."""
    a, b = _flat(stored), _flat(new)
    return [(k, a[k], b[k]) for k in b if k in a and a[k] != b[k]]


def show_changes(changes: list[tuple[str, Any, Any]], most: int = 6) -> str:
    """`field: old -> new` of each change, at most `most` of them (and how many more)."""
    def value(v):
        return repr(v) if v == "" else str(v)

    shown = "; ".join(f"{k}: {value(a)} -> {value(b)}" for k, a, b in changes[:most])
    return shown + (f"; and {len(changes) - most} more" if len(changes) > most else "")


def write_loop_state(path: Path, state: dict) -> None:
    """The loop's position and RNG states in plain types and tensors only (numpy's key array as a
    tensor), so that loading needs no unpickling of arbitrary objects."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    torch.save({**state, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                "np_rng": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}, path)


def read_loop_state(path: Path) -> dict:
    """`write_loop_state`'s dict, loaded with weights_only=True: a file that would need arbitrary objects
    (a crafted pickle, a checkpoint from elsewhere) or that is not one is refused with CheckpointError."""
    try:
        st = torch.load(path, weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError... by cause
        first = last_line(err)
        raise CheckpointError(f"{path} is not a loop state this program wrote, or would run code when "
                              f"loaded; refused ({first})") from None
    missing = {"step", "version", "data_pos", "torch_rng", "py_rng",
               "np_rng"} - set(st if isinstance(st, dict) else ())
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(sorted(missing))}: not a complete loop state")
    try:  # the RNG states tried on throwaway generators: a bad one fails here, not after the weights load
        torch.Generator().set_state(st["torch_rng"])
        random.Random().setstate(st["py_rng"])
        np.random.RandomState().set_state(numpy_rng_state(st["np_rng"]))
    except Exception as err:
        raise CheckpointError(f"{path}: its RNG states are not valid ({type(err).__name__}: {err})") from None
    return st


def numpy_rng_state(saved: tuple) -> tuple:
    """numpy's RNG state from `write_loop_state`'s form (the uint32 keys kept as an int64 tensor)."""
    name, keys, pos, has_gauss, cached = saved
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached
