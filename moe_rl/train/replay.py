"""Rollout Routing Replay (R3) through megatron-core's RouterReplay.

Every MoE router registers a `RouterReplay` (`moe_enable_routing_replay=True`). Per microbatch we hand
each router of this pipeline stage the top-k expert ids the rollout engine chose for exactly the
tokens that router will see:

  routes_BSLK [B, S, L, K] (L = MoE layers of the whole model, global expert ids)
    -> this stage's layers -> sequence-major tokens [S, B] (the router's flattening)
    -> this TP rank's sequence shard when sequence parallelism splits the sequence.

Replay happens in the forward pass and again in activation recompute: megatron keeps a FIFO of the
targets set per microbatch and pops it when the action is REPLAY_BACKWARD; `_phase_aware_topk` switches
to that action automatically while autograd is running a backward pass (recompute), so callers set
REPLAY_FORWARD once. Positions past a row's length (padding) without a route get experts 0..K-1 (they
are never read); padding that carries a recorded route keeps it (see `fill_padding`).
A valid token without a route (-1, or an id no expert has) is an error — never silently re-routed.
Also `router_losses`: the routers' load-balancing and z losses of the update just run.
"""

from __future__ import annotations

import torch

_PATCHED = False


class MissingRoutes(ValueError):
    pass


def _phase_aware_topk():
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    original = RouterReplay.get_replay_topk

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD \
                and torch._C._current_graph_task_id() != -1:
            self.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
            try:
                return original(self, scores, topk, num_groups, group_topk, default_compute_topk)
            finally:
                self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
        return original(self, scores, topk, num_groups, group_topk, default_compute_topk)

    RouterReplay.get_replay_topk = get_replay_topk
    _PATCHED = True


def moe_layer_ids(module, config) -> list[int]:
    """For each MoE layer of this stage (router build order), its index among the model's MoE layers."""
    freq = config.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)] if isinstance(freq, int) \
        else list(freq)
    ids = []
    for layer in module.decoder.layers:
        g = layer.layer_number - 1
        if pattern[g]:
            ids.append(sum(pattern[:g]))
    return ids


def _positions(B: int, S: int, device: torch.device) -> torch.Tensor:
    """[B, S] position of each slot in its row, on `device`: the routes' (masks are built where the
    routes are; lengths may arrive from the host)."""
    return torch.arange(S, device=device).expand(B, S)


def check_complete(routes_BSLK: torch.Tensor, lengths_B: torch.Tensor, num_experts: int) -> None:
    """Raise MissingRoutes naming the first valid position (row, position) without a route: an id < 0
    (unrecorded) or one naming no expert of the model (>= num_experts)."""
    B, S = routes_BSLK.shape[:2]
    valid = _positions(B, S, routes_BSLK.device) < lengths_B.to(routes_BSLK.device).unsqueeze(1)
    missing = ((routes_BSLK < 0) | (routes_BSLK >= num_experts)).flatten(2).any(-1) & valid
    if bool(missing.any()):
        b, s = (int(x) for x in missing.nonzero()[0])
        raise MissingRoutes(f"sample {b} position {s} has no recorded route (ids "
                            f"{routes_BSLK[b, s].flatten().tolist()[:8]}, the model has experts "
                            f"0..{num_experts - 1})")


