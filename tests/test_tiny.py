import json
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_rl.config import TinyModel
from moe_rl.tiny import VOCAB_SIZE, build_tiny_checkpoint


def test_tokenizer_round_trips_and_has_chat_template(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    text = "Guess a number 1-9. Lower! ünïcode ok"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(chat)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and max(ids) < VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>"


@torch.no_grad()
def logits_by_hand(path, ids_S: torch.Tensor) -> torch.Tensor:
    """The reference: Qwen3-MoE's or Mixtral's forward written out from the checkpoint's tensors and
    config.json, one token and one expert at a time, in float64. [S] ids -> [S, V] logits.

    Pre-norm residual blocks: RMSNorm; attention with per-head RMSNorm of q and k (Qwen3 only), rotary
    embeddings (rotate-half, rope_theta), causal softmax(q k^T / sqrt(head_dim)); RMSNorm; a router
    softmax over the experts, its top-k renormalised to sum 1 (Qwen3's norm_topk_prob, Mixtral always),
    each chosen expert's SwiGLU down(silu(gate x) * up x); final RMSNorm; lm_head."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
    mixtral = cfg["model_type"] == "mixtral"
    moe = "block_sparse_moe" if mixtral else "mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    hd, heads, eps, S = cfg["head_dim"], cfg["num_attention_heads"], cfg["rms_norm_eps"], len(ids_S)
    group = heads // cfg["num_key_value_heads"]

    def rms(x, g):
        return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * g

    angle = torch.arange(S, dtype=torch.float64)[:, None] * cfg["rope_parameters"]["rope_theta"] ** (
        -torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # [S, hd]

    def rope(x):  # [heads, S, hd]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][ids_S]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k, v = (t.view(S, -1, hd).transpose(0, 1) for t in (q, k, v))  # [heads, S, hd]
        if not mixtral:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        future = ~torch.ones(S, S, dtype=torch.bool).tril()
        scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(future, -math.inf)
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(S, heads * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = torch.zeros_like(x)
        for s in range(S):
            probs = (h[s] @ w[p + f"{moe}.gate.weight"].T).softmax(-1)
            top = probs.topk(cfg["num_experts_per_tok"])
            shares = top.values / top.values.sum()
            for share, e in zip(shares.tolist(), top.indices.tolist(), strict=True):
                W = {n: w[p + f"{moe}.experts.{e}.{n}.weight"] for n in (gate, up, down)}
                mlp[s] += share * (W[down] @ (torch.nn.functional.silu(W[gate] @ h[s]) * (W[up] @ h[s])))
        x = x + mlp
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_both_architectures_build_and_run(tiny_qwen, tiny_mixtral):
    # a chat-like row: a special token, text bytes, another special, and ids across the vocabulary
    ids = torch.tensor([257, 117, 115, 101, 114, 10, 104, 105, 258, 10, 0, 383, 200, 42, 7, 31])
    for path, model_type in ((tiny_qwen, "qwen3_moe"), (tiny_mixtral, "mixtral")):
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["model_type"] == model_type and cfg["head_dim"] == 32
        assert (path / "model.safetensors").is_file()
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            logits = model(ids[None]).logits[0]
        assert logits.shape == (len(ids), VOCAB_SIZE) and torch.isfinite(logits).all()
        # transformers reads the checkpoint as the architecture it names: its fp32 logits are the float64
        # forward written out by hand (observed gap < 1e-6; logits spread ~0.4)
        ref = logits_by_hand(path, ids)
        torch.testing.assert_close(logits.double(), ref, atol=1e-5, rtol=0)
        assert float(ref.std()) > 0.1  # the comparison has something to compare: not constant logits


def test_same_spec_and_seed_reuse_the_checkpoint(tmp_path):
    spec = TinyModel(num_layers=1)
    p = build_tiny_checkpoint(tmp_path, spec, seed=3)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    build_tiny_checkpoint(tmp_path, spec, seed=3)
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    build_tiny_checkpoint(tmp_path, spec, seed=4)
    assert (p / "model.safetensors").stat().st_mtime_ns != mtime


def test_deepseek_and_glm_tiny_checkpoints_have_every_routing_feature_and_load_in_transformers(tmp_path):
    """`moe-rl tiny --arch deepseek_v3|glm4_moe`: grouped sigmoid routing with a scaling factor, a shared
    expert, a dense first layer; DeepSeek's latent attention at the width vLLM's CPU kernel takes; the
    planner's count is the loaded model's."""
    from moe_rl.model_shape import ModelShape

    for arch in ("deepseek_v3", "glm4_moe"):
        path = build_tiny_checkpoint(tmp_path / arch, TinyModel(arch=arch, num_layers=2))
        hf = json.loads((path / "config.json").read_text())
        assert hf["model_type"] == arch and hf["n_group"] == 2 and hf["topk_group"] == 1
        assert hf["n_shared_experts"] == 1 and hf["first_k_dense_replace"] == 1 and hf["norm_topk_prob"]
        if arch == "deepseek_v3":
            assert (hf["kv_lora_rank"], hf["qk_rope_head_dim"], hf["q_lora_rank"]) == (512, 64, 64)
            assert (hf["topk_method"], hf["scoring_func"]) == ("noaux_tc", "sigmoid")  # what vLLM reads
        else:
            assert hf["use_qk_norm"] and hf["attention_bias"] and hf["partial_rotary_factor"] == 0.5
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
        assert torch.isfinite(logits).all() and float(logits.std()) > 0.1
        assert ModelShape.from_hf(hf).total == sum(p.numel() for p in model.parameters())
