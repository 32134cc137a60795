"""A step's updates, epochs x minibatches over a trainer group (driver/trainer_groups.py), which only
shards batches over its ranks and gathers what they return: the policy's (PPO-EWMA's anchor rescored and
the correction recomputed per minibatch, a batch-scope mask such as M2PO decided per minibatch, pi_old
taken from the update's own forward) and the critic's value regression.

    figures, logp = fit(models, batch, targets, step)   # the critic's, then the policy's
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from moe_rl.algos import aggregate, registry
from moe_rl.algos.targets import Targets, correct, policy_denominators
from moe_rl.batch import Batch
from moe_rl.config import RunConfig
from moe_rl.metrics import reduce_updates, role_figures

if TYPE_CHECKING:
    from moe_rl.driver.trainer_groups import CriticGroup, Models, PolicyGroup


def fit(models: Models, batch: Batch, t: Targets, step: int) -> tuple[dict[str, float], torch.Tensor | None]:
    """The critic's update, then (past critic.warmup_steps) the policy's; their figures and the
    policy's log-probs before the update when its forward gave them (fit_policy).
    Timings and the policy's skip counts are figures of every step (0 for a model that did not train); the
    learning rates, of the steps that trained."""
    t0 = time.perf_counter()
    out = {"timing/critic_train_s": 0.0, "timing/actor_train_s": 0.0, "policy/skipped_minibatches": 0,
           "policy/skipped_nonfinite": 0}
    out |= fit_critic(models.critic, batch, t, step) if models.critic else {}
    logp = None
    if step >= models.cfg.critic.warmup_steps:
        figures, logp = fit_policy(models.policy, batch, t, step)
        out |= figures
    scoring_only = {"reference": models.reference, "reward_model": models.reward_model, **models.teachers}
    for role, group in scoring_only.items():  # their memory is asked for (the others report theirs
        if group:                             # with each update)
            out |= role_figures(role, group.call("memory"))
    tokens = float(batch.lengths_B.sum()) * models.cfg.trainer.epochs
    out["perf/train_tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
    return out, logp


def update_rows(cfg: RunConfig, n: int, dp: int, step: int) -> list[torch.Tensor]:
    """The rows of each update of a step, epoch after epoch: a random split of n rows (seeded by the
    step, the same in every epoch) into trainer.minibatches minibatches, at most n // dp of them so
    every data-parallel replica gets a row of each."""
    k = max(1, min(cfg.trainer.minibatches, n // dp))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.run.seed * 7919 + step))
    return [perm[i::k] for i in range(k)] * cfg.trainer.epochs


def fit_policy(group: PolicyGroup, batch: Batch, t: Targets,
               step: int) -> tuple[dict[str, float], torch.Tensor | None]:
    """Epochs x minibatches of the policy group's updates; the step's policy/ and correction/ figures, and
    with RunConfig.proximal_from_update the policy's log-probs before the update ([B, S], routes
    replayed: the update's own forward), else None.

    Under PPO-EWMA update n uses pi_{theta_bar_{n-1}}, the anchor as it is after the previous
    update: it is scored, and the correction recomputed, per minibatch (guide 000 section 7.2)."""
    cfg, p, t0 = group.cfg, group.params, time.perf_counter()
    group.set_lr(group.scheduled_lr(step))
    full = batch.with_targets(t)
    updates, corrections, masks, skipped, gap = [], [], [], 0, None
    logp = torch.zeros(batch.input_ids_BS.shape) if cfg.proximal_from_update else None
    for n, rows in enumerate(update_rows(cfg, batch.size, group.dp, step)):
        mb = full.rows(rows)
        if p.ewma_anchor:
            old = group.score(mb.model_inputs(), anchor=True).logp_BS
            c = correct(old, mb.logp_mu_BS, mb.mask_BS, p)
            corrections.append(c.metrics)
            if gap is None:  # the anchor vs the policy at the start of the step
                gap = float(((old - t.logp_policy_BS[rows][:, :old.shape[1]]).abs() * mb.mask_BS).sum()
                            / mb.mask_BS.sum().clamp(min=1))
            mb = dataclasses.replace(mb, logp_old_BS=old, is_weight_BS=c.weight_BT,
                                     pg_mask_BS=mb.loss_mask_BS & c.keep_BT)
        denominators = policy_denominators(mb.pg_mask_BS, mb.loss_mask_BS, mb.is_weight_BS, p)
        if group.loss.mask_scope == "batch":  # decided over the whole minibatch, denominators unchanged
            before = t.logp_policy_BS[rows] if n == 0 and t.logp_policy_BS is not None else None
            mb, figures = batch_mask(group, mb, before)
            masks.append(figures)
        trained = float(denominators["policy"]) > 0
        if trained:
            updates.append(group.train(mb, group.loss, denominators, keep_logp=logp is not None))
        else:  # nothing kept (or NaN): a skip, never an epsilon
            skipped += 1
        if logp is not None:  # pi_old from the update's forward, or (no update) a pass of its own
            kept = updates[-1].logp_BS if trained else group.score(mb.model_inputs()).logp_BS
            logp[rows, :kept.shape[1]] = kept
    out = role_figures("policy", [u.figures for u in updates])
    # a count, not a mean
    out["policy/skipped_nonfinite"] = sum(u.figures["skipped_nonfinite"] for u in updates)
    out.update({f"correction/{k}": v for k, v in reduce_updates(corrections).items()})
    out.update({f"policy/{k}": v for k, v in reduce_updates(masks).items()})
    out.update({"policy/skipped_minibatches": skipped, "timing/actor_train_s": time.perf_counter() - t0})
    if gap is not None:
        out["policy/anchor_logp_gap"] = gap
    return out, logp


def batch_mask(group: PolicyGroup, mb: Batch, logp_BS: torch.Tensor | None) -> tuple[Batch, dict]:
    """mb with the batch-scope policy mask (M2PO) decided over all of its rows, and its figures.
    pi_theta is the policy about to be updated: `logp_BS` where the caller has it (the first update
    of a step: the policy as scored before the step), else a forward pass of its own."""
    if logp_BS is None:
        logp_BS = group.score(mb.model_inputs()).logp_BS
    fn = registry.get("policy_mask", group.loss.policy_mask)
    keep, figures = fn(logp_BS[:, :mb.input_ids_BS.shape[1]], mb.logp_old_BS, mb.logp_mu_BS, mb.adv_BS,
                       mb.pg_mask_BS, group.loss.mask_spec)
    return dataclasses.replace(mb, policy_keep_BS=keep), figures


def fit_critic(group: CriticGroup, batch: Batch, t: Targets, step: int) -> dict[str, float]:
    """Epochs x minibatches of value regression to the returns; the step's critic/ figures."""
    cfg, t0 = group.cfg, time.perf_counter()
    full = dataclasses.replace(batch.with_targets(t), routes_BSLK=None)  # the critic routes freely
    updates = []
    for rows in update_rows(cfg, batch.size, group.dp, step):
        mb = full.rows(rows)
        denominator = aggregate.loss_denominator(mb.mask_BS, "token_mean")
        if float(denominator) > 0:
            updates.append(group.train(mb, group.loss, denominator))
    return role_figures("critic", [u.figures for u in updates]) | {
        # a count, not a mean
        "critic/skipped_nonfinite": sum(u.figures["skipped_nonfinite"] for u in updates),
        "timing/critic_train_s": time.perf_counter() - t0}
