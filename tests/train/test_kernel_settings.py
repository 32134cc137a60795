"""Kernel and fusion settings per layer spec (moe_rl.train.model.kernel_settings): the local spec uses
no fusion megatron-core would torch.compile (a real tiny model's steps compile nothing), the Transformer
Engine spec what Megatron-LM's MoE recipes use."""

import pytest
import torch

from moe_rl.train.launch_local import run_ranks
from moe_rl.train.model import kernel_settings

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion", "moe_permute_fusion", "moe_router_fusion", "moe_grouped_gemm",
           "persist_layer_norm")


@pytest.mark.parametrize("fused_wgrad", [False, True])
def test_the_local_spec_fuses_nothing(fused_wgrad):
    assert kernel_settings("local", fused_wgrad) == dict.fromkeys(FUSIONS, False)


@pytest.mark.parametrize("fused_wgrad", [False, True])
def test_the_transformer_engine_spec_uses_megatron_lms_moe_fusions(fused_wgrad):
    flags = kernel_settings("transformer_engine", fused_wgrad)
    assert set(flags) == set(FUSIONS)
    # Megatron-LM's MoE README and Mixtral / Qwen3 scripts: grouped GEMM, permute fusion, and its defaults
    for on in ("moe_grouped_gemm", "moe_permute_fusion", "apply_rope_fusion", "bias_activation_fusion",
               "bias_dropout_fusion", "persist_layer_norm"):
        assert flags[on], on
    # megatron-core's output layer needs apex's kernel
    assert flags["gradient_accumulation_fusion"] == fused_wgrad
    assert not flags["masked_softmax_fusion"]  # the scripts' --no-masked-softmax-fusion
    assert not flags["moe_router_fusion"]  # megatron-core's fused top-k bypasses RouterReplay (R3)
    # model.experts=sequential: Transformer Engine's SequentialMLP, the other fusions as they were
    assert kernel_settings("transformer_engine", fused_wgrad, grouped_experts=False) == flags | {
        "moe_grouped_gemm": False}


def test_an_unknown_spec_is_refused():
    with pytest.raises(ValueError, match="'local' or 'transformer_engine'"):
        kernel_settings("te", False)


def compile_job(rank, world, hf_path):
    """Production's local-spec policy: its config's flags, then forward+backward steps on two batch shapes
    (so every expert sees other token counts), with torch.compile's counters before and after."""
    from conftest import model_spec, optim_spec
    from torch._dynamo.utils import counters

    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path), optim=optim_spec(1e-3))
    flags = {name: getattr(w.config, name) for name in FUSIONS}
    g = torch.Generator().manual_seed(0)
    for rows, length in ((2, 8), (3, 13)):
        ids, lengths = torch.randint(0, 300, (rows, length), generator=g), torch.full((rows,), length)
        w.train_step(Batch(ids, lengths), lambda out, mb: (out["logp_BS"].sum(), {}), torch.tensor(1.0))
    return {"flags": flags, "counters": {k: dict(v) for k, v in counters.items()}}


@pytest.mark.slow
def test_local_spec_steps_compile_nothing(tiny_qwen):
    out = run_ranks(compile_job, 1, (str(tiny_qwen),))[0]
    assert out["flags"] == kernel_settings("local", fused_wgrad=False)  # what production built
    # no graph captured, nothing lowered (megatron's jit_fuser = torch.compile would show here: 9 graphs
    # at the first shape and 3 more at the second with the bias-activation/dropout fusions on)
    assert out["counters"].get("stats", {}).get("unique_graphs", 0) == 0, out["counters"]
    assert not out["counters"].get("inductor") and not out["counters"].get("aot_autograd"), out["counters"]


def import_job(rank, world, layer_spec):
    """A trainer rank's megatron-core import (RankActor: `import_megatron` first), in a fresh interpreter."""
    import sys

    from moe_rl.train.model import import_megatron

    before = "megatron.core" in sys.modules
    import_megatron(layer_spec)
    from megatron.core import jit
    from megatron.core.transformer.moe import router  # noqa: F401 - wraps a function in jit_fuser as it loads

    from moe_rl.train.worker import TrainWorker  # noqa: F401
    return {"before": before, "fuser_compiles": jit.jit_fuser is torch.compile,
            "dynamo": "torch._dynamo" in sys.modules, "compile": torch.compile.__module__,
            "wandb": sys.modules.get("wandb", "absent")}


@pytest.mark.slow
@pytest.mark.parametrize("layer_spec", ["local", "transformer_engine"])
def test_a_rank_imports_megatron_with_the_jit_fuser_only_where_its_fusions_run(layer_spec):
    """On the local spec megatron-core's jit_fuser wraps only the fusions it turns off: off from the first
    import, so that neither dynamo nor inductor is imported (~1.3 s of a rank's start); torch.compile
    itself is left as it was. W&B is not imported by a rank either way."""
    out = run_ranks(import_job, 1, (layer_spec,), dist_env=False, start="spawn")[0]
    assert not out["before"] and out["wandb"] is None and out["compile"] == "torch"
    local = layer_spec == "local"
    assert out["fuser_compiles"] is not local and out["dynamo"] is not local
