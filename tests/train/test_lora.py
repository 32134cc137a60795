"""LoRA adapters on the Megatron policy (train/lora.py): the base frozen bitwise, only adapters trained,
merged weights W + (alpha/r) B A scoring in transformers as the adapted model does, and TP2 / EP2 / PP2
equal to one rank (scores, losses, gradient norms, merged weights) in fp32."""

import json

import pytest
import torch
from train_jobs import B, S, batch_tensors, lora_gradient_job, lora_job

from moe_rl.driver.specs import convert_spec
from moe_rl.train.launch_local import run_ranks
from moe_rl.train.lora import TARGETS

CONVERT = convert_spec()  # the model settings `moe-rl convert` builds with

pytestmark = pytest.mark.slow
TOL = dict(atol=1e-5, rtol=0)


def valid() -> torch.Tensor:
    _, lengths, _, _ = batch_tensors()
    return torch.arange(S).expand(B, S) < lengths.unsqueeze(1)


@pytest.fixture(scope="module")
def one_rank(tiny_qwen):
    return run_ranks(lora_job, 1, (str(tiny_qwen), {}, TARGETS))[0]


@pytest.mark.quick
def test_only_adapters_train_and_the_base_stays_bitwise(one_rank):
    res = one_rank
    assert res["base_same"]
    assert res["trainable"] and all(n.endswith((".lora_A", ".lora_B")) for n in res["trainable"])
    # per layer (2): attention's two linears, every expert's fc1 and fc2 (4 experts), the router; the head
    assert sum(n.endswith(".lora_A") for n in res["trainable"]) == 2 * (2 + 2 * 4 + 1) + 1
    assert res["optimizer_numel"] == res["adapter_numel"] > 0
    moved = (res["after"].logp_BS - res["before"].logp_BS).abs() * valid()
    assert float(moved.max()) > 1e-3  # the adapters learned something


def test_with_adapters_off_the_policy_is_its_base(one_rank):
    """The KL reference of a LoRA policy is its frozen base, scored with the adapters off: after training it
    scores as the policy did before (exactly: the same computation), and the adapters are back after."""
    res = one_rank
    assert torch.equal(res["base_after"].logp_BS, res["before"].logp_BS)
    assert torch.equal(res["after_again"].logp_BS, res["after_free"].logp_BS)
    assert not torch.allclose(res["after_free"].logp_BS * valid(), res["before"].logp_BS * valid(), atol=1e-3)


@pytest.mark.quick
def test_adapters_start_as_the_base_model(one_rank, tiny_qwen):
    """B = 0 at the start: the first scores are the base model's, as transformers computes them."""
    from moe_rl.train.hf_parity import hf_token_logprobs

    ids, lengths, _, _ = batch_tensors()
    hf = hf_token_logprobs(str(tiny_qwen), ids)
    torch.testing.assert_close(one_rank["before"].logp_BS * valid(), hf * valid(), **TOL)


def test_merged_weights_are_base_plus_scaled_BA_and_score_as_the_adapted_model(one_rank, tiny_qwen,
                                                                            tmp_path):
    """What the engines get (the export, merged): each adapted weight is W + (alpha/r) B A exactly, and a
    transformers model of the merged checkpoint scores as the adapted Megatron model (fp32, 1e-5)."""
    from moe_rl.train.hf_parity import hf_token_logprobs
    from moe_rl.weights.hf import save_hf_checkpoint

    res = one_rank
    for name, merged in res["merged_local"].items():
        torch.testing.assert_close(merged, res["merged_by_formula"][name], atol=0, rtol=0, msg=name)
    merged_dir = save_hf_checkpoint(res["merged"].items(), tmp_path / "merged", tiny_qwen)
    ids, _, _, _ = batch_tensors()
    hf = hf_token_logprobs(merged_dir, ids)
    torch.testing.assert_close(res["after_free"].logp_BS * valid(), hf * valid(), **TOL)
    assert float(((hf - hf_token_logprobs(tiny_qwen, ids)).abs() * valid()).max()) > 1e-3  # not the base


