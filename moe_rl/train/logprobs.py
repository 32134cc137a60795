"""Token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary, [B, S, V/tp]. The full
vocabulary is never gathered: the max, the partition function sum_v exp(z_v - m), the target logit
and sum_v p_v z_v are reduced across the TP group (sums with megatron's reduce-from-TP region, whose
backward is the identity, so gradients stay exact on every rank).

Alignment: logp_BS[:, t] = log pi(x_t | x_<t) for t >= 1 (the logits at t-1 score token t);
position 0 has no prediction and gets 0.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(
    logits_BSV: torch.Tensor, tokens_BS: torch.Tensor, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(x_t | x_<t) and H(pi(. | x_<t)) for every position, [B, S] each (position 0 -> 0).

    logits_BSV: [B, S, V/tp] this rank's vocabulary slice (rank r holds ids [r*V/tp, (r+1)*V/tp)).
    tokens_BS:  [B, S] token ids (global vocabulary).
    """
    logp, ent = target_logprobs(logits_BSV[:, :-1], tokens_BS[:, 1:], tp_group, tp_rank, tp_size,
                                with_entropy)
    pad = torch.zeros(logp.shape[0], 1, dtype=logp.dtype, device=logp.device)
    return torch.cat([pad, logp], 1), (torch.cat([pad, ent], 1) if ent is not None else None)


def target_logprobs(
    logits_BSV: torch.Tensor, targets_BS: torch.Tensor, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z_t)[y_t] and the entropy of softmax(z_t) at every position t, [B, S] each, without
    a shift: logits at t score targets at t (callers align them, e.g. y_t = x_{t+1})."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def all_sum(x):
        return reduce_from_tensor_model_parallel_region(x) if tp_size > 1 else x

    Vp = logits_BSV.shape[-1]
    z = logits_BSV.float()
    m = z.detach().amax(-1)
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z = z - m.unsqueeze(-1)
    e = z.exp()
    s = all_sum(e.sum(-1))
    start = tp_rank * Vp
    local = targets_BS - start
    inside = (local >= 0) & (local < Vp)
    z_t = z.gather(-1, local.clamp(0, Vp - 1).unsqueeze(-1)).squeeze(-1) * inside
    z_t = all_sum(z_t)
    log_s = s.log()
    logp = z_t - log_s
    ent = None
    if with_entropy:
        pz = all_sum((e * z).sum(-1)) / s
        ent = log_s - pz
    return logp, ent


