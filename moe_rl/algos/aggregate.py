"""Loss aggregation with explicit global denominators (guide 000 section 5).

A minibatch is cut into microbatches and data-parallel shards. Each piece computes its numerator
locally (`loss_numerator`); the denominator is computed once for the whole minibatch (`loss_denominator`
on the whole minibatch, or the sum of the pieces' contributions — the function is additive over rows).
Then

    loss_piece = numerator_piece / global_denominator

and the sum of the pieces' losses (and gradients) equals the loss of the uncut minibatch, however it
was cut. Modes (J_i = valid model tokens of sample i, B+ = samples with J_i > 0, w = weights):

    token_mean     sum_{i,t} w l / sum_{i,t} m                 (self-normalised: / sum_{i,t} w m)
    seq_mean       sum_i (1/J_i) sum_t w l / B+                (self-normalised: / sum_i (1/J_i) sum_t w m)
    seq_sum_const  sum_{i,t} w l / (B+ * C)                    (Dr.GRPO; C a fixed constant)

Samples with J_i = 0 contribute nothing. A zero global denominator means there is nothing to learn
from: callers skip the update, never divide by an epsilon.
"""

from __future__ import annotations

import torch

MODES = ("token_mean", "seq_mean", "seq_sum_const")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"aggregation mode must be one of {MODES}, not {mode!r}")


def loss_numerator(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str,
                   weight_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Local numerator (0-dim, differentiable) for this piece of the batch: sum_{i,t} m w l, or
    sum_i (1/J_i) sum_t m w l for seq_mean. loss_BT, mask_BT, weight_BT: [B, T]; w is detached.

    Loss and weight values at mask-0 positions are never read (NaN or inf there is harmless, for the
    value and the gradient). Summed in float32 at least (float64 stays float64).
    """
    _check_mode(mode)
    m = mask_BT.bool()
    dtype = torch.float64 if loss_BT.dtype == torch.float64 else torch.float32
    wl = torch.where(m, loss_BT.to(dtype), 0.0)
    if weight_BT is not None:
        wl = wl * torch.where(m, weight_BT.detach().to(dtype), 0.0)
    if mode == "seq_mean":
        J = m.sum(1).to(dtype)
        return (wl.sum(1) / J.clamp(min=1)).sum()
    return wl.sum()


def loss_denominator(
    mask_BT: torch.Tensor, mode: str, constant: float | None = None, weight_BT: torch.Tensor | None = None,
    self_normalize: bool = False,
) -> torch.Tensor:
    """Local denominator contribution (0-dim float64) of this piece (see the module docstring); the
    global denominator is the sum over all pieces of the minibatch."""
    _check_mode(mode)
    mb = mask_BT.bool()
    m = mb.to(torch.float64)
    if self_normalize:
        if weight_BT is None or mode == "seq_sum_const":
            raise ValueError("self-normalised aggregation needs weights and token_mean or seq_mean")
        wm = torch.where(mb, weight_BT.detach().to(torch.float64), 0.0)
        if mode == "seq_mean":
            return (wm.sum(1) / m.sum(1).clamp(min=1)).sum()
        return wm.sum()
    if mode == "token_mean":
        return m.sum()
    n_seq = (m.sum(1) > 0).sum().to(torch.float64)
    if mode == "seq_mean":
        return n_seq
    if constant is None or constant <= 0:
        raise ValueError("seq_sum_const aggregation needs a positive constant C (e.g. the maximum response "
                         "length)")
    return n_seq * constant
