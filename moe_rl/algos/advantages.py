"""Advantage estimators, registered by name (`algorithm.advantage`), and whitening.

Every estimator has the signature

    fn(inp: AdvantageInputs, hp: AdvantageSpec) -> (advantages_BT, returns_BT | None)

`advantages_BT` is 0 on mask-0 positions. `returns_BT` is the critic target (only value-based
estimators produce one). Outcome estimators turn one scalar score per sample into a per-sample
advantage broadcast to every valid model token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos import gae
from moe_rl.algos.registry import register


@dataclass(frozen=True)
class AdvantageInputs:
    """Per-batch tensors an estimator may read (B samples, T raw positions)."""

    rewards_BT: torch.Tensor  # u_t, on action positions (terminal + turn rewards, KL shaping applied)
    mask_BT: torch.Tensor  # response mask m_t (bool)
    score_B: torch.Tensor  # trajectory-level score R(tau_i) (outcome estimators)
    group_B: torch.Tensor  # long: prompt-group id; samples of one prompt share it
    values_BT: torch.Tensor | None = None  # frozen V(s_t) (value-based estimators)
    terminated_B: torch.Tensor | None = None  # bool: true termination (else truncated)
    boundary_value_B: torch.Tensor | None = None  # V(s_boundary) for truncated samples


@dataclass(frozen=True)
class AdvantageSpec:
    gamma: float = 1.0
    lam: float = 0.95
    lam_critic: float | None = None  # decoupled GAE
    length_adaptive_alpha: float | None = None  # lambda_i = 1 - 1/(alpha J_i)
    eps: float = 1e-6  # GRPO std guard


def _broadcast(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return adv_B.unsqueeze(1).to(torch.float32) * mask_BT.to(torch.float32)


def group_stats(x_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group unbiased std, group size) of x over samples sharing group_B."""
    _, inv = torch.unique(group_B, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    x = x_B.to(torch.float64)
    n = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(x))
    s = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, x)
    mean = s / n
    sq = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, (x - mean[inv]).square())
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    return mean[inv], std[inv], n[inv]


@register("advantage", "gae", needs_critic=True, whiten=True,
          params=frozenset({"gamma", "lam", "lam_critic", "length_adaptive_alpha"}))
def gae_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """Masked model-token GAE (gae.masked_gae); decoupled when hp.lam_critic is set, length-adaptive
    (lambda_i = 1 - 1/(alpha J_i)) for the actor when hp.length_adaptive_alpha is set."""
    if inp.values_BT is None or inp.terminated_B is None or inp.boundary_value_B is None:
        raise ValueError("GAE needs values_BT, terminated_B and boundary_value_B (a critic)")
    lam_actor = hp.lam
    if hp.length_adaptive_alpha is not None:
        lam_actor = gae.length_adaptive_lambda(inp.mask_BT.sum(1), hp.length_adaptive_alpha)
    args = (inp.rewards_BT, inp.values_BT, inp.mask_BT, inp.terminated_B, inp.boundary_value_B, hp.gamma)
    if hp.lam_critic is None and hp.length_adaptive_alpha is None:
        return gae.masked_gae(*args, hp.lam)
    lam_critic = hp.lam_critic if hp.lam_critic is not None else hp.lam
    return gae.decoupled_gae(*args, lam_actor, lam_critic)


@register("advantage", "reward_to_go", params=frozenset({"gamma"}), whiten=True)
def reward_to_go_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """Process-reward reward-to-go: A_j = sum_{k >= j} gamma^(k-j) u_{q_k} on the decision timeline
    (GAE with V = 0, lambda = 1, terminal bootstrap 0)."""
    zeros = torch.zeros_like(inp.rewards_BT, dtype=torch.float32)
    B = zeros.shape[0]
    adv, _ = gae.masked_gae(inp.rewards_BT.float(), zeros, inp.mask_BT, torch.ones(B, dtype=torch.bool),
                            torch.zeros(B), hp.gamma, 1.0)
    return adv, None


@register("advantage", "none", reads_reward=False)
def no_task_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """No task signal: A = 0 on every token (on-policy distillation alone: algorithm.distill_coef adds
    the teacher's per-token term, algos/distill.py)."""
    return torch.zeros_like(inp.rewards_BT, dtype=torch.float32), None


@register("advantage", "reinforce", whiten=True)
def reinforce_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """REINFORCE with a batch-mean baseline: A_i = R_i - mean_b R_b."""
    s = inp.score_B.to(torch.float64)
    return _broadcast(s - s.mean(), inp.mask_BT), None


@register("advantage", "rloo", min_group_size=2)
def rloo_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """RLOO: A_i = R_i - 1/(G-1) sum_{j != i} R_j = G/(G-1) (R_i - mean_g R) within each prompt group.

    A group left with one sample (its siblings rejected) has no leave-one-out baseline: A = 0 (as
    GRPO and Dr.GRPO give a group of one)."""
    mean, _, n = group_stats(inp.score_B, inp.group_B)
    s = inp.score_B.to(torch.float64)
    return _broadcast((s - mean) * n / (n - 1).clamp(min=1), inp.mask_BT), None


@register("advantage", "grpo", min_group_size=2, params=frozenset({"eps"}))
def grpo_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased within the prompt group."""
    mean, std, _ = group_stats(inp.score_B, inp.group_B)
    s = inp.score_B.to(torch.float64)
    return _broadcast((s - mean) / (std + hp.eps), inp.mask_BT), None


@register("advantage", "drgrpo", min_group_size=2)
def drgrpo_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """Dr.GRPO: A_i = R_i - mean_g R (no std division; pair with seq_sum_const aggregation)."""
    mean, _, _ = group_stats(inp.score_B, inp.group_B)
    return _broadcast(inp.score_B.to(torch.float64) - mean, inp.mask_BT), None


@register("advantage", "reinforce_pp_baseline", min_group_size=2, whiten=True)
def reinforce_pp_baseline_advantage(inp: AdvantageInputs, hp: AdvantageSpec):
    """REINFORCE++-baseline: A_i = R_i - mean_g R, then whitened over all valid tokens of the batch
    (its registry entry turns the targets' whitening on for that step; this returns the group-centred
    score)."""
    return drgrpo_advantage(inp, hp)


def whiten(adv_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8,
           shift_mean: bool = True) -> torch.Tensor:
    """Whitening over all valid tokens of the batch (guide 000 section 3.4), [B, T] -> [B, T]:

        N = sum m,  mu = sum m A / N,  var = sum m (A - mu)^2 / N,  A~ = (A - mu) / sqrt(var + eps)

    (A / sqrt(var + eps) with shift_mean=False). Call it on the whole batch: the statistics are this
    batch's. Mask-0 positions stay 0. The critic target is never touched.
    """
    m = mask_BT.to(torch.float64)
    a = torch.where(mask_BT.bool(), adv_BT.to(torch.float64), 0.0)
    n = m.sum().clamp(min=1)
    mean = (a * m).sum() / n
    var = ((a * a * m).sum() / n - mean * mean).clamp(min=0)
    centred = a - mean if shift_mean else a
    return (centred * torch.rsqrt(var + eps) * m).to(adv_BT.dtype)
