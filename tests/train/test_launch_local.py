"""run_ranks, the local launcher of tests, benchmarks and `moe-rl convert`: its ranks are forked from a
server that imported PRELOAD once, yet each starts with the caller's environment of the moment and none
of the caller's state."""

import os
import sys

import pytest

from moe_rl.train.launch_local import PRELOAD, default_start, run_ranks

SEEN_BY_CALLER: list[int] = []


def what_a_rank_sees(rank, world_size):
    return {"mark": os.environ.get("MOE_RL_TEST_MARK"), "gone": os.environ.get("MOE_RL_TEST_GONE"),
            "rank": os.environ["RANK"], "pid": os.getpid(), "caller_state": list(SEEN_BY_CALLER),
            "preloaded": [name for name in PRELOAD if name in sys.modules]}


def test_ranks_start_with_the_callers_environment_of_the_moment(monkeypatch):
    monkeypatch.setenv("MOE_RL_TEST_GONE", "set before the server started")
    run_ranks(what_a_rank_sees, 1)  # the fork server is up from here on
    monkeypatch.setenv("MOE_RL_TEST_MARK", "set after")
    monkeypatch.delenv("MOE_RL_TEST_GONE")
    SEEN_BY_CALLER.append(1)
    seen = run_ranks(what_a_rank_sees, 2)
    assert [s["mark"] for s in seen] == ["set after"] * 2 and [s["gone"] for s in seen] == [None, None]
    assert [s["rank"] for s in seen] == ["0", "1"] and len({s["pid"] for s in seen} | {os.getpid()}) == 3
    assert [s["caller_state"] for s in seen] == [[], []]  # a new process, not a fork of the caller


def test_every_preloaded_module_is_in_a_rank_before_its_function_runs():
    """A name in PRELOAD that does not import is skipped by the fork server without a word: each is there."""
    (seen,) = run_ranks(what_a_rank_sees, 1)
    assert seen["preloaded"] == PRELOAD
    (spawned,) = run_ranks(what_a_rank_sees, 1, start="spawn")  # a fresh interpreter has not imported them
    assert spawned["preloaded"] != PRELOAD and spawned["mark"] is None


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start: 'fork'; 'forkserver' or 'spawn'"):
        run_ranks(what_a_rank_sees, 1, start="fork")


def test_ranks_are_spawned_where_cuda_is_available():
    """On a GPU machine importing megatron-core's GPT model asks CUDA for its devices, which poisons every
    later fork: a fork server's ranks could not use CUDA (seen on an H200, 2026-12-04)."""
    assert default_start(cuda_available=True) == "spawn"
    assert default_start(cuda_available=False) == "forkserver"