def planned_adapters(tiny_qwen, layout: dict, stage: int) -> float:
    """`moe-rl plan`'s count of one rank's adapter parameters."""
    from moe_rl.plan import ModelShape, lora_params

    shape = ModelShape.from_hf(json.loads((tiny_qwen / "config.json").read_text()))
    return sum(lora_params(shape, 4, TARGETS, layout.get("tp", 1), layout.get("ep", 1), layout.get("pp", 1),
                           stage))


@pytest.mark.quick
def test_the_plan_counts_the_adapters_the_model_has(one_rank, tiny_qwen):
    assert planned_adapters(tiny_qwen, {}, 0) == one_rank["adapter_numel"]


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}, {"pp": 2}])
def test_layout_matches_single_rank(one_rank, tiny_qwen, layout):
    ref = one_rank
    results = run_ranks(lora_job, 2, (str(tiny_qwen), layout, TARGETS))
    for rank, res in enumerate(results):
        assert res["base_same"]
        # each rank's adapters as `moe-rl plan` counts them (rank 1 is stage 1 under PP2)
        assert res["adapter_numel"] == planned_adapters(tiny_qwen, layout, rank if "pp" in layout else 0)
        for key in ("before", "after", "after_free"):
            torch.testing.assert_close(res[key].logp_BS * valid(), ref[key].logp_BS * valid(), **TOL, msg=key)
    for step in range(2):
        losses = [r["steps"][step]["loss"] for r in results if "loss" in r["steps"][step]]
        total = sum(losses) if "ep" in layout else losses[0]  # EP2 is DP2: each rank its shard's share
        assert total == pytest.approx(ref["steps"][step]["loss"], abs=1e-5)
        norm = ref["steps"][step]["grad_norm"]
        assert results[0]["steps"][step]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    merged = {}
    for res in results:
        merged.update(res["merged"])
    assert merged.keys() == ref["merged"].keys()
    for name, tensor in ref["merged"].items():
        torch.testing.assert_close(merged[name], tensor, **TOL, msg=name)


def test_recompute_trains_the_adapters_as_without(one_rank, tiny_qwen):
    """Activation recompute with a frozen embedding: the adapters still get their gradients (the
    embedding's output carries grad into the recomputed layers)."""
    res = run_ranks(lora_job, 1, (str(tiny_qwen), {}, TARGETS, True))[0]
    for step in range(2):
        norm = one_rank["steps"][step]["grad_norm"]
        assert res["steps"][step]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    torch.testing.assert_close(res["after"].logp_BS * valid(), one_rank["after"].logp_BS * valid(), **TOL)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}])
def test_checkpoint_holds_adapters_only_and_reshards(tmp_path, tiny_qwen, layout):
    """Saved in TP2 (EP2: with the distributed optimizer), the checkpoint holds the adapters alone and
    resumes on one rank as the run would have gone on; a model without adapters refuses it."""
    from train_jobs import ckpt_job

    from moe_rl.train.checkpoint import read_extra, tensor_shapes
    from moe_rl.train.lora import LoraSpec
    from moe_rl.weights.hf import fingerprint

    settings = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(ckpt_job, 2, (str(tiny_qwen), layout, str(ckpt), "save", settings))
    keys = set(tensor_shapes(ckpt))
    model_keys = {k for k in keys if not k.startswith("optimizer")}
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys), sorted(model_keys)[:5]
    assert read_extra(ckpt)["lora"] == {"base": str(tiny_qwen), "base_fingerprint": fingerprint(tiny_qwen),
                                        "rank": 4, "alpha": 8.0, "targets": list(TARGETS), "dtype": "float32"}
    world = 2 if "ep" in layout else 1  # a distributed optimizer's state resumes at the same DP size
    loaded = run_ranks(ckpt_job, world, (str(tiny_qwen), {} if world == 1 else layout, str(ckpt), "load",
                                         settings))
    losses = [sum(r["step2"]["loss"] for r in runs if "loss" in r["step2"]) for runs in (saved, loaded)]
    assert losses[1] == pytest.approx(losses[0] if world == 2 else saved[0]["step2"]["loss"], abs=1e-6)
    after = [runs[0]["after"].logp_BS * valid() for runs in (saved, loaded)]
    torch.testing.assert_close(after[1], after[0], **TOL)
    if world == 1:
        with pytest.raises(RuntimeError, match="does not fit this model's architecture: missing"):
            run_ranks(ckpt_job, 1, (str(tiny_qwen), {}, str(ckpt), "load"))


