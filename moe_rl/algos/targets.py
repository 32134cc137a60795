"""A step's targets from its batch and scores: the pre-update checklist, shaped rewards, advantages and
returns, the off-policy correction, and the global loss denominators. Pure tensor math.

    t = targets(batch, scores, params)                 # once per step, before any update
    w, keep = correct(logp_old, logp_mu, mask, params) # per minibatch under PPO-EWMA (the anchor moves)
    D = policy_denominators(pg_mask, loss_mask, w, params)

`batch` is any object with the named [B, S] / [B] fields of moe_rl.batch.Batch (mask_BS,
loss_mask_BS, rewards_BS, score_B, group_B, terminated_B, lengths_B, prompt_len_B, boundary_len_B,
logp_mu_BS); `scores` holds what the models computed on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moe_rl.algos import aggregate, checks, correction, distill, registry
from moe_rl.algos import rewards as R
from moe_rl.algos.advantages import AdvantageInputs, AdvantageSpec, whiten


@dataclass(frozen=True)
class TargetSpec:
    """The algorithm's settings as the math reads them (built from the config in moe_rl.driver.specs)."""

    advantage: str
    gamma: float
    lam: float
    lam_critic: float | None
    length_adaptive_alpha: float | None
    whiten: bool
    kl_reward_coef: float
    kl_reward_estimator: str
    needs_reference: bool  # a KL term (reward or loss) reads pi_ref
    overlong_buffer: int
    overlong_penalty: float
    token_budget: int  # the episode's tokens after the prompt (environment.token_budget)
    correction: str
    correction_params: correction.CorrectionSpec
    ewma_anchor: bool  # pi_old is the PPO-EWMA anchor, scored per minibatch
    aggregation: str
    loss_constant: float  # seq_sum_const's denominator
    self_normalize: bool
    synchronous: bool  # rollouts come from the weights being trained (mu = pi_old can be verified)
    # R = rule_weight * R_env + reward_model_weight * R_model (with a reward model)
    reward_model_weight: float
    rule_weight: float
    distill_coef: float  # c of algos/distill.py Eq. (2): the teacher's per-token term (0: off)


@dataclass
class Scores:
    """What the models computed on a batch ([B, S]; None where that model is absent)."""

    # the policy before this step's updates, rollout routes replayed; None before a step of one update
    # whose own forward gives it (RunConfig.proximal_from_update): `with_policy` adds it after the update
    logp_BS: torch.Tensor | None
    logp_ref_BS: torch.Tensor | None = None
    critic_out_BS: torch.Tensor | None = None  # the critic's per-position outputs (see state_values)
    free_logp_BS: torch.Tensor | None = None  # diagnostics: the policy routing freely
    free_routes_BSLK: torch.Tensor | None = None
    reward_model_B: torch.Tensor | None = None  # a reward model's score of each episode (at its last token)
    logp_teacher_BS: torch.Tensor | None = None  # each row's distillation teacher (routing freely)
    teacher_seconds: float = 0.0  # the teachers' scoring time

    def with_policy(self, logp_BS: torch.Tensor | None) -> Scores:
        """These scores with the policy's log-probs from the update's forward, when it gave them."""
        return self if logp_BS is None else dataclasses.replace(self, logp_BS=logp_BS)


@dataclass
class Targets:
    adv_BS: torch.Tensor  # float32, 0 off model tokens
    returns_BS: torch.Tensor | None  # critic targets (None without a critic)
    values_old_BS: torch.Tensor | None  # frozen pre-update V(s_t)
    # pi_old; None under PPO-EWMA (scored per minibatch) or from the update's forward
    logp_old_BS: torch.Tensor | None
    logp_policy_BS: torch.Tensor | None  # the policy before this step's updates (routes replayed), as Scores
    logp_ref_BS: torch.Tensor | None
    is_weight_BS: torch.Tensor | None  # the correction's weight (None under PPO-EWMA: per minibatch)
    pg_mask_BS: torch.Tensor | None  # bool: the loss tokens the correction keeps (the policy-gradient term's)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def state_values(out_BS: torch.Tensor) -> torch.Tensor:
    """The critic's per-position outputs -> V(s_t) for every position t, [B, S].

    The output at position t-1 has read tokens 0..t-1: it is the value of the state before token t.
    V(s_0) (nothing read) is never a model-token state and is 0. The one place this shift is written.
    """
    values = torch.zeros_like(out_BS)
    values[:, 1:] = out_BS[:, :-1]
    return values


def boundary_values(out_BS: torch.Tensor, boundary_len_B: torch.Tensor) -> torch.Tensor:
    """V(s_boundary) [B]: the critic's output at position boundary_len - 1."""
    return out_BS.gather(1, (boundary_len_B - 1).clamp(min=0).unsqueeze(1)).squeeze(1)


def correct(logp_old_BS: torch.Tensor, logp_mu_BS: torch.Tensor, mask_BS: torch.Tensor,
            p: TargetSpec) -> correction.Correction:
    """The registered correction p.correction: detached weights w_t and the keep mask."""
    return registry.get("correction", p.correction)(logp_old_BS, logp_mu_BS, mask_BS, p.correction_params)


def policy_denominators(pg_mask_BS: torch.Tensor, loss_mask_BS: torch.Tensor, weight_BS: torch.Tensor,
                        p: TargetSpec) -> dict[str, torch.Tensor]:
    """Global denominators of a minibatch's policy loss: the weighted policy-gradient term over the
    tokens the correction keeps (self-normalised: the kept weights' sum) and the unweighted
    KL / entropy regulariser over every loss token (see train.objectives.PolicyLoss)."""
    return {"policy": aggregate.loss_denominator(pg_mask_BS, p.aggregation, p.loss_constant,
                                                 weight_BS.float(), p.self_normalize),
            "regularizer": aggregate.loss_denominator(loss_mask_BS, p.aggregation, p.loss_constant)}