def chunked_target_logprobs(
    hidden_TH: torch.Tensor, weight_VH: torch.Tensor, targets_T: torch.Tensor, chunk_tokens: int,
    tp_group=None, tp_rank: int = 0, tp_size: int = 1, with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """target_logprobs of the logits z = hidden @ weight^T without holding them: [T] each, in float32.

    hidden_TH:  [T, H] the last hidden states (after the final norm), as the output layer would multiply
                them (gathered over sequence parallelism); its gradient is this rank's part, which the TP
                region op before it reduces, as the output layer's own backward does.
    weight_VH:  [V/tp, H] this rank's vocabulary slice of the output layer (rank r: ids [r V/tp, (r+1) V/tp)).
    targets_T:  [T] token ids (global vocabulary).

    The logits exist `chunk_tokens` rows at a time, in the forward and again in the backward (recomputed
    from hidden and weight): at most a few [chunk_tokens, V/tp] float32 tensors at once, where the whole
    path keeps three [T, V/tp] ones for backward. Values and gradients are those of target_logprobs on
    hidden @ weight^T (the same products, in the same dtype, then float32)."""
    return _ChunkedLogprobs.apply(hidden_TH, weight_VH, targets_T, chunk_tokens, tp_group, tp_rank, tp_size,
                                  with_entropy)


def _logits(hidden_CH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """hidden @ weight^T in float32, [C, V/tp] row-major, as (weight @ hidden^T)^T: the product of the
    same terms (so the same values), without the CPU kernels' copy of the whole weight into the layout they
    want for a transposed right operand. The result is made row-major as it becomes float32 (one copy, the
    upcast's own where the model is bf16), so each row's max and sums run over contiguous memory, in an order
    that does not depend on how many rows the chunk has: a row scores the same in any batch, as it does
    through the output layer's own logits."""
    z = torch.mm(weight_VH, hidden_CH.t()).t()
    return torch.empty(z.shape, dtype=torch.float32, device=z.device).copy_(z)


def _all(x: torch.Tensor, op, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _ChunkedLogprobs(torch.autograd.Function):
    """Per chunk of rows c, with z_c = h_c W^T in float32, m its max, e = exp(z - m), s = sum e (each reduced
    over the TP group): log p(y) = (z_y - m) - log s, H = log s - sum e (z - m) / s. Backward, from z
    recomputed: dlogp/dz = onehot(y) - p, dH/dz = -p (z - E_p[z]), then dh = dz W and dW = dz^T h."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, targets_T, chunk, group, rank, size, with_entropy):
        T, Vp = hidden_TH.shape[0], weight_VH.shape[0]
        logp = torch.empty(T, dtype=torch.float32, device=hidden_TH.device)
        log_s, shift = torch.empty_like(logp), torch.empty_like(logp)
        mean_z = torch.empty_like(logp) if with_entropy else None  # E_p[z - m]
        local = targets_T - rank * Vp
        inside = (local >= 0) & (local < Vp)
        for a in range(0, T, chunk):  # two [chunk, V/tp] float32 tensors at once (z, e), in place after
            rows = slice(a, min(a + chunk, T))
            z = _logits(hidden_TH[rows], weight_VH)
            m = _all(z.amax(-1), dist.ReduceOp.MAX, group, size)
            z -= m.unsqueeze(-1)
            z_t = z.gather(-1, local[rows].clamp(0, Vp - 1).unsqueeze(-1)).squeeze(-1) * inside[rows]
            e = z.exp()
            sums = [e.sum(-1), z_t] + ([e.mul_(z).sum(-1)] if with_entropy else [])
            del z, e
            sums = _all(torch.stack(sums), dist.ReduceOp.SUM, group, size)
            shift[rows], log_s[rows] = m, sums[0].log()
            logp[rows] = sums[1] - log_s[rows]
            if with_entropy:
                mean_z[rows] = sums[2] / sums[0]
        ctx.save_for_backward(hidden_TH, weight_VH, targets_T, shift, log_s, mean_z)
        ctx.chunk, ctx.group, ctx.rank, ctx.size = chunk, group, rank, size
        return logp, (log_s - mean_z if with_entropy else None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden_TH, weight_VH, targets_T, shift, log_s, mean_z = ctx.saved_tensors
        T, Vp = hidden_TH.shape[0], weight_VH.shape[0]
        d_hidden = torch.zeros_like(hidden_TH) if ctx.needs_input_grad[0] else None
        # the weight's gradient sums every chunk's: float32 weights in float64; bf16 / fp16 ones in their own
        # dtype, each chunk's product accumulated in float32 and rounded once as it is added (addmm), as
        # megatron adds each microbatch's gradient to its main_grad: no buffer wider than the weight itself
        wide = torch.float64 if weight_VH.dtype == torch.float32 else weight_VH.dtype
        d_weight = torch.zeros_like(weight_VH, dtype=wide) if ctx.needs_input_grad[1] else None
        local = targets_T - ctx.rank * Vp
        inside = (local >= 0) & (local < Vp)
        for a in range(0, T, ctx.chunk):  # three [chunk, V/tp] float32 tensors at once (z, p, dz)
            rows = slice(a, min(a + ctx.chunk, T))
            z = _logits(hidden_TH[rows], weight_VH)
            z -= shift[rows].unsqueeze(-1)
            p = (z - log_s[rows].unsqueeze(-1)).exp_()
            dz = torch.zeros_like(z)
            if g_logp is not None:
                dz.addcmul_(p, g_logp[rows].unsqueeze(-1), value=-1)
                hit = inside[rows].nonzero().squeeze(-1)
                dz[hit, local[rows][hit]] += g_logp[rows][hit]
            if g_ent is not None and mean_z is not None:
                z -= mean_z[rows].unsqueeze(-1)
                dz.addcmul_(z.mul_(p), g_ent[rows].unsqueeze(-1), value=-1)
            del z, p
            dz = dz.to(weight_VH.dtype)  # as the logits' own backward: the model's dtype
            if d_hidden is not None:
                d_hidden[rows] = dz @ weight_VH
            if d_weight is not None and wide == torch.float64:
                d_weight += dz.t() @ hidden_TH[rows]
            elif d_weight is not None:
                d_weight.addmm_(dz.t(), hidden_TH[rows])
        if d_weight is not None:
            d_weight = d_weight.to(weight_VH.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None


# -- the hidden states a model's last stage gives the chunked path (megatron's GPTModel) --------------


@contextlib.contextmanager
def hidden_out(gpt, on: bool = True):
    """Within it (where `on`), megatron's GPTModel `gpt` returns its last hidden states [s, b, h] (after the
    final norm, sequence-parallel where its layers are) instead of the output layer's logits: the decoder
    applies the final norm, and the model stops before its output layer where post_process is off."""
    if not on:
        yield
        return
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def output_weight(gpt) -> torch.Tensor:
    """`gpt`'s vocabulary slice of its output layer [V/tp, h], as the layer's forward uses it: the
    embeddings where tied to them, plus its LoRA adapter (scale B A, train/lora.py) where it has one on."""
    layer = gpt.output_layer
    tied = gpt.share_embeddings_and_output_weights
    w = gpt.shared_embedding_or_output_weight() if tied else layer.weight
    if getattr(layer, "lora_indices", None) and not layer.lora_off:
        w = w + layer.lora_scale * (layer.lora_B @ layer.lora_A)
    return w


def last_hidden(hidden_SBH: torch.Tensor, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """The hidden states [s, b, h] as the output layer takes them, then [b, s, h]: gathered over sequence
    parallelism (backward: reduce-scatter) or entered into the TP region (backward: all-reduce), so that
    each rank's partial gradient from its vocabulary slice is summed as the layer's own backward does."""
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=True,
                                                          group=tp_group) if sequence_parallel \
            else copy_to_tensor_model_parallel_region(hidden_SBH, group=tp_group)
    return hidden_SBH.transpose(0, 1)
