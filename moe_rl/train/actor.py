"""The training losses a trainer rank runs: the policy's (a registered policy loss with off-policy
weights, plus KL and entropy terms), the critic's value regression, and the supervised warm start.

Each is `fn(outputs, mb) -> (numerator, metrics)`; the worker divides by the minibatch's global
denominator (see algos/aggregate.py and TrainWorker.train_step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos import aggregate, losses, registry


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


def policy_loss_fn(spec: PolicyLossSpec):
    """fn(outputs, mb) -> ({"policy": n_pg, "regularizer": n_reg}, metrics).

    mb.tensors: loss_mask, adv, logp_old, is_weight, optionally reg_mask (default: loss_mask) and, with
    kl_coef > 0, logp_ref. The off-policy weight w and the correction's keep mask (in loss_mask) act
    on the policy-gradient term only; the KL and entropy terms are neither weighted nor rejected
    (they regularise pi_theta itself) and cover reg_mask r:

        L = sum_t w_t m_t l_t / D_pg  +  sum_t r_t (beta_KL k_t - beta_H H_t) / D

    D_pg is the (possibly self-normalised) denominator of the weighted term, D the plain one; both use
    the policy loss's aggregation. The caller passes them as {"policy": D_pg, "regularizer": D}.
    """
    fn = registry.get("policy_loss", spec.name)
    hp = losses.PolicyLossParams(spec.clip_low, spec.clip_high, spec.dual_clip)

    def loss(outputs, mb):
        t = mb.tensors
        mask = t["loss_mask"]
        logp = outputs["logp"]
        loss_BT, metrics = fn(logp, t["logp_old"], t["adv"], mask, hp)
        numerators = {"policy": aggregate.loss_numerator(loss_BT, mask, spec.aggregation, t["is_weight"])}
        reg_mask = t.get("reg_mask", mask)
        reg_BT = None
        if spec.kl_coef:
            kl = losses.sampled_kl_loss(logp, t["logp_ref"], reg_mask, spec.kl_estimator)
            reg_BT = spec.kl_coef * kl
            metrics["kl_ref"] = losses.masked_mean(kl.detach(), reg_mask)
        if spec.entropy_coef:
            ent = -spec.entropy_coef * outputs["entropy"]
            reg_BT = ent if reg_BT is None else reg_BT + ent
        if reg_BT is not None:
            numerators["regularizer"] = aggregate.loss_numerator(reg_BT, reg_mask, spec.aggregation)
        metrics["entropy"] = losses.masked_mean(outputs["entropy"].detach(), mask)
        return numerators, metrics

    return loss


def state_values(out_BS: torch.Tensor) -> torch.Tensor:
    """The critic's per-position outputs -> V(s_t) for every position t, [B, S].

    The output at position t-1 has read tokens 0..t-1: it is the value of the state before token t.
    V(s_0) (nothing read) is never a model-token state and is 0. The one place this shift is written.
    """
    values = torch.zeros_like(out_BS)
    values[:, 1:] = out_BS[:, :-1]
    return values


def value_loss_fn(clip: float | None):
    """fn(outputs, mb) -> (numerator, metrics) for the critic: regress V(s_t) (see state_values) to
    the returns on model tokens (token sum; the caller's denominator). mb.tensors: mask, returns,
    values_old (the pre-update V(s_t))."""

    def loss(outputs, mb):
        t = mb.tensors
        pred = state_values(outputs["values"])
        loss_BT, metrics = losses.clipped_value_loss(pred, t["values_old"], t["returns"], t["mask"], clip)
        metrics["value_mean"] = losses.masked_mean(pred.detach(), t["mask"])
        return aggregate.loss_numerator(loss_BT, t["mask"], "token_mean"), metrics

    return loss


def sft_loss_fn():
    """Supervised warm start: negative log-likelihood of the demonstration's model tokens."""

    def loss(outputs, mb):
        mask = mb.tensors["loss_mask"]
        return -(outputs["logp"] * mask).sum(), {"nll": losses.masked_mean(-outputs["logp"].detach(), mask)}

    return loss
