"""Each CPU shim of moe_rl.train.cpu_compat, checked in a fresh process (the shims patch torch and
megatron-core process-wide, so they stay out of the test runner's own process)."""

import pytest
import torch

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")


def shim_checks(rank, world):
    import torch.distributed as dist

    from moe_rl.train import cpu_compat, parallel

    out = {}
    parallel.init_distributed(parallel.Layout())
    out["applied"] = list(cpu_compat.APPLIED)

    # rng_tracker: named CPU streams, reproducible, isolated from the default generator
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu_compat.seed_model_parallel(7)
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    out["default_untouched"] = torch.equal(before, torch.get_rng_state())
    cpu_compat.seed_model_parallel(7)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    out["fork_reproducible"] = torch.equal(a, b)
    try:
        get_cuda_rng_tracker().add("model-parallel-rng", 99)
        out["duplicate_refused"] = False
    except RuntimeError:
        out["duplicate_refused"] = True

    # cuda_streams: the calls megatron makes run (torch's own raise without CUDA) and change nothing
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.ones(2) * 3
    x.record_stream(s)
    torch.cuda.current_stream().wait_stream(s)
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    out["streams"] = {"x": x.tolist(), "event_done": ev.query(), "elapsed": ev.elapsed_time(ev),
                      "stream_event_done": s.record_event().query(),
                      "installed": torch.cuda.Stream is cpu_compat._NoStream
                      and torch.cuda.Event is cpu_compat._NoEvent}

    # cuda_device
    out["current_device"] = torch.cuda.current_device()
    out["cuda_literal_device"] = str(torch.zeros(2, device="cuda").device)
    out["pinned_on_cpu"] = torch.tensor([1, 2], device="cpu", pin_memory=True).tolist()  # rotary emb under CP

    # te_names
    from megatron.core.transformer.moe import moe_utils

    out["te_general_gemm"] = moe_utils.te_general_gemm

    # the local spec's sequence-parallel norms (train/local_norm.py; not a CPU shim: the local spec
    # needs them on GPU too)
    from types import SimpleNamespace

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from moe_rl.train import local_norm

    local_norm.install()

    # the fields the norm reads from a TransformerConfig with tp > 1 and sequence parallelism
    cfg = SimpleNamespace(normalization="RMSNorm", sequence_parallel=True, params_dtype=torch.float32)
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    xin = torch.randn(4, 8)
    ref = torch.nn.RMSNorm(8, eps=1e-6)
    out["sp_norm_tagged"] = all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    out["sp_norm_names"] = [n for n, _ in norm.named_parameters()]
    out["sp_norm_err"] = float((norm(xin) - ref(xin)).abs().max())
    # without sequence parallelism torch's own norm, in megatron's params_dtype (torch would build fp32)
    plain = SimpleNamespace(normalization="RMSNorm", sequence_parallel=False, params_dtype=torch.bfloat16,
                            layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                            memory_efficient_layer_norm=False)
    norm = WrappedTorchNorm(plain, 8, eps=1e-6)
    out["plain_norm"] = (type(norm).__name__, norm.weight.dtype)

    # optimizer_type
    out["param_type"] = torch.nn.Parameter(torch.zeros(2)).type()
    out["explicit_type"] = str(torch.zeros(2).type(torch.float64).dtype)

    # gloo_all_to_all: split sizes given as tensors
    inp = torch.arange(4.0)
    res = torch.empty(4)
    dist.all_to_all_single(res, inp, torch.tensor([4]), torch.tensor([4]))
    out["all_to_all"] = res.tolist()

    # optimizer_step: the distributed optimizer's template state_dict works on a fresh optimizer
    from megatron.core.optimizer import distrib_optimizer as mdo

    cls = mdo.DistributedOptimizer
    out["optimizer_step"] = {
        "needed": not mdo.HAVE_APEX_OR_TE,  # without apex/TE torch Adam keeps the per-param step
        # the methods are the shim's own (the originals are megatron's), not merely named alike
        "patched": [f.__module__ + "." + f.__qualname__ for f in
                    (cls.state_dict, cls.load_state_dict, cls._set_main_param_and_optimizer_states)],
    }
    return out


def test_every_shim_in_a_fresh_process():
    out = run_ranks(shim_checks, 1)[0]
    from moe_rl.train import cpu_compat

    assert out["applied"] == list(cpu_compat.SHIMS)
    assert out["default_untouched"] and out["fork_reproducible"] and out["duplicate_refused"]
    assert out["streams"] == {"x": [3.0, 3.0], "event_done": True, "elapsed": 0.0, "stream_event_done": True,
                              "installed": True}
    assert out["current_device"] == "cpu" and out["cuda_literal_device"] == "cpu"
    assert out["pinned_on_cpu"] == [1, 2]
    assert out["te_general_gemm"] is None
    assert out["sp_norm_tagged"] and out["sp_norm_names"] == ["weight"] and out["sp_norm_err"] < 1e-6
    assert out["plain_norm"] == ("RMSNorm", torch.bfloat16)
    assert out["param_type"] == "torch.cuda.FloatTensor" and out["explicit_type"] == "torch.float64"
    assert out["all_to_all"] == [0.0, 1.0, 2.0, 3.0]
    shim = "moe_rl.train.cpu_compat._optimizer_step.<locals>."
    assert out["optimizer_step"] == {"needed": True,
                                     "patched": [shim + "state_dict", shim + "load_state_dict",
                                                                 shim + "set_states"]}
    # behaviour: test_checkpoint.py::test_distributed_optimizer_resume (DP2 save, DP2 load)


def test_shims_do_nothing_here_when_not_applied():
    # this process never called apply(): torch is untouched
    from moe_rl.train import cpu_compat

    assert cpu_compat.wanted(torch.cuda.is_available(), cpu_compat.te_available()) and not cpu_compat.APPLIED
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_which_machines_get_which_shims():
    from moe_rl.train import cpu_compat

    assert cpu_compat.wanted(cuda=False, te=False) == list(cpu_compat.SHIMS)  # a CPU box: all of them
    assert cpu_compat.wanted(cuda=False, te=True) == list(cpu_compat.SHIMS)
    # a GPU without Transformer Engine (the local spec): megatron's router still calls te_general_gemm
    assert cpu_compat.wanted(cuda=True, te=False) == ["te_names", "optimizer_step"]
    assert cpu_compat.wanted(cuda=True, te=True) == []
