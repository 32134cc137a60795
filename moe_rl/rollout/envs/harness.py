"""`environment.name: gateway`: episodes run by your own agent harness against the run's engines through
an OpenAI-compatible endpoint (rollout/gateway.py has the endpoint's rules).

    environment:
      name: gateway
      dataset: data/tasks.jsonl            # each row goes whole to the harness
      options:
        harness: my_pkg.agent:run          # or path/to/agent.py:run
        max_concurrent: 32                 # episodes at once, per engine
        episode_timeout_s: 300

The harness, `async def run(base_url, row) -> float | dict` (a plain function runs in a thread), is
called once per episode; what it returns is the reward (a dict: "reward" and figures to log). It may
take `api_key` too; an unmodified `openai.AsyncOpenAI(base_url=base_url)` finds the run's token in
OPENAI_API_KEY. No `reset` / `step`: the harness decides the turns and when the episode ends.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass

from moe_rl.rollout.envs import Environment, absolute_name, import_object, register_env


@register_env("gateway")
class HarnessEpisodes(Environment):
    drives_itself = True  # the agent loop hands the episode to the harness (rollout/gateway.py)

    @dataclass(frozen=True)
    class Options:
        harness: str = ""  # the harness: package.module:function or path/to/file.py:function
        max_concurrent: int = 32  # episodes running at once, per engine
        episode_timeout_s: float = 300.0  # a harness call longer than this ends its episode (env_error)
        max_request_bytes: int = 4 << 20  # a larger request body is refused (413)
        tool_parser: str = ""  # vLLM's tool parser for the model's tool calls ("hermes", ...): "" none

        def check(self) -> None:
            if not self.harness:
                raise ValueError("harness is required: the function that runs one episode "
                                 "(package.module:function or path/to/file.py:function)")
            fn = harness_function(self.harness)
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(params) != 2:
                raise ValueError(f"harness {self.harness} takes {len(params)} required argument(s); it is "
                                 "called as run(base_url, row)")
            for name in ("max_concurrent", "max_request_bytes"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
            if not self.episode_timeout_s > 0:
                raise ValueError(f"episode_timeout_s={self.episode_timeout_s} must be > 0")
            if self.tool_parser:
                from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

                try:
                    ToolParserManager.get_tool_parser(self.tool_parser)
                except KeyError as err:
                    raise ValueError(f"tool_parser={self.tool_parser!r}: {err}") from None

    @classmethod
    def portable_options(cls, options: dict) -> dict:
        harness = options.get("harness")
        return {**options, "harness": absolute_name(harness)} if harness else options

    async def trial(self, row: dict) -> None:
        """The harness called once on `row` against a stub endpoint (`StubEndpoint`: fixed replies, no
        model), before anything starts: its first request must reach the base URL it was given with the
        run's token (OPENAI_API_KEY, or its `api_key` argument). Then it is stopped: the stub's replies
        are no model's, so what it does with them is not tried. TrialError names what it did instead."""
        fn = self.options.harness
        fn = fn if callable(fn) else harness_function(fn)
        async with StubEndpoint() as stub:
            await stub.try_harness(fn, row)


