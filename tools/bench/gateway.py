"""Benchmark: the same multi-turn task through the built-in agent loop and through the gateway (an
`openai`-client harness playing it over HTTP), side by side on one vLLM engine in this process.

The task is the quickstart's guessing game at the quickstart's size (the tiny model, 4 new tokens a turn,
four guesses). The built-in arm runs the game as an Environment (Agent.run_groups); the gateway arm runs
`moe_rl.rollout.envs.harness:guess_number`, a harness that makes the same environment itself and plays it
through chat requests (the game's observations sent back as user messages): with the same seeds, the
same games token for token. The arms alternate round by round so machine noise hits both alike.

  tokens_per_s_agent / tokens_per_s_gateway   model tokens sampled per second of the round
  overhead_per_request_ms   (gateway round time - agent round time) / gateway requests, the medians
  overhead_frac             that overhead's share of the gateway round: (t_gateway - t_agent) / t_gateway
                            (goal <= 0.10)
  http_floor_ms             the same `openai` client against a bare aiohttp server in one process that
                            answers every chat request with a fixed completion (no engine, no template,
                            no episode), as many requests as a round's, as concurrent: the cost of the
                            HTTP round trip alone in Python, per request
  floor_frac                that floor's share of a round made of the agent loop's work plus it: what
                            any Python HTTP gateway would cost at least, whatever it does inside
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


async def http_floor(requests: int, concurrency: int) -> float:
    """Seconds per request of `requests` chat completions from `concurrency` concurrent `openai` clients'
    loops against a bare aiohttp server in this event loop answering each with a fixed completion."""
    from aiohttp import web
    from openai import AsyncOpenAI

    body = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "5"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    async def answer(request):
        await request.json()
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench")
    each = max(1, requests // concurrency)

    async def player():
        for _ in range(each):
            await client.chat.completions.create(model="m", max_tokens=4,
                                                 messages=[{"role": "user", "content": "Guess."}])

    await player()  # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*(player() for _ in range(concurrency)))
    seconds = (time.perf_counter() - t0) / (each * concurrency)
    await client.close()
    await runner.cleanup()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32, help="games per round (the quickstart's step)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=4, help="a turn's tokens (the quickstart's: 4)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from moe_rl import settings
    from moe_rl.config import RunConfig, RunSection, TinyModel
    from moe_rl.rollout.agent import Agent
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.envs import EnvSpec, get_env
    from moe_rl.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(Path(tempfile.gettempdir()) / "moe_rl_bench_gateway", TinyModel(), seed=0)
    turns = 4
    cfg = RunConfig(run=RunSection(seed=0))
    engine = RolloutEngine(settings.engine_settings(cfg, str(path)))
    tok = AutoTokenizer.from_pretrained(path)
    agent_s = settings.agent_settings(cfg)
    import dataclasses

    agent_s = dataclasses.replace(agent_s, max_turns=turns, max_tokens_per_turn=args.max_new_tokens,
                                  token_budget=turns * (args.max_new_tokens + 16))
    env = get_env("guess_number")
    prompts = env.generate_prompts(args.episodes, seed=0, options=env.Options())
    harness = {"harness": "moe_rl.rollout.envs.harness:guess_number"}
    arms = {"agent": Agent(engine, tok, EnvSpec("guess_number"), agent_s),
            "gateway": Agent(engine, tok, EnvSpec("gateway", harness), agent_s)}

    async def bench():
        times, tokens, requests = {k: [] for k in arms}, {k: 0 for k in arms}, 0
        for arm in arms.values():  # warm-up (and the gateway's start)
            await arm.run_groups(prompts[:4], 1, seed=1)
        for i in range(args.rounds):
            for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
                arm = arms[name]
                arm.stats.counts.clear()
                t0 = time.perf_counter()
                groups = await arm.run_groups(prompts, 1, seed=100 + i)
                times[name].append(time.perf_counter() - t0)
                tokens[name] += sum(sum(t.response_mask) for g in groups for t in g)
                if name == "gateway":
                    requests += arm.stats.counts["gateway_requests"]
            print(f"round {i + 1}/{args.rounds}: agent {times['agent'][-1]:.2f} s, "
                  f"gateway {times['gateway'][-1]:.2f} s", flush=True)
        await (await arms["gateway"].gateway()).close()
        floor = await http_floor(requests // args.rounds, args.episodes)
        return times, tokens, requests, floor

    times, tokens, requests, floor = asyncio.run(bench())
    t_agent, t_gateway = statistics.median(times["agent"]), statistics.median(times["gateway"])
    per_round_requests = requests / args.rounds
    overhead_ms = 1000 * (t_gateway - t_agent) / max(per_round_requests, 1)
    figures = {"bench": "gateway", "episodes": args.episodes, "rounds": args.rounds,
               "max_new_tokens": args.max_new_tokens,
               "tokens_per_s_agent": round(tokens["agent"] / sum(times["agent"]), 1),
               "tokens_per_s_gateway": round(tokens["gateway"] / sum(times["gateway"]), 1),
               "round_s_agent": round(t_agent, 3), "round_s_gateway": round(t_gateway, 3),
               "requests_per_round": per_round_requests,
               "overhead_per_request_ms": round(overhead_ms, 2),
               "overhead_frac": round((t_gateway - t_agent) / t_gateway, 4),
               "http_floor_ms": round(1000 * floor, 2),
               "floor_frac": round(floor * per_round_requests / (t_agent + floor * per_round_requests), 4)}
    print(f"built-in agent loop {figures['tokens_per_s_agent']:8.1f} model tokens/s  "
          f"(round {t_agent:.2f} s)")
    print(f"gateway harness     {figures['tokens_per_s_gateway']:8.1f} model tokens/s  "
          f"(round {t_gateway:.2f} s, {per_round_requests:.0f} requests)")
    print(f"gateway overhead: {overhead_ms:.1f} ms per request, {100 * figures['overhead_frac']:.1f}% of the "
          "gateway round (goal <= 10%)")
    print(f"the HTTP round trip alone (openai client, bare aiohttp server): {1000 * floor:.1f} ms per "
          f"request, {100 * figures['floor_frac']:.1f}% of a round of the agent loop's work plus it")
    print(json.dumps(figures))
    engine.shutdown()


if __name__ == "__main__":
    main()
