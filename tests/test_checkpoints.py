"""The loop state of a checkpoint round-trips the RNG states through plain types and tensors, and a
file that is not one (a crafted pickle that would run code, junk, a dict missing fields) is refused
with CheckpointError, one line, before anything runs."""

import os
import pickle
import random

import numpy as np
import pytest
import torch

from moe_rl.checkpoints import numpy_rng_state, read_loop_state, write_loop_state
from moe_rl.weights.hf import CheckpointError


def test_loop_state_round_trips_the_rng_states(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    write_loop_state(tmp_path / "s.pt", {"step": 7, "version": 7, "data_pos": 112})
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    st = read_loop_state(tmp_path / "s.pt")
    assert (st["step"], st["version"], st["data_pos"]) == (7, 7, 112)
    random.setstate(st["py_rng"])
    torch.set_rng_state(st["torch_rng"])
    np.random.set_state(numpy_rng_state(st["np_rng"]))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_crafted_pickle_is_refused_without_running(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"step": 1, "x": Exploit()}, f)
    with pytest.raises(CheckpointError, match="would run code when loaded; refused") as info:
        read_loop_state(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists() and "\n" not in str(info.value)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a loop state this program wrote"):
        read_loop_state(tmp_path / "junk.pt")
    write_loop_state(tmp_path / "ok.pt", {"step": 1, "version": 1, "data_pos": 0})
    st = torch.load(tmp_path / "ok.pt", weights_only=True)
    torch.save({**st, "py_rng": (3, (1, 2), None)}, tmp_path / "bad_rng.pt")
    with pytest.raises(CheckpointError, match="its RNG states are not valid"):
        read_loop_state(tmp_path / "bad_rng.pt")
    torch.save({"step": 1}, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match="lacks data_pos, np_rng, py_rng, torch_rng, version"):
        read_loop_state(tmp_path / "partial.pt")
