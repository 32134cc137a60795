"""Per-token losses to minimise (guide 000 section 4 and 7.1; guide 004 on GSPO, GMPO, CISPO; SAPO).

Policy losses are registered by name (`algorithm.policy_loss`) with the signature

    fn(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossSpec) -> (loss_BT, metrics)

loss_BT is [B, T] and 0 on mask-0 positions; aggregate.py turns it into a scalar with a global
denominator. Ratios are r_t = exp(log pi_theta(a_t) - log pi_old(a_t)), the log-ratio clamped to +-20
first (`_log_ratio`: a ratio that would overflow has a finite loss and no gradient); metrics are 0-dim tensors
(masked means over this batch), never host-synchronised here.

Precision and masking, for every loss here: inputs of lower precision (bf16, fp16) are upcast and the
loss is computed and returned in float32 (float64 stays float64); values at mask-0 positions (log-prob
-inf or NaN on padding, say) are selected away with torch.where before any arithmetic, so neither the
loss nor its gradient can become NaN through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos.registry import register
from moe_rl.algos.rewards import KL_ESTIMATORS


@dataclass(frozen=True)
class PolicyLossSpec:
    clip_low: float = 0.2  # eps_l: ratio lower bound 1 - eps_l
    clip_high: float = 0.2  # eps_h: ratio upper bound 1 + eps_h (clip-higher when > eps_l)
    dual_clip: float | None = None  # c_dual > 1: bound on the negative-advantage branch
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where A > 0
    sapo_tau_neg: float = 1.05  # ... and where A <= 0


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: the RL math never runs in bf16/fp16 (a GSPO range
    of 3e-4 is below bf16's resolution near 1, 2^-7)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _masked(x_BT: torch.Tensor, m_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x upcast to `dtype`, with 0 at mask-0 positions. torch.where, not x * m: NaN * 0 = NaN, and the
    gradient of where is 0 (not NaN) at the positions it drops, whatever they held (-inf log-probs)."""
    return torch.where(m_BT, x_BT.to(dtype), 0.0)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """sum_t m_t x_t / max(sum_t m_t, 1), in float32 (float64 stays float64); mask-0 values are never read."""
    dtype = compute_dtype(x_BT)
    m = mask_BT.to(dtype)
    return (torch.where(m != 0, x_BT.to(dtype), 0.0) * m).sum() / m.sum().clamp(min=1)


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


LOG_RATIO_LIMIT = 20.0  # |log pi_theta - log pi_old| beyond it is clamped: exp(88.7) overflows float32


def _log_ratio(logp_BT: torch.Tensor, old_BT: torch.Tensor) -> torch.Tensor:
    """log r_t = log pi_theta(a_t) - log pi_old(a_t), clamped to +-LOG_RATIO_LIMIT before any exp: a token
    whose ratio would overflow (inf, then a NaN gradient that skips the whole update) gets a finite loss,
    and no gradient through the clamp; its ratio (e^20 = 4.9e8) is far outside every clip range anyway."""
    return (logp_BT - old_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _policy_inputs(logp_BT, logp_old_BT, adv_BT, mask_BT):
    """(log pi_theta, log pi_old, A, m): upcast to float32 (float64 stays), 0 at mask-0 positions."""
    m = mask_BT.bool()
    dtype = compute_dtype(logp_BT, logp_old_BT, adv_BT)
    return _masked(logp_BT, m, dtype), _masked(logp_old_BT, m, dtype), _masked(adv_BT, m, dtype), m


@register("policy_loss", "ppo", params=frozenset({"clip_low", "clip_high", "dual_clip"}))
def ppo_clip_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossSpec):
    """PPO-Clip with clip-higher and optional dual-clip, [B, T] -> [B, T]:

        r_t    = exp(log pi_theta(a_t) - log pi_old(a_t))
        l^asym = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))
        l      = min(l^asym, -c_dual A)   if A < 0 and dual-clip is on,   else l^asym
    """
    logp, old, adv, m = _policy_inputs(logp_BT, logp_old_BT, adv_BT, mask_BT)
    log_ratio = _log_ratio(logp, old)  # 0 at mask-0 positions
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = _ratio_metrics(log_ratio, m)
    was_clipped = clipped > unclipped
    metrics["clipfrac_low"] = masked_mean((was_clipped & (ratio < 1.0 - hp.clip_low)).float(), m)
    metrics["clipfrac_high"] = masked_mean((was_clipped & (ratio > 1.0 + hp.clip_high)).float(), m)
    if hp.dual_clip is not None:
        bound = -hp.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["clipfrac_dual"] = masked_mean(dual.float(), m)
    return torch.where(m, loss, 0.0), metrics


