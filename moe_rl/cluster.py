"""Ray placement: trainer ranks (policy, critic, reference) and rollout engines as actors.

One machine: the run starts a local Ray (the default). A cluster: `cluster.address` (or RAY_ADDRESS)
names it (launch/ starts one on SLURM). A caller that keeps one Ray up for several runs in its process
(a notebook, a test module) starts it with `ray.init(runtime_env=runtime_env(), ...)`: each run places
its actors there and removes them, and the Ray stays. One placement group holds the run: without GPUs a bundle per
trainer rank and per engine, with GPUs a bundle per GPU and each actor pinned to the bundle of its GPU
(`gpu_layout`, `Placement`); `cluster.placement` packs them onto as few nodes as possible or spreads them
over the nodes. Colocated (the default) actors reserve almost no CPU, so trainers and engines time-share
a 2-core box, and on GPUs rank i of every model and engine worker i share GPU i; separate placement gives
each actor a CPU and GPUs of its own.

Inside a trainer group, torch.distributed (gloo on CPU, NCCL on GPU) connects the ranks through rank
0's node. Weight sync puts each rank's buckets in Ray's object store: an engine on the same node reads
them where they lie (shared memory, no copy), an engine on another node receives them from Ray.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter

import ray
import torch

from moe_rl.config import RunConfig

_round_trips = 0  # the driver's waits on remote calls (`gather`)
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
RUN_PARTS: list = []  # what holds the run's actors and bundles (Placement, trainers.Models, rollouts.Rollouts)


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
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        node_ip = cfg.cluster.node_ip or None  # the driver's own address, where a host has several
        _RAY_OF_RUN.append("connected")
        ray.init(address=address, runtime_env=runtime_env(), log_to_driver=False, _node_ip_address=node_ip)
    else:  # Ray turns token authentication on for a local cluster, and says so every run: not a problem to report
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            lambda record: not record.getMessage().startswith("Token authentication is enabled"))
        # the CPUs this process may use (a SLURM step's or a container's share), not the machine's
        _RAY_OF_RUN.append("started")  # before init: an interrupt during it still stops what it started
        ray.init(num_cpus=cfg.cluster.num_cpus or len(os.sched_getaffinity(0)), include_dashboard=False,
                 runtime_env=runtime_env(), log_to_driver=False)
    if signal.getsignal(signal.SIGINT) is _on_signal:  # ray.init replaced the SIGTERM handler with its own
        handle_signals()
    check_interrupted()


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's actors."""


class RemoteCallError(RuntimeError):
    """A remote call that did not answer in time, or whose actor died; the message names both."""