def test_peft_loads_the_exported_adapters_and_scores_as_the_trainer(tmp_path, tiny_qwen):
    """Attention adapters trained in TP2, exported by `moe-rl convert mcore-to-hf` in PEFT's format:
    HF PEFT loads them onto the transformers base model, which then scores as the trainer did; `--merge`
    writes the merged model, which scores the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moe_rl.train.convert import mcore_to_hf
    from moe_rl.train.hf_parity import hf_token_logprobs, model_token_logprobs

    ckpt = tmp_path / "ckpt"
    trained = run_ranks(lora_job, 2, (str(tiny_qwen), {"tp": 2}, ("linear_qkv", "linear_proj"), False,
                                      str(ckpt)))[0]["after_free"].logp_BS
    done = mcore_to_hf(CONVERT, ckpt, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"] and done.tensors == 2 * 4 * 2
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen), tmp_path / "peft")
    ids, _, _, _ = batch_tensors()
    torch.testing.assert_close(model_token_logprobs(peft_model, ids) * valid(), trained * valid(), **TOL)
    mcore_to_hf(CONVERT, ckpt, tmp_path / "merged", merge=True)
    merged = hf_token_logprobs(tmp_path / "merged", ids)
    torch.testing.assert_close(merged * valid(), trained * valid(), **TOL)


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2}])
def test_expert_adapters_export_per_expert_as_the_merged_weights_say(tmp_path, tiny_qwen, layout):
    """Every target, experts and routers included (trained in EP2, or TP2: the experts' linears split over
    expert TP too): each exported HF module's base weight + (alpha/r) B A is the merged export's tensor,
    per expert (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`, the per-expert layout vLLM's MoE LoRA
    and Megatron-Bridge use) and per router (`mlp.gate`)."""
    from safetensors.torch import load_file

    from moe_rl.plan import ModelShape, peft_export_params
    from moe_rl.train.convert import mcore_to_hf
    from moe_rl.train.parallel import Layout
    from moe_rl.weights.hf import HFReader

    ckpt = tmp_path / "ckpt"
    run_ranks(lora_job, 2, (str(tiny_qwen), layout, TARGETS, False, str(ckpt)))
    mcore_to_hf(CONVERT, ckpt, tmp_path / "peft", layout=Layout(**layout))  # exported in the same layout
    mcore_to_hf(CONVERT, ckpt, tmp_path / "merged", merge=True)
    adapters, base, merged = (load_file(tmp_path / "peft" / "adapter_model.safetensors"), HFReader(tiny_qwen),
                              HFReader(tmp_path / "merged"))
    modules = {n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n in adapters}
    # per layer: q, k, v, o, three per expert, the router; and the LM head
    assert len(modules) == 2 * (4 + 3 * 4 + 1) + 1
    assert {"model.layers.1.mlp.experts.3.up_proj", "model.layers.1.mlp.gate", "lm_head"} <= modules
    # what an adapter sync moves is what the plan says it moves
    shape = ModelShape.from_hf(json.loads((tiny_qwen / "config.json").read_text()))
    assert sum(t.numel() for t in adapters.values()) == peft_export_params(shape, 4, TARGETS)
    for m in sorted(modules):
        a, b = (adapters[f"base_model.model.{m}.lora_{x}.weight"].double() for x in "AB")
        expected = base.get(f"{m}.weight").double() + 8.0 / 4 * b @ a
        torch.testing.assert_close(merged.get(f"{m}.weight").double(), expected, atol=1e-6, rtol=0, msg=m)


def test_adapter_gradients_are_the_merged_models_by_the_chain_rule(tmp_path, tiny_qwen):
    """With W' = W + s B A (s = alpha / r), dL/dB = s dL/dW' A^T and dL/dA = s B^T dL/dW': the adapters'
    gradients of a PPO loss (every target, the routers' included, routes replayed) equal those of the
    merged model's whole weights carried through the chain rule (fp32)."""
    grads = run_ranks(lora_gradient_job, 1, (str(tiny_qwen), str(tmp_path / "merged")))[0]
    assert len(grads) == 2 * (2 + 2 * 4 + 1) + 1
    s = 8.0 / 4
    for name, (da, db, dw, a, b) in grads.items():
        assert dw.abs().max() > 0, name
        torch.testing.assert_close(db, s * dw @ a.T, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(da, s * b.T @ dw, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.quick
def test_transformer_engine_outputs_unpack_and_grouped_experts_split_by_their_tokens():
    """The Transformer Engine paths' own logic, on plain tensors (TE itself needs CUDA): a fused norm-linear
    returning its norm's output in either of TE's two forms, and a grouped expert linear's adapters applied
    expert by expert to the tokens m_splits gives each, against a token-by-token reference."""
    from moe_rl.train.lora import _grouped_hook, _unpack

    out, bias, normed = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    assert _unpack((out, bias)) == (out, bias, None)
    assert _unpack(((out, normed), None)) == (out, None, normed)  # return_layernorm_output, no bias
    assert _unpack((out, bias, normed)) == (out, bias, normed)  # ... with the bias returned
    g = torch.Generator().manual_seed(0)
    experts, rank, d_in, d_out, splits = 3, 2, 5, 4, [2, 0, 3]
    module = torch.nn.Module()
    module.lora_scale, module.lora_off = 1.5, False
    for e in range(experts):
        setattr(module, f"lora_A{e}", torch.nn.Parameter(torch.randn(rank, d_in, generator=g)))
        setattr(module, f"lora_B{e}", torch.nn.Parameter(torch.randn(d_out, rank, generator=g)))
    x, base = torch.randn(sum(splits), d_in, generator=g), torch.randn(sum(splits), d_out, generator=g)
    got, _ = _grouped_hook(module, (x, splits), {}, (base, None))
    owner = [e for e, n in enumerate(splits) for _ in range(n)]
    want = torch.stack([base[t] + 1.5 * getattr(module, f"lora_B{e}") @ (getattr(module, f"lora_A{e}") @ x[t])
                        for t, e in enumerate(owner)])
    torch.testing.assert_close(got, want)


def test_adapters_refuse_a_base_that_changed(tmp_path, tiny_qwen):
    """A LoRA checkpoint records its base's fingerprint: resuming it, or converting it, on a base whose
    weights changed since (here one tensor retrained in place) is refused in one line."""
    import shutil

    from safetensors.torch import load_file, save_file
    from train_jobs import ckpt_job

    from moe_rl.train.checkpoint import CheckpointError
    from moe_rl.train.convert import mcore_to_hf
    from moe_rl.train.lora import LoraSpec

    base, ckpt = tmp_path / "base", tmp_path / "ckpt"
    shutil.copytree(tiny_qwen, base)
    settings = LoraSpec(rank=4, alpha=8.0, targets=("linear_qkv",))
    run_ranks(ckpt_job, 1, (str(base), {}, str(ckpt), "save", settings))
    run_ranks(ckpt_job, 1, (str(base), {}, str(ckpt), "load", settings))  # the same base: resumes
    (file,) = base.glob("*.safetensors")
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="its LoRA adapters were trained on a base whose weights differ"):
        run_ranks(ckpt_job, 1, (str(base), {}, str(ckpt), "load", settings))
    with pytest.raises(CheckpointError, match="the base changed since"):
        mcore_to_hf(CONVERT, ckpt, tmp_path / "peft")
