"""Rank functions for the Megatron tests (run in spawned gloo ranks by moe_rl.train.launch_local)."""

import dataclasses

import torch
from conftest import model_spec, optim_spec

from moe_rl.batch import Batch
from moe_rl.config import RunConfig, TrainerSection
from moe_rl.driver import specs

B, S = 4, 12


def batch_tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (B, S), generator=g)
    lengths = torch.tensor([12, 7, 10, 9])
    valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
    mask = valid & (torch.arange(S) >= 3)  # positions 3.. are "model tokens"
    adv = torch.randn(B, S, generator=g) * mask
    return ids, lengths, mask, adv


# production's policy loss as configured by default (PPO-Clip, token mean, eps 0.2) and the loop's
# global denominator; pi_old is given (logp_old_BS, off the current policy), as a separate pass scores it
POLICY = specs.policy_loss(RunConfig(trainer=TrainerSection(proximal_pass="separate")))


def policy_loss():
    return POLICY


def policy_tensors(logp_now, mask, adv):
    """The loss tensors of a PPO step whose behaviour log-probs lie a fixed random offset (std 0.15)
    away from the model's current ones, so ratios spread over both sides of the clip range and the
    loss and its gradient depend on the model; importance weights in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(1)
    offset = 0.15 * torch.randn(B, S, generator=g)
    is_weight = 0.5 + torch.rand(B, S, generator=g)
    return {"pg_mask_BS": mask, "loss_mask_BS": mask, "adv_BS": adv,
            "logp_old_BS": (logp_now - offset) * mask, "is_weight_BS": is_weight}


class Denominator(dict):
    """The global token-mean denominator sum(mask), for a loss that returns one numerator (a tensor)
    or one per term ({term: tensor}, as TrainWorker.train_step also accepts): every term of these
    unweighted token-mean losses shares it."""

    def __init__(self, mask):
        from moe_rl.algos.aggregate import loss_denominator

        super().__init__()
        self.value = loss_denominator(mask, POLICY.aggregation)

    def __missing__(self, term):
        return self.value

    def to(self, dtype):
        return self.value.to(dtype)



def layout_job(rank, world, hf_path, layout, dispatcher, routes, pack=False):
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, moe_dispatcher=dispatcher),
                    # eps 1e-4: Adam does not blow rounding noise in near-zero grads up to full lr steps
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24, pack_sequences=pack))
    ids, lengths, mask, adv = batch_tensors()
    lay = parallel.Layout(**layout)
    dp_size = w.ps.get_data_parallel_world_size()
    dp = parallel.dp_rank_of(rank, lay.tp, lay.cp, dp_size)  # production's sharding (trainer_groups._shard)
    rows = parallel.dp_rows(B, dp, dp_size)
    free = Batch(ids, lengths)
    out = {"free": w.score(free, record_routes=True), "dp_rank": (dp, w.ps.get_data_parallel_rank())}
    out["replay"] = w.score(Batch(ids, lengths, routes))
    tensors = policy_tensors(out["replay"].logp_BS, mask, adv)  # pi_old: scored with the replayed routes
    shard = Batch(ids, lengths, routes, **tensors).rows(rows)
    routers = [(n, p.detach().clone()) for n, p in w.module.named_parameters() if "router" in n]
    # global denominator of the batch
    out["step"] = w.train_step(shard, policy_loss(), Denominator(mask)).figures
    out["router_moved"] = [float((p - dict(w.module.named_parameters())[n].detach()).abs().max())
                           for n, p in routers]
    out["after_replay"] = w.score(Batch(ids, lengths, routes))
    out["after_free"] = w.score(free, record_routes=True)
    out["mbs"] = len(shard.microbatches(24))
    # how the worker cuts the shard: rows it packs are counted by their tokens, rows it pads by their padded
    # size (a budget of 30 tokens cuts the lengths 12, 7, 10, 9 as 3 + 1 rows packed, 2 + 2 padded)
    w.optim_spec = dataclasses.replace(w.optim_spec, micro_batch_tokens=30)
    out["worker_mbs"] = [mb.size for mb in w._microbatches(shard)]
    out["padded_mbs"] = [mb.size for mb in shard.microbatches(30, packed=False)]
    return out


def ckpt_job(rank, world, hf_path, layout, ckpt_dir, mode, lora=None):
    """mode 'save': step, save, step (reference). mode 'load': load, step. Returns step-2 figures.
    `lora`: a LoraSpec for the policy's adapters."""
    from moe_rl.train import checkpoint, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, lora=lora),
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24, pack_sequences=False),
                    load_weights=mode == "save" or lora is not None)  # LoRA: its base is the HF checkpoint
    ids, lengths, mask, adv = batch_tensors()

    def batch():  # pi_old: the current weights' log-probs, offset (the same offset in both runs)
        return Batch(ids, lengths, None, **policy_tensors(w.score(Batch(ids, lengths)).logp_BS, mask, adv))

    if mode == "save":
        w.train_step(batch(), policy_loss(), Denominator(mask))
        checkpoint.save(w, ckpt_dir, extra={"step": 1, "note": "after one update"})
        import multiprocessing

        # what the save left running
        extra = {"children": [p.name for p in multiprocessing.active_children()]}
    else:
        extra = checkpoint.load(w, ckpt_dir)
    step2 = w.train_step(batch(), policy_loss(), Denominator(mask)).figures
    return {"step2": step2, "after": w.score(Batch(ids, lengths)), "extra": extra, "steps": w.steps}