def shaped_rewards(batch, logp_ref_BS: torch.Tensor | None, p: TargetSpec,
                   reward_model_B: torch.Tensor | None = None):
    """Per-token rewards u_t and the episode score R(tau) after shaping, plus reward metrics.

    With a reward model, u_t = w_rule u_t^env + w_model R_model [t = last model token]. The KL penalty
    (u_t - beta k_t) and the DAPO overlong penalty R_len on the last model token, where the length is
    the episode's tokens after the prompt (model and observation tokens: the unit
    environment.token_budget bounds), act on u_t (GAE, reward-to-go) and, through R(tau) = sum_t u_t,
    on the score the outcome estimators read (GRPO, RLOO, REINFORCE, ...): every estimator sees them.
    reward_model_B: [B] or None.
    """
    rewards, m = batch.rewards_BS, {}
    if reward_model_B is not None:
        model = R.place_terminal_reward(reward_model_B.to(rewards.dtype), batch.mask_BS)
        rewards = p.rule_weight * rewards + p.reward_model_weight * model
        m["reward/model_mean"], m["reward/model_std"] = (reward_model_B.mean(),
                                                         reward_model_B.std(correction=0))
    if p.kl_reward_coef:
        rewards, k = R.kl_shaped_rewards(rewards, batch.logp_mu_BS, logp_ref_BS, batch.mask_BS,
                                         p.kl_reward_coef, p.kl_reward_estimator)
        m["reward/kl_penalty_mean"] = (k * batch.mask_BS).sum() / batch.mask_BS.sum().clamp(min=1)
    if p.overlong_buffer:
        penalty = R.overlong_penalty(batch.lengths_B - batch.prompt_len_B, p.token_budget, p.overlong_buffer,
                                     p.overlong_penalty)
        rewards = rewards + R.place_terminal_reward(penalty, batch.mask_BS)
        m["reward/overlong_penalty_mean"] = penalty.mean()
    shaped = p.kl_reward_coef or p.overlong_buffer or reward_model_B is not None
    score = rewards.sum(1) if shaped else batch.score_B
    if reward_model_B is not None:
        m["reward/combined_mean"] = score.mean()
    return rewards, score, m


def targets(batch, scores: Scores, p: TargetSpec) -> Targets:
    """The checklist (guide 000 section 7.4) first, then pi_old and its correction, then advantages."""
    values = boundary = None
    if scores.critic_out_BS is not None:
        values = state_values(scores.critic_out_BS)
        boundary = boundary_values(scores.critic_out_BS, batch.boundary_len_B)
    # pi_old: mu itself (the correction says so), the EWMA anchor (per minibatch), or the policy as
    # scored before this step's updates (None: the update's own forward, which checks mu = pi_old itself)
    method = registry.meta("correction", p.correction)
    logp_old = batch.logp_mu_BS if method.old_is_behaviour else None if p.ewma_anchor else scores.logp_BS
    corr = None if p.ewma_anchor else correct(logp_old, batch.logp_mu_BS, batch.mask_BS, p)
    reads_mu = p.ewma_anchor or method.reads_behaviour
    S = batch.input_ids_BS.shape[1]
    checks.check_batch(batch.mask_BS, torch.arange(S).expand_as(batch.mask_BS) < batch.lengths_B.unsqueeze(1),
                       batch.rewards_BS, batch.terminated_B, boundary, batch.logp_mu_BS, logp_old,
                       scores.logp_ref_BS, needs_behaviour=reads_mu, needs_reference=p.needs_reference,
                       logp_teacher_BT=scores.logp_teacher_BS, needs_teacher=bool(p.distill_coef),
                       needs_boundary=values is not None,
                       # synchronous PPO without a correction assumes mu = pi_old: verify it
                       synchronous=p.synchronous and not reads_mu)
    rewards, score, metrics = shaped_rewards(batch, scores.logp_ref_BS, p, scores.reward_model_B)
    inp = AdvantageInputs(rewards_BT=rewards, mask_BT=batch.mask_BS, score_B=score, group_B=batch.group_B,
                          values_BT=values, terminated_B=batch.terminated_B, boundary_value_B=boundary)
    hp = AdvantageSpec(gamma=p.gamma, lam=p.lam, lam_critic=p.lam_critic,
                         length_adaptive_alpha=p.length_adaptive_alpha)
    adv, returns = registry.get("advantage", p.advantage)(inp, hp)
    if p.whiten:
        adv = whiten(adv, batch.mask_BS)
    if p.distill_coef:  # per token; whitened on its own, like the task's (algos/distill.py Eq. 3)
        k = distill.reverse_kl_tokens(batch.logp_mu_BS, scores.logp_teacher_BS, batch.mask_BS)
        term = distill.distill_advantage(k, 1.0)
        adv = adv + p.distill_coef * (whiten(term, batch.mask_BS) if p.whiten else term)
        metrics.update(distill.reverse_kl_figures(k, batch.mask_BS))
    if corr is not None:
        metrics.update({f"correction/{k}": v for k, v in corr.metrics.items()})
    return Targets(adv.float(), None if returns is None else returns.float(), values, logp_old,
                   scores.logp_BS, scores.logp_ref_BS, None if corr is None else corr.weight_BT,
                   None if corr is None else batch.loss_mask_BS & corr.keep_BT, metrics)
