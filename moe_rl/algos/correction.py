"""Off-policy correction between the behaviour policy mu and the proximal policy pi_old (guide 000
section 6), registered by name (`algorithm.correction`): token and sequence TIS, IcePop, and their
length-invariant sequence forms on the geometric-mean ratio (geo_tis, geo_mask).

Four roles: mu generated the tokens (rollout log-probs), pi_old anchors the PPO ratio, pi_theta is
being optimised, pi_ref anchors KL. A correction reads log pi_old and log mu at the sampled tokens and
returns detached per-token weights and a keep-mask:

    fn(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction

The loss becomes  sum_t keep_t * w_t * l_t / denominator  (ordinary IS: the usual count; self-
normalised: sum of kept weights — see aggregate.py). Log-probs are read in float32 (float64 stays
float64) and only on valid tokens; weights come back in that precision. ESS of raw weights is computed
from log-weights (raw weights may overflow); ESS of truncated or post-rejection weights from the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_rl.algos.losses import compute_dtype
from moe_rl.algos.masking import mean_log_ratio
from moe_rl.algos.registry import register


@dataclass(frozen=True)
class CorrectionSpec:
    is_cap: float = 2.0  # c_IS: token weight bound
    seq_is_cap: float = 10.0  # c_IS^seq: sequence weight bound
    icepop_min: float = 0.5  # c_min
    icepop_max: float = 2.0  # c_max
    geo_min: float = 0.99  # the geometric-mean ratio's band: geo_mask keeps sequences within [min, max]
    geo_max: float = 1.01  # ... and geo_tis truncates the weight at max


@dataclass
class Correction:
    weight_BT: torch.Tensor  # detached importance weight per token (1 where no correction)
    keep_BT: torch.Tensor  # bool: tokens that stay in the loss
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def ess(weights: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective sample size over one granularity (tokens *or* sequences, never mixed):

        ESS = (sum_r w_r)^2 / sum_r w_r^2,   ESS_frac = ESS / |J|;   both 0 when every weight is 0.
    """
    w = torch.where(valid.bool(), weights.detach().to(torch.float64), 0.0)
    s1, s2 = w.sum(), w.square().sum()
    value = torch.where(s2 > 0, s1 * s1 / s2.clamp(min=1e-300), torch.zeros_like(s1))
    n = valid.bool().sum()
    return value, torch.where(n > 0, value / n.clamp(min=1), torch.zeros_like(value))


