"""Tiny-model kit: random Hugging Face MoE checkpoints and a byte-level tokenizer, built locally.

Used by every test and by the quickstart (no model hub is reachable here). The checkpoint is a normal
HF directory — config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat
template — so transformers, vLLM (CPU or GPU) and mbridge all load it like any other model.

    path = build_tiny_checkpoint("runs/tiny", TinyModel(arch="qwen3_moe"), seed=0)

The tokenizer is byte-level BPE without merges: every UTF-8 byte is one token, so any text round-trips
exactly, plus the ChatML special tokens. Model vocabulary: 384 (bytes + specials, padded to a multiple
of 128 so Megatron's padded vocabulary equals Hugging Face's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_rl.config import TinyModel
from moe_rl.config.run import VOCAB_SIZE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str | Path):
    """Write a byte-level tokenizer with a ChatML chat template to out_dir; return the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    assert len(vocab) == 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        unk_token=None, model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    return hf


def hf_config(spec: TinyModel, eos_token_id: int, pad_token_id: int):
    """A transformers config for `spec` (Qwen3-MoE, Mixtral or Qwen2-MoE), fp32, untied embeddings."""
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6,
        num_experts_per_tok=spec.top_k, tie_word_embeddings=False, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, bos_token_id=None, torch_dtype="float32", initializer_range=0.05,
    )
    if spec.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, num_experts=spec.num_experts, moe_intermediate_size=spec.moe_intermediate_size,
            intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1, norm_topk_prob=True,
            mlp_only_layers=list(range(spec.first_dense_layers)), output_router_logits=False,
        )
    if spec.arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**common, num_local_experts=spec.num_experts,
                             intermediate_size=spec.moe_intermediate_size)
    if spec.arch == "qwen2_moe":  # routed experts plus one sigmoid-gated shared expert; q/k/v biases
        from transformers import Qwen2MoeConfig

        common.pop("head_dim")  # hidden_size / num_attention_heads
        return Qwen2MoeConfig(
            **common, num_experts=spec.num_experts, moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.moe_intermediate_size,
            intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1, norm_topk_prob=False,
            mlp_only_layers=list(range(spec.first_dense_layers)), output_router_logits=False,
            use_sliding_window=False,
        )
    if spec.arch in DEEPSEEK_STYLE:
        return deepseek_style_config(spec, common)
    raise ValueError(f"unknown tiny architecture {spec.arch!r}; choose qwen3_moe, mixtral, qwen2_moe, "
                     f"{' or '.join(DEEPSEEK_STYLE)}")


DEEPSEEK_STYLE = ("deepseek_v3", "glm4_moe")
# vLLM's CPU MLA decode kernel takes DeepSeek's latent width only (kv_lora_rank 512, RoPE key 64)
MLA_KV_RANK, MLA_ROPE_DIM = 512, 64


def deepseek_style_config(spec: TinyModel, common: dict):
    """DeepSeek-V3 or GLM-4.5 with every routing feature on: sigmoid scores with an expert bias, experts in
    two groups of which one is chosen per token, normalised top-k weights times a scaling factor, a shared
    expert, the first layer dense (at least one); DeepSeek with multi-latent attention (a compressed query,
    the latent width vLLM's CPU kernel takes), GLM with q/k norms, attention biases and half-rotary heads."""
    from transformers import AutoConfig

    ffn = spec.moe_intermediate_size
    routing = dict(n_routed_experts=spec.num_experts, n_shared_experts=1, n_group=2, topk_group=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True, moe_intermediate_size=ffn,
                   intermediate_size=2 * ffn, first_k_dense_replace=max(1, spec.first_dense_layers),
                   num_nextn_predict_layers=0)
    if spec.arch == "deepseek_v3":
        common = {k: v for k, v in common.items() if k != "head_dim"}
        return AutoConfig.for_model("deepseek_v3", **common, **routing, q_lora_rank=spec.hidden_size,
                                    kv_lora_rank=MLA_KV_RANK, qk_rope_head_dim=MLA_ROPE_DIM,
                                    qk_nope_head_dim=spec.head_dim, v_head_dim=spec.head_dim,
                                    # DeepSeek-V3's published fields, which vLLM reads (transformers has
                                    # no default for them): without noaux_tc it makes no expert bias
                                    topk_method="noaux_tc", scoring_func="sigmoid")
    return AutoConfig.for_model("glm4_moe", **common, **routing, partial_rotary_factor=0.5,
                                attention_bias=True, use_qk_norm=True)


@torch.no_grad()
def draw_expert_bias(model) -> None:
    """An expert bias of 0.2 x N(0, 1) (torch's global generator) for every router of `model` that has one:
    a trained router's bias moves its choices, and transformers starts it at 0."""
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            bias.copy_(0.2 * torch.randn(bias.shape))


def build_tiny_checkpoint(out_dir: str | Path, spec: TinyModel | None = None, seed: int = 0,
                          overwrite: bool = False, reward_model: bool = False) -> Path:
    """Build (or reuse) a random HF checkpoint for `spec` in out_dir and return its path: a causal LM,
    or with `reward_model` a one-label *ForSequenceClassification model (its head: `score.weight`).

    Reuse happens when out_dir already holds a checkpoint built from the same spec and seed.
    `spec` defaults to `TinyModel()`.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    spec = spec or TinyModel()
    out = Path(out_dir)
    stamp = {"spec": spec.__dict__, "seed": seed, "vocab": VOCAB_SIZE,
             **({"reward_model": True} if reward_model else {})}
    stamp_file = out / "moe_rl_tiny.json"
    if not overwrite and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # another model's shards
    for stale in (*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")):
        stale.unlink()
    tok = build_tokenizer(out)
    cfg = hf_config(spec, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    if reward_model:
        cfg.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
    draw_expert_bias(model)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp_file.write_text(json.dumps(stamp, sort_keys=True))
    return out
