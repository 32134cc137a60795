"""The single_turn environment around a reward function, and environments by import path, without
the engine: what the function is called with, its results (a number, a dict with extra figures, an
async function), and what makes an episode an env_error."""

import asyncio
import math

import pytest
from conftest import ROOT, agent_spec
from test_agent import ScriptedPolicy, tok  # noqa: F401  (the fixture)

from moe_rl.rollout.agent import Agent
from moe_rl.rollout.envs import EnvContext, EnvImportError, EnvSpec, get_env, import_object
from moe_rl.trajectory import Outcome


@pytest.fixture
def rewards_module(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "import asyncio\n"
        "seen = []\n"
        "def length(row, response):\n"
        "    seen.append((row['id'], response))\n"
        "    return {'reward': len(response) / 10, 'long': len(response) > 3, 'n': 7}\n"
        "async def later(row, response):\n"
        "    await asyncio.sleep(0)\n"
        "    return 0.5\n"
        "def nan(row, response):\n"
        "    return float('nan')\n"
        "def text(row, response):\n"
        "    return 'good'\n"
        "def one_arg(row):\n"
        "    return 1.0\n")
    return path


def test_the_reward_function_scores_the_decoded_answer(tok, rewards_module):  # noqa: F811
    spec = EnvSpec("single_turn", {"system_prompt": "Be brief."},
                   EnvContext(reward_fn=f"{rewards_module}:length"))
    agent = Agent(ScriptedPolicy(tok, ["hello", "yo"]), tok, spec, agent_spec(max_turns=1))
    [[a, b]] = asyncio.run(agent.run_groups([{"prompt": [{"role": "user", "content": "hi"}], "id": 3}], 2))
    seen = import_object(f"{rewards_module}:seen")
    assert sorted(seen) == [(3, "hello"), (3, "yo")]  # the row and the decoded answer
    assert sorted([a.terminal_reward, b.terminal_reward]) == [0.2, 0.5] and a.outcome is Outcome.COMPLETED
    assert {a.info["figures"]["long"], b.info["figures"]["long"]} == {0.0, 1.0} \
        and a.info["figures"]["n"] == 7.0
    assert "Be brief." in tok.decode(a.token_ids[:a.prompt_len])  # the system prompt comes first


@pytest.mark.parametrize("fn, outcome, reward",
                         [("later", Outcome.COMPLETED, 0.5), ("nan", Outcome.ENV_ERROR, 0.0),
                                                 ("text", Outcome.ENV_ERROR, 0.0)])
def test_reward_function_results(tok, rewards_module, fn, outcome, reward):  # noqa: F811
    spec = EnvSpec("single_turn", {}, EnvContext(reward_fn=f"{rewards_module}:{fn}"))
    t = asyncio.run(Agent(ScriptedPolicy(tok, ["x"]), tok, spec,
                          agent_spec(max_turns=1)).run_episode({"prompt": "q"}))
    assert t.outcome is outcome and t.terminal_reward == reward


def test_bad_reward_functions_and_import_paths_fail_at_start(tok, rewards_module, monkeypatch):  # noqa: F811
    with pytest.raises(EnvImportError, match=r"must take \(row, response\)"):
        Agent(ScriptedPolicy(tok, []), tok,
              EnvSpec("single_turn", {}, EnvContext(reward_fn=f"{rewards_module}:one_arg")), agent_spec())
    with pytest.raises(EnvImportError, match="has no missing"):
        import_object(f"{rewards_module}:missing")
    with pytest.raises(EnvImportError, match="is not an import path"):
        import_object("no_colon_here")
    monkeypatch.chdir(ROOT)
    # a file, relative to the directory
    assert get_env("examples/tool_env/envs.py:Lookup").__name__ == "Lookup"
    assert math.isclose(import_object("math:pi"), math.pi)  # a module
