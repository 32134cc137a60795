"""Megatron models vs transformers (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V3, GLM-4.5), HF weight round
trips through mbridge in TP2/EP2/PP2, and the critic's value head."""

import pytest
import torch
from routing_jobs import gradient_job, hf_logprobs_job
from train_jobs import (
    B,
    S,
    batch_tensors,
    critic_job,
    critic_returns,
    hf_roundtrip_job,
    layout_job,
    reward_model_job,
    teacher_job,
)

from moe_rl.train.hf_parity import hf_token_logprobs
from moe_rl.train.launch_local import run_ranks
from moe_rl.weights.hf import HFReader

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch,pack", [("mixtral", False), ("qwen2_moe", False), ("deepseek_v3", False),
                                       ("deepseek_v3", True), ("glm4_moe", True)])
def test_logprobs_match_transformers(arch, pack, request):
    """Mixtral (softmax after top-k), Qwen2-MoE (shared expert with a sigmoid gate, q/k/v bias),
    DeepSeek-V3 and GLM-4.5 (sigmoid scores with an expert bias, group-limited top-k, scaling, a shared
    expert, a dense first layer; multi-latent attention; half-rotary heads): free routing equals
    transformers', rows padded or packed (value heads narrower than query heads under multi-latent attention).
A dense first layer of Qwen3-MoE: tests/train/test_convert.py."""

    path = request.getfixturevalue(f"tiny_{arch}")
    routes = torch.zeros(B, S, 2, 2, dtype=torch.long)
    res = run_ranks(layout_job, 1, (str(path), {}, "alltoall", routes, pack))[0]
    ids, lengths, _, _ = batch_tensors()
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    ref = hf_token_logprobs(path, ids)
    torch.testing.assert_close(res["free"].logp_BS * valid, ref * valid, atol=1e-5, rtol=0)


