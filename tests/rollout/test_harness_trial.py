"""A gateway harness is tried before the run starts (HarnessEpisodes.trial via try_first_prompt) against a
stub endpoint: its first request must reach the base URL it was given with the run's token. A harness that
ignores base_url, sends a key of its own, raises or returns without a request is refused in one line
naming environment.options.harness; a good one (async or plain, even one that never returns) passes."""

import os

import pytest

from moe_rl.rollout.envs import EnvSpec, try_first_prompt
from moe_rl.schema import ConfigError

ROW = {"id": "trial", "prompt": "hello"}


def trial(name: str) -> None:
    spec = EnvSpec("gateway", {"harness": name if ":" in name else f"harnesses:{name}"})
    try_first_prompt(spec, ROW, "the first row of tasks.jsonl")


@pytest.mark.parametrize("name", ["single_turn", "multi_turn", "streaming", "plain_forever",
                                  "examples/openai_agent/agent.py:run"])
def test_a_harness_that_talks_to_its_base_url_passes(name, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "the user's own")
    trial(name)
    assert os.environ["OPENAI_API_KEY"] == "the user's own"  # restored after the trial
    trial(name)  # twice in one process (a harness that keeps a client per process meets a new loop and key)


@pytest.mark.parametrize("name, says", [
    ("own_key", "the harness's first request carried another API key than the run's"),
    ("host_only", "the harness's first request went to /v1/chat/completions, not under the base URL"),
    ("fixed_url", "the harness raised APIConnectionError: Connection error. (tests/rollout/harnesses.py:"),
    ("no_request", "the harness returned without a request to the base URL it was given"),
])
def test_a_harness_that_does_not_is_refused_in_one_line(name, says):
    with pytest.raises(ConfigError) as err:
        trial(name)
    text = str(err.value)
    assert text.startswith(f"environment.options.harness: {says}") and "\n" not in text, text
    assert "on the first row of tasks.jsonl, before the run starts" in text