def fill_padding(routes_BSLK: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Routes with every padding position (>= the row's length) that holds no route set to experts
    0..K-1 (any valid choice: padding never reaches a loss).

    A padding position that does hold a route (K distinct expert ids >= 0: the trainer's own record
    of a free forward) keeps it. Padding tokens still pass through the experts, and how many rows each
    expert computes (and where its rows start) changes the rounding of the *valid* rows: MKL's sgemm
    picks its kernel by shape and CPU (on an AVX-512 host, a row computed in a 1- or 2-row GEMM
    differs in the last bit from the same row in a 3+-row GEMM). Re-routing all padding to experts
    0..K-1 therefore moved 34 of 200 random tiny-model batches off free routing by an ulp (4.8e-7 in
    a log-prob); keeping the recorded padding routes, 0 of 200: replaying one's own routes is bitwise
    free routing. Missing routes (< 0) and the zeros of positions no microbatch computed (a
    duplicated expert) are filled."""
    B, S, _, K = routes_BSLK.shape
    routes = routes_BSLK.long()
    pad = (_positions(B, S, routes.device) >= lengths_B.to(routes.device).unsqueeze(1))[:, :, None, None]
    ids = routes.sort(-1).values
    has_route = (ids[..., :1] >= 0) & (ids[..., 1:] != ids[..., :-1]).all(-1, keepdim=True)
    return torch.where(pad & ~has_route, torch.arange(K, device=routes.device).expand_as(routes), routes)


def router_tokens(routes_BSK: torch.Tensor, tp_rank: int, tp_size: int,
                  sequence_parallel: bool) -> torch.Tensor:
    """[B, S, K] complete routes of one layer (padding filled) -> the [tokens, K] int64 array this
    rank's router sees."""
    B, S, K = routes_BSK.shape
    r = routes_BSK.long().transpose(0, 1)  # [S, B, K]: sequence-major, as the router flattens [s, b, h]
    if sequence_parallel and tp_size > 1:
        if S % tp_size:
            raise ValueError(f"sequence length {S} must be a multiple of tp={tp_size} under sequence "
                             "parallelism")
        chunk = S // tp_size
        r = r[tp_rank * chunk:(tp_rank + 1) * chunk]
    return r.reshape(-1, K).contiguous()


def set_targets(instances, routes_BSLK: torch.Tensor | None, lengths_B: torch.Tensor, tp_rank: int,
                tp_size: int, sequence_parallel: bool, layer_ids: list[int], topk: int,
                num_experts: int) -> bool:
    """Arm this stage's routers for one microbatch. Returns False (free routing) when routes is None."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if routes_BSLK is None or not instances:
        for inst in instances:
            inst.clear_router_replay_action()
        return False
    _phase_aware_topk()
    if len(layer_ids) != len(instances):
        raise RuntimeError(f"{len(instances)} routers on this stage but {len(layer_ids)} MoE layers")
    if max(layer_ids) >= routes_BSLK.shape[2]:
        raise MissingRoutes(f"routes cover {routes_BSLK.shape[2]} MoE layers, the model has more")
    if routes_BSLK.shape[3] != topk:
        raise MissingRoutes(f"routes carry top-{routes_BSLK.shape[3]} experts, the model routes top-{topk}")
    mine = routes_BSLK[:, :, layer_ids]  # this stage's layers, checked and padding-filled once
    check_complete(mine, lengths_B, num_experts)
    mine = fill_padding(mine, lengths_B)
    for i, inst in enumerate(instances):
        inst.set_target_indices(router_tokens(mine[:, :, i], tp_rank, tp_size, sequence_parallel))
        inst.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return True


def record(instances) -> None:
    """Switch this stage's routers to RECORD (diagnostics: what would the trainer route?)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for inst in instances:
        inst.set_router_replay_action(RouterReplayAction.RECORD)


def recorded(instances) -> list[torch.Tensor | None]:
    return [inst.get_recorded_indices() for inst in instances]


def clear(instances) -> None:
    for inst in instances:
        inst.clear_indices()
        inst.clear_router_replay_action()


def recorded_routes(instances, B: int, S: int, tp_rank: int, tp_size: int, sequence_parallel: bool,
                    tp_group=None) -> torch.Tensor:
    """The routes this stage's routers recorded in the last forward, as [B, S, L_stage, K] int64
    (the inverse of `router_tokens`; TP sequence shards gathered)."""
    import torch.distributed as dist

    layers = []
    for inst in instances:
        r = inst.get_recorded_indices()
        if r is None:
            raise RuntimeError("no routes recorded: call record() before the forward pass")
        if sequence_parallel and tp_size > 1:
            parts = [torch.empty_like(r) for _ in range(tp_size)]
            dist.all_gather(parts, r.contiguous(), group=tp_group)
            r = torch.cat(parts)
        layers.append(r.reshape(S, B, -1).transpose(0, 1))
    return torch.stack(layers, dim=2)


def router_losses(microbatches: int) -> dict[str, float]:
    """The MoE router losses of the update just run (megatron-core records each MoE layer's per
    microbatch while its coefficient is on): their mean over this rank's MoE layers and the
    microbatches, as moe_aux_loss / moe_z_loss, and each layer's mean over the microbatches as
    moe_aux_loss_layerNN / moe_z_loss_layerNN (NN: the layer's index in the model); the record is cleared.

    Under routing replay megatron-core computes each layer's load-balancing loss from that router's own
    top-k of its logits (what the current weights choose for the layer's input, which went through the
    replayed experts of the layers before), not from the replayed experts, with the gradient through the
    router's probabilities; the z-loss reads the same logits."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    out = {}
    for name, key in (("load_balancing_loss", "moe_aux_loss"), ("z_loss", "moe_z_loss")):
        values = get_moe_layer_wise_logging_tracker().get(name, {}).get("values")
        if values is not None and bool((values != 0).any()):
            per = max(1, microbatches)
            out[key] = float(values.sum()) / (int((values != 0).sum()) * per)
            out |= {f"{key}_layer{i:02d}": float(v) / per for i, v in enumerate(values.tolist()) if v != 0}
    clear_aux_losses_tracker()
    return out
