"""Expert parallelism across data-parallel shards of different sizes: every forward runs the experts'
all-to-all over the expert group, so each rank must run as many microbatches as the others even when
its shard needs fewer (scoring is sharded by data-parallel replica, and so is training). Two EP2 ranks
with 3 and 1 rows (one microbatch per row) must score and train like one rank with all 4."""

import dataclasses

import pytest
import torch

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow

LENGTHS = [12, 7, 10, 9]


def uneven_job(rank, world, hf_path, ep):
    from moe_rl.batch import Batch
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs
    from moe_rl.train import parallel
    from moe_rl.train.objectives import SftLoss
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(ep=ep))
    cfg = RunConfig()
    optim = dataclasses.replace(specs.optim_spec(cfg, 1e-3, {}), micro_batch_tokens=12,
                                pack_sequences=False)
    w = TrainWorker(specs.model_spec(cfg, hf_path), optim=optim)
    g = torch.Generator().manual_seed(5)
    B, S = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(0, 300, (B, S), generator=g)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(S) < lengths.unsqueeze(1)) & (torch.arange(S) >= 2)
    rows = slice(0, B) if world == 1 else [slice(0, 3), slice(3, 4)][w.ps.get_data_parallel_rank()]
    shard = Batch(ids, lengths, mask_BS=mask).rows(rows)
    out = {"rows": rows, "microbatches": len(w._microbatches(shard)), "score": w.score(shard).logp_BS}
    out["step"] = w.train_step(shard, SftLoss(), mask.sum().double()).figures
    return out


def test_uneven_shards_in_an_expert_group_score_and_train_like_one_rank(tiny_qwen):
    ref = run_ranks(uneven_job, 1, (str(tiny_qwen), 1))[0]
    ranks = run_ranks(uneven_job, 2, (str(tiny_qwen), 2), timeout=300)  # without equal counts: a hang
    assert [r["microbatches"] for r in ranks] == [3, 3]  # rank 1: its row, then two empty microbatches
    for r in ranks:
        rows = r["rows"]
        S = r["score"].shape[1]
        torch.testing.assert_close(r["score"], ref["score"][rows, :S], atol=1e-5, rtol=0)
    assert ranks[0]["step"]["grad_norm"] == pytest.approx(ref["step"]["grad_norm"], rel=1e-4)
    assert sum(r["step"]["loss"] for r in ranks) == pytest.approx(ref["step"]["loss"], rel=1e-5)
    assert all(r["step"]["nll"] == r["step"]["nll"] for r in ranks)  # empty microbatches add no NaN figure
