"""Core attention for the local (non-Transformer-Engine) layer spec, on torch's fused SDPA kernel.

megatron-core's local `DotProductAttention` materialises the [b*h, s, s] score matrix and runs an
unfused masked softmax; on CPU that is the single largest cost of a step at sequence lengths of a few
hundred. This module computes the same attention (causal, 1/sqrt(head_dim) scaling, grouped-query
heads) with `torch.nn.functional.scaled_dot_product_attention`, and plugs into the spec where
DotProductAttention sits (same constructor and forward signature, tensors [s, b, heads, head_dim]).
Packed sequences (THD, `PackedSeqParams`): tensors [t, heads, head_dim], attention within each
sequence of cu_seqlens. Context parallelism: keys and values gathered from the CP ranks, causal mask
on global positions (moe_rl.train.context).
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SdpaAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        self.cp = config.context_parallel_size
        if self.cp > 1 and attn_mask_type != AttnMaskType.causal:
            raise ValueError("SdpaAttention's context parallelism is causal only")
        self.causal = attn_mask_type == AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SdpaAttention: attention bias needs the Transformer Engine spec")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp > 1:
            return self._context_parallel(query, key, value)
        sq, b, heads, hn = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        mask = None if attention_mask is None else ~attention_mask.bool()  # megatron: True = masked out
        causal = self.causal and mask is None
        if self.causal and mask is not None:
            mask = mask & torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
        return self._sdpa(q, k, v, mask, causal).permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """q [b, h, s, d], k [b, h_kv, S, d], v [b, h_kv, S, d_v] (grouped-query heads repeated to h) ->
        [b, h, s, d_v].

        Values narrower than the queries (multi-latent attention: d = nope + rope, d_v = nope) are padded
        with zeros to d: torch's fused kernels take one head width, and with two widths SDPA falls back to
        its unfused path, which keeps the probabilities [b, h, s, S] for backward (quadratic in the
        length). The padded columns come out zero and are dropped."""
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        width = v.shape[-1]
        if width < q.shape[-1]:
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - width))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
            scale=self.scale)
        return out[..., :width]

    def _context_parallel(self, query, key, value):
        """This CP rank's queries (its two chunks, moe_rl.train.context) against every rank's keys and
        values, gathered; the causal mask compares global positions."""
        from megatron.core import parallel_state as ps

        from moe_rl.train.context import gather_sequence, local_positions

        group = ps.get_context_parallel_group()
        key, value = gather_sequence(key, 0, group), gather_sequence(value, 0, group)
        sq, b, heads, hn = query.shape
        S = key.shape[0]
        q_pos = local_positions(S, self.cp, ps.get_context_parallel_rank(), query.device)
        allowed = torch.arange(S, device=query.device).unsqueeze(0) <= q_pos.unsqueeze(1)  # [sq, S]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        return self._sdpa(q, k, v, allowed, False).permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])

    def _packed(self, query, key, value, params):
        """THD: query/key/value [t, heads, head_dim], sequences at params.cu_seqlens_q; each attends
        causally within itself only. Returns [t, heads * head_dim].

        Sequences of similar length run as one batched call: scattered into rows of the longest
        length, padding at each row's end (a causal query never reaches the keys after it, so the
        padding needs no mask); where that would more than double the attention's work (lengths far
        apart), one call per sequence."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SdpaAttention: packed format {params.qkv_format!r}; only 'thd'")
        t, heads, hn = query.shape
        bounds = params.cu_seqlens_q.tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        longest = max(lengths, default=0)
        if self.causal and len(lengths) > 1 and len(lengths) * longest**2 <= 2 * sum(n * n for n in lengths):
            return self._padded(query, key, value, lengths, longest).reshape(t, heads * value.shape[-1])
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, h, n, d]
            outs.append(self._sdpa(q, k, v, None, self.causal)[0].transpose(0, 1))  # [n, h, d]
        return torch.cat(outs).reshape(t, heads * value.shape[-1])

    def _padded(self, query, key, value, lengths: list[int], longest: int) -> torch.Tensor:
        """The packed sequences (lengths, summing to t) as [n, longest] rows through one causal call;
        [t, heads, head_dim] back in packed order."""
        n, t = len(lengths), query.shape[0]
        counts = torch.tensor(lengths, device=query.device)
        starts = torch.cumsum(counts, 0) - counts
        row = torch.repeat_interleave(torch.arange(n, device=query.device), counts)
        slot = row * longest + torch.arange(t, device=query.device) - starts[row]  # token -> row-major slot

        def rows(x):  # [t, h, d] -> [n, h, longest, d]
            out = x.new_zeros(n * longest, *x.shape[1:]).index_copy(0, slot, x)
            return out.view(n, longest, *x.shape[1:]).transpose(1, 2)

        out = self._sdpa(rows(query), rows(key), rows(value), None, True)  # [n, h, longest, d]
        return out.transpose(1, 2).reshape(n * longest, query.shape[1], value.shape[-1])[slot]
