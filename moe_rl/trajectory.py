"""Data contracts between the rollout side and the training side.

A `Trajectory` is one conversation as the model saw it: a single token sequence (prompt, model turns,
tool and environment observations), with the response mask marking exactly the tokens the model
sampled. Everything downstream (reward placement, GAE, losses, R3) reads these fields.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def route_dtype(num_experts: int):
    """The smallest dtype that holds a global expert id (int16, not uint16: torch supports few operations
    on uint16)."""
    return np.uint8 if num_experts <= 256 else np.int16


def route_torch_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RoutingRecord:
    experts_PLK: np.ndarray  # [P, L, K] uint8/int16 global expert ids (route_dtype)
    computed_P: np.ndarray  # [P] bool: position was run through the model

    @classmethod
    def from_rows(cls, rows_NLK: np.ndarray, start: int, dtype) -> RoutingRecord:
        """A record of positions [start, start + N) from rows computed there (vLLM's returned routes
        with `routed_experts_prompt_start=start`); positions before `start` are not computed."""
        N, L, K = rows_NLK.shape
        experts = np.zeros((start + N, L, K), dtype=dtype)
        experts[start:] = rows_NLK
        computed = np.zeros(start + N, dtype=bool)
        computed[start:] = True
        return cls(experts, computed)

    def extended(self, later: RoutingRecord) -> RoutingRecord:
        """This record plus the positions only `later` computed (the next turn of the same
        conversation): a position keeps the route of the forward pass that first computed it (with
        prefix caching, the one its key/value cache came from; after a weight sync reset the cache, a
        later turn recomputes earlier positions with newer weights, and the record keeps the routes
        that produced the earlier turns' tokens)."""
        P = max(len(self.computed_P), len(later.computed_P))
        experts = np.zeros((P, *self.experts_PLK.shape[1:]), dtype=self.experts_PLK.dtype)
        computed = np.zeros(P, dtype=bool)
        for rec in (later, self):  # self last: earlier computations win
            n = len(rec.computed_P)
            experts[:n][rec.computed_P] = rec.experts_PLK[rec.computed_P]
            computed[:n] |= rec.computed_P
        return RoutingRecord(experts, computed)

    @property
    def num_positions(self) -> int:
        """Positions up to and including the last computed one."""
        return int(np.nonzero(self.computed_P)[0][-1]) + 1 if self.computed_P.any() else 0

    @property
    def bytes_per_token(self) -> float:
        return self.experts_PLK.nbytes / max(1, self.experts_PLK.shape[0])

    def missing_positions(self, length: int) -> np.ndarray:
        """Positions < length without a route, excluding the uncomputable tail (see module doc)."""
        computed = self.computed_P[:length]
        if not computed.any():
            return np.arange(length)
        last = int(np.nonzero(computed)[0][-1])
        return np.nonzero(~computed[: last + 1])[0]

    def to_replay(self, length: int, top_k: int) -> tuple[torch.Tensor, int]:
        """[length, L, K] routes for replay, in the record's dtype, and the number of tail positions
        filled.

        Raises ValueError if a position before the last computed one has no route (misalignment).
        """
        missing = self.missing_positions(length)
        if missing.size:
            raise ValueError(f"routing record has no route for positions {missing[:5].tolist()} (of "
                             f"{length})")
        P, L, K = self.experts_PLK.shape
        out = torch.empty(length, L, K,
                          dtype=torch.uint8 if self.experts_PLK.dtype == np.uint8 else torch.int16)
        n = min(P, length)
        out[:n] = torch.from_numpy(self.experts_PLK[:n].copy())  # a copy: arrays from Ray are read-only
        computed = np.zeros(length, dtype=bool)
        computed[:n] = self.computed_P[:n]
        tail = ~computed
        out[torch.from_numpy(tail)] = torch.arange(top_k, dtype=out.dtype)
        return out, int(tail.sum())




class Outcome(str, enum.Enum):
    COMPLETED = "completed"  # the environment ended the episode (true termination)
    TRUNCATED_BUDGET = "truncated_budget"  # the episode's token budget ran out (bootstrap)
    TRUNCATED_CONTEXT = "truncated_context"  # the model's context limit was reached (bootstrap)
    TRUNCATED_TURNS = "truncated_turns"  # environment.max_turns turns taken, the task not over (bootstrap)
    REPETITION = "repetition"  # the model repeated itself and was cut off: a failed end, no bootstrap
    TOOL_ERROR = "tool_error"  # too many failed tool calls; the environment ended the episode
    ENV_ERROR = "env_error"  # the environment itself failed: reward unreliable, not trained on

    @property
    def terminated(self) -> bool:
        """True termination (bootstrap 0) vs truncation (bootstrap from the boundary state). A repetition
        cut ends the episode as it stands: the policy triggers it at will, so bootstrapping it would pay
        the critic's value of going on to a policy that loops instead of playing."""
        return self in (Outcome.COMPLETED, Outcome.TOOL_ERROR, Outcome.ENV_ERROR, Outcome.REPETITION)


@dataclass
class Trajectory:
    """One episode. Lists are aligned to token positions 0..N-1.

    token_ids        [N] prompt + model turns + observations (never re-tokenised model output)
    response_mask    [N] True exactly for tokens sampled by the model
    logprobs         [N] behaviour log-prob of each sampled token (0.0 elsewhere)
    spans            model-output spans as inclusive (start, end) positions, in order
    turn_rewards     one feedback value per span (placed on the span's last token)
    terminal_reward  R(tau), placed on the last model token
    boundary_len     tokens of the boundary state s_boundary (the prefix including observations
                     returned after the last model token); the critic's value at position
                     boundary_len-1 bootstraps truncated episodes
    weight_version   the version the episode started with: the oldest of its tokens
    versions         [N] weight version of each token: for a model token the weights that sampled it,
                     for a prompt or observation token those of the request that first computed it
                     (asynchronous mode: a weight sync can land mid-conversation, even mid-turn);
                     empty: every token is weight_version
    """

    token_ids: list[int]
    response_mask: list[bool]
    logprobs: list[float]
    spans: list[tuple[int, int]]
    turn_rewards: list[float]
    terminal_reward: float
    outcome: Outcome
    boundary_len: int
    weight_version: int
    prompt_len: int
    routes: RoutingRecord | None = field(default=None, repr=False)
    group_id: int = 0
    sample_index: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)

    @property
    def terminated(self) -> bool:
        return self.outcome.terminated

    @property
    def num_actions(self) -> int:
        return sum(self.response_mask)

    @property
    def total_reward(self) -> float:
        return self.terminal_reward + sum(self.turn_rewards)