def test_deepseek_v3_yarn_rope_logprobs_match_transformers(tiny_deepseek_v3, tmp_path):
    """DeepSeek-V3's published RoPE is YaRN (factor 40 from 4,096 positions; Kimi-K2's 32): the tiny
    checkpoint with YaRN from 64 positions (factor 8, mscale 1 on both sides of the softmax scale) scores
    as transformers scores it, its context past the original 64 positions."""
    import json
    import shutil


    path = tmp_path / "yarn"
    shutil.copytree(tiny_deepseek_v3, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "yarn", "factor": 8.0, "beta_fast": 32,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(5))
    res = run_ranks(hf_logprobs_job, 1, (str(path), ids))[0]
    torch.testing.assert_close(res[:, 1:], hf_token_logprobs(path, ids)[:, 1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,pack", [("deepseek_v3", True), ("glm4_moe", False)])
def test_gradients_match_transformers(arch, pack, request):
    """Every parameter's gradient of a policy-gradient loss equals transformers' (fp32, 1e-6 of the largest):
    latent attention, grouped sigmoid routing with the bias, the routed scaling, shared and dense experts, in
    microbatches of 24 tokens (transformers stores each layer's experts stacked: gate_up_proj [E, 2I, H],
    down_proj [E, H, I])."""
    import re

    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{arch}")
    grads, logp_ours = run_ranks(gradient_job, 1, (str(path), pack))[0]
    ids, _, mask, adv = batch_tensors()
    model = AutoModelForCausalLM.from_pretrained(path)
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = torch.log_softmax(model(ids).logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp_ours * mask, logp.detach() * mask, atol=1e-5, rtol=0)
    (-(adv * mask * logp).sum() / mask.sum()).backward()
    ref = {}
    for name, p in model.named_parameters():
        stacked = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if not stacked:
            ref[name] = p.grad
            continue
        for e, g in enumerate(p.grad):
            expert = f"{stacked[1]}.{e}"
            if stacked[2] == "down_proj":
                ref[f"{expert}.down_proj.weight"] = g
            else:
                ref[f"{expert}.gate_proj.weight"], ref[f"{expert}.up_proj.weight"] = g.chunk(2)
    assert set(grads) - {n for n, _ in model.named_buffers()} == set(ref)  # the expert bias: a buffer
    scale = max(float(g.abs().max()) for g in ref.values())
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("arch,layout",
                         [("qwen", {}), ("qwen", {"tp": 2}), ("qwen", {"ep": 2}), ("qwen", {"pp": 2}),
                                         ("qwen2_moe", {"tp": 2}), ("deepseek_v3", {"tp": 2}),
                                         ("deepseek_v3", {"ep": 2}), ("glm4_moe", {"pp": 2})])
def test_hf_round_trip_is_bitwise(arch, layout, request):
    tiny_qwen = request.getfixturevalue(f"tiny_{arch}")
    world = 1 if not layout else 2
    parts = run_ranks(hf_roundtrip_job, world, (str(tiny_qwen), layout))
    exported = {}
    for part in parts:
        for k, v in part.items():
            if k in exported:
                assert torch.equal(exported[k], v), k  # TP ranks agree
            exported[k] = v
    reader = HFReader(tiny_qwen)
    assert set(exported) == reader.names()
    for name in reader.names():
        assert torch.equal(exported[name], reader.get(name)), name


def test_dense_layers_of_qwen_moe_configs():
    from types import SimpleNamespace as C

    from moe_rl.weights.hf import dense_layers

    assert dense_layers(C(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1)) == [0]
    # MoE at 1, 3
    assert dense_layers(C(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)) == [0, 2]
    assert dense_layers(C(num_hidden_layers=4, mlp_only_layers=[3], decoder_sparse_step=2)) == [0, 2, 3]
    assert dense_layers(C(num_hidden_layers=4, num_local_experts=8)) == []  # Mixtral: experts everywhere


def _value_loss(values_BS, returns, mask):
    """1/2 (V(s_t) - G_t)^2, token mean over model tokens, where V(s_t) is the head's output at t-1 (the
    value of the state before token t is produced)."""
    pred = torch.zeros_like(values_BS)
    pred[:, 1:] = values_BS[:, :-1]
    return float((0.5 * (pred - returns).square() * mask).sum() / mask.sum())


def test_critic_value_head(tiny_qwen):
    res = run_ranks(critic_job, 1, (str(tiny_qwen), {}))[0]
    assert res["before"].shape == (B, S)
    assert float(res["before"].abs().max()) == 0.0  # zero-initialised head: V = 0 everywhere
    assert res["head_moved"] > 0 and res["step"]["grad_norm"] > 0
    _, lengths, mask, _ = batch_tensors()
    returns = critic_returns()
    # each step's loss is production's value loss of the values scored before it, with the V(s_t) shift
    assert res["step"]["loss"] == pytest.approx(_value_loss(res["before"], returns, mask), rel=1e-6)
    expected2 = _value_loss(res["after"], returns, mask)
    assert res["step2"]["loss"] == pytest.approx(expected2, rel=1e-5)
    unshifted = float((0.5 * (res["after"] - returns).square() * mask).sum() / mask.sum())
    assert abs(unshifted - expected2) > 1e-3  # the returns vary: a loss without the shift would differ
    assert expected2 < res["step"]["loss"]  # one step towards the returns
    assert "output_layer.weight" not in res["backbone_names"]
    # the backbone starts from the policy checkpoint
    assert torch.equal(res["embedding_at_start"], HFReader(tiny_qwen).get("model.embed_tokens.weight"))


@pytest.mark.parametrize("layout", [{"tp": 2}, {"cp": 2}])
def test_critic_two_ranks_match_single_rank(tiny_qwen, layout):
    one = run_ranks(critic_job, 1, (str(tiny_qwen), {}))[0]
    two = run_ranks(critic_job, 2, (str(tiny_qwen), layout))
    _, lengths, _, _ = batch_tensors()
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    for r in two:
        torch.testing.assert_close(r["after"] * valid, one["after"] * valid, atol=1e-5, rtol=0)


def test_reward_model_scores_equal_transformers(tmp_path):
    """`moe-rl tiny --reward-model` builds a one-label Qwen3MoeForSequenceClassification; the reward-model
    role (a critic-built Megatron model whose value head is its score.weight) scores each row at its last
    token as transformers does (fp32, <= 1e-5), on one rank and in TP2."""
    import subprocess
    import sys

    from transformers import AutoModelForSequenceClassification

    rm = tmp_path / "rm"
    proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "tiny", str(rm), "--reward-model", "--seed",
                           "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids, lengths, _, _ = batch_tensors()
    model = AutoModelForSequenceClassification.from_pretrained(rm)
    assert type(model).__name__ == "Qwen3MoeForSequenceClassification" and model.config.num_labels == 1
    with torch.no_grad():  # each row alone, unpadded: the classifier reads its last token
        ref = torch.stack([model(ids[b:b + 1, :int(lengths[b])]).logits[0, 0] for b in range(B)])
    assert float(ref.abs().min()) > 1e-3  # a real head: not all zero
    one = run_ranks(reward_model_job, 1, (str(rm), {}))[0]
    torch.testing.assert_close(one, ref, atol=1e-5, rtol=0)
    for scores in run_ranks(reward_model_job, 2, (str(rm), {"tp": 2})):
        torch.testing.assert_close(scores, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"ep": 2}], ids=["one rank", "tp2", "ep2"])
def test_a_teacher_of_another_shape_scores_as_transformers_in_each_layout(tmp_path_factory, layout):
    """Distillation's teacher role (hidden 96, 8 experts: not the policy's shape) on one rank, TP2 and EP2
    equals transformers' log-probs of the same tokens (fp32, <= 1e-5), hence each layout the one rank."""

    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("teacher"),
                                 TinyModel(hidden_size=96, num_experts=8), seed=5)
    ids, lengths, _, _ = batch_tensors()
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    ref = hf_token_logprobs(path, ids)
    for logp in run_ranks(teacher_job, 2 if layout else 1, (str(path), layout)):
        torch.testing.assert_close(logp * valid, ref * valid, atol=1e-5, rtol=0)
