"""The log-probs and entropy from the last hidden states and the output layer a chunk of tokens at a time
(train/logprobs.chunked_target_logprobs, trainer.logit_chunk_tokens) against the whole logits at once
(target_logprobs): values and gradients (hidden states and output weight) in fp32, on one rank and over a
TP group of 2, with and without entropy (as close to a float64 computation as the whole path, to 1e-6:
float32 sums in another order);
then the policy's own scores and PPO step with and without it."""

import pytest
import torch
from train_jobs import chunk_worker_job, chunked_logprobs_job

from moe_rl.train.launch_local import run_ranks
from moe_rl.train.logprobs import chunked_target_logprobs, target_logprobs

T, H, V = 37, 16, 50


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets, torch.randn(T, generator=g), torch.randn(T, generator=g)


def whole(hidden, weight, targets, g_logp, g_ent, dtype=torch.float32):
    """The reference: the whole [T, V] logits, then target_logprobs; values and gradients."""
    h, w = (x.detach().to(dtype).clone().requires_grad_(True) for x in (hidden, weight))
    g_logp, g_ent = g_logp.to(dtype), None if g_ent is None else g_ent.to(dtype)
    logp, ent = target_logprobs((h @ w.t()).unsqueeze(0), targets.unsqueeze(0),
                                with_entropy=g_ent is not None)
    loss = (g_logp * logp[0]).sum() + ((g_ent * ent[0]).sum() if g_ent is not None else 0)
    loss.backward()
    return logp[0].detach(), None if ent is None else ent[0].detach(), h.grad, w.grad


def assert_near(got, today, truth, name):
    """As close to the float64 computation as today's path is, to 1e-6: both sum the same float32 terms in
    different orders (a weight gradient sums over every token), so each is off the exact value by its own
    rounding, up to 1.5e-6 here."""
    gap, slack = (got.double() - truth).abs(), 1e-6 + (today.double() - truth).abs()
    assert bool((gap <= slack).all()), f"{name}: {float((gap - slack).max()):.3g} beyond"


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_chunks_equal_the_whole_logits(entropy, chunk):
    hidden, weight, targets, g_logp, g_ent = case()
    g_ent = g_ent if entropy else None
    today = whole(hidden, weight, targets, g_logp, g_ent)
    truth = whole(hidden, weight, targets, g_logp, g_ent, torch.float64)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    c_logp, c_ent = chunked_target_logprobs(h, w, targets, chunk, with_entropy=entropy)
    ((g_logp * c_logp).sum() + ((g_ent * c_ent).sum() if entropy else 0)).backward()
    assert (c_ent is None) == (not entropy)
    assert h.grad is not None and w.grad is not None
    for name, got, t, t64 in zip(("logp", "entropy", "d_hidden", "d_weight"), (c_logp, c_ent, h.grad, w.grad),
                                 today, truth, strict=True):
        if entropy or name != "entropy":
            assert_near(got, t, t64, name)


def test_a_row_scores_the_same_in_any_batch_wherever_the_whole_logits_do():
    """A token's log-prob must not depend on which other rows share its chunk (the EWMA anchor scores a
    minibatch, the policy the whole batch, and their gap must be exactly 0 at the first update): wherever
    the whole logits give a row the same value inside a slice as in the full batch, the chunked path must
    too. Reducing over a column-major view of the logits (each row's max and sums strided) broke this."""
    g = torch.Generator().manual_seed(3)
    n, width, vocab = 600, 64, 384
    hidden, weight = torch.randn(n, width, generator=g), torch.randn(vocab, width, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    full = chunked_target_logprobs(hidden, weight, targets, 1024)[0]
    full_whole = target_logprobs(hidden @ weight.t(), targets)[0]
    compared = 0
    for a, b in ((5, 77), (100, 600), (0, 150), (3, 500), (64, 320)):
        if torch.equal(target_logprobs(hidden[a:b] @ weight.t(), targets[a:b])[0], full_whole[a:b]):
            compared += 1
            assert torch.equal(chunked_target_logprobs(hidden[a:b], weight, targets[a:b], 1024)[0],
                               full[a:b]), (a, b)
    assert compared >= 3  # the whole path is row-invariant at these sizes on this machine's kernels


def test_only_the_gradients_asked_for():
    """A frozen output layer (LoRA's base): no weight gradient is computed; a frozen input: none either."""
    hidden, weight, targets, g_logp, _ = case()
    h = hidden.clone().requires_grad_(True)
    logp, ent = chunked_target_logprobs(h, weight, targets, 8)
    (logp.sum() + ent.sum()).backward()
    assert h.grad is not None and weight.grad is None


@pytest.mark.slow
@pytest.mark.parametrize("entropy", [True, False])
def test_chunks_over_a_tp_group_equal_the_whole_logits(entropy):
    """TP 2: each rank its half of the vocabulary; the values on every rank are the whole vocabulary's,
    each rank's weight gradient is its slice of the whole one, and the hidden states' partial gradients
    sum to the whole one (the TP region op before the output layer sums them in the model)."""
    hidden, weight, targets, g_logp, g_ent = case(1)
    g_ent = g_ent if entropy else None
    logp, ent, d_hidden, d_weight = whole(hidden, weight, targets, g_logp, g_ent)
    t_logp, t_ent, t_hidden, t_weight = whole(hidden, weight, targets, g_logp, g_ent, torch.float64)
    ranks = run_ranks(chunked_logprobs_job, 2, (hidden, weight, targets, g_logp, g_ent, 6))
    for r, out in enumerate(ranks):
        assert_near(out["logp"], logp, t_logp, "logp")
        if entropy:
            assert_near(out["ent"], ent, t_ent, "entropy")
        assert_near(out["d_weight"], d_weight.chunk(2)[r], t_weight.chunk(2)[r], "d_weight")
    assert_near(ranks[0]["d_hidden"] + ranks[1]["d_hidden"], d_hidden, t_hidden, "d_hidden")


@pytest.mark.slow
@pytest.mark.parametrize("layout, world, pack", [({}, 1, False), ({}, 1, True), ({"tp": 2}, 2, False)],
                         ids=["one_rank", "packed", "tp2_sequence_parallel"])
def test_the_policy_scores_and_trains_the_same_with_chunks(tiny_qwen, layout, world, pack):
    """The trainer's own path (the model's last hidden states, the output layer's weight, the TP region):
    the scores, the step's gradient norm, and every parameter after the step, chunked (5 tokens a chunk)
    against the whole logits."""
    chunked = run_ranks(chunk_worker_job, world, (str(tiny_qwen), layout, 5, pack))
    whole_logits = run_ranks(chunk_worker_job, world, (str(tiny_qwen), layout, 0, pack))
    for a, b in zip(chunked, whole_logits, strict=True):
        for key in ("logp", "entropy", "after"):
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        for name, p in a["params"].items():
            torch.testing.assert_close(p, b["params"][name], atol=1e-6, rtol=0, msg=name)
