"""Device consistency of the context-parallel, packing and replay paths: run with their tensors on a
device other than the CPU (tests/train/elsewhere.py), every index, mask and position they build must
be made on that device, as on a GPU, where one left on the CPU crashes the step. The harness itself is
checked first: it refuses what CUDA refuses."""

import pytest
import torch
from elsewhere import ELSEWHERE, DeviceMix, elsewhere, on_elsewhere, plain

from moe_rl.train import context, replay
from moe_rl.train.packing import Packing


def test_the_harness_refuses_a_cpu_index_into_another_device():
    x = elsewhere(torch.arange(12.0).reshape(3, 4))
    with on_elsewhere():
        for op in (lambda: x.index_select(1, torch.tensor([0, 2])),
                   lambda: x.new_zeros(3, 4).index_copy_(1, torch.tensor([0, 1]), x[:, :2]),
                   lambda: x < torch.tensor([1.0, 2.0, 3.0, 4.0])):
            with pytest.raises(DeviceMix, match="mixes devices"):
                op()
        # what is allowed: a 0-dim CPU scalar, a transfer, an index made on the device
        y = x * torch.tensor(2.0) + torch.tensor([1.0, 0, 0, 0]).to(ELSEWHERE)
        picked = y.index_select(1, torch.arange(0, 4, 2, device=ELSEWHERE))
        n = int((picked > 5).sum())  # values are there to read
    assert picked.device == ELSEWHERE and n == 4
    assert torch.equal(plain(picked), torch.tensor([[1.0, 4.0], [9.0, 12.0], [17.0, 20.0]]))


class FakeContextGroup:
    """`torch.distributed` as context.py uses it, for CP rank `rank` of `cp`: all_gather returns every
    rank's chunks of `full_BSH` (cut as local_positions cuts them), all_reduce leaves the gradient."""

    def __init__(self, full_BSH: torch.Tensor, cp: int, rank: int):
        self.full, self.cp, self.rank, self.reduced = full_BSH, cp, rank, 0

    def get_world_size(self, group):
        return self.cp

    def get_rank(self, group):
        return self.rank

    def all_gather(self, parts, x, group):
        S = self.full.shape[1]
        for r, part in enumerate(parts):
            part.copy_(self.full.index_select(1, context.local_positions(S, self.cp, r, self.full.device)))

    def all_reduce(self, grad, group):
        self.reduced += 1


@pytest.mark.parametrize("rank", [0, 1])
def test_context_parallel_gather_builds_its_indices_on_the_device(monkeypatch, rank):
    cp, S = 2, 8
    full = torch.arange(2 * S * 3, dtype=torch.float32).reshape(2, S, 3)
    mine = context.local_positions(S, cp, rank)
    upstream = torch.randn(2, S, 3, generator=torch.Generator().manual_seed(0))
    with on_elsewhere():
        fake = FakeContextGroup(elsewhere(full), cp, rank)
        monkeypatch.setattr(context, "dist", fake)
        x = elsewhere(full[:, mine], requires_grad=True)
        out = context.gather_sequence(x, 1, group=None)
        out.backward(elsewhere(upstream))
        assert context.local_positions(S, cp, rank, ELSEWHERE).device == ELSEWHERE
        assert out.device == ELSEWHERE and x.grad.device == ELSEWHERE
    assert torch.equal(plain(out), full) and fake.reduced == 1
    assert torch.equal(plain(x.grad), upstream[:, mine])


def test_packing_builds_its_offsets_and_masks_on_the_device():
    lengths = torch.tensor([5, 0, 3, 6])
    ids = torch.arange(4 * 7).reshape(4, 7)
    routes = torch.arange(4 * 7 * 2 * 2).reshape(4, 7, 2, 2)
    ref = Packing.of(lengths, 7, multiple=8)
    with on_elsewhere():
        p = Packing.of(elsewhere(lengths), 7, multiple=8)
        packed, packed_routes = p.pack(elsewhere(ids)), p.pack(elsewhere(routes), fill=-1)
        back, positions, params = p.unpack(packed), p.positions(), p.seq_params()
        for t in (p.valid_BS, p.cu_seqlens, packed, packed_routes, back, positions, params.cu_seqlens_q):
            assert t.device == ELSEWHERE
    assert (p.total, p.real, params.max_seqlen_q) == (ref.total, ref.real, 6) == (16, 14, 6)
    assert torch.equal(plain(p.cu_seqlens), ref.cu_seqlens)
    assert torch.equal(plain(packed), ref.pack(ids)) \
        and torch.equal(plain(packed_routes), ref.pack(routes, fill=-1))
    assert torch.equal(plain(back), ref.unpack(ref.pack(ids))) \
        and torch.equal(plain(positions), ref.positions())


@pytest.fixture
def routers():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    made = [RouterReplay(), RouterReplay()]
    yield made
    for r in made:
        RouterReplay.global_router_replay_instances.remove(r)


@pytest.mark.parametrize("lengths_on", ["device", "host"])
def test_replay_builds_its_masks_on_the_routes_device(routers, lengths_on):
    """Routes on the device with lengths on the device or still on the host (as a Batch arrives)."""
    B, S, L, K, E = 3, 6, 2, 2, 4
    g = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * L)]).reshape(B, S, L, K)
    lengths = torch.tensor([6, 2, 4])
    routes[1, 4:] = -1  # padding without routes
    ref = replay.fill_padding(routes, lengths)
    scores = torch.randn(B * S, E, generator=g)
    with on_elsewhere():
        r, n = elsewhere(routes), elsewhere(lengths) if lengths_on == "device" else lengths
        replay.check_complete(r, n, E)
        filled = replay.fill_padding(r, n)
        assert replay.set_targets(routers, r, n, 0, 1, False, [0, 1], K, E)
        _, chosen = routers[1].get_replay_topk(elsewhere(scores), K)
        broken = r.clone()
        broken[2, 3, 1, 0] = -1
        with pytest.raises(replay.MissingRoutes, match="sample 2 position 3"):
            replay.check_complete(broken, n, E)
        assert filled.device == chosen.device == ELSEWHERE
    assert torch.equal(plain(filled), ref)
    assert torch.equal(plain(chosen), ref[:, :, 1].transpose(0, 1).reshape(-1, K))
