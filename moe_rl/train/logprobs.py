"""Token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary, [B, S, V/tp]. The full
vocabulary is never gathered: the max, the partition function sum_v exp(z_v - m), the target logit
and sum_v p_v z_v are reduced across the TP group (sums with megatron's reduce-from-TP region, whose
backward is the identity, so gradients stay exact on every rank).

Alignment: logp_BS[:, t] = log pi(x_t | x_<t) for t >= 1 (the logits at t-1 score token t);
position 0 has no prediction and gets 0.
"""

from __future__ import annotations

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
