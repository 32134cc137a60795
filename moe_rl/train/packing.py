"""Sequence packing (THD): the valid tokens of a microbatch's rows laid end to end in one row.

Right-padded rows [B, S] spend compute on padding: B * S_max tokens for sum(lengths) real ones.
Packed, the model sees one row of T = sum(lengths) tokens (plus a few padding tokens so T is a multiple of
`token_multiple`: the sequence-parallel size, times 16 or 32 under FP8) and megatron-core's
`PackedSeqParams` (qkv_format "thd") tell rotary embeddings and attention where each sequence starts, so
positions restart at 0 and no token attends across a sequence boundary.

    p = Packing.of(lengths_B, S, multiple=token_multiple(tp, 1, fp8_align))
    ids_1T = p.pack(ids_BS)                   # [1, T]
    x_BS = p.unpack(x_1T)                     # back to [B, S] (zeros beyond each row's length)

Everything the loss sees stays [B, S]: packing lives between the microbatch and the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_ALIGN = {"none": 1, "delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}  # model.fp8 -> tokens


def token_multiple(sp_size: int, cp: int, fp8_align: int) -> int:
    """The multiple a microbatch's row length (or packed length T; packing has cp = 1) rounds up to.

    Sequence parallelism splits a row's tokens over sp_size (= tp, or 1 without it) ranks; context
    parallelism cuts each row into 2 * cp chunks, each split again by sp_size; FP8 GEMMs need every
    rank's token count to be a multiple of fp8_align (Transformer Engine asserts % 8; Megatron aligns
    to 16, 32 for MXFP8). A rank holds S / (sp_size * cp) tokens of each row, so S is a multiple of
    sp_size * cp * fp8_align as well as of the chunking's sp_size * 2cp.
    """
    chunks = sp_size * (2 * cp if cp > 1 else 1)
    return math.lcm(chunks, sp_size * cp * fp8_align)


@dataclass(frozen=True)
class Packing:
    valid_BS: torch.Tensor  # [B, S] bool: positions that hold real tokens
    cu_seqlens: torch.Tensor  # [n + 1] int32 offsets of the packed sequences (a padding tail is its own)
    total: int  # T: packed length (real tokens + padding tail)
    real: int  # real tokens

    @staticmethod
    def of(lengths_B: torch.Tensor, S: int, multiple: int = 1) -> Packing:
        lengths = lengths_B.long()
        device = lengths.device  # attention kernels read cu_seqlens where the tokens are
        valid = torch.arange(S, device=device).expand(len(lengths), S) < lengths.unsqueeze(1)
        real = int(lengths.sum())
        total = max(multiple, -(-real // multiple) * multiple)
        seqs = [int(n) for n in lengths if n > 0] + ([total - real] if total > real else [])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.tensor(seqs, dtype=torch.int32, device=device).cumsum(0)
        return Packing(valid, cu, total, real)

    def pack(self, x_BS: torch.Tensor, fill: torch.Tensor | float = 0) -> torch.Tensor:
        """[B, S, ...] -> [1, T, ...]: valid positions in row order, then the padding tail (= fill)."""
        flat = x_BS[self.valid_BS]
        tail = self.total - self.real
        if tail:
            pad = torch.as_tensor(fill, dtype=x_BS.dtype, device=x_BS.device).expand(tail, *x_BS.shape[2:])
            flat = torch.cat([flat, pad])
        return flat.unsqueeze(0)

    def unpack(self, x_1T: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [B, S, ...] (zeros where a row has no token); differentiable."""
        B, S = self.valid_BS.shape
        out = x_1T.new_zeros(B, S, *x_1T.shape[2:])
        out[self.valid_BS] = x_1T[0, : self.real]
        return out

    def positions(self) -> torch.Tensor:
        """[1, T] position of each packed token inside its own sequence."""
        starts = torch.repeat_interleave(self.cu_seqlens[:-1].long(),
                                         (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long())
        return (torch.arange(self.total, device=starts.device) - starts).unsqueeze(0)

    def seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)
