"""Per-token losses to minimise (guide 000 section 4 and 7.1; guide 004 on GSPO, GMPO, CISPO).

Policy losses are registered by name (`algorithm.policy_loss`) with the signature

    fn(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossParams) -> (loss_BT, metrics)

loss_BT is [B, T] and 0 on mask-0 positions; aggregate.py turns it into a scalar with a global
denominator. Ratios are r_t = exp(log pi_theta(a_t) - log pi_old(a_t)); metrics are 0-dim tensors
(masked means over this batch), never host-synchronised here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos.registry import register
from moe_rl.algos.rewards import KL_ESTIMATORS


@dataclass(frozen=True)
class PolicyLossParams:
    clip_low: float = 0.2  # eps_l: ratio lower bound 1 - eps_l
    clip_high: float = 0.2  # eps_h: ratio upper bound 1 + eps_h (clip-higher when > eps_l)
    dual_clip: float | None = None  # c_dual > 1: bound on the negative-advantage branch


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    m = mask_BT.to(x_BT.dtype)
    return (x_BT * m).sum() / m.sum().clamp(min=1)


def _ratio_metrics(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    lr = log_ratio_BT.detach()
    m = mask_BT.bool()
    big = torch.finfo(lr.dtype).max
    return {
        "ratio_mean": masked_mean(lr.exp(), m),
        "ratio_max": torch.where(m, lr, -big).max().exp(),
        "ratio_min": torch.where(m, lr, big).min().exp(),
        # k3 estimate of KL(pi_old || pi_theta) at the sampled tokens, and the simple k2 form
        "approx_kl_k3": masked_mean(torch.expm1(lr) - lr, m),
        "approx_kl_k2": masked_mean(0.5 * lr.square(), m),
    }


@register("policy_loss", "ppo")
def ppo_clip_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossParams):
    """PPO-Clip with clip-higher and optional dual-clip:

        l^asym = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))
        l      = min(l^asym, -c_dual A)   if A < 0 and dual-clip is on,   else l^asym
    """
    m = mask_BT.bool()
    log_ratio = (logp_BT - logp_old_BT).masked_fill(~m, 0.0)
    ratio = log_ratio.exp()
    unclipped = -adv_BT * ratio
    clipped = -adv_BT * ratio.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = _ratio_metrics(log_ratio, m)
    was_clipped = clipped > unclipped
    metrics["clipfrac_low"] = masked_mean((was_clipped & (ratio < 1.0 - hp.clip_low)).float(), m)
    metrics["clipfrac_high"] = masked_mean((was_clipped & (ratio > 1.0 + hp.clip_high)).float(), m)
    if hp.dual_clip is not None:
        bound = -hp.dual_clip * adv_BT
        dual = (adv_BT < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["clipfrac_dual"] = masked_mean(dual.float(), m)
    return loss * m, metrics


@register("policy_loss", "gspo")
def gspo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossParams):
    """GSPO: length-normalised sequence ratio, clipped at the sequence level:

        s_i = exp( (1/J_i) sum_t m_t (log pi_theta - log pi_old) )
        l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_l, 1 + eps_h))

    Written token-wise (GSPO-token form): s_{i,t} = sg(s_i) * pi_theta(a_t) / sg(pi_theta(a_t)), whose
    value is s_i and whose gradient is s_i grad log pi_theta(a_t). With `seq_mean` aggregation and a
    per-sequence advantage this is exactly GSPO; GSPO's ranges are small (e.g. eps 3e-4 / 4e-4).
    """
    m = mask_BT.bool()
    mf = m.to(logp_BT.dtype)
    J = mf.sum(1).clamp(min=1)
    log_ratio = (logp_BT - logp_old_BT).masked_fill(~m, 0.0)
    seq_log_ratio = (log_ratio * mf).sum(1) / J  # [B]
    s_tok = torch.exp(seq_log_ratio.detach().unsqueeze(1) + logp_BT - logp_BT.detach())
    unclipped = -adv_BT * s_tok
    clipped = -adv_BT * s_tok.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    loss = torch.maximum(unclipped, clipped)
    has = m.any(1)
    s = seq_log_ratio.detach().exp()
    metrics = _ratio_metrics(log_ratio, m)
    hi = (s > 1.0 + hp.clip_high) & has
    lo = (s < 1.0 - hp.clip_low) & has
    n_seq = has.sum().clamp(min=1)
    metrics["seq_clipfrac_high"] = hi.sum() / n_seq
    metrics["seq_clipfrac_low"] = lo.sum() / n_seq
    return loss * m, metrics


@register("policy_loss", "gmpo")
def gmpo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossParams):
    """GMPO: geometric mean of the clipped token objectives (token-level ratios, clipped in log space):

        log rho~_t = sgn(A) * min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_l, eps_h))
        l_i        = -A_i * exp( (1/J_i) sum_t m_t log rho~_t )

    Every valid token of sample i carries l_i, so `seq_mean` aggregation gives mean_i l_i. Here eps_l,
    eps_h bound the *log* ratio (the paper uses 0.4, i.e. ratios in [e^-0.4, e^0.4]).
    """
    m = mask_BT.bool()
    mf = m.to(logp_BT.dtype)
    J = mf.sum(1).clamp(min=1)
    log_ratio = (logp_BT - logp_old_BT).masked_fill(~m, 0.0)
    sgn = torch.sign(adv_BT)
    clipped = log_ratio.clamp(-hp.clip_low, hp.clip_high)
    log_rho = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)
    seq = torch.exp((log_rho * mf).sum(1) / J)  # [B]
    adv_seq = (adv_BT * mf).sum(1) / J
    loss = (-adv_seq * seq).unsqueeze(1).expand_as(logp_BT)
    metrics = _ratio_metrics(log_ratio, m)
    metrics["clipfrac"] = masked_mean((clipped != log_ratio).float(), m)
    return loss * mf, metrics


@register("policy_loss", "cispo")
def cispo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossParams):
    """CISPO: REINFORCE with a clipped, detached importance weight, so clipped tokens still get gradient:

        l_t = - sg(clip(r_t, 1 - eps_l, 1 + eps_h)) * A_t * log pi_theta(a_t)
    """
    m = mask_BT.bool()
    log_ratio = (logp_BT - logp_old_BT).masked_fill(~m, 0.0)
    ratio = log_ratio.detach().exp()
    w = ratio.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    loss = -w * adv_BT * logp_BT
    metrics = _ratio_metrics(log_ratio, m)
    metrics["clipfrac"] = masked_mean((w != ratio).float(), m)
    return loss.masked_fill(~m, 0.0), metrics


def clipped_value_loss(
    values_BT: torch.Tensor, values_old_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l^V = 1/2 max((V_phi - G)^2, (V_clip - G)^2),  V_clip = V_old + clip(V_phi - V_old, -eps_V, eps_V).

    With clip=None: 1/2 (V_phi - G)^2. Returns (loss_BT, metrics); 0 on mask-0 positions.
    """
    m = mask_BT.bool()
    unclipped = (values_BT - returns_BT).square()
    if clip is None:
        loss = 0.5 * unclipped
        frac = torch.zeros((), dtype=values_BT.dtype)
    else:
        v_clip = values_old_BT + (values_BT - values_old_BT).clamp(-clip, clip)
        clipped = (v_clip - returns_BT).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        frac = masked_mean((clipped > unclipped).float(), m)
    return loss.masked_fill(~m, 0.0), {"value_clipfrac": frac}


def sampled_kl_loss(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor, mask_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Actor-side KL(pi_theta || pi_ref) from the sampled tokens, [B, T].

    The tokens were sampled from the behaviour policy mu, not pi_theta, so k1/k3 are unbiased only when
    pi_theta = mu (the first on-policy step) and are the usual approximation otherwise; k2's gradient
    is the KL gradient under that same assumption.
    """
    return KL_ESTIMATORS[estimator](logp_BT, logp_ref_BT).masked_fill(~mask_BT.bool(), 0.0)


def full_kl_from_logits(logits_BTV: torch.Tensor, ref_logits_BTV: torch.Tensor) -> torch.Tensor:
    """Full categorical KL(pi_theta || pi_ref) = sum_a pi(a) (log pi(a) - log pi_ref(a)), [B, T]."""
    logp = torch.log_softmax(logits_BTV.float(), -1)
    logq = torch.log_softmax(ref_logits_BTV.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """H = -sum_a pi(a) log pi(a), [B, T] (the entropy bonus adds -beta_H * H to the loss)."""
    logp = torch.log_softmax(logits_BTV.float(), -1)
    return -(logp.exp() * logp).sum(-1)