def hf_roundtrip_job(rank, world, hf_path, layout):
    """Load HF weights into this layout, export them back; return the exported tensors of this rank."""
    from moe_rl.train import hf_io, parallel
    from moe_rl.train import model as M

    parallel.init_distributed(parallel.Layout(**layout))
    from moe_rl.train import cpu_compat

    cpu_compat.seed_model_parallel(0)
    spec = model_spec(hf_path)
    bridge = M.make_bridge(spec)
    module = M.build_gpt(bridge, spec)
    hf_io.load_hf_weights(bridge, module, hf_path)
    return dict(hf_io.export_hf_weights(bridge, module))


def critic_job(rank, world, hf_path, layout):
    from moe_rl.train import parallel
    from moe_rl.train.objectives import ValueLoss
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path), role="critic",
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=4096, pack_sequences=False))
    ids, lengths, mask, adv = batch_tensors()
    before = w.score(Batch(ids, lengths)).critic_out_BS
    returns = critic_returns()
    # values_old 0 with clip=None: the loss is 1/2 (V(s_t) - G_t)^2 on model tokens, V(s_t) = out[t-1]
    batch = Batch(ids, lengths, mask_BS=mask, returns_BS=returns, values_old_BS=torch.zeros(B, S))

    emb0 = dict(w.module.named_parameters())["embedding.word_embeddings.weight"].detach().clone() \
        if w.ps.is_pipeline_first_stage() else None
    head = w.module.output_layer.weight if w.ps.is_pipeline_last_stage() else None
    head0 = None if head is None else head.detach().clone()
    step = w.train_step(batch, ValueLoss(None), Denominator(mask)).figures
    after = w.score(Batch(ids, lengths)).critic_out_BS
    backbone = {n: p.detach().clone() for n, p in w.module.named_parameters() if "output_layer" not in n}
    # a second step: its loss is computed from `after` (nonzero values), where the V(s_t) shift shows
    step2 = w.train_step(batch, ValueLoss(None), Denominator(mask)).figures
    return {"before": before, "after": after, "step": step, "step2": step2,
            "backbone_names": sorted(backbone),
            "head_moved": None if head is None else float((head.detach() - head0).abs().max()),
            "embedding_at_start": emb0}


def critic_returns():
    """Per-token returns (varying along the sequence, so V(s_t) = out[t-1] and out[t] fit differently)."""
    return 1.0 + torch.randn(B, S, generator=torch.Generator().manual_seed(5))


