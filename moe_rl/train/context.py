"""Context parallelism: each CP rank holds two chunks of every sequence, megatron-core's layout.

A microbatch of length S (a multiple of 2 * cp) is cut into 2 * cp chunks of c = S / (2 * cp)
positions; CP rank r keeps chunks r and 2 * cp - 1 - r (causal attention costs the same on every
rank). megatron-core's rotary embedding selects the same positions. Attention needs every rank's keys
and values (`gather_sequence` inside SdpaAttention; Transformer Engine's attention does its own ring
exchange on GPU); the per-token outputs the loss sees (log-probs, entropy, values) are gathered back
to the full [b, S] on every CP rank, so a loss needs no change — sequence-level ones (GSPO) included.

Gradients: every CP rank computes the same loss from the gathered outputs, and the backward of a
gather sums the copies (all-reduce), so each rank's gradient is cp times its share; megatron's DDP
averages over the data-parallel x context-parallel group, which divides the cp back out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_positions(S: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[2 * S / (2 * cp)] global positions held by CP rank `rank`, in local order, on `device` (the
    device of the tensors they index: `index_copy_` / `index_select` refuse an index elsewhere)."""
    if S % (2 * cp):
        raise ValueError(f"sequence length {S} must be a multiple of 2 * cp = {2 * cp}")
    c = S // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, S: int, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        shape = list(x.shape)
        shape[dim] = S
        full = x.new_empty(shape)
        for r, part in enumerate(parts):
            full.index_copy_(dim, local_positions(S, cp, r, x.device), part)
        ctx.dim, ctx.S, ctx.group, ctx.rank, ctx.cp = dim, S, group, rank, cp
        return full

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank used the full tensor
        return grad.index_select(ctx.dim,
                                 local_positions(ctx.S, ctx.cp, ctx.rank, grad.device)), None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 2 chunks along `dim` -> the full sequence (differentiable; gloo and NCCL)."""
    S = x.shape[dim] * dist.get_world_size(group)
    return _GatherSequence.apply(x, dim, S, group)
