"""The policy's training loss: a registered policy loss, off-policy weights, KL and entropy terms,
aggregated with the minibatch's global denominator (see algos/aggregate.py)."""

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
    """fn(outputs, mb) -> (numerator, metrics). mb.tensors: loss_mask, adv, logp_old, is_weight
    and, with kl_coef > 0, logp_ref. KL and entropy use the policy loss's aggregation."""
    fn = registry.get("policy_loss", spec.name)
    hp = losses.PolicyLossParams(spec.clip_low, spec.clip_high, spec.dual_clip)

    def loss(outputs, mb):
        t = mb.tensors
        mask = t["loss_mask"]
        logp = outputs["logp"]
        loss_BT, metrics = fn(logp, t["logp_old"], t["adv"], mask, hp)
        if spec.kl_coef:
            kl = losses.sampled_kl_loss(logp, t["logp_ref"], mask, spec.kl_estimator)
            loss_BT = loss_BT + spec.kl_coef * kl
            metrics["kl_ref"] = losses.masked_mean(kl.detach(), mask)
        if spec.entropy_coef:
            loss_BT = loss_BT - spec.entropy_coef * outputs["entropy"]
        metrics["entropy"] = losses.masked_mean(outputs["entropy"].detach(), mask)
        return aggregate.loss_numerator(loss_BT, mask, spec.aggregation, t["is_weight"]), metrics

    return loss


def value_loss_fn(clip: float | None):
    """fn(outputs, mb) -> (numerator, metrics) for the critic: V(s_t) is the value head's output at
    position t-1; regress it to the returns on model tokens (token sum; the caller's denominator)."""

    def loss(outputs, mb):
        t = mb.tensors
        out = outputs["values"]
        pred = torch.zeros_like(out)
        pred[:, 1:] = out[:, :-1]
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
