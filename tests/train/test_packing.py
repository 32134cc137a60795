"""Token alignment of microbatches (`token_multiple`, the multiple TrainWorker pads rows and packed
microbatches to) and THD packing: every rank's share of a microbatch holds a whole number of
sequence-parallel tokens and, under FP8, a multiple of the FP8 GEMM alignment."""

import typing

import pytest
import torch

from moe_rl.batch import Batch
from moe_rl.config import FP8Recipe
from moe_rl.train.packing import FP8_ALIGN, Packing, token_multiple


def test_token_multiple_worked_by_hand():
    assert token_multiple(1, 1, 1) == 1
    assert token_multiple(2, 1, 1) == 2  # sequence parallel: whole tokens per TP rank
    assert token_multiple(2, 2, 1) == 8  # 2*cp = 4 chunks, each split over 2 TP ranks
    assert token_multiple(1, 1, 16) == 16
    assert token_multiple(4, 1, 16) == 64  # S/4 tokens per rank, a multiple of 16
    assert token_multiple(2, 2, 16) == 64  # S/(2*2) per rank % 16 == 0, and a multiple of the 8 chunk tokens
    assert token_multiple(8, 2, 32) == 512  # MXFP8 at tp=8, cp=2


def test_every_fp8_recipe_has_an_alignment():
    assert set(FP8_ALIGN) == set(typing.get_args(FP8Recipe))
    assert FP8_ALIGN["none"] == 1 and FP8_ALIGN["mxfp8"] == 32 and FP8_ALIGN["delayed"] == 16


@pytest.mark.parametrize("tp,cp,fp8",
                         [(1, 1, "delayed"), (2, 1, "tensorwise"), (2, 2, "blockwise"), (4, 1, "mxfp8"),
                                       (1, 2, "none")])
def test_each_ranks_share_of_every_microbatch_is_aligned(tp, cp, fp8):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 50, (9,), generator=g)
    batch = Batch(torch.randint(0, 300, (9, 50), generator=g), lengths)
    align, multiple = FP8_ALIGN[fp8], token_multiple(tp, cp, FP8_ALIGN[fp8])
    for mb in batch.microbatches(96, multiple):  # rows, as the worker cuts them (unpacked)
        B, S = mb.input_ids_BS.shape
        assert S % (2 * cp if cp > 1 else 1) == 0 and (S // cp) % tp == 0
        assert (B * S // (tp * cp)) % align == 0 and S >= int(mb.lengths_B.max())
    if cp == 1:  # packed (THD): one row of T tokens, T / tp per rank
        for mb in batch.microbatches(96, multiple, packed=True):
            p = Packing.of(mb.lengths_B, mb.input_ids_BS.shape[1], multiple)
            assert p.total % (tp * align) == 0 and p.real == int(mb.lengths_B.sum()) <= p.total
            assert int(p.cu_seqlens[-1]) == p.total
