"""launch/slurm_lib.sh, the functions launch/slurm_ray.sbatch takes from it, each run by bash on its own:
the Slurm version check, a node's IPv4 address for Ray, and each step's srun with its GPU request. Where a
function asks Slurm (`scontrol show node`, `srun --version`) or starts a step (`srun`), a stand-in on PATH
answers; tests/launch/test_slurm.py runs the script on a real cluster."""

import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

LIB = ROOT / "launch" / "slurm_lib.sh"


@pytest.fixture
def fake_bin(tmp_path):
    """A directory put first on PATH; fake(name, body) writes a bash executable there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def fake(name: str, body: str) -> None:
        exe = bin_dir / name
        exe.write_text(f"#!/bin/bash\n{body}\n")
        exe.chmod(0o755)

    fake.dir = bin_dir
    return fake


def bash(script: str, fake_bin=None, **env) -> subprocess.CompletedProcess:
    path = f"{fake_bin.dir}:{os.environ['PATH']}" if fake_bin else os.environ["PATH"]
    return subprocess.run(["bash", "-c", f"source {LIB}; {script}"], capture_output=True, text=True,
                          env={**os.environ, "PATH": path, **env}, timeout=60)


def node_addr(fake_bin, addr: str) -> None:
    """`scontrol show node -o NAME` as Slurm prints it, with this NodeAddr."""
    fake_bin("scontrol", f'echo "NodeName=$4 Arch=x86_64 CoresPerSocket=1 NodeAddr={addr} '
                         'NodeHostName=host1 Port=6818 Version=22.05.8 State=IDLE"')


# -- node_ip -------------------------------------------------------------------------------------------


def test_a_node_addr_that_is_a_host_name_is_resolved_to_its_ipv4_address(fake_bin):
    node_addr(fake_bin, "localhost")
    proc = bash("node_ip n0", fake_bin)
    assert (proc.returncode, proc.stdout) == (0, "127.0.0.1\n"), proc


def test_an_ipv4_node_addr_comes_back_as_it_is(fake_bin):
    fake_bin("getent", "exit 2")  # not asked: an address needs no resolving
    node_addr(fake_bin, "10.20.30.40")
    proc = bash("node_ip n0", fake_bin)
    assert (proc.returncode, proc.stdout) == (0, "10.20.30.40\n"), proc


@pytest.mark.parametrize("addr", ["no-such-node.invalid", "::1", "10.20.30.400"])
def test_a_node_addr_without_an_ipv4_address_is_one_error_line(fake_bin, addr):
    node_addr(fake_bin, addr)
    proc = bash('ip=$(node_ip gpu7) || { echo "error: $ip"; exit 1; }', fake_bin)
    assert proc.returncode == 1, proc
    assert proc.stdout.splitlines() == [
        f"error: node gpu7: its NodeAddr '{addr}' does not resolve to an IPv4 address (getent ahostsv4 "
        f"{addr}), which Ray's --node-ip-address needs; give the node an IPv4 NodeAddr in slurm.conf or "
        "make the name resolve"]


def test_a_node_scontrol_does_not_know_is_an_error(fake_bin):
    fake_bin("scontrol", 'echo "Node gpu9 not found" >&2; exit 1')
    proc = bash("node_ip gpu9", fake_bin)
    assert (proc.returncode, proc.stdout) == (1, "node gpu9: 'scontrol show node gpu9' gives no NodeAddr\n")


# -- check_slurm_version ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reported, version", [("slurm 20.11.0", "20.11.0"), ("slurm-wlm 22.05.8", "22.05.8"),
                                               ("slurm 24.05.3", "24.05.3"),
                                               ("slurm 25.11.0-0rc1", "25.11.0")])
def test_slurm_20_11_or_newer_is_accepted(fake_bin, reported, version):
    fake_bin("srun", f'[[ "$1" == --version ]] && echo "{reported}"')
    proc = bash("check_slurm_version", fake_bin)
    assert (proc.returncode, proc.stdout) == (0, f"{version}\n"), proc


@pytest.mark.parametrize("reported, version", [("slurm 20.02.7", "20.02.7"), ("slurm 19.05.5", "19.05.5"),
                                               ("slurm-wlm 17.11.2", "17.11.2")])
def test_a_slurm_older_than_20_11_is_refused(fake_bin, reported, version):
    fake_bin("srun", f'[[ "$1" == --version ]] && echo "{reported}"')
    proc = bash("check_slurm_version", fake_bin)
    assert (proc.returncode, proc.stdout) == (1, f"Slurm {version} is too old: launch/slurm_ray.sbatch needs "
                                                 "Slurm >= 20.11 (srun --overlap)\n"), proc


def test_an_srun_without_a_version_is_refused(fake_bin):
    fake_bin("srun", 'echo "srun: fatal: Could not establish a configuration source" >&2; exit 1')
    proc = bash("check_slurm_version", fake_bin)
    assert proc.returncode == 1
    assert proc.stdout.startswith("could not read the Slurm version from 'srun --version' (srun: fatal: ")


# -- step_gpu_args and step -------------------------------------------------------------------------------


@pytest.mark.parametrize("role, gpus, flag", [("ray", "8", "--gpus-per-node=8"),
                                              ("ray", "0", "--gpus-per-node=0"),
                                              ("driver", "8", "--gpus-per-node=0"),
                                              ("driver", "0", "--gpus-per-node=0")])
def test_the_gpu_request_of_each_step(role, gpus, flag):
    proc = bash(f"step_gpu_args {role} {gpus}")
    assert (proc.returncode, proc.stdout) == (0, f"{flag}\n"), proc


@pytest.mark.parametrize("gpus", ["eight", "-1", "2.5"])
def test_a_gpu_count_that_is_not_a_whole_number_is_refused(gpus):
    proc = bash(f"step_gpu_args ray '{gpus}'")
    assert proc.returncode == 1 and "a whole number, 0 or more" in proc.stdout, proc


def srun_args(fake_bin, tmp_path: Path, role: str, gpus: int, container: bool = False) -> list[str]:
    """The arguments `step ROLE n1 ...` (as launch/slurm_ray.sbatch runs it, in the background) gives srun."""
    out = tmp_path / "srun.args"
    fake_bin("srun", f'echo "$$" > {out}.pid; printf "%s\\n" "$@" > {out}')
    setup = "STEP_CONTAINER_ARGS=(--container-image=img.sqsh --container-mounts=/r:/r); " if container else ""
    proc = bash(f"GPUS_PER_NODE={gpus}; {setup}step {role} n1 --output=/logs/x.log my-command --flag & "
                'pid=$!; wait "$pid"; echo "$pid"', fake_bin)
    assert proc.returncode == 0, proc
    # exec: the PID the script keeps (to signal the step) is srun's own
    assert proc.stdout.strip() == Path(f"{out}.pid").read_text().strip()
    return out.read_text().splitlines()


def test_the_driver_step_asks_for_no_gpu_and_the_ray_steps_for_the_nodes_gpus(fake_bin, tmp_path):
    driver = srun_args(fake_bin, tmp_path, "driver", 8)
    assert driver == ["--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--kill-on-bad-exit=0",
                      "--gpus-per-node=0", "--output=/logs/x.log", "my-command", "--flag"]
    ray = srun_args(fake_bin, tmp_path, "ray", 8)
    assert ray == [a.replace("--gpus-per-node=0", "--gpus-per-node=8") for a in driver]
    assert srun_args(fake_bin, tmp_path, "ray", 0) == driver  # a node without GPUs: no GPU for any step
    with_container = srun_args(fake_bin, tmp_path, "ray", 8, container=True)
    assert with_container[5:8] == ["--gpus-per-node=8", "--container-image=img.sqsh",
                                   "--container-mounts=/r:/r"]


# -- the script's own use of them --------------------------------------------------------------------------


def test_the_script_stops_on_a_slurm_older_than_20_11_with_one_log_line(fake_bin, tmp_path):
    fake_bin("srun", '[[ "$1" == --version ]] && echo "slurm 20.02.7" || { touch started; exit 1; }')
    fake_bin("scontrol", "touch started; exit 1")
    logs = tmp_path / "logs"
    env = {**os.environ, "PATH": f"{fake_bin.dir}:{os.environ['PATH']}", "MOE_RL_REPO": str(ROOT),
           "SLURM_JOB_ID": "7", "MOE_RL_LOG_DIR": str(logs)}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "slurm_ray.sbatch"), "configs/quickstart.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc
    lines = (logs / "driver.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "] Slurm 20.02.7 is too old: launch/slurm_ray.sbatch needs Slurm >= 20.11 (srun --overlap)"), lines
    assert not (tmp_path / "started").exists()  # no step, no scontrol: it stopped first


def test_the_scripts_own_ray_commands_run_where_the_jobs_ray_is(fake_bin, tmp_path):
    """`ray status` (waiting for the nodes) and `ray get-auth-token`: in the steps' container, as a step on
    the head node, where the job runs in one (the batch host may have no Ray of that version); else on the
    batch host with the job's environment."""
    out = tmp_path / "args"
    fake_bin("srun", f'printf "%s\\n" "$@" > {out}')
    fake_bin("ray", f'printf "here %s\\n" "$@" > {out}')
    ray = fake_bin.dir / "ray"
    contained = bash("RAY_BIN=/opt/venv/bin/ray; STEP_CONTAINER_ARGS=(--container-image=img.sqsh); "
                     "ray_cli n0 status --address=1.2.3.4:6379", fake_bin)
    assert contained.returncode == 0, contained
    assert out.read_text().splitlines() == ["--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n0",
                                            "--gpus-per-node=0", "--container-image=img.sqsh",
                                            "/opt/venv/bin/ray", "status", "--address=1.2.3.4:6379"]
    here = bash(f"RAY_BIN={ray}; STEP_CONTAINER_ARGS=(); ray_cli n0 get-auth-token --generate", fake_bin)
    assert here.returncode == 0 and out.read_text().splitlines() == ["here get-auth-token", "here --generate"]