class StubEndpoint:
    """An OpenAI-compatible endpoint of fixed replies on 127.0.0.1, for trying a harness before the run:
    `try_harness` calls it with this endpoint's base URL and token, as the gateway would, and waits for
    its first request."""

    REPLY = {"id": "chatcmpl-trial", "object": "chat.completion", "created": 0, "model": "policy",
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": "(a stub's reply: no model yet)"}}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    PATH = "/episodes/trial/v1"

    def __init__(self):
        import secrets

        self.token = "trial-" + secrets.token_hex(8)
        self.seen: asyncio.Future | None = None
        self._runner = None
        self.base = ""

    async def __aenter__(self) -> StubEndpoint:
        from aiohttp import web

        self.seen = asyncio.get_running_loop().create_future()

        async def answer(request):
            auth = request.headers.get("Authorization", "")
            if not self.seen.done():
                self.seen.set_result((request.path, auth))
            if auth != f"Bearer {self.token}":
                return web.json_response({"error": {"message": "wrong token", "code": 401}}, status=401)
            if request.path.endswith("/v1/completions"):  # a completions request: a text choice
                choice = {"index": 0, "text": "", "finish_reason": "stop"}
                return web.json_response({**self.REPLY, "object": "text_completion", "choices": [choice]})
            return web.json_response(self.REPLY)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    async def try_harness(self, fn, row: dict) -> None:
        """`fn(base_url, row)` until its first request here (then it is cancelled, or a plain function's
        thread left to end on its own); TrialError if that request went elsewhere or carried another
        token, or if the harness ended, raised or waited without one."""
        import os
        import threading

        from moe_rl.rollout.envs import TrialError, error_text

        url = self.base + self.PATH
        kw = {"api_key": self.token} if "api_key" in inspect.signature(fn).parameters else {}
        before = os.environ.get("OPENAI_API_KEY")
        os.environ["OPENAI_API_KEY"] = self.token  # as the gateway sets it in the engine's process
        loop = asyncio.get_running_loop()
        if inspect.iscoroutinefunction(fn):
            call = asyncio.ensure_future(fn(url, dict(row), **kw))
        else:  # a daemon thread: a plain function cannot be cancelled, and must not hold the run's exit
            call = loop.create_future()

            def run():
                try:
                    result, failure = fn(url, dict(row), **kw), None
                except Exception as err:  # handed to the trial, which says it
                    result, failure = None, err
                loop.call_soon_threadsafe(lambda: call.done() or (call.set_exception(failure) if failure
                                                                  else call.set_result(result)))

            threading.Thread(target=run, name="moe-rl-harness-trial", daemon=True).start()
        field = "environment.options.harness"
        try:
            await asyncio.wait({call, self.seen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            call.cancel()
            if before is None:
                os.environ.pop("OPENAI_API_KEY", None)
            else:
                os.environ["OPENAI_API_KEY"] = before
        if self.seen.done():
            path, auth = self.seen.result()
            if not path.startswith(self.PATH + "/"):
                raise TrialError(field, f"the harness's first request went to {path}, not under the base "
                                 f"URL it was given ({url})", "build the client with base_url=base_url")
            if auth != f"Bearer {self.token}":
                raise TrialError(field, "the harness's first request carried another API key than the "
                                 "run's", "leave api_key unset (the client reads OPENAI_API_KEY) or take the "
                                 "harness's api_key argument")
            return
        err = call.exception() if not call.cancelled() else None
        raise TrialError(field, f"the harness raised {error_text(err)} before any request to the base URL "
                         "it was given" if err is not None else
                         "the harness returned without a request to the base URL it was given (it must "
                         "send the model's turns there: base_url is the run's endpoint)")


def harness_function(spec: str):
    """The harness an import path names: a function (async or not). ValueError (one line) otherwise."""
    fn = import_object(spec)
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(f"harness {spec} is a {type(fn).__name__}, not a function run(base_url, row)")
    return fn


def environment_harness(name: str, options: dict | None = None, timings: list | None = None):
    """A harness that plays a registered environment through the gateway: its `reset` messages open the
    chat, each reply goes to `step`, each observation comes back as the next message, until the episode
    is done (or the gateway refuses a turn past the run's limits). An observation of None (the model goes
    on) has no chat form: it is sent as an empty message. The same game as the agent loop plays,
    token for token with the same seeds, but over HTTP: what tools/bench/gateway.py and the gateway's
    tests compare. `timings`, if given, gets each request's seconds as the client sees them."""
    from moe_rl.rollout.envs import EnvSpec

    spec = EnvSpec(name, dict(options or {}))
    # one client per event loop for every episode (its connections shared; making one costs ~10 ms, more
    # than a quickstart-sized turn), pointed at each episode's base URL and the run's key as it starts
    clients: dict = {}

    async def play(base_url: str, row: dict) -> float:
        import os

        import httpx2
        import openai

        loop = asyncio.get_running_loop()
        if loop not in clients:  # as many connections kept as episodes at once (openai's default keeps 100)
            limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
            clients[loop] = openai.AsyncOpenAI(base_url=base_url, max_retries=0, http_client=(
                openai.DefaultAsyncHttpxClient(timeout=None, limits=limits)))
        client = clients[loop].with_options(base_url=base_url, api_key=os.environ["OPENAI_API_KEY"])
        env = spec.make()
        messages = await env.reset(row)
        while True:
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages)
            if timings is not None:
                timings.append(time.perf_counter() - t0)
            text = reply.choices[0].message.content or ""
            step = await env.step(text)
            if step.done:
                return float(step.final_reward or 0.0)
            messages += [{"role": "assistant", "content": text},
                         {"role": env.role_for_observations, "content": step.observation or ""}]

    return play


# the guessing game over HTTP: environment.options.harness: moe_rl.rollout.envs.harness:guess_number
guess_number = environment_harness("guess_number")
