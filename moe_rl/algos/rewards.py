"""Reward placement and shaping (guide 000 section 2.3; guide 004 on KL estimators and DAPO).

Placement rule: rewards sit on model tokens only, because mask-0 positions (tool results,
observations, padding) are not decisions and GAE never reads them. The terminal reward goes on the
last valid model token; feedback an environment returns after a turn (with its observation) is
credited to that turn's last token, the action it followed (see moe_rl/batch.py). The checklist's
`reward_placement` rule refuses any other placement.
"""

from __future__ import annotations

import torch


def last_action_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] long: index of the last valid model token q_J, or -1 for samples with no model token."""
    B, T = mask_BT.shape
    idx = torch.arange(T, device=mask_BT.device).expand(B, T)
    return torch.where(mask_BT.bool(), idx, -1).amax(dim=1) if T else torch.full((B,), -1)


def place_terminal_reward(score_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """u_{q_J} = R(tau): the trajectory score on the last *valid model token*, never the tensor end.

    score_B: [B]; mask_BT: [B, T]. Returns rewards_BT [B, T]. Samples without model tokens get no
    reward (they are excluded from every objective; see checks.py).
    """
    B, T = mask_BT.shape
    rewards = torch.zeros(B, T, dtype=score_B.dtype, device=score_B.device)
    last = last_action_index(mask_BT)
    has = last >= 0
    rows = torch.arange(B, device=score_B.device)[has]
    rewards[rows, last[has]] = score_B[has]
    return rewards


def kl_k1(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor) -> torch.Tensor:
    """k1 = log pi(a) - log pi_ref(a). Unbiased for KL(pi || pi_ref) when a ~ pi; can be negative."""
    return logp_BT - logp_ref_BT


def kl_k2(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi(a) - log pi_ref(a))^2. Biased, non-negative; its gradient is KL's at a ~ pi."""
    return 0.5 * (logp_BT - logp_ref_BT).square()


def kl_k3(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1. Unbiased for KL(pi || pi_ref) with
    a ~ pi, non-negative, low variance when the two are close (GRPO's choice)."""
    d = logp_ref_BT - logp_BT
    return torch.expm1(d) - d


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_shaped_rewards(
    rewards_BT: torch.Tensor,
    logp_behaviour_BT: torch.Tensor,
    logp_ref_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    beta: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """u^total_t = u_t - beta * k_t on valid model tokens, applied before GAE.

    k_t is a sampled estimator of KL(mu || pi_ref) at the rollout action a_t ~ mu (the behaviour
    policy); it is 0 at mask-0 positions, whatever the log-probs hold there (-inf on padding is never
    read). Returns (shaped rewards [B, T], k [B, T]).
    """
    m = mask_BT.bool()
    k = KL_ESTIMATORS[estimator](torch.where(m, logp_behaviour_BT, 0.0), torch.where(m, logp_ref_BT, 0.0))
    k = torch.where(m, k, 0.0)
    return rewards_BT - beta * k, k


def overlong_penalty(length_B: torch.Tensor, max_length: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the sequence score:

        R_len(L) = 0                                  if L <= L_max - L_buf
                 = ((L_max - L_buf) - L) / L_buf      if L_max - L_buf < L <= L_max
                 = -1                                 if L > L_max
    scaled by `penalty`. length_B: [B] response lengths. Returns [B] float.
    """
    L = length_B.to(torch.float32)
    start = max_length - buffer
    ramp = (start - L) / max(buffer, 1)
    out = torch.where(L <= start, torch.zeros_like(L),
                      torch.where(L <= max_length, ramp, -torch.ones_like(L)))
    return penalty * out
