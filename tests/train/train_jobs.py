"""Rank functions for the Megatron tests (run in spawned gloo ranks by moe_rl.train.launch_local)."""

import torch

B, S = 4, 12


def batch_tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (B, S), generator=g)
    lengths = torch.tensor([12, 7, 10, 9])
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    mask = valid & (torch.arange(S) >= 3)  # positions 3.. are "model tokens"
    adv = torch.randn(B, S, generator=g) * mask
    return ids, lengths, mask, adv


def pg_loss(outputs, mb):
    """Numerator of a token-sum policy-gradient loss: -sum A * logp over masked tokens."""
    m = mb.tensors["mask"].float()
    num = -(mb.tensors["adv"] * outputs["logp"] * m).sum()
    return num, {"entropy_mean": (outputs["entropy"] * m).sum() / m.sum().clamp(min=1)}


def layout_job(rank, world, hf_path, layout, dispatcher, routes, pack=False):
    from moe_rl.train import model as M
    from moe_rl.train import parallel
    from moe_rl.train.worker import OptimSettings, TokenBatch, TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(M.ModelSpec(hf_path=hf_path, moe_dispatcher=dispatcher),
                    # eps 1e-4: Adam does not blow rounding noise in near-zero grads up to full lr steps
                    optim=OptimSettings(lr=1e-2, adam_eps=1e-4, micro_batch_tokens=24, pack_sequences=pack))
    ids, lengths, mask, adv = batch_tensors()
    dp, dp_size = w.ps.get_data_parallel_rank(), w.ps.get_data_parallel_world_size()
    rows = slice(dp * B // dp_size, (dp + 1) * B // dp_size)  # this data-parallel rank's shard
    free = TokenBatch(ids, lengths)
    out = {"free": w.score(free, record_routes=True)}
    out["replay"] = w.score(TokenBatch(ids, lengths, routes))
    shard = TokenBatch(ids[rows], lengths[rows], routes[rows], {"mask": mask[rows], "adv": adv[rows]})
    denom = mask.sum().double()  # global denominator of the whole batch
    routers = [(n, p.detach().clone()) for n, p in w.module.named_parameters() if "router" in n]
    out["step"] = w.train_step(shard, pg_loss, denom)
    out["router_moved"] = [float((p - dict(w.module.named_parameters())[n].detach()).abs().max()) for n, p in routers]
    out["after_replay"] = w.score(TokenBatch(ids, lengths, routes))
    out["after_free"] = w.score(free, record_routes=True)
    out["mbs"] = len(shard.microbatches(24))
    return out


def ckpt_job(rank, world, hf_path, layout, ckpt_dir, mode):
    """mode 'save': step, save, step (reference). mode 'load': load, step. Returns step-2 figures."""
    from moe_rl.train import checkpoint, parallel
    from moe_rl.train import model as M
    from moe_rl.train.worker import OptimSettings, TokenBatch, TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(M.ModelSpec(hf_path=hf_path), optim=OptimSettings(lr=1e-2, adam_eps=1e-4, micro_batch_tokens=24),
                    load_weights=mode == "save")
    ids, lengths, mask, adv = batch_tensors()
    batch = TokenBatch(ids, lengths, None, {"mask": mask, "adv": adv})
    denom = mask.sum().double()
    if mode == "save":
        w.train_step(batch, pg_loss, denom)
        checkpoint.save(w, ckpt_dir, extra={"step": 1, "note": "after one update"})
        extra = None
    else:
        extra = checkpoint.load(w, ckpt_dir)
    step2 = w.train_step(batch, pg_loss, denom)
    return {"step2": step2, "after": w.score(TokenBatch(ids, lengths)), "extra": extra, "steps": w.steps}


def hf_roundtrip_job(rank, world, hf_path, layout):
    """Load HF weights into this layout, export them back; return the exported tensors of this rank."""
    from moe_rl.train import model as M
    from moe_rl.train import parallel
    from moe_rl.weights import hf

    parallel.init_distributed(parallel.Layout(**layout))
    from moe_rl.train import cpu_compat

    cpu_compat.seed_model_parallel(0)
    spec = M.ModelSpec(hf_path=hf_path)
    bridge = M.make_bridge(spec)
    module = M.build_gpt(bridge, spec)
    hf.load_hf_weights(bridge, module, hf_path)
    return dict(hf.export_hf_weights(bridge, module))


def critic_job(rank, world, hf_path, layout):
    from moe_rl.train import model as M
    from moe_rl.train import parallel
    from moe_rl.train.worker import OptimSettings, TokenBatch, TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(M.ModelSpec(hf_path=hf_path), role="critic", optim=OptimSettings(lr=1e-2, adam_eps=1e-4))
    ids, lengths, mask, adv = batch_tensors()
    before = w.score(TokenBatch(ids, lengths))["values"]
    returns = torch.ones(B, S)

    def value_loss(outputs, mb):
        m = mb.tensors["mask"].float()
        return (0.5 * (outputs["values"] - mb.tensors["returns"]).square() * m).sum(), {}

    emb0 = dict(w.module.named_parameters())["embedding.word_embeddings.weight"].detach().clone() if w.ps.is_pipeline_first_stage() else None
    head = w.module.output_layer.weight if w.ps.is_pipeline_last_stage() else None
    head0 = None if head is None else head.detach().clone()
    step = w.train_step(TokenBatch(ids, lengths, None, {"mask": mask, "returns": returns}), value_loss, mask.sum().double())
    after = w.score(TokenBatch(ids, lengths))["values"]
    backbone = {n: p.detach().clone() for n, p in w.module.named_parameters() if "output_layer" not in n}
    return {"before": before, "after": after, "step": step, "backbone_names": sorted(backbone),
            "head_moved": None if head is None else float((head.detach() - head0).abs().max()),
            "embedding_at_start": emb0}


def recompute_job(rank, world, hf_path, routes, pack=False):
    """Full activation recompute with router replay: the replayed routes must be used again when the
    layers are recomputed in backward. Also: a valid token without a route is refused."""
    from moe_rl.train import model as M
    from moe_rl.train import parallel
    from moe_rl.train.replay import MissingRoutes
    from moe_rl.train.worker import OptimSettings, TokenBatch, TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(M.ModelSpec(hf_path=hf_path, recompute=True),
                    optim=OptimSettings(lr=1e-2, adam_eps=1e-4, micro_batch_tokens=24, pack_sequences=pack))
    ids, lengths, mask, adv = batch_tensors()
    shard = TokenBatch(ids, lengths, routes, {"mask": mask, "adv": adv})
    step = w.train_step(shard, pg_loss, mask.sum().double())
    after = w.score(TokenBatch(ids, lengths, routes))
    broken = routes.clone()
    broken[1, 2, 0, 0] = -1
    try:
        w.score(TokenBatch(ids, lengths, broken))
        refused = None
    except MissingRoutes as err:
        refused = str(err)
    return {"step": step, "after_replay": after, "refused": refused}
