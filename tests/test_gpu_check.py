"""The GPU check as far as CI can take it: `tools/gpu_check.sh --dry-run` fetches the wheels that travel
(seconds once .whl holds them), checks they fit and that the GPU machine meets their requirements,
imports the check's modules without vLLM, Transformer Engine, apex and Ray, collects the gpu tests and
checks the measurement's arithmetic; and the wheel checks name each problem in one line."""

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_dry_run_checks_what_travels_and_says_what_it_would_run():
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "would run: timeout" in out and "tests/train/test_gpu_local.py" in out and "tools/gpu_check.py" in out
    assert "mbridge-0.15.1-py3-none-any.whl" in out and "megatron_core-0.16.1-cp312" in out
    assert "collects: 5 gpu tests" in out
    assert "FLOP/MFU arithmetic: the hand-worked case and the model's own parameter count agree" in out
    assert "problem" not in out and out.rstrip().splitlines()[-1].startswith("gpu_check: dry run OK in")


def test_wheel_checks_name_each_problem(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import gpu_carry

    good = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("fake-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake\nVersion: 1.0\n"
                   "Requires-Dist: not-on-the-machine\nRequires-Dist: torch>=99\nRequires-Dist: pytest; extra == 'test'\n")
    windows = tmp_path / "fake-1.0-cp311-cp311-win_amd64.whl"
    windows.write_bytes(good.read_bytes())
    wheels, problems = gpu_carry.wheel_problems(tmp_path, ["fake==1.0", "mbridge==0.15.1"])
    assert problems == [f"{windows.name} is not built for CPython 3.12 on x86-64 Linux",
                        f"two wheels of fake in {tmp_path}: {windows.name}, {good.name}; keep one",
                        f"no wheel of mbridge==0.15.1 in {tmp_path}"]
    assert gpu_carry.requirement_problems(wheels) == [  # the rest of moe_rl's needs are on the machine
        "moe_rl needs megatron-core>=0.16.1: neither carried nor on the GPU machine",
        "moe_rl needs mbridge>=0.15.1: neither carried nor on the GPU machine",
        "fake needs not-on-the-machine: neither carried nor on the GPU machine",
        "fake needs torch>=99: on the machine is 2.11.0"]
