"""Agent harnesses of tests/rollout/test_gateway.py, as a user writes them: the `openai` client against the
gateway's base URL. Each records what it was served in SEEN (this module, in the engine's process), keyed
by the row's "id", so the test can compare it with the trajectories."""

import asyncio
import json

import httpx
import openai

SEEN: dict[str, list] = {}
ASK = [{"role": "user", "content": "x"}]


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, max_retries=0)  # OPENAI_API_KEY: the run's token


async def single_turn(base_url: str, row: dict) -> float:
    reply = await client(base_url).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=6)
    content = reply.choices[0].message.content
    SEEN[row["id"]] = [reply.choices[0].model_extra["token_ids"], content]
    return float(len(content))


async def multi_turn(base_url: str, row: dict) -> dict:
    """Three turns, each answered with an observation; the history sent back as it was served."""
    c, messages, seen = client(base_url), [{"role": "user", "content": row["prompt"]}], []
    for turn in range(3):
        reply = await c.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        seen.append(reply.choices[0].model_extra["token_ids"])
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"turn {turn} seen"}]
    SEEN[row["id"]] = seen
    return {"reward": 1.0, "turns": 3.0, "success": True}


async def streaming(base_url: str, row: dict) -> float:
    stream = await client(base_url).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=6, stream=True)
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    SEEN[row["id"]] = [text, finish]
    return 0.5


async def rewrites_history(base_url: str, row: dict) -> float:
    """Two turns, then a conversation that drops the first: a prefix break (two trajectories)."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "go on"}]
    await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "start over"}],
                                    max_tokens=4)
    return 0.25


async def completions_tokens(base_url: str, row: dict) -> float:
    """The completions endpoint, token in / token out: the second prompt extends the first's tokens."""
    c = client(base_url)
    first = await c.completions.create(model="policy", prompt=row["prompt"], max_tokens=4)
    ids = first.choices[0].model_extra["token_ids"]
    second = await c.completions.create(model="policy", prompt=row["prompt_ids"] + ids + [10, 10],
                                        max_tokens=4)
    SEEN[row["id"]] = [ids, second.choices[0].model_extra["token_ids"]]
    return 1.0


async def raises(base_url: str, row: dict) -> float:
    await client(base_url).chat.completions.create(model="policy", messages=ASK)
    raise RuntimeError("the harness broke")


async def hangs(base_url: str, row: dict) -> float:
    await asyncio.sleep(3600)
    return 1.0


async def misbehaves(base_url: str, row: dict) -> float:
    """Requests the gateway must refuse, each answered with its status; then one good turn."""
    root, episode = base_url.split("/episodes/")[0], base_url.split("/episodes/")[1].split("/")[0]
    key = {"Authorization": f"Bearer {client(base_url).api_key}"}
    async with httpx.AsyncClient() as http:
        statuses = {
            "no token": (await http.post(f"{base_url}/chat/completions", json={})).status_code,
            "unknown episode": (await http.post(f"{root}/episodes/nope/v1/chat/completions", headers=key,
                                                json={"messages": ASK})).status_code,
            "not json": (await http.post(f"{base_url}/chat/completions", headers=key,
                                         content=b"{not json")).status_code,
            "no messages": (await http.post(f"{base_url}/chat/completions", headers=key,
                                            json={"model": "policy"})).status_code,
            "too large": (await http.post(f"{base_url}/chat/completions", headers=key,
                                          content=b"x" * (1 << 17))).status_code,
            "models": (await http.get(f"{base_url}/models", headers=key)).status_code,
        }
    assert episode
    await client(base_url).chat.completions.create(model="policy", messages=ASK, max_tokens=3)
    SEEN[row["id"]] = [statuses]
    return 1.0


async def returns_text(base_url: str, row: dict):
    await client(base_url).chat.completions.create(model="policy", messages=ASK, max_tokens=2)
    return "great"


async def no_request(base_url: str, row: dict) -> float:
    return 1.0


def plain_function(base_url: str, row: dict) -> float:
    """Not async: runs in a thread, with the synchronous client."""
    reply = openai.OpenAI(base_url=base_url, max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=3)
    SEEN[row["id"]] = [reply.choices[0].model_extra["token_ids"]]
    return 2.0


async def over_budget(base_url: str, row: dict) -> float:
    """Turns until the gateway refuses one (the token budget spent): the episode ends truncated."""
    c, messages = client(base_url), [{"role": "user", "content": row["prompt"]}]
    try:
        for _ in range(50):
            reply = await c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "more"}]
    except openai.BadRequestError as err:
        SEEN[row["id"]] = [err.status_code, str(err)]
        raise
    return 1.0


async def tool_calling(base_url: str, row: dict) -> float:
    """A tool-calling loop: the model's tool call (parsed by the gateway's tool parser) is run here and its
    result sent back as a tool message; then the model answers."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    kw = {"model": "policy", "tools": row["tools"], "max_tokens": 96}
    if row["stream"]:  # the call assembled from the stream's deltas, as agent frameworks do
        content, calls, finish = "", {}, None
        async for chunk in await c.chat.completions.create(messages=messages, stream=True, **kw):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": "",
                                                                                        "arguments": ""}})
                calls[d.index]["function"]["name"] += d.function.name or ""
                calls[d.index]["function"]["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = list(calls.values())
        messages.append({"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls
                                                                             else {})})
    else:
        first = await c.chat.completions.create(messages=messages, **kw)
        message, finish = first.choices[0].message, first.choices[0].finish_reason
        calls = [call.model_dump() for call in message.tool_calls or []]
        messages.append(message.model_dump(exclude_none=True))  # the assistant turn as the client got it
    for call in calls:
        word = json.loads(call["function"]["arguments"])["q"]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"a {word} is a big cat"})
    await c.chat.completions.create(messages=messages, **(kw | {"max_tokens": 8}))
    SEEN[row["id"]] = [[(x["function"]["name"], x["function"]["arguments"]) for x in calls], finish]
    return 1.0 if calls else 0.0


# -- harnesses that the run tries before it starts (HarnessEpisodes.trial), wrong in the ways users are ----


async def own_key(base_url: str, row: dict) -> float:
    """Sends a key of its own instead of the run's."""
    await openai.AsyncOpenAI(base_url=base_url, api_key="sk-my-own", max_retries=0).chat.completions.create(
        model="policy", messages=ASK)
    return 1.0


async def fixed_url(base_url: str, row: dict) -> float:
    """Ignores base_url: a server of its own that does not listen."""
    await openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", max_retries=0).chat.completions.create(
        model="policy", messages=ASK)
    return 1.0


async def host_only(base_url: str, row: dict) -> float:
    """Keeps the host of base_url and drops the episode's path."""
    root = base_url.split("/episodes/")[0]
    await client(root + "/v1").chat.completions.create(model="policy", messages=ASK)
    return 1.0


def plain_forever(base_url: str, row: dict) -> float:
    """Not async: one request, then a loop that never ends (the trial must not wait for it, nor keep the
    process from exiting)."""
    import time

    openai.OpenAI(base_url=base_url, max_retries=0).chat.completions.create(model="policy", messages=ASK)
    while True:
        time.sleep(1)
