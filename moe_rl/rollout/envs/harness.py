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

import inspect
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
        """Nothing to try before the run: the harness was imported with the options."""


def harness_function(spec: str):
    """The harness an import path names: a function (async or not). ValueError (one line) otherwise."""
    fn = import_object(spec)
    if not callable(fn) or inspect.isclass(fn):
        raise ValueError(f"harness {spec} is a {type(fn).__name__}, not a function run(base_url, row)")
    return fn


def environment_harness(name: str, options: dict | None = None):
    """A harness that plays a registered environment through the gateway: its `reset` messages open the
    chat, each reply goes to `step`, each observation comes back as the next message, until the episode
    is done (or the gateway refuses a turn past the run's limits). An observation of None (the model goes
    on) has no chat form: it is sent as an empty message. The same game as the agent loop plays,
    token for token with the same seeds, but over HTTP: what tools/bench/gateway.py and the gateway's
    tests compare."""
    from moe_rl.rollout.envs import EnvSpec

    spec = EnvSpec(name, dict(options or {}))
    # one HTTP client per event loop for every episode: an openai client's own costs ~10 ms to make (its TLS
    # context), more than a quickstart-sized turn
    http: dict = {}

    async def play(base_url: str, row: dict) -> float:
        import asyncio

        import httpx
        import openai

        loop = asyncio.get_running_loop()
        if loop not in http:
            http[loop] = httpx.AsyncClient(timeout=None)
        client = openai.AsyncOpenAI(base_url=base_url, max_retries=0, http_client=http[loop])
        env = spec.make()
        messages = await env.reset(row)
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content or ""
            step = await env.step(text)
            if step.done:
                return float(step.final_reward or 0.0)
            messages += [{"role": "assistant", "content": text},
                         {"role": env.role_for_observations, "content": step.observation or ""}]

    return play


# the guessing game over HTTP: environment.options.harness: moe_rl.rollout.envs.harness:guess_number
guess_number = environment_harness("guess_number")
