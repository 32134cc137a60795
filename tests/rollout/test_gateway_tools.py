"""The gateway's tool calls: a model turn's text read by vLLM's own tool parser for the model (gateway
option tool_parser), and tool results in the history compared as served. The engine is not needed: the
text stands for a model turn."""

import json

import pytest

from moe_rl.rollout.gateway import Gateway, GatewayOptions, served_message


def gateway(tokenizer, parser="hermes"):
    options = GatewayOptions(harness=None, max_concurrent=1, episode_timeout_s=1.0, max_request_bytes=1 << 16,
                             tool_parser=parser)
    return Gateway(None, None, tokenizer, 0, None, options, "127.0.0.1")


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                            "parameters": {"type": "object",
                                                           "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


def request():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    ask = [{"role": "user", "content": "x"}]
    return ChatCompletionRequest.model_validate({"messages": ask, "tools": TOOLS})


def test_a_tool_call_in_the_models_text_comes_back_as_tool_calls(tok):
    text = 'let me see <tool_call>{"name": "lookup", "arguments": {"q": "tiger"}}</tool_call>'
    message = gateway(tok)._tool_calls(text, request())
    assert message["content"] == "let me see "
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"q": "tiger"} and call["id"]


def test_text_without_a_tool_call_stays_content(tok):
    assert gateway(tok)._tool_calls("no tools today", request()) == {"role": "assistant",
                                                                      "content": "no tools today"}


def test_the_history_check_compares_tool_calls_by_name_and_arguments_and_tool_results_by_call():
    call = {"id": "a", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "tiger"}'}}
    served = served_message({"role": "assistant", "content": None, "tool_calls": [call]})
    # the client sends the call back with another id and an empty string content: the same turn
    assert served_message({"role": "assistant", "content": "", "tool_calls": [{**call, "id": "b"}]}) == served
    edited = {**call, "function": {"name": "lookup", "arguments": '{"q": "lion"}'}}
    assert served_message({"role": "assistant", "content": None, "tool_calls": [edited]}) != served
    assert served_message({"role": "tool", "tool_call_id": "a", "content": "a big cat"}) != \
        served_message({"role": "tool", "tool_call_id": "b", "content": "a big cat"})


def test_an_unknown_tool_parser_is_refused_when_the_config_loads(tmp_path):
    from moe_rl.rollout.envs import build_options, get_env
    from moe_rl.schema import ConfigError

    harness = tmp_path / "h.py"
    harness.write_text("async def run(base_url, row):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="tool_parser='nope'"):
        build_options(get_env("gateway"), {"harness": f"{harness}:run", "tool_parser": "nope"})
    other = tmp_path / "h2.py"
    other.write_text("async def run(base_url):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="takes 1 required argument"):
        build_options(get_env("gateway"), {"harness": f"{other}:run"})

