"""Which GPUs each step of launch/slurm_ray.sbatch gets, on a real two-node SLURM cluster whose nodes have
two GPUs each as SLURM counts them (GRES gpu on stand-in device files: tests/launch/slurm_cluster.py).
The script runs as it is; `ray` and `moe-rl` are stand-ins that record what their step was given
(MOE_RL_VENV), so no Ray, no model and no GPU is needed: each Ray node's step must get its node's two
GPUs, the driver's step none, whichever way the job asked for its GPUs."""

import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from slurm_cluster import NODES, SlurmCluster

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "launch" / "slurm_ray.sbatch"
SEEN = 'SLURM_STEP_GPUS=${SLURM_STEP_GPUS:-none} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}'


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the SLURM test runs its daemons as root (as on CI)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm_gpus"), gpus_per_node=2) as cluster:
        yield cluster


def stand_in_venv(venv: Path, seen: Path) -> None:
    """bin/ray: `ray start` writes what its step was given to seen/NODE and blocks until signalled (as
    `ray start --block` does), `ray status` lists the nodes started so far; bin/moe-rl prints its step's."""
    (venv / "bin").mkdir(parents=True)
    seen.mkdir()
    scripts = {
        "ray": f"""case "$1" in
  start) echo "{SEEN} $*" > {seen}/"$SLURMD_NODENAME"; trap 'exit 0' TERM; while :; do sleep 0.2; done ;;
  status) echo Active:; for f in {seen}/*; do [ -e "$f" ] && echo " 1 node_${{f##*/}}"; done; echo Pending: ;;
  *) exit 1 ;;
esac""",
        "moe-rl": f'echo "driver on $SLURMD_NODENAME: {SEEN}"',
    }
    for name, body in scripts.items():
        (venv / "bin" / name).write_text(f"#!/bin/bash\n{body}\n")
        (venv / "bin" / name).chmod(0o755)


@pytest.mark.parametrize("gpus", ["--gpus-per-node=2", "--gres=gpu:2"])
def test_each_ray_node_step_gets_its_nodes_gpus_and_the_driver_step_none(slurm, tmp_path, gpus):
    venv, seen, logs = tmp_path / "venv", tmp_path / "seen", tmp_path / "logs"
    stand_in_venv(venv, seen)
    env = {**slurm.env, "MOE_RL_VENV": str(venv), "MOE_RL_LOG_DIR": str(logs),
           "MOE_RL_RAY_TMPDIR": str(tmp_path / "ray"), "MOE_RL_RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(["sbatch", "--wait", gpus, f"--output={tmp_path / 'job.out'}", str(SCRIPT),
                           "configs/quickstart.yaml"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    out = "\n".join(f"--- {f}\n{f.read_text()}" for f in sorted(tmp_path.rglob("*")) if f.is_file()
                    and f.suffix in (".log", ".out"))
    assert proc.returncode == 0, proc.stderr + out + slurm.logs()[-3000:]
    head = list(NODES)[0]
    for node in NODES:  # the GPUs each Ray node's step holds, and offers to Ray
        line = (seen / node).read_text()
        assert line.startswith("SLURM_STEP_GPUS=0,1 CUDA_VISIBLE_DEVICES=0,1 start "), line
        assert "--num-gpus=2" in line.split(), line
    driver = (logs / f"driver-{head}.log").read_text()
    assert driver == f"driver on {head}: SLURM_STEP_GPUS=none CUDA_VISIBLE_DEVICES=unset\n", out
    assert "2 node(s) n0 n1, 2 GPU(s) each" in (logs / "driver.log").read_text(), out
