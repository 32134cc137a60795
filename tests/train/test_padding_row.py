"""The pad token's embedding row, as transformers trains it: its models build the embedding with
`padding_idx=pad_token_id`, so looking the pad token up sends no gradient into that row (a tied LM head's
gradient still does). One policy update's gradients from the Megatron trainer equal transformers' on a
batch whose tokens include the pad token, on one rank and in TP2 (the row on one shard)."""

import pytest
import torch
from conftest import model_spec, optim_spec
from train_jobs import B, Denominator, S, batch_tensors, policy_loss, policy_tensors

from moe_rl.batch import Batch
from moe_rl.train.launch_local import run_ranks


def pad_batch(pad_id: int):
    """train_jobs' batch with the pad token at prompt and model-token positions of every row (and one
    row's last token, which predicts nothing)."""
    ids, lengths, mask, adv = batch_tensors()
    for row, col in [(0, 1), (0, 5), (0, 11), (1, 4), (1, 6), (2, 2), (2, 8), (3, 3), (3, 7)]:
        ids[row, col] = pad_id
    return ids, lengths, mask, adv


def gradients_job(rank, world, hf_path, layout, pad_id):
    """One policy update (PPO loss, several microbatches, no clipping): the step's figures, the loss
    tensors it used and its gradients, exported under their Hugging Face names (TP shards gathered)."""
    from moe_rl.train import hf_io, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, routing_replay=False),
                    optim=optim_spec(1e-2, grad_clip=1e9, micro_batch_tokens=24))
    ids, lengths, mask, adv = pad_batch(pad_id)
    tensors = policy_tensors(w.score(Batch(ids, lengths)).logp_BS, mask, adv)
    step = w.train_step(Batch(ids, lengths, None, **tensors), policy_loss(), Denominator(mask)).figures
    with torch.no_grad():  # the gradients take the weights' place, to leave through the weights' export
        for p in w.module.parameters():
            p.copy_(p.main_grad)
    return {"step": step, "tensors": tensors, "grads": dict(hf_io.export_hf_weights(w.bridge, w.module))}


def hf_gradients(hf_path, ids, lengths, mask, tensors, out):
    """transformers' gradients of the same loss on the same batch, under the checkpoint's names (saved in
    the weights' place to `out`, through transformers' own name and format mapping), and their norm."""
    from transformers import AutoModelForCausalLM

    from moe_rl.weights.hf import HFReader

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    lp_BSV = torch.log_softmax(model(ids).logits.float(), -1)
    logp, entropy = torch.zeros(B, S), torch.zeros(B, S)
    logp[:, 1:] = lp_BSV[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy[:, 1:] = -(lp_BSV.exp() * lp_BSV).sum(-1)[:, :-1]
    numerators, _ = policy_loss()({"logp_BS": logp, "entropy_BS": entropy},
                                  Batch(ids, lengths, None, **tensors))
    den = Denominator(mask)
    sum(num / den[k] for k, num in numerators.items()).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.copy_(g)
    model.save_pretrained(out)
    reader = HFReader(out)
    return {n: reader.get(n) for n in reader.names()}, float(norm), model.get_input_embeddings().padding_idx


def tied_checkpoint(hf_path, out):
    """The tiny checkpoint's architecture with the LM head tied to the embedding (random weights)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(hf_path)
    cfg.tie_word_embeddings = True
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_path / name, out / name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tied,layout", [(False, {}), (False, {"tp": 2}), (True, {}), (True, {"tp": 2})])
def test_update_gradients_equal_transformers_with_pad_tokens(tiny_qwen, tmp_path, tied, layout):
    from transformers import AutoConfig

    path = tied_checkpoint(tiny_qwen, tmp_path / "tied") if tied else tiny_qwen
    pad = AutoConfig.from_pretrained(path).pad_token_id
    ids, lengths, mask, adv = pad_batch(pad)
    assert bool((ids == pad)[mask].any()) and bool((ids == pad)[~mask].any())  # sampled and prompt pad tokens
    ranks = run_ranks(gradients_job, 2 if layout else 1, (str(path), layout, pad))
    ref, ref_norm, padding_idx = hf_gradients(path, ids, lengths, mask, ranks[0]["tensors"],
                                                tmp_path / "hf_grads")
    assert padding_idx == pad
    for res in ranks:
        assert set(res["grads"]) == set(ref)
        for name, g in ref.items():
            torch.testing.assert_close(res["grads"][name], g, atol=1e-6, rtol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")
        assert res["step"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    row = ranks[0]["grads"]["model.embed_tokens.weight"][pad]
    if tied:  # the LM head's gradient reaches the row; the lookup's does not
        assert float(row.abs().max()) > 0
    else:
        assert float(ref["model.embed_tokens.weight"][pad].abs().max()) == 0.0
        assert float(row.abs().max()) == 0.0


def test_pad_row_is_transformers_padding_idx():
    """nn.Embedding's padding_idx: the config's pad_token_id, a negative one counted from the end."""
    from types import SimpleNamespace as C

    from moe_rl.train.model import pad_row

    assert pad_row(C(pad_token_id=256, vocab_size=384)) == 256
    assert pad_row(C(pad_token_id=-1, vocab_size=384)) == 383
    assert pad_row(C(pad_token_id=None, vocab_size=384)) is None
    assert pad_row(C(vocab_size=384)) is None  # no pad token in the config
    assert pad_row(C(pad_token_id=384, vocab_size=384)) is None  # outside the vocabulary: no row
