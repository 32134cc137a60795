"""Routing records (R3): which experts the rollout engine's routers chose, for every computed position.

`RoutingRecord` is the compact per-trajectory array: experts_PLK [positions, MoE layers, top-k] as
uint8 (<= 256 experts) or int16, plus `computed_P`, which positions the engine actually ran through
the model. The last token of a trajectory is sampled but never fed back, so it has no route; that
position cannot influence any scored token (attention is causal), and `to_replay` fills it — and
only positions past the last computed one — with experts 0..K-1, counting them.

Capture inside vLLM: every FusedMoE router exposes `set_capture_fn`; on GPU builds vLLM can return
the same array itself (`enable_return_routed_experts`). On the CPU build we install a capture
function per MoE layer plus a wrapper around the model runner's forward that knows, for each step,
which request each token row belongs to (`query_start_loc`) and its position; rows are written into
per-request buffers. Prefix caching is off, so every turn recomputes — and re-records — its prompt.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from moe_rl.trajectory import RoutingRecord, route_dtype  # noqa: F401  (re-exported for the engine)


def moe_layers(runner) -> list:
    """The vLLM model's MoE layers (those whose router can report its choices), in layer order."""
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    moe = [m for m in model.modules() if hasattr(m, "router") and hasattr(m.router, "set_capture_fn")]
    return sorted(moe, key=lambda m: getattr(m, "layer_id", 0))


def moe_rows(rows_NHK: np.ndarray, moe_hidden_layers: list[int]) -> np.ndarray:
    """vLLM's routed-experts rows [N, hidden layers, K] -> [N, MoE layers, K].

    vLLM writes the routes of the MoE layer in hidden layer h at index h (the layer's `layer_id`) and
    leaves dense layers' rows unused; records, our capture hook and Megatron's replay index MoE layers
    in layer order (`moe_hidden_layers`: their hidden-layer indices)."""
    if rows_NHK.ndim != 3 or rows_NHK.shape[1] <= max(moe_hidden_layers):
        raise ValueError(f"routed-experts rows of shape {rows_NHK.shape} do not cover MoE layers "
                         f"{moe_hidden_layers}")
    return rows_NHK[:, moe_hidden_layers]


class RouteCapture:
    """Installed inside a vLLM worker process: records routes per request id and position."""

    def __init__(self, runner, num_experts: int):
        self.runner = runner
        self.dtype = route_dtype(num_experts)
        moe = moe_layers(runner)
        if not moe:
            raise RuntimeError("no MoE routers with capture support found in the vLLM model")
        self.num_layers = len(moe)
        self.top_k = None
        self.records: dict[str, dict] = {}
        self._step_layers: list[torch.Tensor | None] = [None] * self.num_layers
        for idx, m in enumerate(moe):
            m.router.set_capture_fn(partial(self._capture, idx))
        self._orig_forward = runner._model_forward
        runner._model_forward = self._forward
        self.enabled = True

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.enabled:
            self._step_layers[layer] = topk_ids.detach().to("cpu", copy=True)

    def _forward(self, input_ids=None, positions=None, **kwargs):
        self._step_layers = [None] * self.num_layers
        out = self._orig_forward(input_ids=input_ids, positions=positions, **kwargs)
        if self.enabled and positions is not None:
            self._store(positions)
        return out

    def _store(self, positions: torch.Tensor) -> None:
        if any(t is None for t in self._step_layers):
            return  # e.g. a dummy/profile run
        runner = self.runner
        n = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:n])
        qsl = runner.query_start_loc.np[: n + 1].copy()
        stacked = torch.stack(self._step_layers, dim=1).numpy()  # [tokens, L, K]
        pos = positions.detach().cpu().numpy()
        self.top_k = stacked.shape[2]
        for i, rid in enumerate(req_ids):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if hi <= lo:
                continue
            p = pos[lo:hi]
            rec = self.records.get(rid)
            need = int(p.max()) + 1
            if rec is None or rec["experts"].shape[0] < need:
                size = max(need, 2 * (rec["experts"].shape[0] if rec else 64))
                experts = np.zeros((size, self.num_layers, self.top_k), dtype=self.dtype)
                computed = np.zeros(size, dtype=bool)
                if rec is not None:
                    experts[: rec["experts"].shape[0]] = rec["experts"]
                    computed[: rec["computed"].shape[0]] = rec["computed"]
                rec = {"experts": experts, "computed": computed}
                self.records[rid] = rec
            rec["experts"][p] = stacked[lo:hi].astype(self.dtype)
            rec["computed"][p] = True

    def pop(self, request_id: str, start: int = 0) -> RoutingRecord | None:
        """The request's record from position `start` on (earlier positions: not computed)."""
        # the engine core may suffix request ids ("r3" -> "r3-1f2e..."): match either form
        key = request_id if request_id in self.records else next(
            (k for k in self.records if k.startswith(request_id + "-")), None)
        rec = self.records.pop(key, None) if key is not None else None
        if rec is None:
            return None
        rec["computed"][:start] = False
        last = int(np.nonzero(rec["computed"])[0][-1]) + 1 if rec["computed"].any() else 0
        return RoutingRecord(rec["experts"][:last].copy(), rec["computed"][:last].copy())
