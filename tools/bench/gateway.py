"""Benchmark: the same multi-turn task through the built-in agent loop and through the gateway (an
`openai`-client harness playing it over HTTP), side by side on one vLLM engine in this process; then the
gateway under load.

The task is the quickstart's guessing game at the quickstart's size (the tiny model, 4 new tokens a turn,
four guesses). The built-in arm runs the game as an Environment (Agent.run_groups); the gateway arm runs
the reference harness (`moe_rl.rollout.envs.harness.environment_harness("guess_number")`), which makes the
same environment itself and plays it through chat requests (the game's observations sent back as user
messages): with the same seeds, the same games token for token. As in a run, the gateway serves on the
engine's event loop and the harnesses run on a loop of their own in another thread. Three arms a round
(agent and gateway alternating, then the floor) so machine noise hits them alike:

  tokens_per_s_agent / tokens_per_s_gateway   model tokens sampled per second of the round
  overhead_per_request_ms   (gateway round time - agent round time) / gateway requests, the medians
  overhead_frac             that overhead's share of the gateway round (goal <= 0.10)
  engine_steps_agent / engine_steps_gateway / engine_s_agent / engine_s_gateway   the engine's steps a
                            round and their seconds (medians): the gateway's requests arrive spread out,
                            the agent loop's turns together, so the same games take the engine more steps
  gateway_cpu_ms            the process's CPU time outside the engine's steps in a gateway round less that
                            in an agent round, per gateway request (medians over rounds): the HTTP round
                            trip on both sides (the harnesses run in this process too) and the gateway's
                            own work
  http_floor_ms             the same for the floor arm: the agent loop plays the round's games (the engine
                            working as in the other arms) while as many `openai` clients, on a harness
                            thread as in a run, send a gateway round's number of chat requests to a bare
                            aiohttp server on the engine's loop that answers a fixed completion, each
                            client waiting a gateway request's engine time between its requests: what any
                            Python HTTP gateway costs at least
  cost_above_floor_ms       gateway_cpu_ms - http_floor_ms: the gateway's own cost a request, above the
                            floor (goal <= 2 ms at the quickstart's size). CPU time, not a request's
                            latency: on a busy loop a latency counts the requests queued before it

The load (--sessions, default 512; --duration-s, default 180; 0 skips it): waves of that many sessions at
once (gateway max_concurrent = sessions), each a game of several turns, until the duration has passed.
--load-through agent runs the same waves through the agent loop (no HTTP): the memory figures' control.

  sessions, waves, sessions_per_s   sessions started, waves, sessions ended per second
  lost                      sessions that neither completed nor failed with a reason (an exception out of
                            the gateway, or no end within the episode timeout); `failed` counts the
                            others' failure reasons
  latency_p50_ms / latency_p99_ms   request times as the clients see them, over the load
  exact_sample              of the first wave's first --sample sessions, how many are the agent loop's
                            games token for token (tokens, masks, spans, versions, routes; log-probs
                            within 1e-5) when the loop replays them with their seeds, of those compared
                            (games the loop cut for repetition, a rule of its own, are not)
  rss_growth_frac, fds_growth, threads_growth, connections_growth   this process's resident memory, open
                            files, threads and TCP connections after the last wave against the second
  rss_growth_late_frac      resident memory after the last wave against the middle one: what still grows
                            once the first minutes' allocations (new batch shapes, allocator arenas) are made
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from moe_rl.rollout.envs.harness import environment_harness

TIMINGS: list[float] = []  # each gateway request's seconds as its client sees them
timed_guess_number = environment_harness("guess_number", timings=TIMINGS)
REPLY = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "5"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class TimedEngine:
    """The engine, with each `agenerate`'s seconds kept in `seconds`."""

    def __init__(self, engine):
        self._engine, self.seconds = engine, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def agenerate(self, prompt_ids, sampling):
        t0 = time.perf_counter()
        result = await self._engine.agenerate(prompt_ids, sampling)
        self.seconds.append(time.perf_counter() - t0)
        return result


