"""What a trainer rank returns across the process boundary, typed: a scoring forward's per-token outputs
(ScoreResult) and one optimizer update's figures (UpdateResult). Names are the batch's and the
targets' (moe_rl.batch, algos.targets.Scores): one name per quantity from the rollout to the loss."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class ScoreResult:
    """A forward over a batch, [B, S] float32 (on every rank): the policy's log-prob of each token and
    its distribution's entropy, or the critic's per-position outputs (algos.targets.state_values makes
    them V(s_t)); with record_routes, the experts its routers chose, [B, S, L, K] (the routes' dtype)."""

    logp_BS: torch.Tensor | None = None
    entropy_BS: torch.Tensor | None = None
    critic_out_BS: torch.Tensor | None = None
    routes_BSLK: torch.Tensor | None = None
    seconds: float = 0.0  # the rank's wall time of the forward passes

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-token fields this result holds, by name."""
        held = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: x for name, x in held.items() if isinstance(x, torch.Tensor)}


@dataclass
class UpdateResult:
    """One optimizer update on a rank's shard: its figures (the loss terms' reduced over microbatches,
    loss on the last pipeline stage, grad_norm, lr, update_ok, skipped_nonfinite, router losses, the
    rank's memory) and, asked for, the forward's log-probs before the update, [B, S]."""

    figures: dict[str, float]
    logp_BS: torch.Tensor | None = None
