"""Data-parallel sharding: which rows each global rank trains on (moe_rl.train.parallel.dp_rows /
dp_rank_of, used by trainer_groups.TrainerGroup._shard and the Megatron test jobs), checked against
megatron-core's own rank generator."""

import itertools
import socket

import pytest
import torch

from moe_rl.train import parallel
from moe_rl.train.parallel import dp_rank_of, dp_rows


def megatron_dp_ranks(tp, cp, dp, pp):
    """{global rank: data-parallel rank} from megatron-core's RankGenerator (its default order)."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    return {r: group.index(r) for group in gen.get_ranks("dp") for r in group}


@pytest.mark.parametrize("tp, cp, dp, pp", list(itertools.product([1, 2], [1, 2], [1, 2, 3], [1, 2])))
def test_dp_rank_of_follows_megatrons_rank_order(tp, cp, dp, pp):
    expected = megatron_dp_ranks(tp, cp, dp, pp)
    assert len(expected) == tp * cp * dp * pp
    assert {r: dp_rank_of(r, tp, cp, dp) for r in expected} == expected


@pytest.mark.parametrize("B, dp", [(4, 1), (4, 2), (5, 2), (7, 3), (2, 4), (0, 2)])
def test_dp_rows_partition_the_batch(B, dp):
    parts = [list(range(B))[dp_rows(B, r, dp)] for r in range(dp)]
    assert sum(parts, []) == list(range(B))  # consecutive, disjoint, every row once, in rank order
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        dp_rows(B, dp, dp)


def test_a_ray_actor_uses_the_gpu_it_was_given_not_its_rank():
    """Ray narrows CUDA_VISIBLE_DEVICES to an actor's GPUs: rank 5 on GPU 3 sees it as cuda:0."""
    from moe_rl.train.parallel import local_device_index

    assert local_device_index("3", [3]) == 0
    assert local_device_index("2,3", ["3"]) == 1  # two visible, the second is ours
    assert local_device_index(None, [5]) == 5  # nothing narrowed: the id is the index
    assert local_device_index("0,1", []) is None  # no GPU from Ray: the caller's local rank applies
    with pytest.raises(RuntimeError, match="hides it"):
        local_device_index("0,1", [3])


def test_trainer_group_shard_gives_each_replica_its_rows():
    from moe_rl.batch import Batch
    from moe_rl.driver.trainer_groups import TrainerGroup

    tp, cp, dp, pp = 2, 1, 3, 2
    group = object.__new__(TrainerGroup)  # no Ray actors: _shard only reads the sizes
    group.tp_cp, group.dp = tp * cp, dp
    B, S = 7, 5
    ids = torch.arange(B * S).reshape(B, S)
    batch = Batch(ids, torch.full((B,), S), mask_BS=torch.ones(B, S))
    dp_of = megatron_dp_ranks(tp, cp, dp, pp)
    for rank in range(tp * cp * dp * pp):
        shard = group._shard(batch, rank)
        want = ids[dp_rows(B, dp_of[rank], dp)]
        assert torch.equal(shard.input_ids_BS, want), rank
        assert shard.mask_BS.shape == want.shape
    group.dp = 1
    assert group._shard(batch, 3) is batch


def test_a_rank_0_port_is_outside_the_range_outgoing_connections_take():
    """A rank 0's port is found free, then bound seconds later by torch.distributed: in the kernel's
    ephemeral range any outgoing connection (Ray opens many) may take it meanwhile (CI met EADDRINUSE
    this way). The port comes from outside that range and outside Ray's worker ports, and binds."""
    low, high = parallel.ephemeral_ports()
    ports = {parallel.free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random, so two groups started together rarely meet
    for port in ports:
        assert not low <= port <= high and not 10002 <= port <= 19999 and 1024 < port < 65536
        with socket.socket() as s:
            s.bind(("", port))
