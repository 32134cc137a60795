"""An agent harness of your own, trained by `moe-rl train examples/openai_agent/config.yaml`.

It is plain `openai` client code: the run calls `run(base_url, row)` once per episode, and the base URL
points at the run's engines (an OpenAI-compatible endpoint for this episode; OPENAI_API_KEY holds the
run's token). The harness decides the turns, runs its tool, and returns the episode's reward.

The task: reply in lowercase letters. After the first reply the harness runs its tool (a checker) and
tells the model how it did; the reward is the second reply's share of lowercase letters.
"""

import asyncio
import os

import openai

_clients: dict = {}  # one client per event loop of the harness's process: making one costs ~10 ms


def client(base_url: str) -> openai.AsyncOpenAI:
    """This loop's client, pointed at the episode's base URL (`with_options` shares its connections; the
    key is read again from OPENAI_API_KEY, which the run sets)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = openai.AsyncOpenAI(base_url=base_url)
    return _clients[loop].with_options(base_url=base_url, api_key=os.environ["OPENAI_API_KEY"])


def lowercase_share(text: str) -> float:
    """The tool: the fraction of the text's characters that are ASCII lowercase letters."""
    return sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0


async def run(base_url: str, row: dict) -> dict:
    episode = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await episode.chat.completions.create(model="policy", messages=messages)
    answer = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": f"{lowercase_share(answer):.0%} lowercase. Again."}]
    second = await episode.chat.completions.create(model="policy", messages=messages)
    return {"reward": lowercase_share(second.choices[0].message.content or ""),
            "first_share": lowercase_share(answer)}
