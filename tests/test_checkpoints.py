"""The loop state of a checkpoint round-trips the RNG states through plain types and tensors, and a
file that is not one (a crafted pickle that would run code, junk, a dict missing fields) is refused
with CheckpointError, one line, before anything runs."""

import os
import pickle
import random

import numpy as np
import pytest
import torch

from moe_rl.driver.run_checkpoints import numpy_rng_state, read_loop_state, write_loop_state
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


def test_a_kept_rollout_round_trips_through_a_safe_load(tmp_path):
    """An asynchronous checkpoint's rollout in flight: every Trajectory field (routes in uint8 and
    int16, per-token versions, info) and every RolloutStats count come back as they were, loaded with
    weights_only=True."""
    from collections import Counter

    import numpy as np

    from moe_rl.driver.rollout_manager import Collected
    from moe_rl.rollout.agent import RolloutStats
    from moe_rl.trajectory import Outcome, RoutingRecord, Trajectory

    def traj(dtype, routes=True):
        rec = RoutingRecord(np.arange(12, dtype=dtype).reshape(3, 2, 2) * 3, np.array([True, True, False]))
        return Trajectory([1, 2, 3], [False, True, True], [0.0, -0.5, -0.25], [(1, 2)], [0.5], 1.0,
                          Outcome.TRUNCATED_TURNS, 3, 4, 1, rec if routes else None, group_id=7,
                          sample_index=1, info={"turns": 1, "tool_errors": 0}, versions=[4, 4, 5])

    stats = RolloutStats(Counter({"completed": 5, "truncated_turns": 2}), Counter({"empty": 3}), 1, 2, 4,
                         {"memory_rss_gib_max": 1.5})
    kept = Collected([([traj(np.uint8), traj(np.int16, routes=False)], stats),
                      ([traj(np.int16)], RolloutStats())], 2.5)
    torch.save(kept.state(), tmp_path / "kept.pt")
    back = Collected.from_state(torch.load(tmp_path / "kept.pt", weights_only=True))
    assert back.wait_s == 2.5 and len(back.results) == 2
    assert back.results[0][1] == stats and back.results[1][1] == RolloutStats()
    for (a, _), (b, _) in zip(kept.results, back.results, strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x.routes is None) == (y.routes is None)
            if x.routes is not None:
                assert y.routes.experts_PLK.dtype == x.routes.experts_PLK.dtype
                assert np.array_equal(x.routes.experts_PLK, y.routes.experts_PLK)
                assert np.array_equal(x.routes.computed_P, y.routes.computed_P)
            x.routes = y.routes = None
            assert x == y


def test_the_best_evaluations_checkpoint_is_never_pruned(tmp_path):
    """checkpoint.keep keeps the newest; the checkpoint of the best held-out evaluation (by
    eval/reward_mean, after RL began) stays beside them."""
    from moe_rl.driver.report import best_eval_step
    from moe_rl.driver.run_checkpoints import prune

    def steps():
        return sorted(int(p.name.removeprefix("step_")) for p in tmp_path.glob("step_*"))

    for s in range(1, 6):
        (tmp_path / f"step_{s:06d}").mkdir()
    evals = {0: {"eval/reward_mean": 0.9}, 2: {"eval/reward_mean": 0.5},
             3: {"eval/reward_mean": float("nan")}, 4: {"eval/reward_mean": 0.1}}
    assert best_eval_step(evals) == 2  # step 0 (before RL) and NaN left out
    assert [p.name for p in prune(tmp_path, 2, best_eval_step(evals))] == ["step_000001", "step_000003"]
    assert steps() == [2, 4, 5]
    prune(tmp_path, 2, 5)  # the best among the newest: nothing more to keep
    assert steps() == [4, 5]
    assert prune(tmp_path, 2, None) == [] and steps() == [4, 5]


def test_hf_exports_need_checkpoints_at_their_steps():
    from moe_rl.config import ConfigError, from_dict

    assert from_dict({}, ["checkpoint.every=2", "checkpoint.export_hf_every=4"],
                     cuda_available=False).checkpoint.export_hf_every == 4
    for every in ("3", "0"):
        with pytest.raises(ConfigError, match=f"checkpoint.export_hf_every: 4 exports the checkpoints of "
                                              f"those steps, and checkpoint.every={every} writes none there"):
            from_dict({}, [f"checkpoint.every={every}", "checkpoint.export_hf_every=4"], cuda_available=False)
