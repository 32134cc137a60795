"""Trajectories -> padded training tensors (the TrainBatch), and the per-step RL math wiring.

Position conventions (all [B, S], right-padded):
  input_ids, attention_mask, mask (response mask: sampled tokens), logp_mu (behaviour log-probs)
  rewards      terminal reward on the last model token, turn feedback on each span's last token
  values       V(s_t) for the state *before* token t = the critic's output at position t-1
  boundary     V(s_boundary) = the critic's output at position boundary_len-1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algos import rewards as R
from moe_rl.types import Trajectory


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, S] long
    lengths: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, S] bool: model-sampled tokens
    loss_mask: torch.Tensor  # [B, S] bool: mask minus samples excluded from the policy loss
    logp_mu: torch.Tensor  # [B, S]
    rewards: torch.Tensor  # [B, S]
    score: torch.Tensor  # [B] total reward R(tau) (terminal + turn feedback)
    group: torch.Tensor  # [B] long
    terminated: torch.Tensor  # [B] bool
    boundary_len: torch.Tensor  # [B] long
    prompt_len: torch.Tensor  # [B] long: tokens before the first model turn
    version: torch.Tensor  # [B] long: weight version at generation start
    routes: torch.Tensor | None  # [B, S, L, K] long, or None
    routes_filled: int = 0  # tail positions filled (never computed by the engine; cannot matter)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> TrainBatch:
        def pick(x):
            return x[rows] if isinstance(x, torch.Tensor) else x

        return TrainBatch(**{k: pick(getattr(self, k)) for k in self.__dataclass_fields__})


def build_batch(trajs: list[Trajectory], top_k: int | None) -> TrainBatch:
    B = len(trajs)
    S = max(len(t.token_ids) for t in trajs)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    logp = torch.zeros(B, S)
    span_rewards = torch.zeros(B, S)
    excluded = torch.zeros(B, dtype=torch.bool)
    routes = None
    filled = 0
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        mask[i, :n] = torch.tensor(t.response_mask)
        logp[i, :n] = torch.tensor(t.logprobs)
        for (_, e), g in zip(t.spans, t.turn_rewards, strict=True):
            span_rewards[i, e] += g
        excluded[i] = "loss_excluded" in t.info
        if t.routes is not None and top_k is not None:
            r, tail = t.routes.to_replay(n, top_k)
            if routes is None:
                routes = torch.zeros(B, S, r.shape[1], r.shape[2], dtype=torch.long)
            routes[i, :n] = r
            filled += tail
    terminal = torch.tensor([t.terminal_reward for t in trajs])
    rewards = R.place_terminal_reward(terminal, mask) + span_rewards
    return TrainBatch(
        input_ids=ids, lengths=torch.tensor([len(t.token_ids) for t in trajs]), mask=mask,
        loss_mask=mask & ~excluded.unsqueeze(1), logp_mu=logp, rewards=rewards,
        score=torch.tensor([t.total_reward for t in trajs]), group=torch.tensor([t.group_id for t in trajs]),
        terminated=torch.tensor([t.terminated for t in trajs]), boundary_len=torch.tensor([t.boundary_len for t in trajs]),
        prompt_len=torch.tensor([t.prompt_len for t in trajs]),
        version=torch.tensor([t.weight_version for t in trajs]), routes=routes, routes_filled=filled)


def state_values(critic_out: torch.Tensor, boundary_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic outputs per position -> (V(s_t) for every t [B, S], V(s_boundary) [B])."""
    from moe_rl.train.actor import state_values as shift

    values = shift(critic_out)
    boundary = critic_out.gather(1, (boundary_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return values, boundary