def own_routes_job(rank, world, hf_path, seeds):
    """Free routing vs replaying the routes it recorded, over random batches of random lengths
    (microbatched: padding positions inside each microbatch pass through the experts too). Returns,
    per seed, the largest |replay - free| log-prob over valid positions."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path),
                    optim=optim_spec(1e-5, micro_batch_tokens=24, pack_sequences=False))
    gaps = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 300, (B, S), generator=g)
        lengths = torch.randint(3, S + 1, (B,), generator=g)
        valid = torch.arange(S).expand(B, S) < lengths.unsqueeze(1)
        free = w.score(Batch(ids, lengths), record_routes=True)
        again = w.score(Batch(ids, lengths, free.routes_BSLK))
        gaps.append(float(((again.logp_BS - free.logp_BS).abs() * valid).max()))
    return gaps


def recompute_job(rank, world, hf_path, routes, pack=False):
    """Full activation recompute with router replay: the replayed routes must be used again when the
    layers are recomputed in backward. Also: a valid token without a route is refused."""
    from moe_rl.train import parallel
    from moe_rl.train.replay import MissingRoutes
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path, recompute=True),
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24, pack_sequences=pack))
    ids, lengths, mask, adv = batch_tensors()
    tensors = policy_tensors(w.score(Batch(ids, lengths, routes)).logp_BS, mask, adv)
    shard = Batch(ids, lengths, routes, **tensors)
    step = w.train_step(shard, policy_loss(), Denominator(mask)).figures
    after = w.score(Batch(ids, lengths, routes))
    broken = routes.clone()
    broken[1, 2, 0, 0] = 255  # no expert of the model (a uint8 route cannot say -1)
    try:
        w.score(Batch(ids, lengths, broken))
        refused = None
    except MissingRoutes as err:
        refused = str(err)
    return {"step": step, "after_replay": after, "refused": refused}


def offload_job(rank, world, hf_path, layout, dtype, offload):
    """Two policy steps; with `offload`, the rank's memory goes to the host and back before each (as a
    colocated rollout would make it). Returns scores, step figures, the weights and the bytes moved."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, dtype=dtype),
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24))
    ids, lengths, mask, adv = batch_tensors()
    out = {"moved": [], "steps": [], "scores": []}
    for _ in range(2):
        if offload:
            out["moved"].append(w.offload())
            out["emptied"] = all(p.untyped_storage().nbytes() == 0 for p in w.module.parameters())
            refused = []
            for call in (lambda: w.score(Batch(ids, lengths)), w.offload):  # nothing reads an absent weight
                try:
                    call()
                except RuntimeError as err:
                    refused.append(str(err).split(":")[0])
            out["refused"] = refused
            w.onload()
        logp = w.score(Batch(ids, lengths)).logp_BS
        out["scores"].append(logp)
        out["steps"].append(w.train_step(Batch(ids, lengths, None, **policy_tensors(logp, mask, adv)),
                                         policy_loss(), Denominator(mask)).figures)
    out["weights"] = {n: p.detach().clone() for n, p in w.module.named_parameters()}
    return out


