"""`moe-rl bench gateway` (tools/bench/gateway.py) at a small size, as a user runs it: the gateway under a
load of concurrent multi-turn sessions loses none, replays a sample exactly as the agent loop plays it, and
ends with no episode, file or connection left open; the JSON line has the figures the docs report."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_a_load_of_sessions_loses_none_and_the_sample_is_exact():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "bench", "gateway", "--rounds", "1",
                          "--episodes", "8", "--sessions", "48", "--duration-s", "1", "--sample", "6"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["waves"] >= 2 and figures["sessions"] == 48 * figures["waves"]
    assert figures["lost"] == 0 and not figures["failed"], figures
    assert sum(figures["outcomes"].values()) == figures["sessions"]  # one trajectory a session: no split
    done, compared = map(int, figures["exact_sample"].split("/"))
    assert compared >= 3 and done == compared, figures
    assert figures["episodes_left"] == 0 and figures["connections_growth"] <= 0
    # every turn of every session was timed by its client; the percentiles are of those
    assert figures["requests"] >= figures["sessions"]
    assert 0 < figures["latency_p50_ms"] <= figures["latency_p99_ms"]
    for key in ("gateway_cpu_ms", "http_floor_ms", "cost_above_floor_ms", "sessions_per_s"):
        assert isinstance(figures[key], float), key
    above = figures["gateway_cpu_ms"] - figures["http_floor_ms"]
    assert figures["cost_above_floor_ms"] == pytest.approx(above, abs=0.011)
