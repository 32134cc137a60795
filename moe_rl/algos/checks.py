"""The guide's pre-update checklist (guide 000 section 7.4) as runtime validation of a batch.

`check_batch` raises `BatchCheckError` naming the sample and the rule it breaks; nothing is repaired
silently. It runs once per batch before the update (it synchronises with the host by design); when
pi_old is the update's own forward, `check_sync_roles` runs in the loss, before the backward pass.

Non-finite rewards never get this far in the loop: the agent rejects such trajectories (counted as
`rollout/rejected_rewards`, see types.validate_trajectory), because one NaN reward would spread
through group statistics, the GAE recursion and whitening into every advantage. The
`finite_rewards` rule here is the batch-level guard.
"""

from __future__ import annotations

import torch

SYNC_TOLERANCE = 1e-3  # |log mu - log pi_old| a synchronous step allows on a model token


class BatchCheckError(ValueError):
    def __init__(self, rule: str, sample: int | None, detail: str):
        self.rule, self.sample, self.detail = rule, sample, detail
        where = f"sample {sample}: " if sample is not None else ""
        super().__init__(f"batch check '{rule}' failed: {where}{detail}")

    def __reduce__(self):  # pickled by its own arguments (a rank raises it: Ray sends it to the driver)
        return BatchCheckError, (self.rule, self.sample, self.detail)


def _first(bad_B: torch.Tensor) -> int | None:
    idx = bad_B.nonzero()
    return int(idx[0, 0]) if idx.numel() else None


def check_sync_roles(logp_behaviour_BT: torch.Tensor, logp_old_BT: torch.Tensor, mask_BT: torch.Tensor,
                     tolerance: float = SYNC_TOLERANCE) -> None:
    """sync_roles: in a synchronous step mu = pi_old on valid tokens, within `tolerance` (all [B, T]).
    Checked with the batch (check_batch) or, when pi_old is the update's own forward, by the loss
    before its backward pass (train.objectives.PolicyLoss): before the update either way."""
    # torch.where, not * m: -inf - -inf = NaN on padding would make the row's max NaN (never > tol)
    gap = torch.where(mask_BT.bool(), (logp_behaviour_BT - logp_old_BT).abs(), 0.0).amax(1)
    s = _first(gap > tolerance)
    if s is not None:
        raise BatchCheckError("sync_roles", s, f"mu and pi_old differ by {float(gap[s]):.3g} in a "
                              "synchronous step (an objective without off-policy correction assumes they are "
                              "equal; use a correction such as tis_token, or replay the rollout's routes)")


def check_batch(
    mask_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    rewards_BT: torch.Tensor,
    terminated_B: torch.Tensor | None = None,
    boundary_value_B: torch.Tensor | None = None,
    logp_behaviour_BT: torch.Tensor | None = None,
    logp_old_BT: torch.Tensor | None = None,
    logp_ref_BT: torch.Tensor | None = None,
    needs_behaviour: bool = False,
    needs_reference: bool = False,
    logp_teacher_BT: torch.Tensor | None = None,
    needs_teacher: bool = False,
    needs_boundary: bool = False,
    synchronous: bool = False,
    sync_tolerance: float = SYNC_TOLERANCE,
) -> dict[str, int]:
    """Validate a batch against the checklist. Returns counts of what it saw ({"empty_samples": n, ...}).

    Rules (names as raised):
      action_mask       m_t = 1 only where the attention mask is 1 (padding is never an action)
      finite_rewards    every reward u_t is finite, on every position (NaN or +-inf anywhere fails)
      reward_placement  non-zero rewards only on valid model tokens (terminal reward on q_J, not the end)
      boundary          truncated samples carry a finite boundary value V(s_boundary) (when bootstrapping)
      policy_roles      the roles the correction / KL / distillation need are present and finite on
                        valid tokens
      sync_roles        in synchronous mode mu = pi_old on valid tokens (within sync_tolerance)
      empty_batch       at least one sample has a model token
    """
    m = mask_BT.bool()
    att = attention_mask_BT.bool()
    s = _first((m & ~att).any(1))
    if s is not None:
        raise BatchCheckError("action_mask", s,
                              "response mask is 1 at a position the attention mask excludes")
    bad_r = ~torch.isfinite(rewards_BT)
    s = _first(bad_r.any(1))
    if s is not None:
        t = int(bad_r[s].nonzero()[0])
        raise BatchCheckError("finite_rewards", s, f"reward at position {t} is {float(rewards_BT[s, t])}")
    s = _first(((rewards_BT != 0) & ~m).any(1))
    if s is not None:
        t = int(((rewards_BT[s] != 0) & ~m[s]).nonzero()[0])
        raise BatchCheckError("reward_placement", s,
                              f"non-zero reward at position {t}, which is not a model token")
    if needs_boundary:
        if terminated_B is None or boundary_value_B is None:
            raise BatchCheckError("boundary", None,
                                  "value bootstrapping needs terminated and boundary_value for every sample")
        s = _first(~terminated_B.bool() & ~torch.isfinite(boundary_value_B))
        if s is not None:
            raise BatchCheckError("boundary", s, "truncated sample without a finite boundary value")
    roles = {"behaviour (mu)": (logp_behaviour_BT, needs_behaviour),
             "reference": (logp_ref_BT, needs_reference), "proximal (pi_old)": (logp_old_BT, False),
             "teacher": (logp_teacher_BT, needs_teacher)}
    for name, (logp, needed) in roles.items():
        if logp is None:
            if needed:
                raise BatchCheckError("policy_roles", None, f"the {name} log-probs are required but missing")
            continue
        bad = m & (~torch.isfinite(logp) | (logp > 1e-4))
        s = _first(bad.any(1))
        if s is not None:
            raise BatchCheckError("policy_roles", s,
                                  f"{name} log-prob is not a finite value <= 0 on a model token")
    if synchronous and logp_behaviour_BT is not None and logp_old_BT is not None:
        check_sync_roles(logp_behaviour_BT, logp_old_BT, m, sync_tolerance)
    empty = ~m.any(1)
    if bool(empty.all()):
        raise BatchCheckError("empty_batch", None, "no sample has a model token; skip this update")
    return {"empty_samples": int(empty.sum()), "samples": int(m.shape[0]), "valid_tokens": int(m.sum())}
