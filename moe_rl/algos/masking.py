"""Trust masks of the policy-gradient term against off-policy drift, registered by name
(`algorithm.policy_mask`): which loss tokens a policy update leaves out, decided from the policy being
optimised (pi_theta, detached), pi_old, the behaviour policy mu and the advantages:

    fn(logp_BT, logp_old_BT, logp_mu_BT, adv_BT, mask_BT, hp: PolicyMaskSpec) -> (keep_BT, metrics)

keep_BT is bool [B, T] (False at mask-0 positions). A mask zeroes loss terms and nothing else: every
denominator (the minibatch's global one, seq_mean's per-sequence J_i) stays the one of the unmasked
tokens, as the methods define it. Each method's `scope` says where it is decided: "sequence" methods
decide each sequence from its own tokens, so the loss computes them per microbatch with the same
result under any layout; "batch" methods select over the whole optimizer batch (every microbatch and
data-parallel shard of the minibatch at once), so the driver computes them on the gathered minibatch
before the update and sends the mask with it. All arithmetic in float64 (the selections compare sums).

The sequence-level ratios here are geometric means, (1/J_i) sum_t m_t log(a_t / b_t): length-invariant,
unlike the product of tis_seq (correction.py has the geometric corrections between pi_old and mu).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos.registry import register


@dataclass(frozen=True)
class PolicyMaskSpec:
    opsm_delta: float = 0.1  # delta: OPSM's bound on a sequence's mean log(mu / pi_theta)
    m2po_tau: float = 0.04  # tau: M2PO's bound on the batch's second moment of log r (the paper's default)


def _masked(x_BT: torch.Tensor, m_BT: torch.Tensor) -> torch.Tensor:
    """x detached in float64, 0 at mask-0 positions (selected away: -inf or NaN there is never read)."""
    return torch.where(m_BT, x_BT.detach().to(torch.float64), 0.0)


def mean_log_ratio(logp_a_BT: torch.Tensor, logp_b_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The log of the geometric-mean ratio a/b of each sequence, [B, T] -> [B] float64:

        g_i = (1/J_i) sum_t m_t (log a_t - log b_t),   0 for a sequence without valid tokens (J_i = 0)
    """
    m = mask_BT.bool()
    return (_masked(logp_a_BT, m) - _masked(logp_b_BT, m)).sum(1) / m.sum(1).clamp(min=1)


def sequence_advantage(adv_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """A_i = (1/J_i) sum_t m_t A_t, [B, T] -> [B] float64: one sign per sequence, whether the estimator
    gave one advantage per sequence (GRPO: A_i itself) or one per token (GAE)."""
    m = mask_BT.bool()
    return _masked(adv_BT, m).sum(1) / m.sum(1).clamp(min=1)


@register("policy_mask", "none", reads_behaviour=False)
def no_mask(logp_BT, logp_old_BT, logp_mu_BT, adv_BT, mask_BT, hp: PolicyMaskSpec):
    """Every loss token stays."""
    return mask_BT.bool(), {}


@register("policy_mask", "opsm", params=frozenset({"opsm_delta"}))
def off_policy_sequence_mask(logp_BT, logp_old_BT, logp_mu_BT, adv_BT, mask_BT, hp: PolicyMaskSpec):
    """OPSM, off-policy sequence masking (DeepSeek-V3.2, section 3.1, Eq. 9): a whole sequence leaves the
    policy-gradient term when it has a negative advantage and drifted from the policy that sampled it:

        M_i = 0  if  A_i < 0  and  (1/J_i) sum_t m_t log( mu(a_t) / pi_theta(a_t) ) > delta,   else 1

    with A_i = sequence_advantage (one decision per sequence, broadcast to its tokens: never each
    token's own advantage sign) and mu the engine's log-probs (the sampling policy, which carries both
    the staleness and the engine-trainer mismatch: never the trainer's pi_old). pi_theta is the policy
    being optimised, detached; logp_old_BT is not read.

    It is a geometric sequence mask (correction.geo_mask) with a one-sided bound e^-delta on the
    geometric mean of pi_theta / mu, taken against pi_theta rather than pi_old and only on negative
    advantages: g_i(mu / pi_theta) > delta  <=>  exp(g_i(pi_theta / mu)) < e^-delta.

    Metrics: opsm_masked_frac (masked sequences over sequences with loss tokens) and
    opsm_masked_of_negative (over those with A_i < 0).
    """
    m = mask_BT.bool()
    has = m.any(1)
    negative = has & (sequence_advantage(adv_BT, m) < 0)
    drop = negative & (mean_log_ratio(logp_mu_BT, logp_BT, m) > hp.opsm_delta)
    n_drop = drop.sum().to(torch.float64)
    metrics = {"opsm_masked_frac": n_drop / has.sum().clamp(min=1),
               "opsm_masked_of_negative": n_drop / negative.sum().clamp(min=1)}
    return m & ~drop.unsqueeze(1), metrics


@register("policy_mask", "m2po", scope="batch", reads_behaviour=False, reads_old=True,
          params=frozenset({"m2po_tau"}))
def second_moment_mask(logp_BT, logp_old_BT, logp_mu_BT, adv_BT, mask_BT, hp: PolicyMaskSpec):
    """M2PO, second-moment trust policy optimization (Zheng et al. 2025, Algorithm 1), over the whole
    optimizer batch (N = its valid loss tokens, r_t = pi_theta(a_t) / pi_old(a_t), the PPO ratio):

        M2 = (1/N) sum_t m_t (log r_t)^2
        candidates: tokens in PPO's active quadrants, A_t > 0 with r_t > 1 or A_t < 0 with r_t < 1
        mask the candidates of largest (log r_t)^2 until (1/N) sum_{kept} (log r_t)^2 <= tau

    N stays the original count. The cut is a threshold c (the smallest (log r)^2 that has to go), so
    every candidate with (log r)^2 >= c is masked: ties go together, and the mask does not depend on the
    order of the rows. If masking every candidate cannot bring M2 to tau, every candidate is masked.
    The paper has no separate proximal policy: with correction=bypass (pi_old := mu) r is its
    pi_theta / mu exactly. logp_mu_BT is not read.

    Metrics: m2po_m2_before, m2po_m2_after, m2po_masked_frac (masked over valid tokens).
    """
    m = mask_BT.bool()
    log_r, adv = _masked(logp_BT, m) - _masked(logp_old_BT, m), _masked(adv_BT, m)
    sq = log_r.square()
    n = m.sum().clamp(min=1).to(torch.float64)
    total = sq.sum()
    candidate = m & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    masked = torch.zeros_like(m)
    excess = total - hp.m2po_tau * n  # what has to be taken out of the sum
    if bool(excess > 0) and bool(candidate.any()):
        values = sq[candidate].sort(descending=True).values
        reached = (values.cumsum(0) >= excess).nonzero()
        cut = values[int(reached[0])] if len(reached) else values[-1]
        masked = candidate & (sq >= cut)
    metrics = {"m2po_m2_before": total / n, "m2po_m2_after": torch.where(masked, 0.0, sq).sum() / n,
               "m2po_masked_frac": masked.sum().to(torch.float64) / n}
    return m & ~masked, metrics