def nonfinite_job(rank, world, hf_path):
    """DP2: a step whose advantages hold a NaN in rank 0's shard only, then a finite step."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path), optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24))
    ids, lengths, mask, adv = batch_tensors()
    rows = parallel.dp_rows(B, rank, world)
    before = {n: p.detach().clone() for n, p in w.module.named_parameters()}
    logp = w.score(Batch(ids, lengths)).logp_BS
    poisoned = adv.clone()
    poisoned[rows.start, 5] = float("nan") if rank == 0 else poisoned[rows.start, 5]
    bad = w.train_step(Batch(ids, lengths, None, **policy_tensors(logp, mask, poisoned)).rows(rows),
                       policy_loss(), Denominator(mask)).figures
    untouched = all(torch.equal(before[n], p) for n, p in w.module.named_parameters())
    good = w.train_step(Batch(ids, lengths, None, **policy_tensors(logp, mask, adv)).rows(rows),
                        policy_loss(), Denominator(mask)).figures
    finite = all(bool(torch.isfinite(p).all()) for p in w.module.parameters())
    moved = any(not torch.equal(before[n], p) for n, p in w.module.named_parameters())
    return {"bad": bad, "untouched": untouched, "good": good, "finite": finite, "moved": moved}


def router_loss_job(rank, world, hf_path, aux, z, replay_first_experts=False):
    """One policy update with the MoE router losses at the given coefficients, from the same weights
    and batch: the step's figures, the routers' weights after it and the expert bias's update rate.
    replay_first_experts: every token's routes replayed as experts 0..K-1 (not the router's choice)."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z),
                    optim=optim_spec(1e-2, micro_batch_tokens=24))
    ids, lengths, mask, adv = batch_tensors()
    routes = None
    if replay_first_experts:
        free = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
        routes = torch.arange(free.shape[-1], dtype=free.dtype).expand_as(free).clone()
    logp = w.score(Batch(ids, lengths, routes)).logp_BS
    figures = w.train_step(Batch(ids, lengths, routes, **policy_tensors(logp, mask, adv)), policy_loss(),
                           Denominator(mask)).figures
    routers = {n: p.detach().clone() for n, p in w.module.named_parameters() if "router" in n}
    return {"figures": figures, "routers": routers, "bias_rate": w.config.moe_router_bias_update_rate,
            "logp": logp}


def reward_model_job(rank, world, hf_path, layout):
    """A reward model as the run builds it (a critic whose value head is the checkpoint's score.weight):
    its score of each row, the output at the row's last position (algos.targets.boundary_values)."""
    from moe_rl.algos.targets import boundary_values
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    spec = model_spec(hf_path, routing_replay=False)
    w = TrainWorker(spec, role="critic", optim=optim_spec(1e-3), value_head_from=hf_path, trains=False)
    ids, lengths, _, _ = batch_tensors()
    return boundary_values(w.score(Batch(ids, lengths)).critic_out_BS, lengths)


def proximal_job(rank, world, hf_path, from_forward, mu_offset=0.0):
    """One policy update on this rank's shard (DP = world), routes replayed: pi_old scored first by a
    forward of its own (from_forward=False) or taken from the update's own forward (True: keep_logp,
    and mu = pi_old checked before the backward pass; mu is pi_old + mu_offset on model tokens)."""
    import dataclasses

    from moe_rl.algos.checks import BatchCheckError
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path), optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24))
    ids, lengths, mask, adv = batch_tensors()
    routes = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
    logp = w.score(Batch(ids, lengths, routes)).logp_BS  # pi_old as the separate pass scores it
    loss = dataclasses.replace(POLICY, old_from_forward=from_forward, check_sync=from_forward)
    rows = parallel.dp_rows(B, rank, world)
    shard = Batch(ids, lengths, routes, pg_mask_BS=mask, loss_mask_BS=mask, adv_BS=adv, logp_old_BS=logp,
                  is_weight_BS=torch.ones(B, S),
                  logp_mu_BS=logp + mu_offset * mask).rows(rows).only(loss.fields)
    before = [p.detach().clone() for p in w.module.parameters()]
    try:
        step = w.train_step(shard, loss, Denominator(mask), keep_logp=from_forward)
    except BatchCheckError as err:
        return {"refused": str(err),
                "untouched": all(torch.equal(a, p)
                                 for a, p in zip(before, w.module.parameters(), strict=True))}
    params = [p.detach().clone() for p in w.module.parameters()]
    return {"step": step, "scored": logp[rows], "params": params, "fields": loss.fields,
            "moved": sum(not torch.equal(a, p) for a, p in zip(before, params, strict=True))}


