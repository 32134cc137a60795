"""Rank functions for the DeepSeek-V3 / GLM-4.5 tests (grouped routing with an expert bias, whole-row
scoring), run in spawned gloo ranks by moe_rl.train.launch_local."""

import torch
from conftest import model_spec, optim_spec
from train_jobs import Denominator, batch_tensors, policy_loss, policy_tensors

from moe_rl.batch import Batch


def expert_bias_job(rank, world, hf_path, rate, replay):
    """One policy update of a model whose routers carry an expert bias, at model.expert_bias_update_rate
    `rate`, routing freely or replaying its own routes: the bias before and after, per router."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path, expert_bias_update_rate=rate, routing_replay=replay),
                    optim=optim_spec(1e-2, micro_batch_tokens=24))

    def biases():
        return {n: b.detach().clone() for n, b in w.module.named_buffers() if n.endswith("expert_bias")}

    before = biases()
    ids, lengths, mask, adv = batch_tensors()
    routes = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK if replay else None
    logp = w.score(Batch(ids, lengths, routes)).logp_BS
    w.train_step(Batch(ids, lengths, routes, **policy_tensors(logp, mask, adv)), policy_loss(),
                 Denominator(mask))
    return before, biases()


def hf_logprobs_job(rank, world, hf_path, ids):
    """The trainer's log-probs of whole rows `ids` [B, S] (free routing, rows padded)."""
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path, routing_replay=False),
                    optim=optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    return w.score(Batch(ids, torch.full((ids.shape[0],), ids.shape[1]))).logp_BS


def gradient_job(rank, world, hf_path, pack):
    """The gradient of a PPO loss at ratio 1 (pi_old the model's own scores, importance weights 1): L =
    -sum(A * mask * logp) / sum(mask), whose gradient is the policy gradient itself, in microbatches of 24
    tokens (padded or packed), routes the model's own replayed. Returns {HF name: gradient} as the
    checkpoint's tensors (the exporter's layout), and logp_BS."""
    from moe_rl.train import hf_io, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_path), optim=optim_spec(0.0, grad_clip=0.0, micro_batch_tokens=24,
                                                         pack_sequences=pack))
    ids, lengths, mask, adv = batch_tensors()
    routes = w.score(Batch(ids, lengths), record_routes=True).routes_BSLK
    logp = w.score(Batch(ids, lengths, routes)).logp_BS
    tensors = {"pg_mask_BS": mask, "loss_mask_BS": mask, "adv_BS": adv, "logp_old_BS": logp * mask,
               "is_weight_BS": torch.ones_like(logp)}
    w.train_step(Batch(ids, lengths, routes, **tensors), policy_loss(), Denominator(mask))
    with torch.no_grad():  # each parameter holds its gradient, so the exporter lays them out as HF's
        for _, p in w.module.named_parameters():
            p.copy_(p.main_grad)
    return dict(hf_io.export_hf_weights(w.bridge, w.module)), logp
