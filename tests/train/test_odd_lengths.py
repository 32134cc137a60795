"""Scoring and training with odd sequence lengths in every layout, packed and unpacked: microbatches
padded to a multiple of tp (sequence parallelism) or 2*cp (context parallelism) may be wider than
the batch itself; results must still land in the batch's own [B, S] and equal one rank's."""

import dataclasses

import pytest
import torch

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow
B, S = 3, 43
LENGTHS = [43, 17, 30]  # the longest is odd: padded to 44 under TP2 / CP2


def odd_job(rank, world, hf_path, layout):
    from conftest import model_spec, optim_spec

    from moe_rl.batch import Batch
    from moe_rl.config import RunConfig, TrainerSection
    from moe_rl.driver import specs
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path),
                    optim=optim_spec(1e-3, micro_batch_tokens=64, pack_sequences=False))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (B, S), generator=g)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(S) < lengths.unsqueeze(1)) & (torch.arange(S) >= 5)
    out = {}
    for pack in (False, True):
        w.optim_spec = dataclasses.replace(w.optim_spec, pack_sequences=pack)
        out[pack] = w.score(Batch(ids, lengths))
    dp, dps = w.ps.get_data_parallel_rank(), w.ps.get_data_parallel_world_size()
    rows = slice(dp * B // dps, (dp + 1) * B // dps)
    full = Batch(ids, lengths, pg_mask_BS=mask, loss_mask_BS=mask,
                 adv_BS=torch.randn(B, S, generator=g) * mask, logp_old_BS=out[False].logp_BS,
                 is_weight_BS=torch.ones(B, S))
    # PPO-Clip, token mean, as configured by default; pi_old given (scored by a pass of its own)
    loss = specs.policy_loss(RunConfig(trainer=TrainerSection(proximal_pass="separate")))
    out["step"] = w.train_step(full.rows(rows), loss, {"policy": mask.sum().double()}).figures
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_qwen):
    return run_ranks(odd_job, 1, (str(tiny_qwen), {}))[0]


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"ep": 2}, {"cp": 2}])
def test_odd_lengths_match_one_rank(one_rank, tiny_qwen, layout):
    valid = torch.arange(S) < torch.tensor(LENGTHS).unsqueeze(1)
    torch.testing.assert_close(one_rank[True].logp_BS * valid, one_rank[False].logp_BS * valid, atol=1e-5,
                               rtol=0)
    results = run_ranks(odd_job, 2, (str(tiny_qwen), layout))
    for res in results:
        for pack in (False, True):
            for name in ("logp_BS", "entropy_BS"):
                got, want = getattr(res[pack], name), getattr(one_rank[False], name)
                assert got.shape == (B, S)
                torch.testing.assert_close(got * valid, want * valid, atol=1e-5, rtol=0)
    losses = [r["step"]["loss"] for r in results if "loss" in r["step"]]
    total = sum(losses) if "ep" in layout else losses[0]  # EP2 is data-parallel 2: shares of the loss
    assert total == pytest.approx(one_rank["step"]["loss"], abs=1e-5)
