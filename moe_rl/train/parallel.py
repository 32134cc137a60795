"""Process groups for tensor, pipeline, expert, context and data parallelism.

One code path: gloo without CUDA, NCCL with it. torch.distributed is initialised from the usual
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT — set by Ray workers, torchrun or srun), then
megatron-core's parallel_state builds the groups.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """A parallel layout: ranks = tp * pp * cp * dp; experts are split ep ways inside dp*cp*tp."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    # expert tensor parallelism; None: same as tp (megatron's default). With etp < tp and ep=1 the
    # experts would be replicated across TP ranks that each see only their own tokens, which
    # megatron-core does not reduce: check() refuses it (config.run.layout_problem).
    etp: int | None = None

    def check(self, world_size: int) -> int:
        """The data-parallel size of this layout over `world_size` ranks; ValueError where it cannot be
        (config.run.layout_problem, the rule the config checks too)."""
        from moe_rl.config.run import layout_problem

        problem = layout_problem(world_size, self.tp, self.pp, self.cp, self.ep, self.etp)
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        return world_size // (self.tp * self.pp * self.cp)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "") -> int:
    """A TCP port that binds now on `host`, for a rank 0 (or a weight transfer) to listen on seconds later.

    Drawn at random from 20000-65535 (above Ray's default worker ports, 10002-19999) outside the
    ephemeral range: a port the kernel hands out for binding to port 0 is one any outgoing connection
    may take before torch.distributed binds it (EADDRINUSE), and a fixed draw would make two groups
    started together meet."""
    low, high = ephemeral_ports()
    candidates = [p for p in range(20000, 65536) if not low <= p <= high]
    for port in random.SystemRandom().sample(candidates, min(100, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # none free there: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device_index(visible_devices: str | None, assigned: list) -> int | None:
    """The CUDA index, in this process, of the GPU it was given.

    A process that Ray gave GPU ids `assigned` sees only the devices CUDA_VISIBLE_DEVICES lists (Ray
    narrows it to the actor's GPUs): its GPU is the position of its first id in that list, so 0 for a
    one-GPU actor, whatever its global rank. Without ids (no Ray, or Ray gave none) the caller's
    local rank applies instead (None)."""
    if not assigned:
        return None
    gpu = str(assigned[0])
    if not visible_devices:
        return int(gpu)
    visible = [v.strip() for v in visible_devices.split(",")]
    if gpu not in visible:
        raise RuntimeError(f"GPU {gpu} was assigned to this process but "
                           f"CUDA_VISIBLE_DEVICES={visible_devices} hides it")
    return visible.index(gpu)


def init_distributed(layout: Layout, rank: int | None = None, world_size: int | None = None,
                     timeout_minutes: int = 10) -> None:
    """Initialise torch.distributed (if needed) and megatron-core's model-parallel groups."""
    from megatron.core import parallel_state

    from moe_rl.train import cpu_compat

    cpu_compat.apply()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(backend(), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    layout.check(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=True,
    )


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker, whose data-, tensor- and expert-parallel streams
    the layers' weight init and dropout draw from: megatron's `model_parallel_cuda_manual_seed` with CUDA
    (without it, building a model on a GPU stops on "cuda rng state model-parallel-rng is not added"), the
    same streams on CPU generators without (cpu_compat). After init_distributed: the offsets read the
    rank's place in the groups."""
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from moe_rl.train import cpu_compat

        cpu_compat.seed_model_parallel(seed)


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Ranks:
    tp: int
    pp: int
    ep: int
    dp: int
    etp: int
    tp_size: int
    pp_size: int
    ep_size: int
    dp_size: int

    @property
    def first_stage(self) -> bool:
        return self.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.pp == self.pp_size - 1


def ranks() -> Ranks:
    from megatron.core import parallel_state as ps

    return Ranks(
        tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(), dp=ps.get_data_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(), dp_size=ps.get_data_parallel_world_size(),
    )


def dp_rank_of(rank: int, tp: int, cp: int, dp: int) -> int:
    """The data-parallel rank of global `rank` in megatron-core's rank order tp, cp, (ep), dp, pp
    (tp fastest): rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)). Expert parallelism
    lives inside dp and does not change it; only the product tp * cp matters."""
    if min(tp, cp, dp) < 1 or rank < 0:
        raise ValueError(f"rank {rank} with tp={tp}, cp={cp}, dp={dp}: sizes must be >= 1 and the rank >= 0")
    return (rank // (tp * cp)) % dp


def dp_rows(batch_size: int, dp_rank: int, dp: int) -> slice:
    """The rows of a `batch_size`-row batch that data-parallel rank `dp_rank` of `dp` trains on:
    consecutive, disjoint, covering every row, sizes differing by at most one."""
    if not 0 <= dp_rank < dp:
        raise ValueError(f"data-parallel rank {dp_rank} is outside 0..{dp - 1}")
    return slice(dp_rank * batch_size // dp, (dp_rank + 1) * batch_size // dp)


def row_cost(lengths_B: torch.Tensor, attention_span: float) -> torch.Tensor:
    """The estimated compute of each row, [B] -> [B] float64:

        c_i = L_i + L_i^2 / attention_span

    A transformer layer spends about 24 h^2 FLOPs a token on its matrices (h the hidden size; an MoE
    layer's active experts count like the dense MLP they replace) and 4 h L on attention over L positions:
    attention adds L / (6h) a token, so attention_span = 6h."""
    L = lengths_B.to(torch.float64)
    return L + L * L / attention_span


DP_BALANCE = ("cost", "count")


def dp_partition(cost_B: torch.Tensor, dp: int, balance: str = "cost") -> list[torch.Tensor]:
    """The rows each data-parallel replica takes, ascending indices, disjoint, every row once:

    "count": consecutive runs whose sizes differ by at most one (`dp_rows`);
    "cost":  longest processing time first: rows by cost, largest first (ties: lower index), each to
             the replica with the least cost so far (ties: fewer rows, then lower rank). Its largest
             replica cost is within 4/3 - 1/(3 dp) of the best partition's (Graham 1969).

    Deterministic: the same costs give the same partition on every process."""
    if dp < 1 or balance not in DP_BALANCE:
        raise ValueError(f"dp={dp} must be >= 1 and balance={balance!r} one of {DP_BALANCE}")
    B = cost_B.shape[0]
    if balance == "count" or dp == 1:
        return [torch.arange(B)[dp_rows(B, r, dp)] for r in range(dp)]
    order = sorted(range(B), key=lambda i: (-float(cost_B[i]), i))
    load, rows = [0.0] * dp, [[] for _ in range(dp)]
    for i in order:
        r = min(range(dp), key=lambda k: (load[k], len(rows[k]), k))
        load[r] += float(cost_B[i])
        rows[r].append(i)
    return [torch.tensor(sorted(r), dtype=torch.long) for r in rows]


def imbalance(cost_B: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """max / mean of the replicas' summed costs (1: balanced); 1 for a batch without cost."""
    loads = torch.stack([cost_B[p].sum() for p in parts])
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0
