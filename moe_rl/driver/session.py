"""The run's Ray session and its exit paths: a local Ray started (or a cluster joined) with the actors'
environment, SIGINT/SIGTERM turned into a stop at the next safe point, and `shutdown`, which every exit
path runs: the run's actors, its placement group and the Ray it started go with it. Also the fault
injection points tests kill processes at (`failpoint`).

One machine: the run starts a local Ray (the default). A cluster: `cluster.address` (or RAY_ADDRESS)
names it (launch/ starts one on SLURM). A caller that keeps one Ray up for several runs in its process (a
notebook, a test module) starts it with `ray.init(runtime_env=runtime_env(), ...)`: each run places its
actors there and removes them, and the Ray stays.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter

import ray

from moe_rl.config import RunConfig

FAILPOINT = "MOE_RL_FAILPOINT"  # fault injection for tests: "<point>:<n>:<token file>" (see `failpoint`)
_passed: Counter = Counter()

def failpoint(point: str) -> None:
    """A place where tests inject a real process death. With MOE_RL_FAILPOINT="<point>:<n>:<token file>",
    the process that passes `point` for the n-th time and takes the token (deletes the file: one
    process, once per run and its retries) kills itself with SIGKILL, in the middle of its work.
    Points: "engine_update" (an engine, halfway through loading a weight update), "trainer_export" (a
    trainer rank, between two weight buckets of a sync)."""
    spec = os.environ.get(FAILPOINT)
    if not spec or spec.split(":", 1)[0] != point:
        return
    _, n, token = spec.split(":", 2)
    _passed[point] += 1
    if _passed[point] == int(n):
        try:
            os.unlink(token)
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


# -- exit paths: a signal stops the run at the next safe point; the run's actors and its Ray go with it --
INTERRUPTED: list[int] = []  # the signals received by `moe-rl train` (handle_signals), first first


def _on_signal(signum, frame) -> None:
    first = not INTERRUPTED
    INTERRUPTED.append(signum)
    if first:  # a second signal while the run shuts down only records itself: the shutdown is bounded
        raise KeyboardInterrupt


def handle_signals() -> None:
    """SIGINT and SIGTERM record themselves in INTERRUPTED and raise KeyboardInterrupt (Ray's init
    replaces the SIGTERM handler: called again after it)."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def check_interrupted() -> None:
    """At a safe point: a signal whose KeyboardInterrupt Python swallowed (raised inside a finalizer or
    a callback: "Exception ignored ...") still stops the run here."""
    if INTERRUPTED:
        raise KeyboardInterrupt


# how the run came by its Ray: "started" (a local Ray of its own) or "connected" (to a cluster); empty:
# none yet, or the caller's (initialised before the run), which the run leaves up
_RAY_OF_RUN: list[str] = []
RUN_PARTS: list = []  # what holds the run's actors and bundles (Placement, Models, Rollouts)


def _actors_of(part) -> list:
    groups = part.groups().values() if hasattr(part, "groups") else []
    return [a for g in groups for a in g.actors] + list(getattr(part, "engines", []))


def shutdown(timeout_s: float = 20.0) -> None:
    """Every exit path of a run: kill its actors (their processes' children, such as vLLM's workers, with
    them) and remove its placement group, then stop the local Ray if the run started it (connected to a
    cluster: the connection; the caller's Ray stays up). Bounded: whatever of this process's descendants
    is still alive after `timeout_s` is killed."""
    import psutil
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized() and not _RAY_OF_RUN:
        RUN_PARTS.clear()
        return
    me = psutil.Process()
    try:
        descendants = me.children(recursive=True)  # the local Ray, its workers and their children
    except psutil.Error:
        descendants = []
    for part in RUN_PARTS:
        for actor in _actors_of(part):
            try:
                if ray.is_initialized():
                    ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray gone: nothing to kill
                pass
    for part in RUN_PARTS:
        if getattr(part, "pg", None) is not None and ray.is_initialized():
            try:
                remove_placement_group(part.pg)
            except Exception:  # noqa: BLE001 - removed with the job already
                pass
    RUN_PARTS.clear()
    how = _RAY_OF_RUN.pop() if _RAY_OF_RUN else "the caller's"  # the caller's Ray stays up for its next run
    if how == "connected":
        ray.shutdown()  # the driver's connection only; the cluster stays
    if how != "started":
        return
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - what it left behind is stopped below
        pass
    deadline = time.monotonic() + timeout_s
    try:  # processes re-parented meanwhile (a killed worker's children) are still in `descendants`
        descendants += [p for p in me.children(recursive=True) if p not in descendants]
    except psutil.Error:
        pass
    for p in descendants:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(descendants, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2.0)


