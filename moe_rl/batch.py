"""The one batch of the program: trajectories as right-padded tensors, plus the targets of an update.

A `Batch` is built once from a step's trajectories (`build_batch`), given a step's targets by the
update loops (`with_targets`), and cut into data-parallel shards and microbatches on its way to the
trainer ranks, carrying only the fields the loss reads (`only`). Every field is named with its shape:

  B rows (samples), S positions (right-padded), L MoE layers, K experts per token.

Position conventions (all [B, S]):
  mask_BS      model-sampled tokens (the actions)
  rewards_BS   terminal reward on the last model token, turn feedback on each span's last token
  logp_*_BS    the log-prob of the token at position t, scored by the model that read 0..t-1
  values_*_BS  V(s_t), the state before token t (the critic's output at t-1; see algos.targets)

Routes stay in the smallest integer dtype that holds the expert count (uint8 up to 256 experts,
int16 beyond) everywhere, over Ray included; a trainer rank widens one microbatch at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_rl.algos import rewards as R
from moe_rl.trajectory import Trajectory, trajectory_success

# the fields a step's targets fill (algos.targets.Targets names them alike)
TARGET_FIELDS = ("adv_BS", "returns_BS", "values_old_BS", "logp_old_BS", "logp_ref_BS", "is_weight_BS",
                 "pg_mask_BS")


@dataclass
class Batch:
    input_ids_BS: torch.Tensor  # long
    lengths_B: torch.Tensor  # long: valid tokens per row
    routes_BSLK: torch.Tensor | None = None  # uint8 / int16 global expert ids; None: route freely
    # --- from the rollout
    mask_BS: torch.Tensor | None = None  # bool: model-sampled tokens
    loss_mask_BS: torch.Tensor | None = None  # bool: mask minus samples excluded from the policy loss
    logp_mu_BS: torch.Tensor | None = None  # behaviour log-probs (the engine's)
    rewards_BS: torch.Tensor | None = None
    score_B: torch.Tensor | None = None  # R(tau) = terminal + turn feedback
    success_B: torch.Tensor | None = None  # bool: the episode succeeded (types.trajectory_success)
    turns_B: torch.Tensor | None = None  # long: model turns
    group_B: torch.Tensor | None = None  # long: prompt group
    terminated_B: torch.Tensor | None = None  # bool: true termination (else truncated: bootstrap)
    boundary_len_B: torch.Tensor | None = None  # long: tokens of the boundary state
    prompt_len_B: torch.Tensor | None = None  # long: tokens before the first model turn
    version_B: torch.Tensor | None = None  # long: weight version at generation start
    routed_len_B: torch.Tensor | None = None  # long: leading positions whose routes the engine computed;
    # the rest of a row's routes are placeholders (positions never computed; they cannot matter)
    teacher_B: torch.Tensor | None = None  # long: the row's distillation teacher (RunConfig.teachers' order)
    # --- targets of an update (set by the policy and critic loops)
    adv_BS: torch.Tensor | None = None
    logp_old_BS: torch.Tensor | None = None  # pi_old, the PPO ratio's anchor
    logp_ref_BS: torch.Tensor | None = None  # the reference policy (KL)
    is_weight_BS: torch.Tensor | None = None  # off-policy weight of the policy-gradient term
    pg_mask_BS: torch.Tensor | None = None  # bool: tokens of the policy-gradient term (correction keeps)
    # bool: the pg tokens a batch-scope policy mask (M2PO) keeps, decided per minibatch; None: no such mask
    policy_keep_BS: torch.Tensor | None = None
    returns_BS: torch.Tensor | None = None  # critic targets
    values_old_BS: torch.Tensor | None = None  # pre-update V(s_t) (value clipping)

    @property
    def size(self) -> int:
        return self.input_ids_BS.shape[0]

    def _map(self, per_row, per_position) -> Batch:
        """Apply per_row to every [B] tensor and per_position to every [B, S, ...] tensor."""
        out = {}
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if isinstance(x, torch.Tensor):
                x = per_position(x) if x.dim() >= 2 else per_row(x)
            out[f.name] = x
        return Batch(**out)

    def rows(self, idx: slice | torch.Tensor, multiple: int = 1) -> Batch:
        """Rows `idx`, cut to their longest length rounded up to `multiple` (sequence parallelism)."""
        lengths = self.lengths_B[idx]
        S = -(-(int(lengths.max()) if lengths.numel() else 1) // multiple) * multiple

        def cut(x):
            out = x[idx, :S]
            if out.shape[1] < S:
                out = torch.nn.functional.pad(out, (0, 0) * (x.dim() - 2) + (0, S - out.shape[1]))
            return out

        return self._map(lambda x: x[idx], cut)

    def padded(self, rows: int, length: int) -> Batch:
        """Append empty rows (length 0) and right-pad every tensor to `length` positions."""
        B, S = self.input_ids_BS.shape

        def grow_rows(x):
            return torch.cat([x, torch.zeros((rows - B, *x.shape[1:]), dtype=x.dtype)])

        return self._map(grow_rows, lambda x: grow_rows(
            torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, length - S))))

    def uniform_microbatches(self, rows_per_mb: int, count: int, length: int) -> list[Batch]:
        """`count` microbatches of exactly [rows_per_mb, length] (empty rows appended)."""
        full = self.padded(rows_per_mb * count, length)
        return [full._map(lambda x, i=i: x[i * rows_per_mb:(i + 1) * rows_per_mb],
                          lambda x, i=i: x[i * rows_per_mb:(i + 1) * rows_per_mb]) for i in range(count)]

    def microbatches(self, token_budget: int, multiple: int = 1, packed: bool = False) -> list[Batch]:
        """Consecutive rows whose padded size B*S_max (packed: sum of lengths) stays within
        token_budget (at least one row)."""
        out, start, B = [], 0, self.size
        while start < B:
            end, longest, total = start, 0, 0
            while end < B:
                longest_new = max(longest, int(self.lengths_B[end]))
                cost = total + int(self.lengths_B[end]) if packed else longest_new * (end - start + 1)
                if end > start and cost > token_budget:
                    break
                total += int(self.lengths_B[end])
                longest, end = longest_new, end + 1
            out.append(self.rows(slice(start, end), multiple))
            start = end
        return out

    def with_targets(self, t) -> Batch:
        """This batch carrying a step's targets (algos.targets.Targets, under the same names) for the
        update loops; under PPO-EWMA pi_old and the correction are left to each minibatch."""
        return dataclasses.replace(self, **{name: getattr(t, name) for name in TARGET_FIELDS})

    def to(self, device) -> Batch:
        """Every tensor on `device` (a trainer rank's; no copy where they are already there)."""
        return self._map(lambda x: x.to(device), lambda x: x.to(device))

    def model_inputs(self, routes: bool = True) -> Batch:
        """What scoring needs (tokens, lengths and, with `routes`, the routes to replay)."""
        return Batch(self.input_ids_BS, self.lengths_B, self.routes_BSLK if routes else None)

    def only(self, fields: tuple[str, ...]) -> Batch:
        """The model inputs (routes included) and the named fields, nothing else."""
        return dataclasses.replace(self.model_inputs(), **{f: getattr(self, f) for f in fields})


def teacher_index(trajs: list[Trajectory], teachers: list[str]) -> torch.Tensor:
    """Each trajectory's distillation teacher as its index in `teachers` (names; "" is teacher.path, the
    teacher of rows that name none), [B] long."""
    names = [t.info.get("teacher", "") for t in trajs]
    unknown = sorted({n for n in names if n not in teachers})
    if unknown:
        default = "set" if "" in teachers else "empty"
        raise ValueError(f"rows name teachers {unknown} that are not configured (teacher.named: "
                         f"{[n for n in teachers if n]}; teacher.path {default})")
    return torch.tensor([teachers.index(n) for n in names])


def build_batch(trajs: list[Trajectory], top_k: int | None, teachers: list[str] | None = None) -> Batch:
    """A step's trajectories as one batch; routes (when recorded and `top_k` is given) in their
    recorded dtype; with `teachers` (distillation), each row's teacher (teacher_index)."""
    B = len(trajs)
    S = max(len(t.token_ids) for t in trajs)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    logp = torch.zeros(B, S)
    span_rewards = torch.zeros(B, S)
    excluded = torch.zeros(B, dtype=torch.bool)
    routes, routed = None, torch.zeros(B, dtype=torch.long)
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
                routes = torch.zeros(B, S, r.shape[1], r.shape[2], dtype=r.dtype)
            routes[i, :n] = r
            routed[i] = n - tail
    terminal = torch.tensor([t.terminal_reward for t in trajs])
    return Batch(
        input_ids_BS=ids, lengths_B=torch.tensor([len(t.token_ids) for t in trajs]), routes_BSLK=routes,
        mask_BS=mask, loss_mask_BS=mask & ~excluded.unsqueeze(1), logp_mu_BS=logp,
        rewards_BS=R.place_terminal_reward(terminal, mask) + span_rewards,
        score_B=torch.tensor([t.total_reward for t in trajs]),
        success_B=torch.tensor([trajectory_success(t) for t in trajs], dtype=torch.bool),
        turns_B=torch.tensor([len(t.spans) for t in trajs]),
        group_B=torch.tensor([t.group_id for t in trajs]),
        terminated_B=torch.tensor([t.terminated for t in trajs]),
        boundary_len_B=torch.tensor([t.boundary_len for t in trajs]),
        prompt_len_B=torch.tensor([t.prompt_len for t in trajs]),
        version_B=torch.tensor([t.weight_version for t in trajs]),
        routed_len_B=routed if routes is not None else None,
        teacher_B=None if teachers is None else teacher_index(trajs, teachers))
