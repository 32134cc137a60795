"""launch/slurm_ray.sbatch on a real two-node SLURM cluster (munged, slurmctld and two slurmd on
127.0.0.10 and 127.0.0.11, started and stopped by this module): a short quickstart whose trainer
ranks and engine spread over both nodes (two policy ranks talk gloo across the nodes), a run that
fails, and a cancelled run. Each must leave no Ray process of its job behind."""

import os
import subprocess
import time
from pathlib import Path

import pytest
from cli_runs import NO_CRITIC
from conftest import ROOT
from glossary_check import assert_tags_in_glossary
from slurm_cluster import NODES, SlurmCluster

from moe_rl.train.parallel import free_port

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "launch" / "slurm_ray.sbatch"
SHORT = ["run.steps=3", "trainer.warm_start_steps=2", "trainer.warm_start_batch=4",
         "trainer.eval_prompts=0", "trainer.eval_every=0",
         "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "logging.progress_bar=false",
         "checkpoint.every=0", "cluster.placement=spread", "parallel.world_size=2",
         *NO_CRITIC]  # the subject is the launcher: the policy's two ranks span the nodes


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the SLURM test runs its daemons as root (as on CI)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def submit(slurm, tmp: Path, *overrides: str, wait: bool = True, retries: int = 0,
           env_extra: dict | None = None):
    logs = tmp / "logs"
    env = {**slurm.env, "MOE_RL_LOG_DIR": str(logs), "MOE_RL_RAY_PORT": str(free_port("127.0.0.1")),
           "OMP_NUM_THREADS": "1", "MOE_RL_RETRIES": str(retries), **(env_extra or {})}
    argv = ["sbatch", "--parsable", f"--output={tmp / 'job.out'}", *(["--wait"] if wait else []),
            str(SCRIPT), "configs/quickstart.yaml", f"run.output_dir={tmp / 'run'}", *SHORT, *overrides]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    job = proc.stdout.strip().split(";")[0] if proc.stdout.strip() else ""  # "id;cluster"
    return proc, job, logs


def job_processes(job: str) -> list[str]:
    """Command lines of live processes that belong to the job's Ray session (its temp dir)."""
    out = subprocess.run(["ps", "-eww", "-o", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"moe_rl_ray_{job}" in line and not line.startswith("Z")]


def explain(slurm, tmp: Path) -> str:
    texts = [f"--- {f}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(tmp.rglob("*.log"))
             + [tmp / "job.out"] if f.exists()]
    return "\n".join(texts) + slurm.logs()[-3000:]


def test_quickstart_runs_across_both_nodes_and_a_fault_is_retried_on_the_same_cluster(slurm, tmp_path):
    """The quickstart with its ranks and engine spread over both nodes; MOE_RL_RETRIES=1 and a policy
    rank that kills itself (session.failpoint) in step 2's weight sync: the driver exits 3 and runs once
    more on the same Ray cluster, resuming from the step-1 checkpoint, and finishes (the resumed steps'
    equality with an undisturbed run: tests/test_loop.py, through the same launcher retry rule)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    token = tmp_path / "token"
    token.touch()
    proc, job, logs = submit(slurm, tmp_path, "checkpoint.every=1", "rollout.weight_sync_bucket_mb=0.5",
                             retries=1, env_extra={"MOE_RL_FAILPOINT": f"trainer_export:3:{token}"})
    assert proc.returncode == 0, explain(slurm, tmp_path)
    driver = (logs / f"driver-{list(NODES)[0]}.log").read_text()
    placement = next(line for line in driver.splitlines() if "placement:" in line)
    for ip in NODES.values():  # workers on both nodes took part
        assert ip in placement, placement
    policy_nodes = placement.split("policy ranks on ")[1].split(" (")[0]  # "a, b (1 thread each); ..."
    assert sorted(policy_nodes.split(", ")) == sorted(NODES.values())  # one gloo group across the nodes
    assert "run finished: 3 steps" in driver
    for node in NODES:  # per-node logs
        assert "Ray runtime started" in (logs / f"ray-{node}.log").read_text()
    script = (logs / "driver.log").read_text()
    assert not token.exists() and "policy rank" in driver and "(export_weights): the actor died" in driver
    assert script.count("Ray cluster up") == 1 and "driver exited with 3" in script \
        and "driver exited with 0" in script
    assert "retry 1 of 1 from the last checkpoint (the Ray cluster stays up)" in script
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step_000001'}" in driver
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "quickstart"))  # run.name
    acc.Reload()
    # step 1 by the first try, 2 and 3 by the retry
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3]
    assert_tags_in_glossary(tmp_path / "run" / "tensorboard" / "quickstart")
    time.sleep(1)
    assert job_processes(job) == []


def test_a_config_mistake_is_not_retried_and_shuts_the_cluster_down(slurm, tmp_path):
    """MOE_RL_RETRIES=1: a config mistake (exit 2) is final: one try, its one-line error names the
    setting (a fault, exit 3, is retried: the quickstart's test)."""
    override = "algorithm.no_such_knob=1"
    proc, job, logs = submit(slurm, tmp_path, override, retries=1)
    assert proc.returncode == 2, explain(slurm, tmp_path)
    script, driver = (logs / "driver.log").read_text(), (logs / f"driver-{list(NODES)[0]}.log").read_text()
    assert script.count("driver exited with 2") == 1 and "retry 1 of 1" not in script
    assert driver.count(override.split("=")[0]) == 1
    time.sleep(1)
    assert job_processes(job) == [], explain(slurm, tmp_path)


def test_a_ray_step_that_exits_while_starting_is_started_again_then_named(slurm, tmp_path):
    """Ray gives a node a fixed 30 s to start; on a loaded node `ray start` gives up and its step ends: the
    script starts it again, MOE_RL_RAY_START_TRIES times in all, then stops naming the node. Here every
    start fails (an argument `ray start` refuses), so the head's step runs twice and the job ends."""
    proc, job, logs = submit(slurm, tmp_path, env_extra={"MOE_RL_RAY_START_TRIES": "2",
                                                         "MOE_RL_RAY_NODE_ARGS": "--no-such-ray-flag"})
    head = list(NODES)[0]
    script = (logs / "driver.log").read_text()
    assert proc.returncode == 1, explain(slurm, tmp_path)
    assert f"Ray on {head} exited while starting (start 1 of 2; see {logs}/ray-{head}.log): starting it " \
        "again" in script, script
    assert f"a Ray step exited early, on {head} after 2 start(s)" in script and "driver exited" not in script
    assert (logs / f"ray-{head}.log").read_text().count("no-such-ray-flag") >= 2  # both starts' output kept
    time.sleep(1)
    assert job_processes(job) == [], explain(slurm, tmp_path)


def test_cancelled_job_stops_everything_it_started(slurm, tmp_path):
    proc, job, logs = submit(slurm, tmp_path, wait=False)
    assert proc.returncode == 0 and job, proc.stderr
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (logs / "driver.log").exists() and "Ray cluster up" in (logs / "driver.log").read_text():
            break
        time.sleep(1)
    else:
        pytest.fail("the job never brought its Ray cluster up:\n" + explain(slurm, tmp_path))
    assert job_processes(job)  # Ray is running for this job
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job], env=slurm.env, capture_output=True,
                                text=True).stdout
        if not queued.strip() and not job_processes(job):
            break
        time.sleep(1)
    assert job_processes(job) == [], explain(slurm, tmp_path)
    assert "cancelled" in (logs / "driver.log").read_text()
