"""Loss aggregation with explicit global denominators (guide 000 section 5).

A minibatch is cut into microbatches and data-parallel shards. Each piece computes its numerator
locally; the denominator is computed once for the whole minibatch (summed over pieces and
all-reduced over the data-parallel group). Then

    loss_piece = numerator_piece / global_denominator

and the sum of the pieces' losses (and gradients) equals the loss of the uncut minibatch, however it
was cut. Modes (J_i = valid model tokens of sample i, B+ = samples with J_i > 0, w = weights):

    token_mean     sum_{i,t} w l / sum_{i,t} m                 (self-normalised: / sum_{i,t} w m)
    seq_mean       sum_i (1/J_i) sum_t w l / B+                (self-normalised: / sum_i (1/J_i) sum_t w m)
    seq_sum_const  sum_{i,t} w l / (B+ * C)                    (Dr.GRPO; C a fixed constant)


Samples with J_i = 0 contribute nothing. A zero global denominator means there is nothing to learn
from: callers skip the update (`EmptyBatch`), never divide by an epsilon.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MODES = ("token_mean", "seq_mean", "seq_sum_const")


class EmptyBatch(Exception):
    """The (global) batch has no valid model tokens or no retained weight: skip this update."""


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"aggregation mode must be one of {MODES}, not {mode!r}")


def loss_numerator(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, weight_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Local numerator (0-dim, differentiable) for this piece of the batch."""
    _check_mode(mode)
    m = mask_BT.to(loss_BT.dtype)
    wl = loss_BT * m if weight_BT is None else loss_BT * weight_BT.detach().to(loss_BT.dtype) * m
    if mode == "seq_mean":
        J = m.sum(1)
        return (wl.sum(1) / J.clamp(min=1)).sum()
    return wl.sum()


def loss_denominator(
    mask_BT: torch.Tensor, mode: str, constant: float | None = None, weight_BT: torch.Tensor | None = None,
    self_normalize: bool = False,
) -> torch.Tensor:
    """Local denominator contribution (0-dim float64) of this piece; sum pieces, then all-reduce."""
    _check_mode(mode)
    m = mask_BT.to(torch.float64)
    if self_normalize:
        if weight_BT is None or mode == "seq_sum_const":
            raise ValueError("self-normalised aggregation needs weights and token_mean or seq_mean")
        wm = weight_BT.detach().to(torch.float64) * m
        if mode == "seq_mean":
            return (wm.sum(1) / m.sum(1).clamp(min=1)).sum()
        return wm.sum()
    if mode == "token_mean":
        return m.sum()
    n_seq = (m.sum(1) > 0).sum().to(torch.float64)
    if mode == "seq_mean":
        return n_seq
    if constant is None or constant <= 0:
        raise ValueError("seq_sum_const aggregation needs a positive constant C (e.g. the maximum response length)")
    return n_seq * constant


def global_denominator(local_denominators: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum the pieces' denominators and all-reduce over `group` (the data-parallel group)."""
    total = torch.stack([d.to(torch.float64).reshape(()) for d in local_denominators]).sum()
    if group is not None:
        dist.all_reduce(total, group=group)
    return total


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, constant: float | None = None,
    weight_BT: torch.Tensor | None = None, self_normalize: bool = False,
    denominator: torch.Tensor | None = None,
) -> torch.Tensor:
    """numerator / denominator; `denominator` defaults to this batch's own. Raises EmptyBatch at 0."""
    if denominator is None:
        denominator = loss_denominator(mask_BT, mode, constant, weight_BT, self_normalize)
    if float(denominator) <= 0.0:
        raise EmptyBatch("no valid model tokens (or no retained importance weight) in this batch")
    return loss_numerator(loss_BT, mask_BT, mode, weight_BT) / denominator.to(loss_BT.dtype)
