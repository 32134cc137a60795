"""Data-parallel sharding: which rows each global rank trains on (moe_rl.train.parallel.dp_rows /
dp_rank_of, used by trainer_groups.TrainerGroup._shard and the Megatron test jobs), checked against
megatron-core's own rank generator."""

import itertools
import socket

import pytest
import torch

from moe_rl.train import parallel
from moe_rl.train.parallel import dp_partition, dp_rank_of, dp_rows, imbalance, row_cost


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
    group.tp_cp, group.dp, group.balance, group.attention_span = tp * cp, dp, "count", 6.0
    B, S = 7, 5
    ids = torch.arange(B * S).reshape(B, S)
    batch = Batch(ids, torch.full((B,), S), mask_BS=torch.ones(B, S))
    dp_of = megatron_dp_ranks(tp, cp, dp, pp)
    for rank in range(tp * cp * dp * pp):
        shard = group._shard(batch, rank)
        want = ids[dp_rows(B, dp_of[rank], dp)]
        assert torch.equal(shard.input_ids_BS, want), rank
        assert shard.mask_BS.shape == want.shape
    # by cost: one row five times as long as the others goes alone, every rank of a replica gets the same
    group.balance = "cost"
    lengths = torch.tensor([1, 1, 5, 1, 1, 1, 1])
    batch = Batch(ids, lengths, mask_BS=torch.ones(B, S))
    by_replica: dict[int, list[int]] = {}
    for rank in range(tp * cp * dp * pp):
        rows = group._shard(batch, rank).input_ids_BS[:, 0].div(S, rounding_mode="floor").tolist()
        assert by_replica.setdefault(dp_of[rank], rows) == rows, rank
    assert sorted(sum(by_replica.values(), [])) == list(range(B)) and [2] in by_replica.values()
    group.dp = 1
    assert group._shard(batch, 3) is batch


def test_row_cost_and_the_cost_partition_by_hand():
    # c = L + L^2 / span: span 6 (a hidden size of 1), L = 2 and 6
    assert row_cost(torch.tensor([2, 6]), 6.0).tolist() == pytest.approx([2 + 4 / 6, 12.0])
    # costs 10, 1, 1, 1, 1, 6: largest first, each to the lighter replica: 10 | 6, then the ones on 6
    cost = torch.tensor([10.0, 1, 1, 1, 1, 6])
    parts = dp_partition(cost, 2)
    assert [p.tolist() for p in parts] == [[0], [1, 2, 3, 4, 5]] and imbalance(cost, parts) == 1.0
    count = dp_partition(cost, 2, "count")
    assert [p.tolist() for p in count] == [[0, 1, 2], [3, 4, 5]]
    assert imbalance(cost, count) == pytest.approx(1.2)
    with pytest.raises(ValueError):
        dp_partition(cost, 2, "tokens")


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_the_cost_partition_of_long_tailed_lengths(dp):
    """Long-tailed lengths (a few episodes ten times the rest): every row once, the same partition every
    time, and never less balanced than consecutive runs of equal count (here far better)."""
    g = torch.Generator().manual_seed(dp)
    # Pareto(scale 20, shape 1.2) by its inverse CDF from this test's own generator: the draw must not depend
    # on what ran before in the process (torch.distributions samples from the global generator)
    lengths = (20.0 * torch.rand(64, generator=g, dtype=torch.float64) ** (-1 / 1.2)).clamp(max=4000).long()
    lengths[torch.randperm(64, generator=g)[:3]] = 4000
    cost = row_cost(lengths, 6.0 * 256)
    parts = dp_partition(cost, dp)
    assert sorted(torch.cat(parts).tolist()) == list(range(64))
    assert all(torch.equal(a, b) for a, b in zip(parts, dp_partition(cost, dp), strict=True))
    balanced, counted = imbalance(cost, parts), imbalance(cost, dp_partition(cost, dp, "count"))
    assert 1.0 <= balanced <= counted and balanced < 4 / 3


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
