"""An OpenAI-compatible gateway to a rollout engine, for agent harnesses that run their own loop.

    environment:
      name: gateway
      options: {harness: my_pkg.agent:run}      # or path/to/agent.py:run

    async def run(base_url: str, row: dict) -> float | dict:   # one episode: its reward
        client = openai.AsyncOpenAI(base_url=base_url)           # OPENAI_API_KEY holds the run's token
        reply = await client.chat.completions.create(model="policy", messages=[...])
        ...
        return 1.0          # or {"reward": 1.0, "success": 1, ...}: the other numbers logged as env/KEY

Each engine process serves `/episodes/{id}/v1` (`chat/completions` with tools, `completions`, streaming
or not; `models`) on its node's address, for the run only, behind a bearer token made for the run; one
episode per harness call, many at once (`max_concurrent`), each within `episode_timeout_s`. The harnesses
run on an event loop of their own, in a thread beside the engine's: a harness that blocks stalls the
other harnesses, never the engine.

Exact tokens. A chat request's messages (and tools) are compared with what its episode has been served:
the messages it sent and the replies it got, as returned. When they extend it (or repeat it: the model's
next turn follows its last), only the new messages are rendered, as the chat template renders them after
an assistant turn (rollout/chat.py), and appended with response mask 0 after the model's own tokens,
which are never re-encoded from text. When they do not (the
harness dropped, edited or re-ordered messages, or changed its tools), the episode's tokens so far become
a trajectory of their own and the request starts another, rendered whole: the episode's reward goes to
each, and rollout/gateway_prefix_breaks counts the splits. `completions` requests compare token ids (a
prompt given as token ids, or as text encoded). Each trajectory keeps the engine's log-probs, the routes
of every position it computed (Rollout Routing Replay) and the weight version of every token.

The run's sampling settings (rollout.temperature, top_p) govern every request, since the update needs
the behaviour policy's log-probs; a request's own are ignored. A request's max_tokens is honoured up to
rollout.max_new_tokens. Past environment.token_budget, rollout.max_model_len or environment.max_turns
model turns (requests) a request is refused (400) and the episode ends truncated (bootstrapped), whatever
the harness does next. A harness that raises,
outlasts its timeout or returns no reward ends its episode as env_error (counted and logged, not trained
on); so does one that made no request. A request for more than one choice (n > 1) is refused: an episode
is one conversation. Requests for an unknown or ended episode get 404, malformed ones
400, ones without the token 401, bodies over `max_request_bytes` 413.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import secrets
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from moe_rl.rollout.engine import Sampling
from moe_rl.rollout.record import TokenRecord
from moe_rl.rollout.seeds import sample_seed
from moe_rl.trajectory import Outcome, Trajectory

log = logging.getLogger(__name__)
MODEL_NAME = "policy"  # what /v1/models lists; any model name is accepted


class RequestError(Exception):
    """A request the gateway refuses: its HTTP status and an OpenAI-style error message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def served_message(m: dict) -> tuple:
    """A chat message as the prefix check compares it: role, content, tool calls (name and arguments),
    the tool call it answers and its name."""
    calls = tuple((c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
                  for c in m.get("tool_calls") or ())
    content = m.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return m.get("role"), content or "", calls, m.get("tool_call_id"), m.get("name")


@dataclass
class Segment(TokenRecord):
    """One trajectory of an episode, as the gateway built it (its tokens: rollout.record.TokenRecord);
    `version`, the engines' weights when it began; `served`, the chat messages it stands for (None for a
    completions-built one) and `tools`, the tools they were rendered with."""

    version: int = 0
    served: list[tuple] | None = None
    tools: str = ""

    def trajectory(self, reward: float, outcome: Outcome, group_id: int, sample_index: int,
                   figures: dict) -> Trajectory:
        versions = self.all_versions(self.version)
        return Trajectory(
            token_ids=self.ids, response_mask=self.mask, logprobs=self.logps, spans=self.spans,
            turn_rewards=[0.0] * len(self.spans), terminal_reward=reward, outcome=outcome,
            boundary_len=len(self.ids), weight_version=min(versions), prompt_len=self.prompt_len,
            routes=self.routes, group_id=group_id, sample_index=sample_index,
            info={"tool_errors": 0, "turns": len(self.spans), "figures": figures}, versions=versions)


@dataclass
class Episode:
    id: str
    seed: int | None
    segments: list[Segment] = field(default_factory=list)
    truncated: Outcome | None = None  # the budget or the context ran out: what it ends as
    requests: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time: turns are ordered
    counts: Counter = field(default_factory=Counter)  # gateway_requests, gateway_prefix_breaks, ...


@dataclass(frozen=True)
class GatewayOptions:
    harness: object  # the harness function (imported)
    max_concurrent: int
    episode_timeout_s: float
    max_request_bytes: int
    tool_parser: str  # a vLLM tool parser by name ("hermes", ...), or "" for none


class Gateway:
    """The HTTP server of one engine process and its episodes (the module's docstring has the rules)."""

    def __init__(self, engine, chat, tokenizer, eos: int, settings, options: GatewayOptions, host: str):
        self.engine, self.chat, self.tok, self.eos = engine, chat, tokenizer, eos
        self.s, self.o = settings, options
        self.host, self.token = host, secrets.token_urlsafe(24)
        self.episodes: dict[str, Episode] = {}
        self.counts: Counter = Counter()  # of requests no running episode owns (`drain_counts`)
        self.base = ""
        self._runner = None
        self._harness_loop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(options.max_concurrent)

    # -- the server -------------------------------------------------------------------------------------

    async def start(self) -> Gateway:
        """Serve on a free port of `host` (the base address: `base`, http://host:port)."""
        import os

        from aiohttp import web

        app = web.Application(client_max_size=self.o.max_request_bytes, middlewares=[self._auth])
        app.add_routes([web.post("/episodes/{id}/v1/chat/completions", self._chat),
                        web.post("/episodes/{id}/v1/completions", self._completions),
                        web.get("/episodes/{id}/v1/models", self._models)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base = f"http://{self.host}:{port}"
        os.environ["OPENAI_API_KEY"] = self.token  # an unmodified openai client in the harness finds it
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="moe-rl-harnesses", daemon=True).start()
        self._harness_loop = loop
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._harness_loop is not None:
            self._harness_loop.call_soon_threadsafe(self._harness_loop.stop)
            self._harness_loop = None

    @staticmethod
    def _error(status: int, message: str, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    @property
    def _auth(self):
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                self.counts["gateway_unauthorized"] += 1
                return self._error(401, "a bearer token is required: the run's (OPENAI_API_KEY in the "
                                        "harness's process)", "authentication_error")
            try:
                return await handler(request)
            except RequestError as err:
                ep = self.episodes.get(request.match_info.get("id", ""))
                (ep.counts if ep is not None else self.counts)["gateway_refused"] += 1
                log.warning("gateway refused a request (%d): %s", err.status, err)
                return self._error(err.status, str(err), err.kind)
        return auth

    async def _body(self, request) -> tuple[Episode, dict]:
        ep = self.episodes.get(request.match_info["id"])
        if ep is None:
            raise RequestError(404, f"no episode {request.match_info['id']!r} is running", "not_found_error")
        from aiohttp import web

        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge as err:
            raise RequestError(413, f"the body is over environment.options.max_request_bytes="
                                    f"{self.o.max_request_bytes}") from err
        except (ValueError, UnicodeDecodeError) as err:
            raise RequestError(400, f"the body is not JSON ({err})") from err
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return ep, body

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "moe-rl"}]})

    # -- turns ------------------------------------------------------------------------------------------

    async def _chat(self, request):
        ep, body = await self._body(request)
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            raise RequestError(400, f"not a chat completion request: {err.errors()[0]['msg']} at "
                                    f"{'.'.join(map(str, err.errors()[0]['loc']))}") from err
        if (req.n or 1) != 1:
            raise RequestError(400, f"n={req.n}: one choice per request (an episode is one conversation)")
        messages, tools = body["messages"], body.get("tools") or None
        async with ep.lock:
            seg = self._chat_segment(ep, messages, tools)
            res = await self._turn(ep, seg, req.max_completion_tokens or req.max_tokens)
            text = self.tok.decode(res.token_ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
            if tools and self.o.tool_parser:
                message = self._tool_calls(text, req)
            seg.served = [*(served_message(m) for m in messages), served_message(message)]
        finish = "tool_calls" if message.get("tool_calls") else self._finish(res)
        usage = {"prompt_tokens": len(res.prompt_ids), "completion_tokens": len(res.token_ids),
                 "total_tokens": len(res.prompt_ids) + len(res.token_ids)}
        if body.get("stream"):
            return await self._stream(request, "chat.completion.chunk", [
                {"index": 0, "delta": {"role": "assistant", "content": message.get("content") or ""}},
                {"index": 0, "delta": {"tool_calls": [{"index": i, **call} for i, call in
                                                      enumerate(message["tool_calls"])]}
                 if message.get("tool_calls") else {}, "finish_reason": finish}])
        from aiohttp import web

        return web.json_response({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                  "created": int(time.time()), "model": body.get("model") or MODEL_NAME,
                                  "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                               "token_ids": res.token_ids}], "usage": usage})

    async def _completions(self, request):
        ep, body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(self.tok.encode(prompt, add_special_tokens=False))
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            ids = prompt
        else:
            raise RequestError(400, "prompt must be one text or one list of token ids")
        async with ep.lock:
            seg = ep.segments[-1] if ep.segments else None
            if seg is None or seg.served is not None or ids[:len(seg.ids)] != seg.ids:
                seg = self._new_segment(ep, ids, None, "")
            else:
                self._extend(ep, seg, ids[len(seg.ids):])
            res = await self._turn(ep, seg, body.get("max_tokens"))
        text = self.tok.decode(res.token_ids, skip_special_tokens=True)
        if body.get("stream"):
            return await self._stream(request, "text_completion", [
                {"index": 0, "text": text}, {"index": 0, "text": "", "finish_reason": self._finish(res)}])
        from aiohttp import web

        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                  "created": int(time.time()), "model": body.get("model") or MODEL_NAME,
                                  "choices": [{"index": 0, "text": text, "finish_reason": self._finish(res),
                                               "token_ids": res.token_ids}],
                                  "usage": {"prompt_tokens": len(res.prompt_ids),
                                            "completion_tokens": len(res.token_ids),
                                            "total_tokens": len(res.prompt_ids) + len(res.token_ids)}})

    def _chat_segment(self, ep: Episode, messages: list[dict], tools: list | None) -> Segment:
        """The segment this request continues (its new messages appended), or a new one (a prefix break
        or the episode's first request)."""
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        seg = ep.segments[-1] if ep.segments else None
        asked = [served_message(m) for m in messages]
        if seg is not None and seg.served is not None and seg.tools == tools_key \
                and asked[:len(seg.served)] == seg.served:  # no new message: the model's next turn
            self._extend(ep, seg, self.chat.after_turn_ids(messages[len(seg.served):], seg.closed, tools))
            return seg
        return self._new_segment(ep, self.chat.prompt_ids(messages, tools), asked, tools_key)

    def _new_segment(self, ep: Episode, ids: list[int], served, tools_key: str) -> Segment:
        if ep.segments:
            ep.counts["gateway_prefix_breaks"] += 1
            if not ep.segments[-1].spans:  # nothing sampled on it: nothing to keep
                ep.segments.pop()
        if len(ids) >= self.s.max_model_len:
            self._truncate(ep, Outcome.TRUNCATED_CONTEXT, f"the prompt's {len(ids)} tokens fill "
                           f"rollout.max_model_len={self.s.max_model_len}")
        seg = Segment.of_prompt(ids, version=getattr(self.engine, "version", 0), served=served,
                                tools=tools_key)
        ep.segments.append(seg)
        return seg

    def _extend(self, ep: Episode, seg: Segment, ids: list[int]) -> None:
        if len(seg.ids) + len(ids) > self.s.max_model_len:
            self._truncate(ep, Outcome.TRUNCATED_CONTEXT, f"the conversation would pass "
                           f"rollout.max_model_len={self.s.max_model_len} tokens")
        seg.observe(ids)

    def _truncate(self, ep: Episode, outcome: Outcome, why: str):
        ep.truncated = ep.truncated or outcome
        raise RequestError(400, f"{why}: the episode ends here ({outcome.value})", "context_length_exceeded")

    async def _turn(self, ep: Episode, seg: Segment, max_tokens: int | None):
        """Sample the model's turn after `seg`'s tokens: the engine's result, recorded on the segment."""
        if ep.truncated is not None:
            raise RequestError(400, f"the episode has ended ({ep.truncated.value})",
                               "context_length_exceeded")
        budget_left = self.s.token_budget - (len(seg.ids) - seg.prompt_len)
        context_left = self.s.max_model_len - len(seg.ids)
        if budget_left <= 0:
            self._truncate(ep, Outcome.TRUNCATED_BUDGET,
                           f"environment.token_budget={self.s.token_budget} is spent")
        if context_left <= 1:
            self._truncate(ep, Outcome.TRUNCATED_CONTEXT, f"rollout.max_model_len={self.s.max_model_len} "
                           "is reached")
        if ep.requests >= self.s.max_turns:
            self._truncate(ep, Outcome.TRUNCATED_TURNS, f"environment.max_turns={self.s.max_turns} turns "
                           "are taken")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RequestError(400, f"max_tokens={max_tokens!r} must be a positive integer")
        most = self.s.max_tokens_per_turn
        # the k-th request samples with the agent loop's seed for turn k: the same game, the same tokens
        sampling = Sampling(max_tokens=min(most, max_tokens or most, budget_left, context_left - 1),
                            temperature=self.s.temperature, top_p=self.s.top_p, stop_token_ids=(self.eos,),
                            seed=None if ep.seed is None else sample_seed(ep.seed, "turn", ep.requests),
                            routes_from=0 if seg.routes is None else seg.routes.num_positions)
        ep.requests += 1
        ep.counts["gateway_requests"] += 1
        res = await self.engine.agenerate(seg.ids, sampling)
        if not res.token_ids:
            self._truncate(ep, Outcome.TRUNCATED_CONTEXT, "the engine sampled nothing")
        seg.add_turn(res, self.eos)
        return res

    def _finish(self, res) -> str:
        return "stop" if res.token_ids and res.token_ids[-1] == self.eos else "length"

    def _tool_calls(self, text: str, req) -> dict:
        """The assistant message with the tool calls the model's text holds, as vLLM's tool parser for the
        model (gateway option tool_parser) reads them."""
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        parsed = ToolParserManager.get_tool_parser(self.o.tool_parser)(self.tok, req.tools) \
            .extract_tool_calls(text, req)
        if not parsed.tools_called:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in parsed.tool_calls]}

    async def _stream(self, request, kind: str, choices: list[dict]):
        """Server-sent events: the turn as chunks (the engine samples the turn whole), then [DONE]."""
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        cid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        for choice in choices:
            chunk = {"id": cid, "object": kind, "created": created, "model": MODEL_NAME,
                     "choices": [{"finish_reason": None, **choice}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- episodes ---------------------------------------------------------------------------------------

    def drain_counts(self) -> Counter:
        """The counts of requests no running episode owned (no token, an unknown episode), since the
        last drain."""
        counts, self.counts = self.counts, Counter()
        return counts

    async def run_episode(self, row: dict, group_id: int, sample_index: int,
                          seed: int | None) -> tuple[list[Trajectory], str, Counter]:
        """One harness call: the episode's trajectories, why it failed ("" if it did not) and its
        counts."""
        ep = Episode(uuid.uuid4().hex, seed)
        url = f"{self.base}/episodes/{ep.id}/v1"
        async with self._slots:
            self.episodes[ep.id] = ep
            try:
                reward, figures, failure = harness_result(await self._call_harness(url, row))
            except TimeoutError:
                ep.counts["gateway_timeouts"] += 1
                reward, figures, failure = 0.0, {}, ("the harness outlasted environment.options."
                                                     f"episode_timeout_s={self.o.episode_timeout_s:g}")
            except Exception as err:  # the harness's own failure: its episode's, not the run's
                from moe_rl.rollout.envs import error_text

                ep.counts["gateway_harness_errors"] += 1
                reward, figures, failure = 0.0, {}, f"the harness raised {error_text(err)}"
            finally:
                del self.episodes[ep.id]  # its later requests: 404
        outcome = ep.truncated or Outcome.COMPLETED
        if ep.truncated is not None:  # cut by the gateway: whatever the harness did after, it ends truncated
            reward, failure = (0.0 if failure else reward), ""
        kept = [s for s in ep.segments if s.spans]
        if not failure and not kept:
            failure = "the harness made no request"
        if failure:
            return [], failure, ep.counts
        return [s.trajectory(reward, outcome, group_id, sample_index, figures) for s in kept], "", ep.counts

    async def _call_harness(self, url: str, row: dict):
        """The harness on its own event loop (a plain function: in a thread of that loop), within the
        episode's timeout; a timeout cancels it there."""
        fn = self.o.harness
        kw = {"api_key": self.token} if "api_key" in inspect.signature(fn).parameters else {}

        async def call():
            if inspect.iscoroutinefunction(fn):
                return await fn(url, dict(row), **kw)
            return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(url, dict(row), **kw))

        future = asyncio.run_coroutine_threadsafe(call(), self._harness_loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.o.episode_timeout_s)
        finally:
            future.cancel()


def harness_result(result) -> tuple[float, dict, str]:
    """(reward, figures, failure) from what a harness returned: a number, or a dict with a numeric
    "reward" (its other numbers are the episode's figures, env/KEY; bools count 0/1); anything else is a
    failure, said in `failure`."""
    if isinstance(result, dict):
        figures = {k: float(v) for k, v in result.items()
                   if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        figures |= {k: float(v) for k, v in result.items() if isinstance(v, bool)}
        result = result.get("reward")
    else:
        figures = {}
    if isinstance(result, bool) or not isinstance(result, (int, float)) or result != result:
        return 0.0, {}, f"the harness returned {result!r}, not a reward (a number, or a dict with 'reward')"
    return float(result), figures, ""
