"""`moe-rl plan`'s trainer terms against bytes measured on the CPU trainer at tiny size, term by term:
the logits' peak through production's log-probs (train/logprobs.py) forward and backward, counted by a
dispatch mode that follows every storage the ops allocate until it is freed; a real TrainWorker's
weights, gradient buffers, optimizer state (after a step, so Adam's moments exist) and the PPO-EWMA
anchor, counted from the tensors that hold them, under the layouts where the distributed optimizer
shards (dp 2: dense state over dp*cp, expert state over the expert-data-parallel ranks) and where it
does not (dp 1 with cp 2); and the activations, with and without recompute, from the tensors autograd
saves in a real TrainWorker's decoder."""

import dataclasses
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moe_rl.config import from_dict
from moe_rl.plan import ModelShape, hf_config_of, logit_bytes, trainer_memory
from moe_rl.train.launch_local import run_ranks

# what the plan may differ from the measurement by: the log-probs score S - 1 of a row's S tokens (1/256
# here) and hold a few [B, S] tensors; megatron pads its gradient buffers and keeps Adam's step counts
TOLERANCE = 0.01
# the chunked path's: a few [T] float32 tensors (the rows' max, log-sum and mean, the targets' mask) and the
# backward's [c, h] products, left out of the plan
CHUNKED_TOLERANCE = 0.03


