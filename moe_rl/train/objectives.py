"""The training losses a trainer rank runs, one type each: the policy's (a registered policy loss with
off-policy weights, plus KL and entropy terms), the critic's value regression, and the supervised warm
start. A loss is a small frozen dataclass (it travels to the ranks) called per microbatch:

    loss(outputs, mb) -> (numerator or {term: numerator}, metrics)

outputs: the model's per-token outputs ({"logp_BS", "entropy_BS"} or {"critic_out_BS"}, [b, s]: named as
train.results.ScoreResult); mb: a microbatch of moe_rl.batch.Batch carrying the fields the loss reads
(`fields`: all a rank is sent). The worker divides each numerator by the minibatch's global denominator
(see algos/aggregate.py and TrainWorker.train_step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos import aggregate, checks, losses, registry
from moe_rl.algos.masking import PolicyMaskSpec
from moe_rl.algos.targets import state_values


@dataclass(frozen=True)
class PolicyLoss:
    """L = sum_t w_t g_t l_t / D_pg  +  sum_t m_t (beta_KL k_t - beta_H H_t) / D

    mb fields: pg_mask_BS g (the loss tokens the correction keeps), loss_mask_BS m, adv_BS, logp_old_BS,
    is_weight_BS w and, with kl_coef > 0, logp_ref_BS. The off-policy weight and the keep mask act on
    the policy-gradient term only; the KL and entropy terms regularise pi_theta itself and are neither
    weighted nor rejected. D_pg is the (possibly self-normalised) denominator of the weighted term, D
    the plain one; the caller passes them as {"policy": D_pg, "regularizer": D}.

    With `old_from_forward` (a step of one update, RunConfig.proximal_from_update) pi_old is this
    forward's log pi_theta, detached: the same values a separate pass before the update computes, so
    the same loss and gradients. `check_sync` then checks mu = pi_old (the checklist's sync_roles, on
    the loss tokens) before the backward pass; mb then also carries logp_mu_BS.

    `policy_mask` (algos/masking.py) zeroes the policy-gradient terms it leaves out, denominators
    unchanged: a sequence-scope mask (OPSM) is decided here from this forward's pi_theta and mb's
    logp_mu_BS; a batch-scope one (M2PO) arrives decided over the whole minibatch as mb.policy_keep_BS.
    """

    name: str
    hp: losses.PolicyLossSpec  # the loss's hyperparameters (algorithm.clip_low, ...)
    aggregation: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    old_from_forward: bool
    check_sync: bool
    policy_mask: str
    mask_spec: PolicyMaskSpec

    @property
    def mask_scope(self) -> str | None:
        """Where the policy mask is decided ("sequence": here; "batch": on the driver), None without one."""
        meta = registry.meta("policy_mask", self.policy_mask)
        return None if self.policy_mask == "none" else meta.scope

    @property
    def fields(self) -> tuple[str, ...]:
        own = ("logp_mu_BS",) if self.check_sync else ()  # pi_old is this forward; mu to check it against
        if not self.old_from_forward:
            own = ("logp_old_BS",)
        if self.mask_scope == "batch":
            own += ("policy_keep_BS",)
        elif self.mask_scope == "sequence" and registry.meta("policy_mask",
                                                               self.policy_mask).reads_behaviour:
            own += ("logp_mu_BS",)
        base = ("pg_mask_BS", "loss_mask_BS", "adv_BS", "is_weight_BS", "logp_ref_BS")
        return tuple(dict.fromkeys((*base, *own)))  # each once (mu may be read twice)

    def __call__(self, outputs, mb):
        fn = registry.get("policy_loss", self.name)
        pg, reg, logp = mb.pg_mask_BS, mb.loss_mask_BS, outputs["logp_BS"]
        logp_old = mb.logp_old_BS
        if self.old_from_forward:
            logp_old = logp.detach()
            if self.check_sync:
                checks.check_sync_roles(mb.logp_mu_BS, logp_old, reg)
        loss_BT, metrics = fn(logp, logp_old, mb.adv_BS, pg, self.hp)
        if self.mask_scope == "sequence":
            keep, mask_metrics = registry.get("policy_mask", self.policy_mask)(
                logp.detach(), logp_old, mb.logp_mu_BS, mb.adv_BS, pg, self.mask_spec)
            loss_BT, metrics = torch.where(keep, loss_BT, 0.0), metrics | mask_metrics
        elif self.mask_scope == "batch":
            loss_BT = torch.where(mb.policy_keep_BS, loss_BT, 0.0)
        numerators = {"policy": aggregate.loss_numerator(loss_BT, pg, self.aggregation, mb.is_weight_BS)}
        reg_BT = None
        if self.kl_coef:
            kl = losses.sampled_kl_loss(logp, mb.logp_ref_BS, reg, self.kl_estimator)
            reg_BT = self.kl_coef * kl
            metrics["kl_ref"] = losses.masked_mean(kl.detach(), reg)
        if self.entropy_coef:
            ent = -self.entropy_coef * outputs["entropy_BS"]
            reg_BT = ent if reg_BT is None else reg_BT + ent
        if reg_BT is not None:
            numerators["regularizer"] = aggregate.loss_numerator(reg_BT, reg, self.aggregation)
        metrics["entropy"] = losses.masked_mean(outputs["entropy_BS"].detach(), pg)
        return numerators, metrics


@dataclass(frozen=True)
class ValueLoss:
    """Regress V(s_t) (see algos.targets.state_values) to the returns on model tokens (token sum; the
    caller's denominator), clipped around the pre-update values when `clip` is set. mb fields: mask_BS,
    returns_BS, values_old_BS."""

    fields = ("mask_BS", "returns_BS", "values_old_BS")

    clip: float | None

    def __call__(self, outputs, mb):
        pred = state_values(outputs["critic_out_BS"])
        loss_BT, metrics = losses.clipped_value_loss(pred, mb.values_old_BS, mb.returns_BS, mb.mask_BS,
                                                     self.clip)
        metrics["value_mean"] = losses.masked_mean(pred.detach(), mb.mask_BS)
        return aggregate.loss_numerator(loss_BT, mb.mask_BS, "token_mean"), metrics


@dataclass(frozen=True)
class SftLoss:
    """Supervised warm start: negative log-likelihood of the demonstration's model tokens (mask_BS)."""

    fields = ("mask_BS",)

    def __call__(self, outputs, mb):
        mask = mb.mask_BS
        return (-(outputs["logp_BS"] * mask).sum(),
                {"nll": losses.masked_mean(-outputs["logp_BS"].detach(), mask)})
