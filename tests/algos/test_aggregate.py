"""Explicit global denominators: the same loss and gradient however the batch is cut — 1 vs 4
microbatches in one process, and 2 gloo ranks (real torch.distributed)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl.algos import aggregate as agg
from moe_rl.algos.advantages import whiten

B, T = 8, 6
MODES = [("token_mean", False), ("seq_mean", False), ("seq_sum_const", False), ("token_mean", True), ("seq_mean", True)]


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # one sample without model tokens
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    theta = torch.randn(B, T, generator=g, dtype=torch.float64)
    weight = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return theta, mask, weight


def _loss_BT(theta):
    return (theta - 0.3).square() * torch.sin(theta)


def _full(mode, sn):
    theta, mask, w = _batch()
    theta.requires_grad_(True)
    loss = agg.aggregate(_loss_BT(theta), mask, mode, constant=6.0, weight_BT=w, self_normalize=sn)
    loss.backward()
    return loss.detach(), theta.grad


def _pieces(mode, sn, rows_list, group=None):
    theta, mask, w = _batch()
    theta.requires_grad_(True)
    denoms = [agg.loss_denominator(mask[r], mode, 6.0, w[r], sn) for r in rows_list]
    denom = agg.global_denominator(denoms, group)
    total = 0.0
    for r in rows_list:
        piece = agg.loss_numerator(_loss_BT(theta[r]), mask[r], mode, w[r]) / denom
        piece.backward()
        total += float(piece.detach())
    return total, theta.grad


@pytest.mark.parametrize("mode, sn", MODES)
def test_one_vs_four_microbatches(mode, sn):
    loss, grad = _full(mode, sn)
    rows = [slice(0, 3), slice(3, 4), slice(4, 7), slice(7, 8)]  # uneven pieces
    total, grad4 = _pieces(mode, sn, rows)
    assert total == pytest.approx(float(loss), rel=1e-12)
    torch.testing.assert_close(grad4, grad, rtol=1e-12, atol=1e-12)


def test_seq_mean_excludes_empty_samples_and_empty_batch_skips():
    _, mask, _ = _batch()
    assert float(agg.loss_denominator(mask, "seq_mean")) == 7.0
    with pytest.raises(agg.EmptyBatch):
        agg.aggregate(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), "token_mean")
    with pytest.raises(agg.EmptyBatch):  # everything rejected under self-normalisation
        agg.aggregate(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), "token_mean",
                      weight_BT=torch.zeros(2, 3), self_normalize=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {}
        # rank 0 holds rows 0-4 (two microbatches), rank 1 rows 5-7 (one)
        mine = [slice(0, 2), slice(2, 5)] if rank == 0 else [slice(5, 8)]
        for mode, sn in MODES:
            total, grad = _pieces(mode, sn, mine, group=dist.group.WORLD)
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            dist.all_reduce(grad)  # data-parallel gradient reduction is a SUM with global denominators
            out[(mode, sn)] = (float(t), grad.tolist())  # plain data: no shared-memory handles
        theta, mask, _ = _batch()
        rows = slice(0, 5) if rank == 0 else slice(5, 8)
        out["whiten"] = whiten(theta[rows], mask[rows], group=dist.group.WORLD).tolist()
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_the_whole_batch():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for mode, sn in MODES:
        loss, grad = _full(mode, sn)
        for rank in (0, 1):
            total, g = results[rank][(mode, sn)]
            assert total == pytest.approx(float(loss), rel=1e-12), (mode, sn)
            torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), grad, rtol=1e-12, atol=1e-12)
    theta, mask, _ = _batch()
    whole = whiten(theta, mask)
    torch.testing.assert_close(torch.tensor(results[0]["whiten"] + results[1]["whiten"], dtype=torch.float64), whole)
