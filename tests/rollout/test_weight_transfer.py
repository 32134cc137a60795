"""vLLM weight transfer (nccl / ipc), its CPU-checkable parts: the export as vLLM's weight source (what the
sender announces equals what it sends, element for element, checked by vLLM's own sender check; TP
shards gathered; under PP and EP every tensor reaches rank 0 from its owner over gloo), the engines'
NCCL ranks, and the configuration rules. The broadcast itself needs CUDA: tests/train/test_gpu.py
runs the loop with it."""

import pytest
import torch
from rollout_jobs import export_source_job

from moe_rl.config import ConfigError, from_dict
from moe_rl.rollout.transfer import engine_rank_offsets
from moe_rl.train.launch_local import run_ranks
from moe_rl.weights.hf import HFReader


def test_replicated_export_announces_exactly_what_it_sends(tiny_qwen):
    reader = HFReader(tiny_qwen)
    for out in run_ranks(export_source_job, 2, (str(tiny_qwen), {"tp": 2}, False)):  # each TP rank gathers
        assert out["passes"] == 2  # metadata from one pass, cached; the send is the second
        assert [n for n, _, _ in out["meta"]] == list(out["sent"])
        assert set(out["sent"]) == set(reader.names())
        for name, dtype, shape in out["meta"]:
            assert dtype == torch.float32 and shape == tuple(reader.get(name).shape)
            assert torch.equal(out["sent"][name], reader.get(name))  # untrained: the checkpoint's weights


@pytest.mark.parametrize("layout", [{"pp": 2}, {"ep": 2}, {"tp": 2}])
def test_gathered_export_brings_the_whole_model_to_rank_0(tiny_qwen, layout):
    reader = HFReader(tiny_qwen)
    sender, other = run_ranks(export_source_job, 2, (str(tiny_qwen), layout, True))
    assert sender["meta"] == other["meta"] and other["sent"] == {}  # only rank 0 yields
    assert [n for n, _, _ in sender["meta"]] == list(sender["sent"])  # vLLM's check passed in that order
    assert sorted(sender["sent"]) == sorted(reader.names())  # every tensor once, whoever owned it
    for name, t in sender["sent"].items():
        assert torch.equal(t, reader.get(name))


def test_engine_ranks_follow_the_sender():
    assert engine_rank_offsets([1, 1, 1]) == [1, 2, 3]
    assert engine_rank_offsets([2, 4]) == [1, 3]


def test_weight_transfer_choice():
    assert from_dict({}, [], cuda_available=True).rollout.weight_transfer == "store"
    ep2 = ["parallel.ep=2", "parallel.world_size=2"]
    # NCCL: trainer and engines on their own GPUs
    nccl = ["rollout.weight_transfer=nccl", "cluster.colocate=false"]
    assert from_dict({}, [*nccl, *ep2], cuda_available=True).rollout.weight_transfer == "nccl"
    with pytest.raises(ConfigError, match="rollout.weight_transfer: 'ipc' needs every trainer rank"):
        from_dict({}, ["rollout.weight_transfer=ipc", *ep2], cuda_available=True)
    with pytest.raises(ConfigError, match="rollout.weight_transfer: 'nccl' needs CUDA"):
        from_dict({}, ["rollout.weight_transfer=nccl"], cuda_available=False)
    with pytest.raises(ConfigError, match="rollout.weight_transfer: 'ipc' needs CUDA"):
        from_dict({}, ["rollout.weight_transfer=ipc"], cuda_available=False)
    assert from_dict({}, ["rollout.weight_transfer=ipc"],
                     cuda_available=True).rollout.weight_transfer == "ipc"
    # colocated ipc: every engine GPU must hold a policy rank (its IPC handle comes from that rank)
    ipc2 = ["rollout.weight_transfer=ipc", "parallel.world_size=2", "parallel.tp=2"]
    assert from_dict({}, [*ipc2, "rollout.num_engines=2"], cuda_available=True).rollout.num_engines == 2
    assert from_dict({}, [*ipc2, "rollout.engine_tp=2"], cuda_available=True).rollout.engine_tp == 2
    for more in (["rollout.num_engines=3"], ["rollout.num_engines=2", "rollout.engine_tp=2"]):
        with pytest.raises(ConfigError, match=r"'ipc' needs a policy rank on every engine GPU .* GPUs > "
                                              r"parallel.world_size = 2"):
            from_dict({}, [*ipc2, *more], cuda_available=True)


def test_ipc_transfer_is_packed_into_one_bounded_buffer():
    """ipc: packed (vLLM then copies the tensors, chunk after chunk, into one CUDA IPC buffer it shares
    once; unpacked it shares every tensor and holds them all until the update ends: a second copy of the
    model on each trainer GPU). The buffer is rollout.weight_sync_bucket_mb, widened to the largest tensor
    (vLLM's packer refuses a tensor larger than its buffer). The trainer-side engine itself needs CUDA:
    here the init info production passes it is checked."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    from moe_rl.rollout.transfer import ExportSource, ipc_buffer_bytes, trainer_init_info

    mib = 2**20
    named = [("model.embed_tokens.weight", torch.zeros(3 * mib // 4, dtype=torch.float32))]  # 3 MiB
    # 1 MiB each
    named += [(f"model.layers.{i}.mlp.weight", torch.zeros(mib // 2, dtype=torch.bfloat16)) for i in range(8)]
    passes = []

    def export():
        passes.append(1)
        return iter(named)

    source = ExportSource(export)
    cls, info = trainer_init_info("ipc", source, 0, "", 0, 1, bucket_mb=2.0)
    assert cls is IPCTrainerWeightTransferEngine and isinstance(info, IPCTrainerInitInfo)
    assert info.packed and info.rank == 0
    # the largest tensor (3 MiB) does not fit the 2 MiB bucket: the buffer holds it, and not the model (11
    # MiB)
    assert info.packed_buffer_size_bytes == 3 * mib
    assert ipc_buffer_bytes(4.0, source.metadata()) == 4 * mib and ipc_buffer_bytes(0.5, []) == mib // 2
    assert passes == [1]  # the metadata came from one pass of the export, cached for every later use
    _, other_rank = trainer_init_info("ipc", source, 1, "", 0, 1, bucket_mb=2.0)
    # chunk alike
    assert other_rank.packed and other_rank.packed_buffer_size_bytes == info.packed_buffer_size_bytes