def trajectory_success(t: Trajectory) -> bool:
    """Whether an episode succeeded: its environment's `success` figure where it reports one (e.g. math:
    the answer was right, whatever the format reward), else a terminal reward > 0."""
    figure = t.info.get("figures", {}).get("success")
    return bool(figure > 0.5) if figure is not None else t.terminal_reward > 0


def trajectory_state(t: Trajectory) -> dict:
    """A trajectory in plain types and tensors (a checkpoint loads it with weights_only=True)."""
    state = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
    state["outcome"] = t.outcome.value
    state["spans"] = [list(s) for s in t.spans]
    if t.routes is not None:
        state["routes"] = (torch.from_numpy(t.routes.experts_PLK.copy()),
                           torch.from_numpy(t.routes.computed_P.copy()))
    return state


def trajectory_from_state(state: dict) -> Trajectory:
    """`trajectory_state`'s inverse."""
    routes = None if state["routes"] is None else RoutingRecord(*(x.numpy() for x in state["routes"]))
    return Trajectory(**{**state, "outcome": Outcome(state["outcome"]),
                         "spans": [tuple(s) for s in state["spans"]], "routes": routes})


def validate_trajectory(t: Trajectory, max_len: int | None = None) -> list[str]:
    """The guide's checklist, per trajectory. Returns the violated rules (empty: valid)."""
    bad = []
    n = len(t.token_ids)
    if not (len(t.response_mask) == len(t.logprobs) == n) or (t.versions and len(t.versions) != n):
        bad.append("lengths: token_ids, response_mask, logprobs and versions differ in length")
        return bad
    if t.versions and min(t.versions) < t.weight_version:
        bad.append(f"versions: a token is older than the episode's start version {t.weight_version}")
    if t.prompt_len < 1 or any(t.response_mask[: t.prompt_len]):
        bad.append("action_mask: prompt tokens are marked as model actions")
    covered = [False] * n
    prev_end = -1
    for b, e in t.spans:
        if not (prev_end < b <= e < n):
            bad.append(f"spans: span ({b}, {e}) is out of order or out of range")
            break
        for p in range(b, e + 1):
            covered[p] = True
        prev_end = e
    if covered != list(t.response_mask):
        bad.append("spans: model-output spans do not match the response mask")
    if len(t.turn_rewards) != len(t.spans):
        bad.append("turn_rewards: one turn reward per model-output span is required")
    if not all(math.isfinite(r) for r in [t.terminal_reward, *t.turn_rewards]):
        bad.append("rewards: a reward is not finite (NaN or inf)")
    if any(lp > 1e-4 or lp != lp for lp, m in zip(t.logprobs, t.response_mask, strict=False) if m):
        bad.append("policy_roles: a sampled token has no valid behaviour log-prob")
    if not t.terminated and not (0 < t.boundary_len <= n):
        bad.append("boundary: a truncated episode needs its boundary state")
    if t.num_actions == 0:
        bad.append("empty: no model tokens")
    if max_len is not None and n > max_len:
        bad.append(f"length: {n} tokens exceed the context limit {max_len}")
    if t.routes is not None:
        missing = t.routes.missing_positions(n)
        if missing.size:
            bad.append(f"routes: no routing record for positions {missing[:5].tolist()}")
    return bad