def teacher_job(rank, world, hf_path, layout):
    """A distillation teacher as the run builds one (trainer_groups.Models: role policy, no replay, scoring
    only): its log-probs of batch_tensors' rows, routing freely."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, routing_replay=False), optim=optim_spec(1e-3), trains=False)
    ids, lengths, _, _ = batch_tensors()
    return w.score(Batch(ids, lengths)).logp_BS


def lora_job(rank, world, hf_path, layout, targets, recompute=False, ckpt_dir=None):
    """The policy with LoRA adapters (rank 4, alpha 8) on `targets` in `layout`: scores before, two PPO
    steps on the routes it recorded (this rank's data-parallel shard), scores after (replayed and free),
    whether every base parameter is bitwise unchanged, the numbers of trainable and optimizer elements,
    and the merged Hugging Face weights this rank exports; saved to `ckpt_dir` where given."""
    from moe_rl.train import hf_io, lora, parallel
    from moe_rl.train.worker import TrainWorker

    lay = parallel.Layout(**layout)
    parallel.init_distributed(lay)
    settings = lora.LoraSpec(rank=4, alpha=8.0, targets=tuple(targets))
    w = TrainWorker(model_spec(hf_path, lora=settings, recompute=recompute),
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24))
    ids, lengths, mask, adv = batch_tensors()
    dp_size = w.ps.get_data_parallel_world_size()
    rows = parallel.dp_rows(B, parallel.dp_rank_of(rank, lay.tp, lay.cp, dp_size), dp_size)
    params = dict(w.module.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items() if not lora.is_adapter(n)}
    out = {"before": w.score(Batch(ids, lengths), record_routes=True), "steps": []}
    routes = out["before"].routes_BSLK
    for _ in range(2):
        logp = w.score(Batch(ids, lengths, routes)).logp_BS
        shard = Batch(ids, lengths, routes, **policy_tensors(logp, mask, adv)).rows(rows)
        out["steps"].append(w.train_step(shard, policy_loss(), Denominator(mask)).figures)
    out["after"] = w.score(Batch(ids, lengths, routes))
    out["after_free"] = w.score(Batch(ids, lengths))
    out["base_after"] = w.score(Batch(ids, lengths), adapters=False)  # the KL reference: the frozen base
    out["after_again"] = w.score(Batch(ids, lengths))
    if ckpt_dir is not None:
        from moe_rl.train import checkpoint

        checkpoint.save(w, ckpt_dir)
    out["base_same"] = all(torch.equal(params[n], b) for n, b in base.items())
    out["trainable"] = sorted(n for n, p in params.items() if p.requires_grad)
    out["adapter_numel"] = sum(p.numel() for p in lora.adapter_parameters(w.module).values())
    optimizers = getattr(w.optimizer, "chained_optimizers", [w.optimizer])
    out["optimizer_numel"] = sum(p.numel() for opt in optimizers for g in opt.optimizer.param_groups
                                 for p in g["params"])
    out["merged"] = dict(hf_io.export_hf_weights(w.bridge, w.module))
    adapted = dict(lora.adapted_weights(w.module))
    out["merged_by_formula"] = {
        n: (m.weight.double() + settings.scale * m.b.double() @ m.a.double()).float()
        for n, m in adapted.items()}
    out["merged_local"] = {n: lora.merged_weight(m) for n, m in adapted.items()}
    return out


def lora_gradient_job(rank, world, hf_path, merged_dir):
    """One PPO loss's gradients two ways: the adapters' (B drawn nonzero, so both factors get one) and the
    whole weights' of the merged model W + (alpha/r) B A (saved to `merged_dir`, a second model built
    from it). Returns {weight name: (dA, dB, dW, A, B)} for every adapted weight (grad clipping off)."""
    from moe_rl.train import hf_io, lora, parallel
    from moe_rl.train.worker import TrainWorker
    from moe_rl.weights.hf import save_hf_checkpoint

    parallel.init_distributed(parallel.Layout())
    settings = lora.LoraSpec(rank=4, alpha=8.0, targets=lora.TARGETS)
    optim = optim_spec(0.0, grad_clip=0.0, micro_batch_tokens=24)
    w = TrainWorker(model_spec(hf_path, lora=settings), optim=optim)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, adapter in lora.adapted_weights(w.module):
            adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.1)
    save_hf_checkpoint(hf_io.export_hf_weights(w.bridge, w.module), merged_dir, hf_path)
    whole = TrainWorker(model_spec(merged_dir), optim=optim)
    ids, lengths, mask, adv = batch_tensors()
    grads, routes = [], w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
    for worker in (w, whole):
        logp = worker.score(Batch(ids, lengths, routes)).logp_BS
        worker.train_step(Batch(ids, lengths, routes, **policy_tensors(logp, mask, adv)), policy_loss(),
                          Denominator(mask))
        grads.append({n: p.main_grad.detach().clone() for n, p in worker.module.named_parameters()
                      if getattr(p, "main_grad", None) is not None})
    adapter_grads, whole_grads = grads
    out = {}
    for name, adapter in lora.adapted_weights(w.module):
        prefix = name.rsplit(".weight", 1)[0]
        out[name] = (adapter_grads[f"{prefix}.lora_A"], adapter_grads[f"{prefix}.lora_B"], whole_grads[name],
                     adapter.a.detach(), adapter.b.detach())
    return out


def chunked_logprobs_job(rank, world, hidden, weight, targets, g_logp, g_ent, chunk):
    """chunked_target_logprobs over a TP group of `world` ranks, each with its vocabulary slice of `weight`;
    the hidden states replicated. Returns this rank's values and gradients (hidden: its partial)."""
    import torch.distributed as dist

    from moe_rl.train.logprobs import chunked_target_logprobs

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    h = hidden.clone().requires_grad_(True)
    w = weight.chunk(world)[rank].clone().requires_grad_(True)
    logp, ent = chunked_target_logprobs(h, w, targets, chunk, group, rank, world, g_ent is not None)
    loss = (g_logp * logp).sum() + ((g_ent * ent).sum() if g_ent is not None else 0)
    loss.backward()
    return {"logp": logp.detach(), "ent": None if ent is None else ent.detach(), "d_hidden": h.grad,
            "d_weight": w.grad}


