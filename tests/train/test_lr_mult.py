"""trainer.lr_mult / critic.lr_mult: learning-rate multipliers by parameter name. Adam's update is linear in
the learning rate, so from the same weights and batch a parameter a glob matches moves exactly its factor
times what it moves without, and every other parameter as it moves without: at the rate the worker starts
with and at one set later (as the warm start and the schedule set it). The globs see the whole model's
names: under PP2 the second layer is `decoder.layers.1` on the stage that holds it as its first. DP2
shards the optimizer (megatron's distributed optimizer)."""

import fnmatch
from pathlib import Path

import pytest
import torch
from conftest import model_spec, optim_spec
from train_jobs import Denominator, batch_tensors, policy_loss, policy_tensors

from moe_rl.batch import Batch
from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow

# 0 freezes: the routers (no gradient, no optimizer state)
MULT = {"decoder.layers.1.self_attention.linear_qkv.weight": 0.25, "*.mlp.experts.linear_fc1.weight*": 3.0,
        "*.mlp.router.weight": 0.0}


def step_job(rank, world, hf_path, layout, lr_mult, lr):
    """One policy update at `lr` (the worker built with 1e-2, then set to `lr`): each parameter's change by
    its whole-model name, and the rate the step's figures report."""
    from moe_rl.train import hf_io, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path), optim=optim_spec(1e-2, grad_clip=1e9, micro_batch_tokens=24,
                                                          lr_mult=tuple(lr_mult.items())))
    names = hf_io.rank_names(w.module, w.config.num_moe_experts)
    ids, lengths, mask, adv = batch_tensors()
    if lr != 1e-2:
        w.set_lr(lr)
    before = {n: p.detach().clone() for n, p in w.module.named_parameters()}
    tensors = policy_tensors(w.score(Batch(ids, lengths)).logp_BS, mask, adv)
    figures = w.train_step(Batch(ids, lengths, None, **tensors), policy_loss(), Denominator(mask)).figures
    return {"lr": figures["lr"],
            "moves": {names[n]: p.detach() - before[n] for n, p in w.module.named_parameters()},
            "frozen": {names[n] for n, p in w.module.named_parameters() if not p.requires_grad}}


def refusals_job(rank, world, hf_path):
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    refused = []
    for role, lr_mult in [("policy", {"*linear_kv_up_proj*": 0.5}),
                          ("critic", {"*.linear_qkv.weight": 0.5, "decoder.layers.0.*": 2.0}),
                          ("policy", {"*": 0.0})]:
        try:
            TrainWorker(model_spec(hf_path), role, optim=optim_spec(1e-2, lr_mult=tuple(lr_mult.items())))
        except ValueError as err:
            refused.append(str(err))
    return refused


@pytest.mark.parametrize("world,layout,lr", [(1, {}, 3e-2), (2, {"pp": 2}, 1e-2), (2, {}, 3e-2)],
                         ids=["1rank-set", "pp2", "dp2-distributed-optimizer-set"])
def test_lr_mult_scales_exactly_the_matching_parameters(tiny_qwen, world, layout, lr):
    plain = run_ranks(step_job, world, (str(tiny_qwen), layout, {}, lr))
    scaled = run_ranks(step_job, world, (str(tiny_qwen), layout, MULT, lr))
    matched, frozen = set(), set()
    for a, b in zip(plain, scaled, strict=True):
        assert a["lr"] == b["lr"] == lr and not a["frozen"]
        frozen |= b["frozen"]
        for name, move in a["moves"].items():
            factor = next((f for glob, f in MULT.items() if fnmatch.fnmatchcase(name, glob)), None)
            assert move.abs().max() > 0, name
            if factor is None:
                torch.testing.assert_close(b["moves"][name], move, rtol=1e-5, atol=1e-9, msg=name)
            else:
                matched.add(name)
                torch.testing.assert_close(b["moves"][name], factor * move, rtol=1e-4, atol=1e-9, msg=name)
    # one attention weight of layer 1 (PP2: the second stage's first layer) and every expert's fc1
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in matched
    assert sum(".mlp.experts.linear_fc1.weight" in n for n in matched) == 2 * 4  # 2 MoE layers x 4 experts
    # the routers (factor 0: they moved 0 times as much, above) have no gradient at all
    assert frozen == {f"decoder.layers.{i}.mlp.router.weight" for i in (0, 1)}


