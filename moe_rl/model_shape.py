"""A Mixture-of-Experts model's shape, read from its Hugging Face config.json alone (no weights, no torch):
what the planner's sizes depend on (moe_rl/plan.py). Parameter counts follow the architectures as
transformers builds them, exactly (tests/test_plan.py counts transformers' own models):

- Qwen3-MoE, Qwen2-MoE (a sigmoid-gated shared expert, q/k/v biases), Mixtral, with Qwen-style dense
  layers (`mlp_only_layers`, `decoder_sparse_step`);
- the DeepSeek-V3 family (DeepSeek-V3 / R1, Kimi-K2, Moonlight: `deepseek_v3`): multi-latent attention
  (q compressed to q_lora_rank where given, keys and values to kv_lora_rank, with a decoupled RoPE part of
  qk_rope_head_dim per head), `n_shared_experts` ungated shared experts of moe_intermediate_size each,
  `first_k_dense_replace` dense first layers;
- GLM-4.5 (`glm4_moe`): grouped-query attention with biases (attention_bias) and optional q/k norms
  (use_qk_norm), its shared experts and dense first layers as DeepSeek's.

The routers' expert bias (e_score_correction_bias) is a buffer, not a parameter: it is not counted. The
multi-token-prediction layers a DeepSeek-V3 or GLM-4.5 checkpoint carries (num_nextn_predict_layers) are
not part of the model transformers, vLLM or the trainer build: `mtp_layers` counts them apart (`mtp`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def routed_experts(c: dict) -> int | None:
    """A config.json's routed experts a layer, by each architecture's name for them (None: not MoE)."""
    return c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """What sizes depend on, read from a Hugging Face config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # a query / key head's width (MLA: qk_nope_head_dim + qk_rope_head_dim)
    vocab: int
    experts: int
    top_k: int
    moe_ffn: int  # one routed expert's intermediate size
    dense_ffn: int  # a dense layer's intermediate size
    shared_ffn: int  # the shared experts' intermediate size, all of them together (0: none)
    dense_layers: int  # layers with a dense MLP instead of experts
    tied: bool  # embedding and output projection share one matrix
    qk_norm: bool
    qkv_bias: bool
    shared_gate: bool = False  # the shared expert's output scaled by a sigmoid gate [1, h] (Qwen2-MoE)
    q_lora_rank: int = 0  # multi-latent attention: the queries' compressed width (0: a full q projection)
    kv_lora_rank: int = 0  # multi-latent attention: the keys' and values' compressed width (0: not MLA)
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE part of each query / key head (and the shared key)
    v_head_dim: int = 0  # MLA: a value head's width
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (not built for RL)
    kind: str = ""  # the config's model_type

    @staticmethod
    def from_hf(c: dict) -> ModelShape:
        from types import SimpleNamespace

        from moe_rl.weights.hf import dense_layers

        experts = routed_experts(c)
        if not experts:
            raise ValueError("the model config names no experts (num_experts / num_local_experts / "
                             "n_routed_experts): not an MoE model")
        heads, kind = c["num_attention_heads"], c.get("model_type")
        moe_ffn = c.get("moe_intermediate_size") or c["intermediate_size"]
        mla = bool(c.get("kv_lora_rank"))
        if "first_k_dense_replace" in c:  # DeepSeek-V3, GLM-4.5: the first k layers are dense
            dense = min(c["first_k_dense_replace"], c["num_hidden_layers"])
        else:
            dense = len(dense_layers(SimpleNamespace(**c)))
        return ModelShape(
            hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
            kv_heads=heads if mla else c.get("num_key_value_heads") or heads,
            head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"] if mla
            else c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"], experts=experts, top_k=c["num_experts_per_tok"], moe_ffn=moe_ffn,
            dense_ffn=c.get("intermediate_size", 0),
            shared_ffn=c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * moe_ffn,
            dense_layers=dense, tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=kind == "qwen3_moe" or bool(c.get("use_qk_norm")),
            qkv_bias=kind == "qwen2_moe" or bool(c.get("attention_bias")),
            shared_gate=kind == "qwen2_moe",
            q_lora_rank=(c.get("q_lora_rank") or 0) if mla else 0, kv_lora_rank=c.get("kv_lora_rank") or 0,
            qk_rope_head_dim=c.get("qk_rope_head_dim", 0) if mla else 0,
            v_head_dim=c.get("v_head_dim", 0) if mla else 0,
            mtp_layers=c.get("num_nextn_predict_layers") or 0, kind=kind or "")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def attention(self) -> int:
        """Parameters of one attention block with its input norm."""
        h = self.hidden
        if self.mla:
            return self._latent_attention() + h
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        p = h * (q + 2 * kv) + q * h + h
        return p + (2 * self.head_dim if self.qk_norm else 0) + (q + 2 * kv if self.qkv_bias else 0)

    def _latent_attention(self) -> int:
        """Multi-latent attention's projections and norms (qkv_bias: attention_bias, on the compressing
        projections and the output)."""
        h, n, d, r = self.hidden, self.heads, self.head_dim, self.qk_rope_head_dim
        bias = self.qkv_bias
        if self.q_lora_rank:
            q = h * self.q_lora_rank + bias * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * d
        else:
            q = h * n * d
        kv_a = self.kv_lora_rank + r
        kv = h * kv_a + bias * kv_a + self.kv_lora_rank + self.kv_lora_rank * n * (d - r + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h + bias * h

    @property
    def expert(self) -> int:
        """One routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_ffn

    @property
    def moe_shared(self) -> int:
        """An MoE layer's parameters that every token uses: norm, router, shared experts (and their gate)."""
        shared = 3 * self.hidden * self.shared_ffn + self.hidden * self.shared_gate if self.shared_ffn else 0
        return self.hidden + self.hidden * self.experts + shared

    @property
    def dense_mlp(self) -> int:
        return self.hidden + 3 * self.hidden * self.dense_ffn

    @property
    def embeddings(self) -> int:
        """Input embedding, final norm and output projection."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def non_expert(self) -> int:
        return (self.layers * self.attention + self.moe_layers * self.moe_shared
                + self.dense_layers * self.dense_mlp
                + self.embeddings)

    @property
    def total(self) -> int:
        return self.non_expert + self.moe_layers * self.experts * self.expert

    @property
    def active(self) -> int:
        """Parameters one token passes through (top_k experts per MoE layer)."""
        return self.non_expert + self.moe_layers * self.top_k * self.expert

    @property
    def mtp(self) -> int:
        """The checkpoint's multi-token-prediction layers (DeepSeek-V3's layout: each an MoE decoder layer,
        a [h, 2h] projection of the embedding and the hidden state together with a norm for each, and its
        own copies of the embedding and of the output head with its norm)."""
        h = self.hidden
        return self.mtp_layers * (self.attention + self.moe_shared + self.experts * self.expert
                                  + 2 * h * h + 3 * h + 2 * self.vocab * h)

    def activation_bytes(self, recompute: bool, b: int = 2, local: bool = False) -> float:
        """Bytes a layer keeps per token for backward (averaged over MoE and dense layers), `b` bytes an
        element of the model's dtype; with `recompute`, the layer's input only (its activations exist
        again one layer at a time, in the backward). `local`: megatron-core's local layer spec as the
        trainer builds it (moe_rl's norms and attention; tests/train/test_plan_memory.py measures these
        terms exactly for packed microbatches); else Transformer Engine's fused kernels (an estimate:
        not measured here)."""
        h, nq, nkv, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        if recompute:
            return b * h
        if not local:
            attention = b * (2 * h + (nq + 2 * nkv) * d + nq * d)
            moe = b * (h + self.top_k * (2 * h + 3 * self.moe_ffn)) + 4 * self.experts
            dense = b * (2 * h + 3 * self.dense_ffn)
        else:
            attention = self._local_latent_attention(b) if self.mla else self._local_attention(b)
            moe, dense = self._local_moe(b), self._local_norm(b)
            dense += 6 * b * self.dense_ffn
        return attention + (self.moe_layers * moe + self.dense_layers * dense) / self.layers

    def final_norm_bytes(self, b: int = 2, local: bool = False) -> float:
        """The last layer norm's bytes kept for backward, per token."""
        return 8 * self.hidden + 4 if local else b * self.hidden + 4

    def _local_norm(self, b: int, width: int | None = None) -> int:
        """moe_rl's RMSNorm (train/local_norm.py) over `width` (default: the hidden size) computes in
        float32: its input and the normalised rows in float32, the reciprocal RMS, and the output in the
        model's dtype (the next linear's input)."""
        width = self.hidden if width is None else width
        return 8 * width + 4 + b * width

    def _local_attention(self, b: int) -> int:
        """Input norm; the q/k/v projection's output; q/k norms (float32 in and out, each head's RMS; an
        upcast copy of their input below float32); RoPE's cos and sin for q and k; q and k rotated; the
        packed sequences gathered into padded rows (train/attention.py; q and keys and values repeated
        to the query heads) with the softmax's log-sum-exp and the output, and the output back in
        packed order. (Rows of similar length: padding adds its share on top.)"""
        nq, nkv, d = self.heads, self.kv_heads, self.head_dim
        qk = (nq + nkv) * (8 * d + 4 if b != 4 else 4 * d + 4) if self.qk_norm else 0
        return (self._local_norm(b) + b * (nq + 2 * nkv) * d + qk + 4 * b * d + b * (nq + nkv) * d + 8
                + 3 * b * nq * d + 4 * nq + 2 * b * nq * d)

    def _local_latent_attention(self, b: int) -> int:
        """Multi-latent attention on the local spec: the input norm; the query latent's norm (float32, as the
        input norm) and its output; the key-value latent's norm (float32: in float32 its input is a view of
        the down projection's output, RoPE key included) and its output; RoPE's cos and sin for q and k;
        q and k (nope and rope parts joined) and v; the padded rows of q, k and v (v padded to the query
        width for the fused kernel, train/attention.py) with the output and its log-sum-exp; the output
        in packed order."""
        n, d, r, dv, qr, kr = (self.heads, self.head_dim, self.qk_rope_head_dim, self.v_head_dim,
                               self.q_lora_rank, self.kv_lora_rank)
        q_latent = self._local_norm(b, qr) if qr else 0
        kv_latent = self._local_norm(b, kr) + (4 * r if b == 4 else 0)
        return (self._local_norm(b) + q_latent + kv_latent + 4 * b * r + 8 + b * n * (2 * d + dv)
                + 4 * b * n * d + 4 * n + b * n * dv)

    def _local_moe(self, b: int) -> int:
        """Pre-MLP norm; the router's top-k indices (int64) and probabilities, routing map (bool) and
        scores (float32), the permutation's indices; per routed token the permuted input, the first
        projection's output, SwiGLU's four halves and its probability; a shared expert as a dense MLP."""
        k, f = self.top_k, self.moe_ffn
        shared = 6 * b * self.shared_ffn if self.shared_ffn else 0
        routed = k * (b * self.hidden + 6 * b * f + 4)
        return self._local_norm(b) + 20 * k + 5 * self.experts + routed + shared

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """The KV cache of one token on one of `tp` tensor-parallel ranks: keys and values (KV heads split,
        or replicated when fewer than tp); under multi-latent attention the compressed latent and the
        shared RoPE key, whole on every rank (vLLM's MLA cache)."""
        if self.mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.layers * math.ceil(self.kv_heads / tp) * self.head_dim * dtype_bytes


GROUPED_GEMM_ALIGN_BYTES = 16  # torch._grouped_mm's row-stride alignment (the grouped experts' kernel)


def grouped_gemm_misfits(element_bytes: int, widths: dict[str, int]) -> list[str]:
    """The widths (name -> elements) whose rows are not a multiple of GROUPED_GEMM_ALIGN_BYTES at
    `element_bytes` an element: what keeps torch._grouped_mm from the grouped experts (train/experts.py)."""
    return [f"{name} {n}" for name, n in widths.items() if n * element_bytes % GROUPED_GEMM_ALIGN_BYTES]


def grouped_expert_widths(hidden: int, expert_width: int, etp: int, lora_rank: int,
                          lora_targets) -> dict[str, int]:
    """The widths one rank's grouped expert GEMMs see: the hidden size, the expert width on this expert-TP
    rank, and the LoRA rank where adapters go on the experts' linears (model.lora: rank, targets)."""
    widths = {"hidden size": hidden, "expert width per expert-TP rank": expert_width // etp}
    if lora_rank and {"linear_fc1", "linear_fc2"} & set(lora_targets):
        widths["expert LoRA rank"] = lora_rank
    return widths