class LiveBytes(TorchDispatchMode):
    """The bytes of storages that ops allocate and that are still alive, and their peak: every op's
    outputs are followed (a view adds nothing: its storage is known) until their storage is freed."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, tuple[weakref.ref, int]] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key not in self.sizes:
                    self.sizes[key] = (weakref.ref(st, lambda _, key=key: self._freed(key)), st.nbytes())
                    self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _plan_cfg(dtype: str, **changes):
    return from_dict({"model": {"dtype": dtype}, **changes}, cuda_available=False)


def _shape(cfg, vocab: int | None = None) -> ModelShape:
    hf = hf_config_of(cfg, None)  # the tiny model's
    return ModelShape.from_hf({**hf, "vocab_size": vocab or hf["vocab_size"]})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("trains", [True, False], ids=["train", "score"])
def test_logits_term_is_the_measured_peak_of_the_log_probs(dtype, trains):
    """One microbatch of T tokens on the last stage: the output layer's logits [1, T, V] in the model's
    dtype go through production's log-probs and entropy into a loss, are released (as megatron's schedule
    releases the model's output once the loss is computed), and the loss is backpropagated to the output
    layer. Peak bytes from the logits' creation on (scoring: forward under no_grad) against the plan's
    logits term for T = trainer.micro_batch_tokens, tp = cp = 1."""
    from moe_rl.train.logprobs import vocab_parallel_logprobs

    T, V, H = 256, 1024, 8
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, T, H, generator=g).to(torch_dtype)
    output_layer = torch.randn(H, V, generator=g).to(torch_dtype).requires_grad_(trains)
    ids = torch.randint(0, V, (1, T), generator=g)

    def loss_of_logits():  # the logits are released on return
        logp, entropy = vocab_parallel_logprobs(hidden @ output_layer, ids)
        return logp.sum() + 0.01 * entropy.sum()

    with torch.set_grad_enabled(trains), LiveBytes() as live:  # counts what is allocated from the logits on
        loss = loss_of_logits()
        if trains:
            loss.backward()
    measured = live.peak
    cfg = _plan_cfg(dtype, trainer={"micro_batch_tokens": T, "logit_chunk_tokens": 0})
    planned = trainer_memory(_shape(cfg, V), cfg, "policy" if trains else "reference")["logits"]
    assert planned == T * V * logit_bytes(2 if dtype == "bfloat16" else 4, trains)
    assert measured == pytest.approx(planned, rel=TOLERANCE), (measured / (T * V), planned / (T * V))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("trains", [True, False], ids=["train", "score"])
@pytest.mark.parametrize("chunk, H", [(64, 8), (64, 128), (128, 128)])
def test_chunked_logits_term_is_the_measured_peak_of_the_log_probs(dtype, trains, chunk, H):
    """The default path (trainer.logit_chunk_tokens): the last hidden states [T, H] and the output layer's
    weight [V, H] through chunked_target_logprobs, a chunk of the logits at a time, into the same loss and
    back to both. Peak bytes from the call on against the plan's logits term (`logits_memory`), for chunks
    and widths where either of its two main parts (the chunk's logits, the weight's gradient) dominates."""
    from moe_rl.train.logprobs import chunked_target_logprobs

    T, V = 512, 2048
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(torch_dtype).requires_grad_(trains)
    weight = torch.randn(V, H, generator=g).to(torch_dtype).requires_grad_(trains)
    ids = torch.randint(0, V, (T,), generator=g)
    with torch.set_grad_enabled(trains), LiveBytes() as live:
        logp, entropy = chunked_target_logprobs(hidden, weight, ids, chunk)
        loss = logp.sum() + 0.01 * entropy.sum()
        if trains:
            loss.backward()
    cfg = _plan_cfg(dtype, trainer={"micro_batch_tokens": T, "logit_chunk_tokens": chunk})
    shape = dataclasses.replace(_shape(cfg, V), hidden=H)
    planned = trainer_memory(shape, cfg, "policy" if trains else "reference")["logits"]
    assert live.peak == pytest.approx(planned, rel=CHUNKED_TOLERANCE), live.peak / planned


def _storage_bytes(tensors, exclude=()) -> int:
    seen, total = {st.data_ptr() for st in exclude}, 0
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def state_bytes_job(rank, world, hf_path, layout, dtype):
    """After one policy step: the bytes of this rank's weights, gradient buffers, optimizer state (the
    optimizer's own parameters, i.e. fp32 master weights, and its state tensors, less any storage the
    model's parameters or DDP buffers hold) and of a PPO-EWMA anchor of its parameters."""
    from conftest import model_spec, optim_spec
    from train_jobs import Denominator, batch_tensors, policy_loss, policy_tensors

    from moe_rl.algos.anchor import EwmaAnchor
    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, dtype=dtype), optim=optim_spec(1e-2, micro_batch_tokens=24))
    ids, lengths, mask, adv = batch_tensors()
    logp = w.score(Batch(ids, lengths)).logp_BS
    w.train_step(Batch(ids, lengths, None, **policy_tensors(logp, mask, adv)), policy_loss(),
                 Denominator(mask))
    params = list(w.module.parameters())
    buffers = [*w.model.buffers, *w.model.expert_parallel_buffers]
    held = [t.untyped_storage()
            for t in [*params, *(b.param_data for b in buffers if b.param_data is not None),
                                          *(b.grad_data for b in buffers)]]
    optimizer = []
    for opt in getattr(w.optimizer, "chained_optimizers", [w.optimizer]):
        optimizer += [p for group in opt.optimizer.param_groups for p in group["params"]]
        optimizer += [v for state in opt.optimizer.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor)]
    return {"distributed": w.ddp_config.use_distributed_optimizer,
            "weights": sum(p.numel() * p.element_size() for p in params),
            "gradients": _storage_bytes([b.grad_data for b in buffers]),
            "optimizer": _storage_bytes(optimizer, held),
            "ewma_anchor": sum(t.numel() * t.element_size()
                               for t in EwmaAnchor(w.local_params(), 0.9).params.values())}