@register("policy_loss", "gspo", sequence_level=True, params=frozenset({"clip_low", "clip_high"}))
def gspo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossSpec):
    """GSPO: length-normalised sequence ratio, clipped at the sequence level, [B, T] -> [B, T]:

        s_i = exp( (1/J_i) sum_t m_t (log pi_theta - log pi_old) )
        l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_l, 1 + eps_h))

    Written token-wise (GSPO-token form): s_{i,t} = sg(s_i) * pi_theta(a_t) / sg(pi_theta(a_t)), whose
    value is s_i and whose gradient is s_i grad log pi_theta(a_t). With `seq_mean` aggregation and a
    per-sequence advantage this is exactly GSPO; GSPO's ranges are small (e.g. eps 3e-4 / 4e-4), which
    is why everything here runs in float32 at least.
    """
    logp, old, adv, m = _policy_inputs(logp_BT, logp_old_BT, adv_BT, mask_BT)
    J = m.sum(1).clamp(min=1).to(logp.dtype)
    log_ratio = _log_ratio(logp, old)  # 0 at mask-0 positions
    seq_log_ratio = log_ratio.sum(1) / J  # [B]
    s_tok = torch.exp(seq_log_ratio.detach().unsqueeze(1) + logp - logp.detach())
    unclipped = -adv * s_tok
    clipped = -adv * s_tok.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    loss = torch.maximum(unclipped, clipped)
    has = m.any(1)
    s = seq_log_ratio.detach().exp()
    metrics = _ratio_metrics(log_ratio, m)
    hi = (s > 1.0 + hp.clip_high) & has
    lo = (s < 1.0 - hp.clip_low) & has
    n_seq = has.sum().clamp(min=1)
    metrics["seq_clipfrac_high"] = hi.sum() / n_seq
    metrics["seq_clipfrac_low"] = lo.sum() / n_seq
    return torch.where(m, loss, 0.0), metrics


@register("policy_loss", "gmpo", sequence_level=True, params=frozenset({"clip_low", "clip_high"}))
def gmpo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossSpec):
    """GMPO: geometric mean of the clipped token objectives (token-level ratios, clipped in log space),
    [B, T] -> [B, T]:

        log rho~_t = sgn(A) * min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_l, eps_h))
        l_i        = -A_i * exp( (1/J_i) sum_t m_t log rho~_t ),   A_i = (1/J_i) sum_t m_t A_t

    Every valid token of sample i carries l_i, so `seq_mean` aggregation gives mean_i l_i. Here eps_l,
    eps_h bound the *log* ratio (the paper uses 0.4, i.e. ratios in [e^-0.4, e^0.4]).
    """
    logp, old, adv, m = _policy_inputs(logp_BT, logp_old_BT, adv_BT, mask_BT)
    J = m.sum(1).clamp(min=1).to(logp.dtype)
    log_ratio = _log_ratio(logp, old)  # 0 at mask-0 positions
    sgn = torch.sign(adv)
    clipped = log_ratio.clamp(-hp.clip_low, hp.clip_high)
    log_rho = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)  # 0 at mask-0 positions
    seq = torch.exp(log_rho.sum(1) / J)  # [B]
    adv_seq = adv.sum(1) / J
    loss = (-adv_seq * seq).unsqueeze(1).expand_as(logp)
    metrics = _ratio_metrics(log_ratio, m)
    metrics["clipfrac"] = masked_mean((clipped != log_ratio).float(), m)
    return torch.where(m, loss, 0.0), metrics