def runtime_env() -> dict:
    """The run's actors' environment: threads, offline Hugging Face, and PYTHONPATH with the project and
    the driver's directory (a user's environment module, `environment.name: my_pkg.envs:Task`, imports
    there as it does for the driver); MOE_RL_FAILPOINT where set."""
    env = {"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
                            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.getcwd(),
                             os.environ.get("PYTHONPATH", "")])}}
    if os.environ.get(FAILPOINT):
        env["env_vars"][FAILPOINT] = os.environ[FAILPOINT]
    return env


def start_ray(cfg: RunConfig) -> None:
    """Connect to cluster.address (or RAY_ADDRESS), else start a local Ray; a Ray the caller initialised
    is used as it is (and left up by `shutdown`)."""
    if ray.is_initialized():
        return
    # the driver waits on every remote call through `gather`, which reports the failure that matters; the
    # calls it then abandons (a dead rank's peers, failing with it) would print their tracebacks at exit
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    # no Prometheus metrics (nothing reads them: no dashboard): the driver's core worker exports its stats
    # as it disconnects, and on a loaded machine that export once aborted the process (SIGABRT in
    # opencensus's StatsExporter::ExportNow inside ray.shutdown) after the run had finished
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    address = cfg.cluster.ray_address
    if address:
        node_ip = cfg.cluster.node_ip or None  # the driver's own address, where a host has several
        _init_ray("connected", f"join the Ray cluster at {address}", address=address,
                  runtime_env=runtime_env(), log_to_driver=False, _node_ip_address=node_ip)
        check_cluster_devices(cfg, address)
    # Ray turns token authentication on for a local cluster, and says so every run: not a problem to report
    else:
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            lambda record: not record.getMessage().startswith("Token authentication is enabled"))
        # the CPUs this process may use (a SLURM step's or a container's share), not the machine's
        cpus = cfg.cluster.num_cpus or len(os.sched_getaffinity(0))
        _init_ray("started", "start a local Ray", num_cpus=cpus, include_dashboard=False,
                  runtime_env=runtime_env(), log_to_driver=False)
    if signal.getsignal(signal.SIGINT) is _on_signal:  # ray.init replaced the SIGTERM handler with its own
        handle_signals()
    check_interrupted()


RAY_START_TRIES = 3  # Ray gives its raylet 30 s to register (fixed in Ray 2.60); a loaded machine needs more
RAY_START_PAUSE_S = 2.0  # before the next try, times the tries so far


def _init_ray(how: str, what: str, **kwargs) -> None:
    """ray.init(**kwargs), tried RAY_START_TRIES times with what a failed try started stopped in between;
    RayStartError in one line (a fault: exit 3, which launch/ retries) when no try succeeds. `how`: how the
    run comes by its Ray ("started" or "connected"), recorded before each try so that an interrupt during
    it still stops what it started."""
    from moe_rl.driver.remote import RayStartError, last_line
    from moe_rl.driver.report import say

    for attempt in range(1, RAY_START_TRIES + 1):
        _RAY_OF_RUN.append(how)
        try:
            ray.init(**kwargs)
            return
        except Exception as err:  # noqa: BLE001 - Ray raises bare Exceptions from its start-up
            shutdown()  # what this try started, and the record of it
            if attempt == RAY_START_TRIES:
                raise RayStartError(f"could not {what} in {RAY_START_TRIES} tries ({last_line(err)}); the "
                                    "machine may be overloaded: run again (exit code 3: launch/ retries it)"
                                    ) from None
            say(f"could not {what} ({last_line(err)}); trying again ({attempt + 1} of {RAY_START_TRIES})")
            time.sleep(RAY_START_PAUSE_S * attempt)


def check_cluster_devices(cfg: RunConfig, address: str) -> None:
    """The GPU-only settings against the GPUs of the Ray cluster the run joined, which its workers use (the
    driver's own machine, a login or head node, may have none): ConfigError in one line where they need
    GPUs the cluster does not offer, or a CPU-only setting meets GPUs."""
    from moe_rl.config.rules import check_machine

    check_machine(cfg, ray.cluster_resources().get("GPU", 0) > 0, f"the Ray cluster at {address}")