@pytest.mark.slow
@pytest.mark.parametrize("layout,dtype,distributed", [
    ({"cp": 2}, "float32", False),  # dp 1: no distributed optimizer, so no sharding over cp either
    ({"ep": 2}, "bfloat16", True),  # dp 2: dense state over dp*cp = 2, expert state over edp = 2 / ep = 1
], ids=["cp2-fp32", "dp2-ep2-bf16"])
def test_weights_gradients_optimizer_and_anchor_terms_are_measured_bytes(
        tiny_qwen, layout, dtype, distributed):
    cfg = _plan_cfg(dtype, parallel={**layout, "world_size": 2},
                    algorithm={"anchor": "ewma", "correction": "tis_token"})  # for the anchor's term
    planned = trainer_memory(_shape(cfg), cfg, "policy")
    for rank in run_ranks(state_bytes_job, 2, (str(tiny_qwen), layout, dtype)):
        assert rank.pop("distributed") is distributed
        assert rank["weights"] == planned["weights"]
        for term, measured in rank.items():
            assert measured == pytest.approx(planned[term], rel=TOLERANCE), (term, measured, planned[term])


def activations_job(rank, world, hf_path, cases):
    """For each (dtype, recompute): one packed microbatch (rows of 128, 100, 128 and 77 tokens) through a
    real TrainWorker's forward; the bytes of every storage autograd saves for backward inside the decoder
    (its layers and final norm; the parameters left out), per token the decoder sees."""
    from conftest import model_spec, optim_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    ids = torch.randint(0, 300, (4, 128), generator=torch.Generator().manual_seed(0))
    out = []
    for dtype, recompute in cases:
        w = TrainWorker(model_spec(hf_path, dtype=dtype, recompute=recompute),
                        optim=optim_spec(1e-2, micro_batch_tokens=4096))
        block = next(m for m in w.module.modules() if isinstance(m, TransformerBlock))
        params = {p.untyped_storage().data_ptr() for p in w.module.parameters()}
        inside, tokens, saved = [False], [0], {}

        def enter(_, args, kwargs, inside=inside, tokens=tokens):
            hidden = kwargs.get("hidden_states", args[0] if args else None)  # [s, b, h]
            inside[0], tokens[0] = True, hidden.shape[0] * hidden.shape[1]

        def keep(t, inside=inside, saved=saved, params=params):
            st = t.untyped_storage()
            if inside[0] and st.data_ptr() not in params:
                saved[st.data_ptr()] = st.nbytes()
            return t

        block.register_forward_pre_hook(enter, with_kwargs=True)
        block.register_forward_hook(lambda *_, inside=inside: inside.__setitem__(0, False))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            w._forward(Batch(ids, torch.tensor([128, 100, 128, 77])), w.model)
        assert w._packs()  # the trainer's default: the planner's terms are for packed microbatches
        out.append(sum(saved.values()) / tokens[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_qwen2_moe", "tiny_glm4_moe", "tiny_deepseek_v3"])
def test_activations_term_is_what_the_local_spec_keeps_for_backward(model, request):
    """The plan's activations per token, with and without recompute, in float32 and bf16, against what
    autograd keeps in the decoder per token (Qwen3-MoE: q/k norms; Qwen2-MoE: a shared expert and q/k/v
    biases; GLM-4.5: half-rotary heads; DeepSeek-V3: multi-latent attention, its 512-wide latent).
    With recompute the plan adds one layer's full activations, alive while the backward recomputes it:
    measured as a layer's share without recompute, so the forward's part is compared."""
    path = request.getfixturevalue(model)
    shape = ModelShape.from_hf(json.loads((path / "config.json").read_text()))
    cases = [(dtype, recompute) for dtype in ("float32", "bfloat16") for recompute in (False, True)]
    measured = run_ranks(activations_job, 1, (str(path), cases))[0]
    for (dtype, recompute), per_token in zip(cases, measured, strict=True):
        cfg = _plan_cfg(dtype, model={"dtype": dtype, "recompute": recompute})
        b = 4 if dtype == "float32" else 2
        tokens = max(cfg.trainer.micro_batch_tokens, cfg.rollout.max_model_len)
        planned = trainer_memory(shape, cfg, "policy")["activations"] / tokens
        if recompute:
            planned -= shape.activation_bytes(False, b, local=True)
        # the float32 RoPE frequencies recompute keeps once and padding's share: left out of the plan
        assert per_token == pytest.approx(planned, rel=0.06), (dtype, recompute, per_token, planned)