async def floor_round(play, clients: int, requests: int, think_s: float) -> int:
    """`play()` (the round's games) while `clients` `openai` clients' loops on a thread of their own send
    `requests` chat requests in all to a bare aiohttp server on this loop answering a fixed completion,
    each client waiting `think_s` between its requests. Returns the requests sent."""
    from aiohttp import web
    from openai import AsyncOpenAI

    async def answer(request):
        await request.json()
        return web.json_response(REPLY)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    each = -(-requests // clients)

    async def pingers():
        client = AsyncOpenAI(base_url=base, api_key="bench", max_retries=0)

        async def pinger():
            for _ in range(each):
                await client.chat.completions.create(model="m", max_tokens=4,
                                                     messages=[{"role": "user", "content": "Guess."}])
                await asyncio.sleep(think_s)

        await asyncio.gather(*(pinger() for _ in range(clients)))
        await client.close()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    future = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(pingers(), loop))
    try:
        await play()
    finally:
        await future
        loop.call_soon_threadsafe(loop.stop)
        await runner.cleanup()
    return each * clients


def same_game(h, a) -> tuple[bool, float]:
    """Whether trajectory `h` is `a` token for token (log-probs within 1e-5), and their log-probs' largest
    difference."""
    diff = max((abs(x - y) for x, y in zip(h.logprobs, a.logprobs, strict=False)), default=0.0)
    same = (h.token_ids == a.token_ids and h.response_mask == a.response_mask and h.spans == a.spans
            and h.versions == a.versions and h.outcome is a.outcome
            and h.routes.experts_PLK.tolist() == a.routes.experts_PLK.tolist() and diff <= 1e-5)
    return same, diff