def last_line(err: BaseException) -> str:
    """An error's last non-empty line (a remote error's own message), or its type's name."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def fault_line(err: BaseException) -> str | None:
    """One line for an error that means a process of the run died or hung: RemoteCallError, or a remote
    call that failed because a process it worked with died (a peer rank, an engine); None otherwise."""
    if isinstance(err, RemoteCallError):
        return str(err)
    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    if isinstance(cause, LOST):
        return f"a remote call failed because a process it worked with died ({last_line(cause)})"
    return None


def round_trips() -> int:
    """How many times this process has waited on remote calls so far: one per `gather`, whose calls
    travel together (the loop logs the count from one step's log to the next, timing/round_trips: a
    checkpoint or an evaluation between two steps counts in the later one)."""
    return _round_trips


def gather(calls: list[tuple[str, object]], timeout_s: float, retry=None) -> list:
    """The results of remote calls [(label, ref)], in order. The wait ends at the first call whose actor
    died (a rank's peers may be blocked in a collective with it) or once `timeout_s` has passed with a
    call unanswered: RemoteCallError names the actor and what it was doing (`label`). An exception the
    call raised itself comes back as Ray raises it (an instance of its own type).

    `retry(index, err)`, where given, is asked first about a call that failed (its actor lost, or the
    call raised): it returns a new ref to wait on instead (the call submitted again, with `timeout_s`
    from now), or None to fail as above."""
    global _round_trips
    _round_trips += 1
    labels = {ref: (i, label) for i, (label, ref) in enumerate(calls)}
    pending, results, deadline = [ref for _, ref in calls], {}, time.monotonic() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise RemoteCallError(f"no answer within cluster.call_timeout_s={timeout_s:g} s from "
                                  f"{', '.join(labels[r][1] for r in pending)}")
        i, label = labels[done[0]]
        try:
            results[i] = ray.get(done[0])
            continue
        except ray.exceptions.RayTaskError as err:  # the call itself raised (also when something it waited on died)
            if retry is None or (again := retry(i, err)) is None:
                dead = _dead_peer(pending, labels)
                if dead is not None:  # e.g. a rank's collective broke because its peer died: name the peer
                    raise dead from err
                raise
        except LOST as err:
            what = "is unreachable" if isinstance(err, ray.exceptions.ActorUnavailableError) else "died"
            failure = RemoteCallError(f"{label}: the actor {what} ({last_line(err)})")
            if retry is None or (again := retry(i, failure)) is None:
                raise failure from err
        labels[again] = (i, label)
        pending.append(again)
        deadline = max(deadline, time.monotonic() + timeout_s)
    return [results[i] for i in range(len(calls))]


def _dead_peer(pending: list, labels: dict, grace_s: float = 5.0) -> RemoteCallError | None:
    """After a call raised: whether one of the calls still pending lost its actor within `grace_s`
    (Ray notices a death within about a second). A rank's error is often the consequence of a peer's
    death (its collective broke): then the dead peer is the fault to report."""
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except LOST as err:
            return RemoteCallError(f"{labels[ref][1]}: the actor died ({last_line(err)})")
        except Exception:
            continue
    return None


# a call's process gone (crashed, killed for memory, never started) or its result lost with a node
LOST = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError, ray.exceptions.ActorUnschedulableError,
         ray.exceptions.RuntimeEnvSetupError, ray.exceptions.ObjectLostError)


def _free_address() -> tuple[str, int]:
    """(this node's IP, a free TCP port on it): where a rank 0 listens."""
    from moe_rl.train.parallel import free_port

    return ray.util.get_node_ip_address(), free_port()


_node_address = ray.remote(num_cpus=0)(_free_address)


def thread_counts(bundles: list[tuple[str, str]], node_cpus: dict[str, float], engine_workers: int, overlap: bool,
                  cap: int | None = None) -> list[int]:
    """CPU threads for the process(es) of each bundle [(role, node)]: the node's CPUs divided among the
    processes computing at the same time there, at least 1, at most `cap`.

    A model's ranks compute together, one model at a time (the driver scores and trains the policy,
    critic, reference and reward model one after another); an engine is `engine_workers` processes
    (rollout.engine_tp), and a node's engines generate together. Synchronous runs (`overlap` False)
    alternate generation and training, so a rank shares its node with its own model's ranks there, an
    engine with the engines' processes there; asynchronous runs train while the engines generate, and
    both count.

        thread_counts([("policy", "n"), ("critic", "n"), ("engine", "n")], {"n": 4}, 1, False) == [4, 4, 4]
        thread_counts([("policy", "n"), ("critic", "n"), ("engine", "n")], {"n": 4}, 1, True) == [2, 2, 2]
    """
    procs: dict[str, Counter] = {}
    for role, node in bundles:
        procs.setdefault(node, Counter())[role] += engine_workers if role == "engine" else 1
    out = []
    for role, node in bundles:
        here = procs[node]
        if role == "engine":
            sharers = here["engine"] + overlap * max((n for r, n in here.items() if r != "engine"), default=0)
        else:
            sharers = here[role] + overlap * here["engine"]
        n = max(1, int(node_cpus[node] // sharers))
        out.append(n if cap is None else min(n, cap))
    return out


def use_threads(n: int) -> None:
    """This process computes with n CPU threads (torch intra-op and OpenMP, read again by libraries that
    start later, e.g. vLLM's CPU worker), at most as many as the CPUs it may run on."""
    n = max(1, min(n, len(os.sched_getaffinity(0))))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def thread_cap() -> int | None:
    """OMP_NUM_THREADS of the driver's environment, where set: the most threads automatic counts give."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, int(value)) if value.isdigit() else None


def gpu_layout(counts: dict[str, int], engine_tp: int, colocate: bool) -> dict[str, list[list[int]]]:
    """The GPUs of each actor, as indices among the run's GPUs: per role, one list per actor (a trainer
    rank has one GPU, an engine `engine_tp`, one per vLLM worker).

    Colocated, the roles time-share the same GPUs: rank i of every model (policy, critic, reference,
    reward model) on GPU i, engine j's workers on GPUs j*engine_tp ... (j+1)*engine_tp-1. Separate, each
    actor has GPUs of its own, in the order of `counts`. Either way no two ranks of one model share a GPU
    (NCCL refuses two ranks of a group on one device), nor do two engines.

        gpu_layout({"policy": 2, "critic": 2, "engine": 1}, 1, True) == {
            "policy": [[0], [1]], "critic": [[0], [1]], "engine": [[0]]}
        gpu_layout({"policy": 1, "critic": 0, "engine": 2}, 2, False) == {
            "policy": [[0]], "critic": [], "engine": [[1, 2], [3, 4]]}
    """
    layout, end = {}, 0
    for role, n in counts.items():
        width = engine_tp if role == "engine" else 1
        first = 0 if colocate else end
        layout[role] = [list(range(first + i * width, first + (i + 1) * width)) for i in range(n)]
        end = max(end, first + n * width)
    return layout


def engines_first(colocate: bool, gpus: float) -> bool:
    """Whether the engines start, and finish starting, before the trainer ranks do: colocated on GPUs.
    vLLM sizes its KV cache at start-up from a profile of its GPU's memory (it needs
    gpu_memory_utilization x the GPU free, and asserts when a co-tenant frees memory meanwhile), so each
    engine profiles alone on its GPUs. Otherwise (CPU, or GPUs of their own) everything starts at once."""
    return colocate and gpus > 0


# Ray leaves CUDA_VISIBLE_DEVICES alone in a process started with this set (an engine's vLLM workers
# need all of its GPUs visible, not only the one Ray accounts it on)
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@ray.remote(num_cpus=0, num_gpus=1)
def _bundle_gpu() -> str:
    """The GPU id of the placement group bundle this task runs in, as CUDA_VISIBLE_DEVICES names it."""
    return str(ray.get_gpu_ids()[0])


def _gpu_order(gpu: str) -> tuple:
    return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)


class Placement:
    """The run's placement group, and each actor's (trainer rank's, engine's) place in it.

    Without GPUs in the Ray cluster: a bundle per trainer rank and per engine, in the order given.
    With GPUs (the Ray cluster's resources decide, not the driver's torch: a driver on a CPU-only head
    node places GPU actors too): a bundle per GPU ({"GPU": 1}), ordered by node and GPU id, and each
    actor pinned to the bundle of its (first) GPU as `gpu_layout` lays them out (the way verl and slime
    pin actors to bundle indices), with an equal share of it among the actors pinned there. An engine of
    engine_tp > 1 runs vLLM's workers as processes of its own: its actor sees exactly its GPUs
    (CUDA_VISIBLE_DEVICES set for it rather than by Ray), worker k the k-th.

        place = Placement(cfg, {"policy": 2, "critic": 2, "engine": 1})
        Actor.options(**place.options("policy", 0)).remote(...)
    """

    def __init__(self, cfg: RunConfig, counts: dict[str, int], timeout_s: float = 300.0):
        from ray.util.placement_group import placement_group, placement_group_table

        self.roles = [role for role, n in counts.items() for _ in range(n)]  # the actors, in order
        self.index = {role: [a for a, r in enumerate(self.roles) if r == role] for role in counts}  # role -> actors
        self.gpus = ray.cluster_resources().get("GPU", 0.0)  # the Ray cluster's GPUs
        self.engines_first = engines_first(cfg.cluster.colocate, self.gpus)
        cpus = 0 if cfg.cluster.colocate else 1
        self.resources = [{"num_cpus": cpus} for _ in self.roles]  # per actor (GPUs: `_pin_to_gpus`)
        if self.gpus:
            self.layout = gpu_layout(counts, cfg.rollout.engine_tp, cfg.cluster.colocate)
            n_gpus = 1 + max((g for gpus in self.layout.values() for actor in gpus for g in actor), default=-1)
            bundles = [{"GPU": 1, "CPU": max(cpus, 0.01)}] * n_gpus
        else:  # a bundle may not be empty: colocated actors reserve a hundredth of a CPU
            bundles = [{"CPU": max(cpus, 0.01)}] * len(self.roles)
        self.bundle_of = list(range(len(self.roles)))  # actor -> bundle index
        have = ray.cluster_resources()
        for kind in ("GPU", "CPU"):  # the scarcer first
            need = sum(b.get(kind, 0) for b in bundles)
            if need > have.get(kind, 0) + 1e-9:
                raise PlacementError(f"the run needs {need:g} {kind} for {len(self.roles)} actors ({counts}), the Ray "
                                     f"cluster has {have.get(kind, 0):g}; use cluster.colocate=true or a larger cluster")
        self.call_timeout_s = cfg.cluster.call_timeout_s
        self.engine_workers = cfg.rollout.engine_tp  # processes per engine
        self.pg = placement_group(bundles, strategy=cfg.cluster.placement.upper())
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise PlacementError(f"Ray could not place {len(bundles)} bundles ({cfg.cluster.placement}) within {timeout_s:.0f} s; "
                                 f"cluster resources: {ray.cluster_resources()}")
        self.node_of = placement_group_table(self.pg)["bundles_to_node_id"]  # bundle index -> Ray node id
        self.devices: list[list[str]] = [[] for _ in self.roles]  # per actor: its GPU ids (CUDA_VISIBLE_DEVICES)
        if self.gpus:
            self._pin_to_gpus(len(bundles))
        self.threads = self._threads(cfg)

    def _pin_to_gpus(self, n_gpus: int) -> None:
        """Each actor into the bundle of its first GPU, with its share of that GPU; the run's GPUs are the
        bundles ordered by node (in Ray's packing order) and GPU id, so that consecutive GPUs (a model's
        tensor-parallel ranks, an engine's workers) share a node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ids = gather([(f"GPU bundle {b} (its GPU id)", _bundle_gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=b)).remote()) for b in range(n_gpus)], self.call_timeout_s)
        node_rank = {}
        for b in range(n_gpus):
            node_rank.setdefault(self.node_of[b], len(node_rank))
        order = sorted(range(n_gpus), key=lambda b: (node_rank[self.node_of[b]], _gpu_order(ids[b])))  # GPU -> bundle
        gpus_of = [gpus for role in self.index for gpus in self.layout[role]]  # per actor, in the order of self.roles
        sharers = Counter(gpus[0] for gpus in gpus_of)
        for a, gpus in enumerate(gpus_of):
            self.bundle_of[a] = order[gpus[0]]
            self.devices[a] = [ids[order[g]] for g in gpus]
            # Ray counts GPU shares in ten-thousandths: equal shares that sum to at most one
            self.resources[a]["num_gpus"] = (10_000 // sharers[gpus[0]]) / 10_000
            if len(gpus) > 1:
                nodes = {self.node_of[order[g]] for g in gpus}
                if len(nodes) > 1:
                    raise PlacementError(f"{self.roles[a]} {self.index[self.roles[a]].index(a)}: its {len(gpus)} GPUs "
                                         f"(rollout.engine_tp) fell on {len(nodes)} nodes; an engine's workers share "
                                         "one node: use nodes whose GPU count engine_tp divides, or placement=pack")
                self.resources[a]["runtime_env"] = {"env_vars": {
                    NOSET_CUDA_VISIBLE_DEVICES: "1", "CUDA_VISIBLE_DEVICES": ",".join(self.devices[a])}}

    def _node(self, a: int) -> str:
        """The Ray node id of actor a."""
        return self.node_of[self.bundle_of[a]]

    def _threads(self, cfg: RunConfig) -> list[int]:
        """Each actor's CPU threads: cluster.trainer_threads / engine_threads, or `thread_counts` over
        the nodes Ray placed the actors on."""
        cpus = {n["NodeID"]: n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n["Alive"]}
        auto = thread_counts([(role, self._node(a)) for a, role in enumerate(self.roles)], cpus, cfg.rollout.engine_tp,
                             cfg.rollout.async_mode, thread_cap())
        given = {"engine": cfg.cluster.engine_threads}
        return [given.get(role, cfg.cluster.trainer_threads) or n for role, n in zip(self.roles, auto, strict=True)]

    def threads_of(self, role: str, i: int) -> int:
        """CPU threads of the role's i-th actor (an engine: of each of its workers)."""
        return self.threads[self.index[role][i]]

    def first_core(self, i: int) -> int:
        """Where the i-th engine's workers start binding their threads among its node's cores: after
        the threads of the engines before it on that node (engines of one node generate together)."""
        engines = self.index["engine"]
        node = self._node(engines[i])
        return sum(self.threads[a] * self.engine_workers for a in engines[:i] if self._node(a) == node)

    def options(self, role: str, i: int) -> dict:
        """Ray options of the role's i-th actor: its resources (its share of its GPU), its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a = self.index[role][i]
        return {**self.resources[a], "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=self.bundle_of[a])}

    def address(self, role: str) -> tuple[str, int]:
        """IP and a free port of the node holding the role's rank 0: found here when that is the
        driver's node (a task would start a worker process first, seconds on a small box)."""
        if self._node(self.index[role][0]) == ray.get_runtime_context().get_node_id():
            return _free_address()
        ref = _node_address.options(**{**self.options(role, 0), "num_cpus": 0, "num_gpus": 0}).remote()
        return gather([(f"{role} rank 0's node (address)", ref)], self.call_timeout_s)[0]


@ray.remote
class RankActor:
    """One rank of a trainer group, as a Ray actor: its TrainWorker (the Megatron model, optimizer,
    forward and update) plus the EWMA anchor, weight export and checkpoint I/O of that rank."""

    def __init__(self, rank: int, world: int, addr: str, port: int, spec, role: str, optim, seed: int, layout,
                 threads: int, load_weights: bool = True, value_head_from: str | None = None, trains: bool = True):
        from moe_rl.train import parallel

        # the GPU Ray gave this actor, by its index among the devices this process sees (not the rank)
        device = parallel.local_device_index(os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get_gpu_ids())
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank if device is None else device),
                          MASTER_ADDR=addr, MASTER_PORT=str(port))
        use_threads(threads)
        from moe_rl.train.worker import TrainWorker

        parallel.init_distributed(layout)
        self.rank, self.world = rank, world
        self.transfer = None
        self.worker = TrainWorker(spec, role=role, optim=optim, seed=seed, load_weights=load_weights,
                                  value_head_from=value_head_from, trains=trains)
        self.anchor = None

    def placed(self) -> tuple[str, int]:
        """(this rank's node IP, its CPU threads)."""
        return ray.util.get_node_ip_address(), torch.get_num_threads()

    def score(self, batch, record_routes: bool = False, anchor: bool = False):
        if anchor and self.anchor is not None:
            return self.worker.score_with(self.anchor.params, batch)
        return self.worker.score(batch, record_routes=record_routes)

    def train(self, batch, loss, denominator, keep_logp: bool = False):
        """One optimizer update with `loss` (a train.objectives type) on this rank's shard."""
        from moe_rl.metrics import process_memory
        from moe_rl.train.objectives import PolicyLoss

        metrics = self.worker.train_step(batch, loss, denominator, keep_logp)
        if self.anchor is not None and isinstance(loss, PolicyLoss) and not metrics["skipped_nonfinite"]:
            self.anchor.update(self.worker.local_params())  # after the step: theta_n never anchors its own loss
        return metrics | process_memory()

    def memory(self) -> dict[str, float]:
        """This rank's memory (metrics.process_memory); the train call reports it too."""
        from moe_rl.metrics import process_memory

        return process_memory()

    def offload(self) -> int:
        return self.worker.offload(list(self.anchor.params.values()) if self.anchor is not None else [])

    def onload(self) -> None:
        self.worker.onload()

    def set_lr(self, lr: float) -> None:
        for group in self.worker.optimizer.param_groups:
            group["lr"] = lr

    def init_anchor(self, beta: float) -> None:
        from moe_rl.algos.anchor import EwmaAnchor

        self.anchor = EwmaAnchor(self.worker.local_params(), beta)

    def export_weights(self, bucket_mb: float) -> list:
        """The tensors this rank owns (each (pp, ep) shard once) as buckets in Ray's object store
        (weights.sync.as_buffers), a ref each; all ranks take part (TP shards are gathered). The store
        frees a bucket once the engines have loaded it and the driver lets go of its ref."""
        from moe_rl.train.hf_io import export_hf_weights
        from moe_rl.weights.sync import as_buffers, buckets

        offloaded = self.worker.offloaded  # a replacement engine's weights, asked for during a rollout
        if offloaded:
            self.onload()
        try:
            named = export_hf_weights(self.worker.bridge, self.worker.module, owned_only=True)
            refs = []
            for i, b in enumerate(buckets(named, bucket_mb)):
                refs.append(ray.put(as_buffers(b)))  # copied into the store here: the weights may change after
                if i == 0:
                    failpoint("trainer_export")  # once per export, after its first bucket
            return refs
        finally:
            if offloaded:
                self.offload()

    def start_transfer(self, backend: str, engines: list, world_size: int, offsets: list[int], bucket_mb: float) -> None:
        """Join vLLM's weight transfer (rank 0 sends; every rank takes part in the export; ipc stages
        bucket_mb at a time)."""
        from moe_rl.rollout.transfer import ExportSource, GatheredExport, start_transfer
        from moe_rl.train.hf_io import export_hf_weights

        w = self.worker
        source = GatheredExport(lambda: export_hf_weights(w.bridge, w.module, owned_only=True)) if backend == "nccl" \
            else ExportSource(lambda: export_hf_weights(w.bridge, w.module))
        addr, port = _free_address() if self.rank == 0 else ("", 0)
        client = EngineSyncClient(engines, offsets) if self.rank == 0 else None
        self.transfer = start_transfer(backend, source, client, self.rank, addr, port, world_size, bucket_mb)

    def send_weights(self, version: int) -> None:
        if self.transfer.client is not None:
            self.transfer.client.version = version
        self.transfer.send_weights()

    def _anchor_file(self, path: str) -> str:
        return os.path.join(path, f"ewma_anchor_rank{self.rank:05d}.pt")

    def save(self, path: str, extra: dict) -> None:
        from moe_rl.train import checkpoint

        checkpoint.save(self.worker, path, dict(extra, anchor_ranks=self.world if self.anchor is not None else 0))
        if self.anchor is not None:  # this rank's shards of the EWMA anchor (each rank holds other tensors)
            torch.save(self.anchor.state_dict(), self._anchor_file(path))

    def load(self, path: str) -> dict:
        from moe_rl.train import checkpoint

        extra = checkpoint.load(self.worker, path)
        if self.anchor is not None and extra.get("anchor_ranks"):
            if extra["anchor_ranks"] != self.world:
                raise checkpoint.CheckpointError(
                    f"{path}: its EWMA anchor was saved by {extra['anchor_ranks']} trainer ranks, this run has "
                    f"{self.world}; resume it with the layout it was saved with")
            self.anchor.load_state_dict(torch.load(self._anchor_file(path), weights_only=True))
        return extra


class TrainerGroup:
    """The ranks of one model (policy, critic, reference or reward model): batches go out sharded by
    data-parallel replica, results come back merged. trainers.py adds each model's update loop.

    Its actors start in the background (beside the other groups' and the engines'): `started` waits."""

    def __init__(self, cfg: RunConfig, place: Placement, slot: str, spec, role: str, optim, seed: int,
                 load_weights: bool = True, value_head_from: str | None = None, trains: bool = True):
        from moe_rl.train.parallel import Layout

        par = cfg.parallel
        layout = Layout(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp)
        world = par.world_size
        addr, port = place.address(slot)
        self.actors = [RankActor.options(**place.options(slot, r)).remote(
            r, world, addr, port, spec, role, optim, seed, layout, place.threads_of(slot, r), load_weights,
            value_head_from, trains) for r in range(world)]
        self.dp = par.dp
        self.world = world
        self.tp_cp = par.tp * par.cp
        self.slot, self.timeout_s = slot, cfg.cluster.call_timeout_s
        self._placed = [a.placed.remote() for a in self.actors]  # answered once each rank has built its model
        self.nodes: list[str] = []
        self.threads: list[int] = []  # each rank's CPU threads
        self.route_bytes = self.new_route_counters()

    def started(self) -> None:
        """Wait until every rank has started (its model built and loaded)."""
        self.nodes, self.threads = map(list, zip(*self._gather("start", self._placed), strict=True))

    def export_weights(self, bucket_mb: float) -> list:
        """Refs to the whole model's weight buckets in Ray's object store, put there by the ranks."""
        return [ref for refs in self.call("export_weights", bucket_mb) for ref in refs]

    def start_transfer(self, backend: str, engines: list, workers_per_engine: list[int], bucket_mb: float) -> None:
        """Open vLLM's weight transfer (nccl | ipc) between this group's rank 0 and every engine worker
        (bucket_mb: rollout.weight_sync_bucket_mb)."""
        from moe_rl.rollout.transfer import engine_rank_offsets

        world = 1 + sum(workers_per_engine)
        self.call("start_transfer", backend, engines, world, engine_rank_offsets(workers_per_engine), bucket_mb)

    def send_weights(self, version: int) -> None:
        """One sync round: rank 0 sends while the others take part in the export."""
        self.call("send_weights", version)

    def _dp_rank(self, rank: int) -> int:
        from moe_rl.train.parallel import dp_rank_of

        return dp_rank_of(rank, tp=self.tp_cp, cp=1, dp=self.dp)  # only tp*cp matters to the order

    def _shard(self, batch, rank: int):
        """Each DP replica gets its rows; TP/PP ranks of one replica get the same rows."""
        from moe_rl.train.parallel import dp_rows

        if self.dp == 1:
            return batch
        return batch.rows(dp_rows(batch.size, self._dp_rank(rank), self.dp))

    @staticmethod
    def new_route_counters() -> dict[str, dict[str, int]]:
        """Bytes of routes sent to the ranks per call kind: as sent (each rank its shard, in the routes'
        compact dtype; measured) and, computed rather than measured, what the path before 2026-12 would
        have sent (8 bytes x elements, int64; scoring sent the whole batch to every rank)."""
        return {kind: {"sent": 0, "int64_computed": 0} for kind in ("score", "train")}

    def _send(self, batch, kind: str) -> list:
        """This batch's shard for each rank, counting the route bytes it carries."""
        shards = [self._shard(batch, r) for r in range(self.world)]
        if batch.routes_BSLK is not None:
            count = self.route_bytes[kind]
            count["sent"] += sum(s.routes_BSLK.nbytes for s in shards)
            # computed, not measured: the int64 bytes the old path would have sent for the same routes
            count["int64_computed"] += 8 * sum((batch if kind == "score" else s).routes_BSLK.numel() for s in shards)
        return shards

    def score(self, batch, **kw) -> dict:
        """Forward passes, each data-parallel replica on its rows; results for the whole batch, [B, S, ...]."""
        outs = self._gather("score", [a.score.remote(s, **kw) for a, s in zip(self.actors, self._send(batch, "score"),
                                                                             strict=True)])
        return self._whole(batch, outs)

    def _whole(self, batch, outs: list[dict]) -> dict:
        """The ranks' per-shard outputs ([b, s, ...] each) as the whole batch's, [B, S, ...]."""
        from moe_rl.train.parallel import dp_rows

        if self.dp == 1:
            return outs[0]
        (B, S), full = batch.input_ids_BS.shape, {}
        for rank in range(0, self.tp_cp * self.dp, self.tp_cp):  # one rank per replica (its ranks all agree)
            rows = dp_rows(B, self._dp_rank(rank), self.dp)
            for name, x in outs[rank].items():
                full.setdefault(name, torch.zeros((B, S, *x.shape[2:]), dtype=x.dtype))[rows, :x.shape[1]] = x
        return full

    def train(self, batch, loss, denominator, keep_logp: bool = False):
        """One update with `loss` (a train.objectives type): each rank gets its shard of the fields the
        loss reads. keep_logp: the result's "logp" is the update's forward before the step, [B, S]."""
        from moe_rl.metrics import reduce_updates

        shards = self._send(batch.only(loss.fields), "train")
        outs = self._gather("train", [a.train.remote(s, loss, denominator, keep_logp)
                                      for a, s in zip(self.actors, shards, strict=True)])
        logp = self._whole(batch, [{"logp": o.pop("logp")} for o in outs])["logp"] if keep_logp else None
        losses = [o["loss"] for o in outs if "loss" in o]  # last-stage ranks: tp*cp per data-parallel replica
        merged = reduce_updates(outs)  # over the ranks' shards: means, maxima of *max, minima of *min
        if losses:
            merged["loss"] = sum(losses) / self.tp_cp  # each replica's share of the global loss, summed
        if logp is not None:
            merged["logp"] = logp
        return merged

    def call(self, method: str, *args):
        return self._gather(method, [getattr(a, method).remote(*args) for a in self.actors])

    def _gather(self, method: str, refs: list) -> list:
        return gather([(f"{self.slot} rank {r} ({method})", ref) for r, ref in enumerate(refs)], self.timeout_s)


class EngineSyncClient:
    """vLLM's VLLMWeightSyncClient protocol over our engine actors: what the trainer's sender calls to
    drive each round. Under NCCL, engine i's workers join the group at rank offsets[i]; the round's
    weight version (set before sending) reaches the engines with the finish."""

    def __init__(self, engines: list, offsets: list[int]):
        self.engines, self.offsets, self.version = engines, offsets, None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        ray.get([e.transfer.remote("init_weight_transfer_engine",
                                   {**init_info, "rank_offset": off} if "rank_offset" in init_info else init_info)
                 for e, off in zip(self.engines, self.offsets, strict=True)])

    def start_weight_update(self) -> None:
        ray.get([e.transfer.remote("start_weight_update") for e in self.engines])

    def update_weights(self, update_info: dict) -> None:
        ray.get([e.transfer.remote("update_weights", update_info) for e in self.engines])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        ray.get([e.transfer.remote("finish_weight_update", None, self.version) for e in self.engines])


class EngineStartError(ValueError):
    """vLLM refused an engine's settings at start-up (a user's mistake: exit 2); its message, one line."""


def vllm_refusal(err: ValueError) -> str:
    """vLLM's own words for a refused setting: pydantic's first error message (vLLM validates its configs
    with pydantic), else the error's last line."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            return str(errors()[0]["msg"]).removeprefix("Value error, ")
        except (IndexError, KeyError, TypeError):
            pass
    return last_line(err)


@ray.remote
class RolloutActor:
    """A vLLM engine and the agent loop, as an asyncio actor: rollouts run as coroutines, and a weight
    update arriving meanwhile runs between engine steps (in-flight conversations pause, then resume
    with the new weights; each trajectory keeps the version it started with). An engine whose settings
    vLLM refuses stays alive to say so: `info` raises EngineStartError (a dead actor would read as a fault)."""

    def __init__(self, settings, agent_settings, env, threads: int, first_core: int = 0):
        use_threads(threads)  # before vLLM starts: its CPU worker refuses later changes
        from transformers import AutoTokenizer

        from moe_rl.rollout.agent import Agent
        from moe_rl.rollout.engine import RolloutEngine

        self.refused = ""
        try:
            self.engine = RolloutEngine(settings, threads, first_core)
        except ValueError as err:  # pydantic's ValidationError too
            self.refused = vllm_refusal(err)
            return
        tok = AutoTokenizer.from_pretrained(settings.model_path)
        self.agent = Agent(self.engine, tok, env, agent_settings)  # env: rollout.envs.EnvSpec
        self.top_k = self.engine.top_k

    async def collect(self, prompts: list[dict], samples_per_prompt: int, seed: int, dynamic: int = 0,
                      first_group_id: int = 0):
        import copy

        from moe_rl.rollout.agent import RolloutStats

        agent = copy.copy(self.agent)  # statistics of this call only: an evaluation may run beside a rollout
        agent.stats = RolloutStats()
        if dynamic:
            pool = list(prompts)

            def next_prompts(k):
                out = pool[:k]
                del pool[:k]
                return out

            groups = await agent.dynamic_sampling(next_prompts, len(prompts) // (dynamic + 1) or 1,
                                                  samples_per_prompt, dynamic, seed, first_group_id)
        else:
            groups = await agent.run_groups(prompts, samples_per_prompt, seed, first_group_id)
        from moe_rl.metrics import process_memory

        agent.stats.memory = process_memory()
        return [t for g in groups for t in g], agent.stats

    async def update_weights(self, buckets: list, version: int) -> int:
        """Load weight buckets: refs to them in Ray's object store (TrainerGroup.export_weights), read
        where they lie on this node, received from other nodes. They are fetched first; the update
        itself is one engine call between two engine steps (in-flight conversations pause, never see
        half-updated weights, and resume with the new version)."""
        from moe_rl.weights.sync import from_buffers, shm_dir

        sources = [await b for b in buckets]

        def loaded():
            for k, src in enumerate(sources):
                if k == len(sources) // 2:
                    failpoint("engine_update")  # halfway: some layers new, the rest old
                yield from_buffers(src)

        if self.engine.settings.tensor_parallel_size == 1:  # the engine's one worker is this process
            return self.engine.update_weights((t for bucket in loaded() for t in bucket), version)
        # tensor parallel: the engine's workers are processes of their own; each bucket reaches them as a
        # file in this node's shared memory, one at a time, each worker reading its shard of it
        return self.engine.update_weights_through_files(loaded(), version,
                                                        shm_dir() / f"moe_rl_update_{os.getpid()}_{version}")

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self, part: str | None = None) -> None:
        self.engine.wake(part)

    def transfer(self, call: str, payload: dict | None = None, version: int | None = None) -> None:
        """A step of vLLM's weight transfer (under NCCL, update_weights blocks while the trainer broadcasts)."""
        self.engine.transfer(call, payload, version)

    def info(self) -> dict:
        if self.refused:
            raise EngineStartError(f"vLLM refused the engine's settings: {self.refused}")
        return {"top_k": self.engine.top_k, "num_experts": self.engine.num_experts, "moe_layers": self.engine.num_moe_layers,
                "version": self.engine.version,
                "node": ray.util.get_node_ip_address(), "threads": torch.get_num_threads(),
                "workers": self.engine.llm.llm_engine.vllm_config.parallel_config.world_size}