def chunk_worker_job(rank, world, hf_path, layout, chunk, pack=False):
    """A policy's scores and one PPO step with trainer.logit_chunk_tokens=`chunk` (0: the whole logits)."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path),
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24, pack_sequences=pack,
                                         logit_chunk_tokens=chunk))
    ids, lengths, mask, adv = batch_tensors()
    routes = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
    before = w.score(Batch(ids, lengths, routes))
    batch = Batch(ids, lengths, routes, **policy_tensors(before.logp_BS, mask, adv))
    figures = w.train_step(batch, policy_loss(), Denominator(mask)).figures
    after = w.score(Batch(ids, lengths, routes))
    return {"logp": before.logp_BS, "entropy": before.entropy_BS, "grad_norm": figures["grad_norm"],
            "after": after.logp_BS, "params": {n: p.detach().clone() for n, p in w.module.named_parameters()}}


def optimizer_offload_job(rank, world, hf_path, layout, offload, steps=3, precision_aware=False,
                          dtype="float32"):
    """`steps` PPO updates on the same batch with trainer.optimizer_offload=`offload` (a GPU feature; and
    trainer.precision_aware_optimizer, a `dtype` model): each step's figures, the log-probs after, and the
    optimizer's class (HybridDeviceOptimizer where offloaded)."""
    from moe_rl.train import parallel
    from moe_rl.train.hf_parity import exact_fp32_matmuls
    from moe_rl.train.worker import TrainWorker

    exact_fp32_matmuls()
    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(hf_path, dtype=dtype),
                    optim=optim_spec(1e-2, adam_eps=1e-4, micro_batch_tokens=24,
                                         optimizer_offload=offload, precision_aware=precision_aware))
    ids, lengths, mask, adv = batch_tensors()
    routes = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
    before = w.score(Batch(ids, lengths, routes))
    batch = Batch(ids, lengths, routes, **policy_tensors(before.logp_BS, mask, adv))
    figures = [w.train_step(batch, policy_loss(), Denominator(mask)).figures for _ in range(steps)]
    chained = getattr(w.optimizer, "chained_optimizers", [w.optimizer])
    return {"figures": figures, "after": w.score(Batch(ids, lengths, routes)).logp_BS,
            "inner": sorted({type(o.optimizer).__name__ for o in chained})}