@register("policy_loss", "cispo", params=frozenset({"clip_low", "clip_high"}))
def cispo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossSpec):
    """CISPO: REINFORCE with a clipped, detached importance weight, so clipped tokens still get gradient,
    [B, T] -> [B, T]:

        l_t = - sg(clip(r_t, 1 - eps_l, 1 + eps_h)) * A_t * log pi_theta(a_t)
    """
    logp, old, adv, m = _policy_inputs(logp_BT, logp_old_BT, adv_BT, mask_BT)
    log_ratio = _log_ratio(logp, old)  # 0 at mask-0 positions
    ratio = log_ratio.detach().exp()
    w = ratio.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    loss = -w * adv * logp
    metrics = _ratio_metrics(log_ratio, m)
    metrics["clipfrac"] = masked_mean((w != ratio).float(), m)
    return torch.where(m, loss, 0.0), metrics


@register("policy_loss", "sapo", params=frozenset({"sapo_tau_pos", "sapo_tau_neg"}))
def sapo_loss(logp_BT, logp_old_BT, adv_BT, mask_BT, hp: PolicyLossSpec):
    """SAPO: a smooth, temperature-controlled gate on the ratio in place of PPO's hard clip, [B, T] -> [B, T]:

        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = (4 / tau_t) sigmoid(tau_t (r_t - 1))
        l_t   = -f(r_t) A_t

    d l_t / d log pi_theta = -w_t A_t r_t with w_t = 4 s (1 - s), s = sigmoid(tau_t (r_t - 1)): w = 1 at
    r = 1 (the plain policy gradient on-policy), decaying smoothly as r leaves 1, faster for a larger tau
    (tau_neg > tau_pos damps the negative-advantage tokens more, the unstable side). No token's gradient
    is cut to 0 at a bound. The paper (Gao et al. 2025, Qwen) aggregates per sequence: seq_mean.
    """
    logp, old, adv, m = _policy_inputs(logp_BT, logp_old_BT, adv_BT, mask_BT)
    log_ratio = _log_ratio(logp, old)  # 0 at mask-0 positions
    ratio = log_ratio.exp()
    tau = torch.where(adv > 0, hp.sapo_tau_pos, hp.sapo_tau_neg).to(logp.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * adv
    metrics = _ratio_metrics(log_ratio, m)
    # w_t = 4 s (1 - s): each token's gradient against the plain policy gradient's (1 on-policy)
    metrics["sapo_weight_mean"] = masked_mean((4.0 * gate * (1.0 - gate)).detach(), m)
    return torch.where(m, loss, 0.0), metrics


def clipped_value_loss(
    values_BT: torch.Tensor, values_old_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l^V = 1/2 max((V_phi - G)^2, (V_clip - G)^2),  V_clip = V_old + clip(V_phi - V_old, -eps_V, eps_V).

    With clip=None: 1/2 (V_phi - G)^2. All inputs [B, T]. Returns (loss_BT [B, T], metrics); 0 on mask-0
    positions, whatever the inputs hold there. Computed in float32 (float64 stays float64).
    """
    m = mask_BT.bool()
    dtype = compute_dtype(values_BT, values_old_BT, returns_BT)
    v, v_old, G = (_masked(x, m, dtype) for x in (values_BT, values_old_BT, returns_BT))
    unclipped = (v - G).square()
    if clip is None:
        loss = 0.5 * unclipped
        frac = torch.zeros((), dtype=dtype, device=v.device)
    else:
        v_clip = v_old + (v - v_old).clamp(-clip, clip)
        clipped = (v_clip - G).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        frac = masked_mean((clipped > unclipped).to(dtype), m)
    return torch.where(m, loss, 0.0), {"value_clipfrac": frac}


def sampled_kl_loss(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor, mask_BT: torch.Tensor,
                    estimator: str) -> torch.Tensor:
    """Actor-side KL(pi_theta || pi_ref) from the sampled tokens, [B, T] (estimator "k1", "k2" or "k3",
    see rewards.py); 0 on mask-0 positions. Computed in float32 (float64 stays float64).

    The tokens were sampled from the behaviour policy mu, not pi_theta, so k1/k3 are unbiased only when
    pi_theta = mu (the first on-policy step) and are the usual approximation otherwise; k2's gradient
    is the KL gradient under that same assumption.
    """
    m = mask_BT.bool()
    dtype = compute_dtype(logp_BT, logp_ref_BT)
    k = KL_ESTIMATORS[estimator](_masked(logp_BT, m, dtype), _masked(logp_ref_BT, m, dtype))
    return torch.where(m, k, 0.0)
