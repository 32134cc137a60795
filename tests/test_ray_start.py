"""Ray's own start on a loaded machine: Ray 2.60 gives its raylet 30 s to register, so a start that times
out is tried again (session._init_ray), and a start that never succeeds ends `moe-rl train` in one line with
exit code 3 (a fault launch/ retries), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed"


TIMES_OUT_ONCE = f"""
import ray
from moe_rl.config import load_config
from moe_rl.driver import session
real, calls = ray.init, []
def init(*args, **kwargs):
    calls.append(kwargs)
    if len(calls) == 1:
        raise Exception({TIMED_OUT!r})  # as Ray raises it (node.py), after its processes started
    return real(*args, **kwargs)
ray.init = init
session.RAY_START_PAUSE_S = 0.0
cfg = load_config("configs/quickstart.yaml", ["cluster.num_cpus=1"])
try:
    session.start_ray(cfg)
    print("up", ray.is_initialized(), len(calls), calls[0] == calls[1], ray.cluster_resources()["CPU"],
          session._RAY_OF_RUN)
finally:
    session.shutdown()
print("down", ray.is_initialized())
"""


def test_a_start_that_times_out_is_tried_again():
    """In a process of its own (session.shutdown stops every process the driver started)."""
    proc = subprocess.run([sys.executable, "-c", TIMES_OUT_ONCE], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    assert "up True 2 True 1.0 ['started']" in out and "down False" in out  # the failed try's record went
    assert "could not start a local Ray (The current node timed out during startup." in out \
        and "trying again (2 of 3)" in out


RAY_NEVER_STARTS = f"""
import os
if os.environ.pop("MOE_RL_TEST_RAY_NEVER_STARTS", None):
    import ray
    def init(*args, **kwargs):
        raise Exception({TIMED_OUT!r})
    ray.init = init
"""


def test_a_start_that_never_succeeds_is_one_line_and_exit_3(tmp_path):
    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(RAY_NEVER_STARTS)
    path = os.pathsep.join(filter(None, [str(tmp_path / "spy"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "configs/quickstart.yaml",
         f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "trainer.warm_start_steps=0",
         "trainer.warm_start_lr=1e-3", "trainer.eval_prompts=0",
         "trainer.eval_every=0", "logging.progress_bar=false"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
                          "MOE_RL_TEST_RAY_NEVER_STARTS": "1"})
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "moe-rl: error: could not start a local Ray in 3 tries (" + TIMED_OUT + "); the machine may be "
        "overloaded: run again (exit code 3: launch/ retries it)")
    assert proc.stdout.count("trying again") == 2
