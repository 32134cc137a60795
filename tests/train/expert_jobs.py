"""Rank functions for the expert tests (grouped vs sequential experts, the routers' precision), run in
spawned gloo ranks by moe_rl.train.launch_local."""

import dataclasses

import torch
from conftest import model_spec, optim_spec
from train_jobs import B, Denominator, S, batch_tensors, policy_loss, policy_tensors

from moe_rl.batch import Batch


def experts_job(rank, world, hf_path, layout, lora_rank=0, dtype="float32"):
    """The same model (and, with `lora_rank`, adapters on every expert linear, B drawn nonzero) built with
    sequential and with grouped experts in `layout`: for each, the expert module's class, the log-probs
    scored with replayed routes that leave experts 2 and 3 without a token in layer 0 (layer 1 routes
    over all four), and one PPO loss's gradients (this rank's shard of every trainable parameter)."""
    from moe_rl.train import lora, parallel
    from moe_rl.train.worker import TrainWorker

    lay = parallel.Layout(**layout)
    parallel.init_distributed(lay)
    ids, lengths, mask, adv = batch_tensors()
    routes = torch.zeros(B, S, 2, 2, dtype=torch.long)
    routes[:, :, 0] = torch.tensor([0, 1])
    routes[:, :, 1] = torch.stack([torch.arange(B * S) % 4, (torch.arange(B * S) + 1) % 4], -1).view(B, S, 2)
    settings = lora.LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank, targets=("linear_fc1", "linear_fc2")) \
        if lora_rank else None
    optim = optim_spec(0.0, grad_clip=0.0, micro_batch_tokens=24)
    out = {}
    for experts in ("sequential", "grouped"):
        w = TrainWorker(model_spec(hf_path, experts=experts, lora=settings, dtype=dtype), optim=optim)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, adapter in lora.adapted_weights(w.module):
                adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.1)
        dp_size = w.ps.get_data_parallel_world_size()
        rows = parallel.dp_rows(B, parallel.dp_rank_of(rank, lay.tp, lay.cp, dp_size), dp_size)
        logp = w.score(Batch(ids, lengths, routes)).logp_BS
        w.train_step(Batch(ids, lengths, routes, **policy_tensors(logp, mask, adv)).rows(rows), policy_loss(),
                     Denominator(mask))
        out[experts] = {
            "module": {type(m).__name__ for n, m in w.module.named_modules() if n.endswith("mlp.experts")},
            "logp": logp,
            "grads": {n: p.main_grad.detach().clone() for n, p in w.module.named_parameters()
                      if getattr(p, "main_grad", None) is not None}}
    return out


def experts_choice_job(rank, world, hf_path):
    """model.local_experts's choice for each model.experts value, on the model's config and on one whose
    expert width (62 fp32 elements: 248 bytes) torch's grouped GEMM cannot take."""
    from moe_rl.train import model as M
    from moe_rl.train import parallel

    parallel.init_distributed(parallel.Layout())
    spec = model_spec(hf_path)
    config = M.make_bridge(spec).config
    odd = dataclasses.replace(config, moe_ffn_hidden_size=62)
    out = {}
    for name, cfg in (("", config), ("odd ", odd)):
        for experts in ("auto", "grouped", "sequential"):
            try:
                chosen = M.local_experts(dataclasses.replace(spec, experts=experts), cfg)
                out[name + experts] = chosen.__name__
            except ValueError as err:
                out[name + experts] = str(err)
    return out


def bf16_routes_job(rank, world, hf_path, ids):
    """The bfloat16 trainer's free routes [B, S, L, k] and the routers' precision it was built with."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path, dtype="bfloat16"), optim=optim_spec(1e-6))
    routes = w.score(Batch(ids, torch.full((ids.shape[0],), ids.shape[1])), record_routes=True).routes_BSLK
    return routes, w.config.moe_router_dtype
