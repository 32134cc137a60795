"""Packed (THD) attention: the batched call (sequences padded to the longest, one causal SDPA) equals
attention computed sequence by sequence, outputs and gradients; lengths far apart take the
per-sequence path."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_rl.train.attention import SdpaAttention


def attention():
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0)
    return SdpaAttention(cfg, 1, AttnMaskType.causal, "self")


def reference(q, k, v, lengths, scale):
    """Sequence by sequence, causal, kv heads repeated: [t, h, d] -> [t, h * d]."""
    outs, a = [], 0
    for n in lengths:
        qs, ks, vs = (x[a:a + n].transpose(0, 1) for x in (q, k, v))  # [h, n, d]
        ks, vs = (x.repeat_interleave(qs.shape[0] // x.shape[0], dim=0) for x in (ks, vs))
        w = (qs @ ks.transpose(1, 2)) * scale + torch.full((n, n), float("-inf")).triu(1)
        outs.append((w.softmax(-1) @ vs).transpose(0, 1).reshape(n, -1))
        a += n
    return torch.cat(outs)


# batched; per sequence (padding > 2x); one
@pytest.mark.parametrize("lengths", [[5, 7, 6, 7], [1, 1, 12], [9]])
def test_packed_attention_equals_sequence_by_sequence(lengths, monkeypatch):
    attn = attention()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    out = attn(q, k, v, None, packed_seq_params=params)
    assert len(calls) == (1 if lengths == [5, 7, 6, 7] else len(lengths))
    want = reference(q, k, v, lengths, attn.scale)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_widths_take_the_fused_kernel(dtype):
    """Multi-latent attention: query and key heads (nope + rope) wider than the value heads. The values are
    padded to the query width for SDPA's fused kernel: the same outputs and gradients as the reference, and
    nothing quadratic in the length kept for backward (the unfused path keeps the probabilities
    [rows, heads, S, S])."""
    attn = attention()
    lengths, longest = [100, 90], 100
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, 4, d, generator=g).to(dtype).requires_grad_() for d in (12, 12, 4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    shapes = []

    def keep(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 4 * 4)
    assert shapes and not [s for s in shapes if s.count(longest) > 1], shapes
    want = reference(*(x.double() for x in (q, k, v)), lengths, attn.scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got.double(), ref.double(), rtol=tol * 10, atol=tol * 10)