def ess_from_log_weights(log_weights: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ess` from log w, without ever forming w (which overflows float32 once log w > 88.7):

        ESS = exp(2 logsumexp_r(log w_r) - logsumexp_r(2 log w_r)),   ESS_frac = ESS / |J|

    Only entries with `valid` are in J. Both are 0 when J is empty or every weight is 0 (log w = -inf).
    Returns two 0-dim float64 tensors.
    """
    v = valid.bool()
    lw = torch.where(v, log_weights.detach().to(torch.float64), -torch.inf)
    if lw.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64, device=lw.device)
        return zero, zero.clone()
    lse1, lse2 = torch.logsumexp(lw.reshape(-1), 0), torch.logsumexp(2 * lw.reshape(-1), 0)
    # lse2 = -inf: nothing valid or every weight 0 -> 0 (a NaN log-weight stays NaN, it is not hidden)
    value = torch.where(lse2 == -torch.inf, torch.zeros_like(lse2), torch.exp(2 * lse1 - lse2))
    n = v.sum()
    return value, torch.where(n > 0, value / n.clamp(min=1), torch.zeros_like(value))


def _log_ratio(logp_old_BT, logp_mu_BT, mask_BT):
    """log pi_old - log mu, detached, in float32 (float64 stays float64); 0 at mask-0 positions, selected
    with torch.where before subtracting (-inf - -inf = NaN on padding)."""
    m = mask_BT.bool()
    dtype = compute_dtype(logp_old_BT, logp_mu_BT)
    old = torch.where(m, logp_old_BT.detach().to(dtype), 0.0)
    mu = torch.where(m, logp_mu_BT.detach().to(dtype), 0.0)
    return old - mu


def _report(metrics: dict, prefix: str, weights: torch.Tensor, valid: torch.Tensor,
            log: bool = False) -> None:
    """ESS and ESS_frac of `weights` (of log-weights when `log`) as metrics ess_<prefix>,
    ess_frac_<prefix>."""
    value, frac = ess_from_log_weights(weights, valid) if log else ess(weights, valid)
    metrics[f"ess_{prefix}"] = value
    metrics[f"ess_frac_{prefix}"] = frac


@register("correction", "none", reads_behaviour=False)
def no_correction(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """No correction: w = 1. (Synchronous PPO, where mu = pi_old.) Reads neither log-prob's values:
    logp_old_BT may be None (pi_old is then the update's own forward)."""
    m = mask_BT.bool()
    return Correction(torch.ones_like(logp_mu_BT, dtype=compute_dtype(logp_mu_BT)), m)


@register("correction", "bypass", old_is_behaviour=True)
def bypass_correction(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """Bypass: pi_old := mu, so the PPO ratio is pi_theta / mu and no separate weight is applied. The
    loop uses the behaviour log-probs as logp_old (no proximal forward pass)."""
    m = mask_BT.bool()
    return Correction(torch.ones_like(logp_old_BT, dtype=compute_dtype(logp_old_BT)), m)


@register("correction", "tis_token", params=frozenset({"is_cap"}))
def token_tis(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """Token TIS: w_t = min(pi_old(a_t) / mu(a_t), c_IS), detached."""
    m = mask_BT.bool()
    log_r = _log_ratio(logp_old_BT, logp_mu_BT, m)
    raw = log_r.exp()
    w = raw.clamp(max=hp.is_cap)
    metrics = {"tis_truncated_frac": (((raw > hp.is_cap) & m).sum() / m.sum().clamp(min=1))}
    _report(metrics, "token_raw", log_r, m, log=True)
    _report(metrics, "token_truncated", w, m)
    return Correction(torch.where(m, w, 0.0), m, metrics)


@register("correction", "tis_seq", params=frozenset({"seq_is_cap"}))
def sequence_tis(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """Sequence IS in log space, truncated: log w_i = sum_t m_t (log pi_old - log mu);
    w_i = exp(min(log w_i, log c_seq)); every token of sample i carries w_i. The raw ESS is computed
    from log w_i (`ess_from_log_weights`): exp(log w_i) itself overflows for long sequences."""
    m = mask_BT.bool()
    log_w = _log_ratio(logp_old_BT, logp_mu_BT, m).sum(1)
    has = m.any(1)
    log_cap = torch.log(torch.tensor(hp.seq_is_cap, dtype=log_w.dtype))
    w_B = torch.exp(torch.minimum(log_w, log_cap))
    metrics = {"seq_is_truncated_frac": ((log_w > log_cap) & has).sum() / has.sum().clamp(min=1)}
    _report(metrics, "seq_raw", log_w, has, log=True)
    _report(metrics, "seq_truncated", w_B, has)
    return Correction(torch.where(m, w_B.unsqueeze(1), 0.0), m, metrics)


@register("correction", "icepop", params=frozenset({"icepop_min", "icepop_max"}))
def icepop(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """IcePop / masked IS: keep token t only if c_min <= pi_old(a_t) / mu(a_t) <= c_max (weight 1)."""
    m = mask_BT.bool()
    log_r = _log_ratio(logp_old_BT, logp_mu_BT, m)
    ratio = log_r.exp()
    keep = m & (ratio >= hp.icepop_min) & (ratio <= hp.icepop_max)
    metrics = {"rejection_rate": (m & ~keep).sum() / m.sum().clamp(min=1)}
    _report(metrics, "token_raw", log_r, m, log=True)
    _report(metrics, "token_post_rejection", keep.to(ratio.dtype), m)
    return Correction(keep.to(ratio.dtype), keep, metrics)


def _geometric(logp_old_BT, logp_mu_BT, mask_BT):
    """(m, g_B, has_B): the mask as bool, the log geometric-mean ratio pi_old / mu of each sequence
    (masking.mean_log_ratio) in the log-ratio's dtype, and which sequences have valid tokens."""
    m = mask_BT.bool()
    dtype = compute_dtype(logp_old_BT, logp_mu_BT)
    return m, mean_log_ratio(logp_old_BT, logp_mu_BT, m).to(dtype), m.any(1)


@register("correction", "geo_tis", params=frozenset({"geo_max"}))
def geometric_tis(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """Geometric sequence TIS, the length-invariant sequence-level TIS: every token of sample i carries

        w_i = min( exp( (1/J_i) sum_t m_t log(pi_old(a_t) / mu(a_t)) ), c_geo ),   c_geo = geo_max

    the geometric mean of the token ratios (tis_seq's product, whose log grows with J_i, to the power
    1/J_i), truncated. Metrics: geo_truncated_frac and the ESS of the sequence weights."""
    m, g, has = _geometric(logp_old_BT, logp_mu_BT, mask_BT)
    log_cap = torch.log(torch.tensor(hp.geo_max, dtype=g.dtype))
    w_B = torch.exp(torch.minimum(g, log_cap))
    metrics = {"geo_truncated_frac": ((g > log_cap) & has).sum() / has.sum().clamp(min=1)}
    _report(metrics, "seq_truncated", w_B, has)
    return Correction(torch.where(m, w_B.unsqueeze(1), 0.0), m, metrics)


@register("correction", "geo_mask", params=frozenset({"geo_min", "geo_max"}))
def geometric_mask(logp_old_BT, logp_mu_BT, mask_BT, hp: CorrectionSpec) -> Correction:
    """Geometric sequence masking: sample i stays (weight 1) only if its geometric-mean ratio is in band,

        c_min <= exp( (1/J_i) sum_t m_t log(pi_old(a_t) / mu(a_t)) ) <= c_max      (geo_min, geo_max)

    IcePop's band applied to the length-normalised sequence ratio. OPSM (masking.off_policy_sequence_mask)
    is its one-sided special case against pi_theta on negative advantages. Metric: geo_rejected_frac."""
    m, g, has = _geometric(logp_old_BT, logp_mu_BT, mask_BT)
    lo, hi = (torch.log(torch.tensor(c, dtype=g.dtype)) for c in (hp.geo_min, hp.geo_max))
    keep_B = has & (g >= lo) & (g <= hi)
    metrics = {"geo_rejected_frac": (has & ~keep_B).sum() / has.sum().clamp(min=1)}
    keep = m & keep_B.unsqueeze(1)
    return Correction(keep.to(g.dtype), keep, metrics)


def staleness(gen_version_B: torch.Tensor, train_version: int,
              max_staleness: int | None) -> tuple[torch.Tensor, dict]:
    """nu_train - nu_gen per sample; keep_B marks samples within `max_staleness` (all when None).

    Raises ValueError if a sample claims a version newer than the trainer's (versions are monotonic).
    """
    lag = train_version - gen_version_B.long()
    if bool((lag < 0).any()):
        raise ValueError(f"sample {int((lag < 0).nonzero()[0])} was generated with weight version newer than "
                         f"the trainer's {train_version}")
    keep = lag <= max_staleness if max_staleness is not None else torch.ones_like(lag, dtype=torch.bool)
    metrics = {
        "staleness_mean": lag.double().mean() if lag.numel() else torch.zeros((), dtype=torch.float64),
        "staleness_max": lag.max() if lag.numel() else torch.zeros((), dtype=torch.long),
        "stale_dropped": (~keep).sum(),
    }
    return keep, metrics
