"""Where the run's actors go: trainer ranks (policy, critic, reference, reward model, distillation
teachers) and rollout engines in one Ray placement group, and the CPU threads each computes with.

One placement group holds the run: without GPUs a bundle per trainer rank and per engine, with GPUs a
bundle per GPU and each actor pinned to the bundle of its GPU (`gpu_layout`, `Placement`);
`cluster.placement` packs them onto as few nodes as possible or spreads them over the nodes. Colocated
(the default) actors reserve almost no CPU, so trainers and engines time-share a 2-core box, and on GPUs
rank i of every model and engine worker i share GPU i; separate placement gives each actor a CPU and GPUs
of its own. (The Ray the run uses, local or a cluster's, is session.py's.)

Inside a trainer group, torch.distributed (gloo on CPU, NCCL on GPU) connects the ranks through rank
0's node. Weight sync puts each rank's buckets in Ray's object store: an engine on the same node reads
them where they lie (shared memory, no copy), an engine on another node receives them from Ray.
"""

from __future__ import annotations

import os
from collections import Counter

import ray
import torch

from moe_rl.config import RunConfig
from moe_rl.driver.remote import gather


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's actors."""


def _free_address() -> tuple[str, int]:
    """(this node's IP, a free TCP port on it): where a rank 0 listens."""
    from moe_rl.train.parallel import free_port

    return ray.util.get_node_ip_address(), free_port()


_node_address = ray.remote(num_cpus=0)(_free_address)


def thread_counts(bundles: list[tuple[str, str]], node_cpus: dict[str, float], engine_workers: int,
                  overlap: bool, cap: int | None = None) -> list[int]:
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
    reward model, teachers) on GPU i, engine j's workers on GPUs j*engine_tp ... (j+1)*engine_tp-1.
    Separate, each actor has GPUs of its own, in the order of `counts`. Either way no two ranks of one
    model share a GPU (NCCL refuses two ranks of a group on one device), nor do two engines.

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
        # role -> actors
        self.index = {role: [a for a, r in enumerate(self.roles) if r == role] for role in counts}
        self.gpus = ray.cluster_resources().get("GPU", 0.0)  # the Ray cluster's GPUs
        self.engines_first = engines_first(cfg.cluster.colocate, self.gpus)
        cpus = 0 if cfg.cluster.colocate else 1
        self.resources = [{"num_cpus": cpus} for _ in self.roles]  # per actor (GPUs: `_pin_to_gpus`)
        if self.gpus:
            self.layout = gpu_layout(counts, cfg.rollout.engine_tp, cfg.cluster.colocate)
            n_gpus = 1 + max((g for gpus in self.layout.values() for actor in gpus for g in actor),
                             default=-1)
            bundles = [{"GPU": 1, "CPU": max(cpus, 0.01)}] * n_gpus
        else:  # a bundle may not be empty: colocated actors reserve a hundredth of a CPU
            bundles = [{"CPU": max(cpus, 0.01)}] * len(self.roles)
        self.bundle_of = list(range(len(self.roles)))  # actor -> bundle index
        have = ray.cluster_resources()
        for kind in ("GPU", "CPU"):  # the scarcer first
            need = sum(b.get(kind, 0) for b in bundles)
            if need > have.get(kind, 0) + 1e-9:
                raise PlacementError(f"the run needs {need:g} {kind} for {len(self.roles)} actors "
                                     f"({counts}), the Ray cluster has {have.get(kind, 0):g}; use "
                                     "cluster.colocate=true or a larger cluster")
        self.call_timeout_s = cfg.cluster.call_timeout_s
        self.engine_workers = cfg.rollout.engine_tp  # processes per engine
        self.pg = placement_group(bundles, strategy=cfg.cluster.placement.upper())
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise PlacementError(f"Ray could not place {len(bundles)} bundles ({cfg.cluster.placement}) "
                                 f"within {timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}")
        self.node_of = placement_group_table(self.pg)["bundles_to_node_id"]  # bundle index -> Ray node id
        # per actor: its GPU ids (CUDA_VISIBLE_DEVICES)
        self.devices: list[list[str]] = [[] for _ in self.roles]
        if self.gpus:
            self._pin_to_gpus(len(bundles))
        self.threads = self._threads(cfg)

    def _pin_to_gpus(self, n_gpus: int) -> None:
        """Each actor into the bundle of its first GPU, with its share of that GPU; the run's GPUs are the
        bundles ordered by node (in Ray's packing order) and GPU id, so that consecutive GPUs (a model's
        tensor-parallel ranks, an engine's workers) share a node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ids = gather([(f"GPU bundle {b} (its GPU id)",
                       _bundle_gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=b)).remote()) for b in range(n_gpus)], self.call_timeout_s)
        node_rank = {}
        for b in range(n_gpus):
            node_rank.setdefault(self.node_of[b], len(node_rank))
        # GPU -> bundle
        order = sorted(range(n_gpus), key=lambda b: (node_rank[self.node_of[b]], _gpu_order(ids[b])))
        # per actor, in the order of self.roles
        gpus_of = [gpus for role in self.index for gpus in self.layout[role]]
        sharers = Counter(gpus[0] for gpus in gpus_of)
        for a, gpus in enumerate(gpus_of):
            self.bundle_of[a] = order[gpus[0]]
            self.devices[a] = [ids[order[g]] for g in gpus]
            # Ray counts GPU shares in ten-thousandths: equal shares that sum to at most one
            self.resources[a]["num_gpus"] = (10_000 // sharers[gpus[0]]) / 10_000
            if self.roles[a] != "engine":  # a trainer rank: megatron's TP / SP communication overlap needs
                # its kernels queued in issue order, on one hardware queue (Megatron-LM sets it for each rank)
                self.resources[a]["runtime_env"] = {"env_vars": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}
            if len(gpus) > 1:
                nodes = {self.node_of[order[g]] for g in gpus}
                if len(nodes) > 1:
                    raise PlacementError(f"{self.roles[a]} {self.index[self.roles[a]].index(a)}: its "
                                         f"{len(gpus)} GPUs (rollout.engine_tp) fell on {len(nodes)} nodes; "
                                         "an engine's workers share one node: use nodes whose GPU count "
                                         "engine_tp divides, or placement=pack")
                self.resources[a]["runtime_env"] = {"env_vars": {
                    NOSET_CUDA_VISIBLE_DEVICES: "1", "CUDA_VISIBLE_DEVICES": ",".join(self.devices[a])}}

    def _node(self, a: int) -> str:
        """The Ray node id of actor a."""
        return self.node_of[self.bundle_of[a]]

    def _threads(self, cfg: RunConfig) -> list[int]:
        """Each actor's CPU threads: cluster.trainer_threads / engine_threads, or `thread_counts` over
        the nodes Ray placed the actors on."""
        cpus = {n["NodeID"]: n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n["Alive"]}
        auto = thread_counts([(role, self._node(a)) for a, role in enumerate(self.roles)], cpus,
                             cfg.rollout.engine_tp, cfg.rollout.async_mode, thread_cap())
        given = {"engine": cfg.cluster.engine_threads}
        return [given.get(role, cfg.cluster.trainer_threads) or n
                for role, n in zip(self.roles, auto, strict=True)]

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

