"""Benchmark: rollout generation tokens/s with and without routes (R3), and routing bytes per token.
One vLLM engine in this process; routes are switched on and off between interleaved rounds so machine
noise hits both arms alike. With routes: the capture hook records every step's expert choices in the
worker and the engine fetches each finished request's record (the route RPC, one per engine step that
finishes requests), as a run with rollout.record_routes does. Without: the hook records nothing and the
engine makes no route RPC (as an engine without routes; route_rpcs_without_routes counts them: 0).
Both arms keep the engine's one configuration (prefix caching off, as capture requires).

  capture_overhead   time with routes / time without - 1 (target <= 0.05)
  route_bytes_per_token
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _set_capture(worker, on: bool) -> None:
    worker.model_runner._moe_rl_capture.enabled = on


def _set_routes(engine, on: bool) -> None:
    """Routes on: the hook records and the engine asks the worker for each finished request's record.
    Off: the hook records nothing and the engine, with no route source, makes no route RPC."""
    engine.llm.collective_rpc(_set_capture, args=(on,))
    engine.route_source = "capture" if on else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moe_rl.config import RunConfig, RunSection, TinyModel
    from moe_rl.driver import specs
    from moe_rl.rollout.engine import RolloutEngine, Sampling
    from moe_rl.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "moe_rl_bench_rollout"), TinyModel(),
                                 seed=0)
    engine = RolloutEngine(specs.engine_spec(RunConfig(run=RunSection(seed=0)), str(path)))
    prompts = [[257] + [40 + (i * 7 + j) % 60 for j in range(20)] for i in range(args.prompts)]
    s = Sampling(max_tokens=args.max_tokens, seed=0)
    if engine.route_source != "capture":
        raise SystemExit(f"rollout bench: routes come from {engine.route_source!r} here; it switches the "
                         "capture hook")
    engine.generate(prompts, s)  # warm-up
    times = {True: [], False: []}
    tokens = {True: 0, False: 0}
    rpcs = {True: 0, False: 0}
    bytes_, positions = 0, 0
    for i in range(args.rounds):
        for on in (False, True)[:: 1 if i % 2 == 0 else -1]:  # alternating order
            _set_routes(engine, on)
            calls = engine.route_calls
            t0 = time.perf_counter()
            res = engine.generate(prompts, s)
            times[on].append(time.perf_counter() - t0)
            rpcs[on] += engine.route_calls - calls
            tokens[on] += sum(len(r.token_ids) for r in res)
            assert all((r.routes is not None) == on for r in res)
            if on:
                for r in res:
                    bytes_ += r.routes.experts_PLK.nbytes
                    positions += r.routes.experts_PLK.shape[0]
    per_round = {k: tokens[k] / args.rounds for k in tokens}
    t_off, t_on = statistics.median(times[False]), statistics.median(times[True])
    figures = {"bench": "rollout", "prompts": args.prompts, "max_tokens": args.max_tokens,
               "tokens_per_s_no_capture": round(per_round[False] / t_off, 1),
               "tokens_per_s_capture": round(per_round[True] / t_on, 1),
               "capture_overhead": round(t_on / t_off - 1, 4),
               "route_rpcs_with_routes": rpcs[True], "route_rpcs_without_routes": rpcs[False],
               "route_bytes_per_token": round(bytes_ / max(positions, 1), 2),
               "moe_layers": engine.num_moe_layers, "top_k": engine.top_k}
    print(f"generation without routes {per_round[False] / t_off:8.1f} tokens/s   ({rpcs[False]} route RPCs)")
    print(f"generation with routes    {per_round[True] / t_on:8.1f} tokens/s   ({rpcs[True]} route RPCs)   "
          f"overhead {100 * (t_on / t_off - 1):+.1f}% (target <= 5%)")
    print(f"routing record: {bytes_ / max(positions, 1):.1f} bytes per token ({engine.num_moe_layers} MoE "
          f"layers x top-{engine.top_k}, uint8)")
    print(json.dumps(figures))
    engine.shutdown()


if __name__ == "__main__":
    main()