def test_lr_mult_refuses_a_glob_that_matches_nothing_and_two_that_overlap(tiny_qwen):
    refused = run_ranks(refusals_job, 1, (str(tiny_qwen),))[0]
    assert refused[0].startswith("trainer.lr_mult: '*linear_kv_up_proj*' matches none of the model's "
                                 "trainable parameters, named like "
                                 "embedding.word_embeddings.weight, ")
    assert refused[1] == ("critic.lr_mult: '*.linear_qkv.weight' and 'decoder.layers.0.*' both match "
                          "decoder.layers.0.self_attention.linear_qkv.weight: one glob a parameter")
    assert refused[2] == ("trainer.lr_mult: its factors of 0 freeze every trainable parameter of rank(s) 0: "
                          "leave something to train")


def resume_job(rank, world, hf_path, ckpt, saved_mult, resumed_mult, unrecorded=False):
    """A worker at 1e-2 takes one step and saves; one built at 3e-2 (a run resumed with a new trainer.lr)
    loads it: the rates its parameter groups hold then, by factor, or the refusal's message. `unrecorded`:
    the checkpoint's record loses its multipliers, as one written before it kept them."""
    from moe_rl.train import checkpoint, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    ids, lengths, mask, adv = batch_tensors()
    saved = TrainWorker(model_spec(hf_path), optim=optim_spec(1e-2, lr_mult=tuple(saved_mult.items())))
    tensors = policy_tensors(saved.score(Batch(ids, lengths)).logp_BS, mask, adv)
    saved.train_step(Batch(ids, lengths, None, **tensors), policy_loss(), Denominator(mask))
    checkpoint.save(saved, ckpt)
    if unrecorded:
        record = checkpoint.read_extra(ckpt)
        del record["lr_mult"]
        torch.save(record, Path(ckpt) / checkpoint.EXTRA_FILE)
    resumed = TrainWorker(model_spec(hf_path), optim=optim_spec(3e-2, lr_mult=tuple(resumed_mult.items())))
    try:
        checkpoint.load(resumed, ckpt)
    except checkpoint.CheckpointError as err:
        return str(err)
    return {g.get("lr_mult", 1.0): g["lr"] for g in resumed.optimizer.param_groups}


def test_a_resumed_run_takes_its_own_learning_rate_and_refuses_other_multipliers(tiny_qwen, tmp_path):
    # the checkpoint's parameter groups carry the rate they were saved with: the resumed run's replaces it
    rates = run_ranks(resume_job, 1, (str(tiny_qwen), str(tmp_path / "a"), MULT, MULT))[0]
    assert rates == pytest.approx({1.0: 3e-2, 0.25: 3e-2 * 0.25, 3.0: 3e-2 * 3.0})
    # other multipliers make other parameter groups than the checkpoint's optimizer state has
    refused = run_ranks(resume_job, 1, (str(tiny_qwen), str(tmp_path / "b"), MULT, {}))[0]
    assert refused == (
        f"{tmp_path / 'b'}: its optimizer state was saved with trainer.lr_mult {MULT} and this run has {{}}, "
        "which make other parameter groups: resume with the multipliers it was saved with, or convert its "
        "weights (moe-rl convert mcore-to-hf) and start a new run from them")
    # a checkpoint without the record had no multipliers (they came a day before it): one line, not
    # megatron's "damaged" message from merging parameter-group lists that differ
    refused = run_ranks(resume_job, 1, (str(tiny_qwen), str(tmp_path / "c"), {}, MULT, True))[0]
    assert refused.startswith(f"{tmp_path / 'c'}: its optimizer state was saved before checkpoints recorded "
                              f"their learning-rate multipliers (so, as far as it says, with none) and this "
                              f"run has {MULT}, which make other parameter groups"), refused
    assert run_ranks(resume_job, 1, (str(tiny_qwen), str(tmp_path / "d"), {}, {}, True))[0] \
        == pytest.approx({1.0: 3e-2})