async def load(agent, loop_agent, env, timings: list, sessions: int, duration_s: float, sample: int,
               through: str = "gateway") -> dict:
    """Waves of `sessions` gateway sessions at once until `duration_s` has passed (two waves at least), the
    harness's request times in `timings`; the module docstring names the figures. `through="agent"`: the
    same waves through the agent loop (no HTTP, no gateway), for the memory figures' control."""
    import psutil

    from moe_rl.rollout.seeds import sample_seed
    from moe_rl.trajectory import Outcome

    proc, gateway = psutil.Process(), await agent.gateway()
    limit = gateway.o.episode_timeout_s + 60
    timings.clear()
    failed, outcomes, marks, lost, first = Counter(), Counter(), [], 0, None
    t0 = time.perf_counter()
    while len(marks) < 2 or time.perf_counter() - t0 < duration_s:
        wave = len(marks)
        prompts = env.generate_prompts(sessions, seed=1000 + wave, options=env.Options())
        seed = 2000 + wave
        play = agent.run_harness_episode if through == "gateway" else loop_agent.run_episode
        results = await asyncio.gather(*(
            asyncio.wait_for(play(row, g, 0, sample_seed(seed, "sample", g, 0)), limit)
            for g, row in enumerate(prompts)), return_exceptions=True)
        results = [r if isinstance(r, (list, BaseException)) else [r] for r in results]
        for r in results:
            if isinstance(r, BaseException):
                lost += 1
                failed[f"lost: {type(r).__name__}: {r}"[:100]] += 1
                continue
            for t in r:
                outcomes[t.outcome.value] += 1
                if t.outcome is Outcome.ENV_ERROR:
                    failed[t.info["error"][:100]] += 1
            failed["rejected by the checklist"] += sum(t.outcome is not Outcome.ENV_ERROR for t in r) \
                - len(agent.accept(r))
        first = first or (prompts, seed, results)
        marks.append((proc.memory_info().rss, proc.num_fds(), proc.num_threads(),
                      len(proc.net_connections("tcp")), len(gateway.episodes)))
        print(f"load wave {wave + 1}: {sessions} sessions, {time.perf_counter() - t0:.0f} s, "
              f"lost {lost}, RSS {marks[-1][0] / 2**20:.0f} MiB, fds {marks[-1][1]}, "
              f"threads {marks[-1][2]}, connections {marks[-1][3]}", flush=True)
    seconds = time.perf_counter() - t0
    prompts, seed, results = first
    replayed = {t.group_id: t for g in await loop_agent.run_groups(prompts[:sample], 1, seed=seed) for t in g}
    compared = [same_game(results[g][0], a) for g, a in replayed.items()
                if a.outcome is not Outcome.REPETITION and not isinstance(results[g], BaseException)]
    ms = sorted(1000 * s for s in timings)
    return {"sessions": sessions * len(marks), "waves": len(marks), "load_s": round(seconds, 1),
            "sessions_per_s": round(sessions * len(marks) / seconds, 2), "lost": lost,
            "through": through, "failed": dict(+failed), "outcomes": dict(outcomes), "requests": len(timings),
            "latency_p50_ms": round(ms[len(ms) // 2], 1) if ms else None,  # none through the agent loop
            "latency_p99_ms": round(ms[int(0.99 * len(ms))], 1) if ms else None,
            "exact_sample": f"{sum(s for s, _ in compared)}/{len(compared)}",
            "max_logprob_diff": max((d for _, d in compared), default=0.0),
            "rss_growth_frac": round(marks[-1][0] / marks[1][0] - 1, 4),
            "rss_growth_late_frac": round(marks[-1][0] / marks[len(marks) // 2][0] - 1, 4),
            "fds_growth": marks[-1][1] - marks[1][1], "threads_growth": marks[-1][2] - marks[1][2],
            "connections_growth": marks[-1][3] - marks[1][3], "episodes_left": marks[-1][4]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32, help="games per round (the quickstart's step)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=4, help="a turn's tokens (the quickstart's: 4)")
    ap.add_argument("--sessions", type=int, default=512, help="sessions at once in the load")
    ap.add_argument("--duration-s", type=float, default=180.0, help="the load's length (0: no load)")
    ap.add_argument("--sample", type=int, default=16, help="sessions of the load replayed by the agent loop")
    ap.add_argument("--load-through", choices=["gateway", "agent"], default="gateway",
                    help="agent: the load's waves through the agent loop (the memory figures' control)")
    return ap.parse_args()


def count_steps(engine) -> Counter:
    """Counts the engine's steps and their seconds from now on: its own work, apart from the arms'."""
    in_steps = Counter()
    raw_step = engine._step

    def step():
        t0 = time.perf_counter()
        try:
            return raw_step()
        finally:
            in_steps["steps"] += 1
            in_steps["seconds"] += time.perf_counter() - t0

    engine._step = step
    return in_steps


async def rounds(args, arms: dict, prompts, in_steps: Counter, timed: TimedEngine) -> tuple:
    """The arms' rounds of the same games, alternating which goes first, each followed by the floor's round
    with the gateway's request count: (times, cpu, tokens, steps, engine_s), lists per arm."""
    arm_names = (*arms, "floor")
    times, cpu, steps, engine_s = ({k: [] for k in arm_names} for _ in range(4))
    tokens = Counter()
    for arm in arms.values():  # warm-up (and the gateway's start)
        await arm.run_groups(prompts[:4], 1, seed=1)

    async def measured(name, play):
        t0, c0, s0, n0 = time.perf_counter(), time.process_time(), in_steps["seconds"], in_steps["steps"]
        result = await play()
        times[name].append(time.perf_counter() - t0)
        engine_s[name].append(in_steps["seconds"] - s0)
        steps[name].append(in_steps["steps"] - n0)
        cpu[name].append(time.process_time() - c0 - engine_s[name][-1])  # outside the engine's steps
        return result

    for i in range(args.rounds):
        for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            arm = arms[name]
            arm.stats.counts.clear()
            groups = await measured(name, lambda arm=arm, i=i: arm.run_groups(prompts, 1, seed=100 + i))
            tokens[name] += sum(sum(t.response_mask) for g in groups for t in g)
        requests = arms["gateway"].stats.counts["gateway_requests"]
        sent = await measured("floor", lambda i=i, n=requests: floor_round(
            lambda: arms["agent"].run_groups(prompts, 1, seed=100 + i), args.episodes, n,
            statistics.median(timed.seconds)))
        cpu["gateway"][-1] = (cpu["gateway"][-1] - cpu["agent"][-1]) / requests
        cpu["floor"][-1] = (cpu["floor"][-1] - cpu["agent"][-1]) / sent
        tokens["requests"] += requests
        print(f"round {i + 1}/{args.rounds}: agent {times['agent'][-1]:.2f} s, gateway "
              f"{times['gateway'][-1]:.2f} s, floor {times['floor'][-1]:.2f} s", flush=True)
    return times, cpu, tokens, steps, engine_s


def report(args, times, cpu, tokens, steps, engine_s, loaded: dict) -> None:
    """Prints the rounds' figures (the module docstring names them) and the load's, then the JSON line."""
    t_agent, t_gateway = statistics.median(times["agent"]), statistics.median(times["gateway"])
    per_round_requests = tokens["requests"] / args.rounds
    overhead_ms = 1000 * (t_gateway - t_agent) / max(per_round_requests, 1)
    gateway_ms, floor_ms = (1000 * statistics.median(cpu[k]) for k in ("gateway", "floor"))
    figures = {"bench": "gateway", "episodes": args.episodes, "rounds": args.rounds,
               "max_new_tokens": args.max_new_tokens,
               "tokens_per_s_agent": round(tokens["agent"] / sum(times["agent"]), 1),
               "tokens_per_s_gateway": round(tokens["gateway"] / sum(times["gateway"]), 1),
               "round_s_agent": round(t_agent, 3), "round_s_gateway": round(t_gateway, 3),
               "requests_per_round": per_round_requests,
               "overhead_per_request_ms": round(overhead_ms, 2),
               "overhead_frac": round((t_gateway - t_agent) / t_gateway, 4),
               **{f"engine_steps_{k}": statistics.median(steps[k]) for k in ("agent", "gateway")},
               **{f"engine_s_{k}": round(statistics.median(engine_s[k]), 3) for k in ("agent", "gateway")},
               "gateway_cpu_ms": round(gateway_ms, 2), "http_floor_ms": round(floor_ms, 2),
               "cost_above_floor_ms": round(gateway_ms - floor_ms, 2), **loaded}
    print(f"built-in agent loop {figures['tokens_per_s_agent']:8.1f} model tokens/s  "
          f"(round {t_agent:.2f} s)")
    print(f"gateway harness     {figures['tokens_per_s_gateway']:8.1f} model tokens/s  "
          f"(round {t_gateway:.2f} s, {per_round_requests:.0f} requests)")
    print(f"gateway overhead: {overhead_ms:.1f} ms per request, {100 * figures['overhead_frac']:.1f}% of the "
          "gateway round (goal <= 10%)")
    print(f"CPU a gateway request: {gateway_ms:.1f} ms; a bare HTTP request beside the engine (the floor): "
          f"{floor_ms:.1f} ms; the gateway's own cost: {gateway_ms - floor_ms:.1f} ms (goal <= 2 ms)")
    if loaded:
        print(f"load: {loaded['sessions']} sessions ({args.sessions} at once) in {loaded['load_s']} s, "
              f"{loaded['sessions_per_s']} a second; lost {loaded['lost']}; request p50 "
              f"{loaded['latency_p50_ms']} ms, p99 {loaded['latency_p99_ms']} ms; exact "
              f"{loaded['exact_sample']}; RSS {100 * loaded['rss_growth_frac']:+.1f}% (second half "
              f"{100 * loaded['rss_growth_late_frac']:+.1f}%), fds "
              f"{loaded['fds_growth']:+d}, threads {loaded['threads_growth']:+d}, connections "
              f"{loaded['connections_growth']:+d}")
    print(json.dumps(figures))


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("moe_rl.rollout.gateway").setLevel(logging.ERROR)  # each budget refusal: a warning
    import dataclasses

    from transformers import AutoTokenizer

    from moe_rl.config import RunConfig, RunSection, TinyModel
    from moe_rl.driver import specs
    from moe_rl.rollout.agent import Agent
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.envs import EnvSpec, get_env, import_object
    from moe_rl.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(Path(tempfile.gettempdir()) / "moe_rl_bench_gateway", TinyModel(), seed=0)
    turns = 4
    cfg = RunConfig(run=RunSection(seed=0))
    engine = RolloutEngine(specs.engine_spec(cfg, str(path)))
    timed = TimedEngine(engine)  # the floor's clients wait a gateway request's engine time between requests
    in_steps = count_steps(engine)
    tok = AutoTokenizer.from_pretrained(path)
    agent_s = dataclasses.replace(specs.agent_spec(cfg), max_turns=turns,
                                  max_tokens_per_turn=args.max_new_tokens,
                                  token_budget=turns * (args.max_new_tokens + 16))
    env = get_env("guess_number")
    prompts = env.generate_prompts(args.episodes, seed=0, options=env.Options())
    # the harness as the gateway loads it (by path): the module whose TIMINGS its requests fill
    timings = import_object(f"{Path(__file__).resolve()}:TIMINGS")
    harness = {"harness": f"{Path(__file__).resolve()}:timed_guess_number",
               "max_concurrent": max(args.sessions, args.episodes)}
    arms = {"agent": Agent(engine, tok, EnvSpec("guess_number"), agent_s),
            "gateway": Agent(timed, tok, EnvSpec("gateway", harness), agent_s)}

    async def bench():
        measured = await rounds(args, arms, prompts, in_steps, timed)
        loaded = {}
        if args.duration_s > 0:
            loaded = await load(arms["gateway"], arms["agent"], env, timings, args.sessions, args.duration_s,
                                args.sample, args.load_through)
        await (await arms["gateway"].gateway()).close()
        return measured, loaded

    measured, loaded = asyncio.run(bench())
    report(args, *measured, loaded)
    engine.shutdown()


if __name__ == "__main__":
    main()
