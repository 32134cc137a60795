"""The agent loop with the real tokenizer and environments. The model's choices come from a scripted
policy (a test double standing in for the engine, so that masks, spans and rewards can be worked out
by hand); the end-to-end test with the real vLLM engine is in test_agent_vllm.py."""

import asyncio
import json

import numpy as np
import pytest
from conftest import agent_spec
from scripted_policy import ScriptedPolicy, run
from transformers import AutoTokenizer

from moe_rl.rollout.agent import Agent
from moe_rl.rollout.data import DatasetError, load_prompts
from moe_rl.rollout.envs import EnvContext, Environment, EnvSpec, StepResult, env_names, get_env
from moe_rl.rollout.sandbox import SandboxUnavailable
from moe_rl.trajectory import Outcome, RoutingRecord, validate_trajectory


@pytest.fixture(scope="module")
def tok(tiny_qwen):
    return AutoTokenizer.from_pretrained(tiny_qwen)


def test_guessing_game_masks_spans_and_rewards_by_hand(tok):
    policy = ScriptedPolicy(tok, ["5", "7", "6"])
    agent = Agent(policy, tok, EnvSpec("guess_number"), agent_spec(max_turns=4, token_budget=200))
    t = run(agent.run_episode({"secret": 6, "low": 1, "high": 9}))
    assert t.outcome is Outcome.COMPLETED and t.terminated
    text = tok.decode(t.token_ids)
    assert text == ("<|im_start|>user\nGuess my number from 1 to 9.<|im_end|>\n<|im_start|>assistant\n"
                    "5<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
                    "7<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n6<|im_end|>")
    # each turn is "digit" + <|im_end|>: two sampled tokens per span
    assert [e - b + 1 for b, e in t.spans] == [2, 2, 2]
    sampled = [i for i, m in enumerate(t.response_mask) if m]
    assert sampled == [p for b, e in t.spans for p in range(b, e + 1)]
    assert [tok.decode([t.token_ids[b]]) for b, _ in t.spans] == ["5", "7", "6"]
    assert t.turn_rewards == [-0.05, -0.05, 0.0] and t.terminal_reward == 1.0
    assert all(lp == -0.5 for lp, m in zip(t.logprobs, t.response_mask, strict=True) if m)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.response_mask, strict=True) if not m)
    assert t.weight_version == 5 and validate_trajectory(t) == []
    # token-in: each turn was sampled from exactly the previous tokens (no re-tokenisation)
    assert policy.calls[2] == t.token_ids[: t.spans[2][0]]


def test_truncation_keeps_the_boundary_observation(tok):
    policy = ScriptedPolicy(tok, ["1", "2"])
    agent = Agent(policy, tok, EnvSpec("guess_number"), agent_spec(max_turns=2, token_budget=200))
    t = run(agent.run_episode({"secret": 9}))
    assert t.outcome is Outcome.TRUNCATED_TURNS and not t.terminated
    # the boundary state includes the observation returned after the last model token
    assert t.boundary_len == len(t.token_ids)
    assert tok.decode(t.token_ids).endswith("2<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n"
                                            "<|im_start|>assistant\n")
    assert not any(t.response_mask[t.spans[-1][1] + 1:])


def test_budget_and_context_limits(tok):
    agent = Agent(ScriptedPolicy(tok, ["12345678"] * 5), tok, EnvSpec("guess_number"),
                  agent_spec(max_turns=5, token_budget=30, max_tokens_per_turn=16))
    t = run(agent.run_episode({"secret": 3}))
    # no turn starts once the budget is spent; the boundary observation itself may overshoot it
    assert t.outcome is Outcome.TRUNCATED_BUDGET and len(t.spans) == 1 and t.spans[0][1] - t.prompt_len < 30
    agent = Agent(ScriptedPolicy(tok, ["12345678"] * 5), tok, EnvSpec("guess_number"),
                  agent_spec(max_turns=5, token_budget=500, max_model_len=60))
    t = run(agent.run_episode({"secret": 3}))
    assert t.outcome is Outcome.TRUNCATED_CONTEXT and len(t.token_ids) <= 60


def test_repetition_outcome(tok):
    agent = Agent(ScriptedPolicy(tok, ["hmm"] * 5), tok, EnvSpec("guess_number"),
                  agent_spec(max_turns=5, token_budget=500, repetition_limit=3))
    t = run(agent.run_episode({"secret": 3}))
    assert t.outcome is Outcome.REPETITION and len(t.spans) == 3 and t.turn_rewards == [-0.1] * 3
    # a cut the policy can trigger at will ends the episode as it stands: no bootstrap from the critic's
    # value of going on (a policy that loops would otherwise collect it instead of playing)
    assert t.terminated and t.terminal_reward == 0.0


class Exploding(Environment):
    async def reset(self, prompt):
        return [{"role": "user", "content": "hi"}]

    async def step(self, action_text):
        raise RuntimeError("environment bug")


class Sleepy(Exploding):
    async def step(self, action_text):
        await asyncio.sleep(10)


def test_environment_failures_are_counted_not_trained(tok):
    for env, settings in ((Exploding, agent_spec()), (Sleepy, agent_spec(env_timeout_s=0.2))):
        agent = Agent(ScriptedPolicy(tok, ["x"]), tok, EnvSpec(env), settings)
        t = run(agent.run_episode({}))
        assert t.outcome is Outcome.ENV_ERROR
        assert agent.accept([t]) == [] and agent.stats.rejected["env_error"] == 1


def test_calculator_tool_call_result_and_verified_answer(tok):
    agent = Agent(ScriptedPolicy(tok, ["<calc>12*7+3</calc>", "<answer>87</answer>"]), tok,
                  EnvSpec("calculator"),
                  agent_spec(max_turns=3, token_budget=300, max_tokens_per_turn=32))
    t = run(agent.run_episode({"question": "What is 12*7+3?", "answer": 87}))
    assert t.outcome is Outcome.COMPLETED and t.terminal_reward == 1.0
    assert "<|im_start|>user\n<result>87</result><|im_end|>" in tok.decode(t.token_ids)
    obs_tokens = [i for i in range(t.spans[0][1] + 1, t.spans[1][0])]
    assert obs_tokens and not any(t.response_mask[i] for i in obs_tokens)


def test_calculator_expert_calls_the_tool_then_answers(tok):
    """The calculator's scripted expert (its warm-start demonstrations): a tool call on the question's
    expression, then the tool's result as the answer, through the real sandbox."""
    from moe_rl.rollout.demos import ExpertPolicy

    env = get_env("calculator")
    settings = agent_spec(max_turns=3, token_budget=300, max_tokens_per_turn=32)
    agent = Agent(ExpertPolicy(tok, env.expert_turn, 0), tok, EnvSpec(env), settings)
    prompt = env.generate_prompts(1, seed=3, options=env.Options())[0]
    t = run(agent.run_episode(prompt))
    text = tok.decode(t.token_ids)
    assert t.outcome is Outcome.COMPLETED and t.terminal_reward == 1.0 and len(t.spans) == 2
    assert f"<calc>{prompt['question'][8:-1]}</calc>" in text \
        and f"<result>{prompt['answer']}</result>" in text


@pytest.mark.parametrize("expr, expect", [
    ("2**99999999", "tool_error"),  # exponent refused
    ("__import__('os').system('true')", "tool_error"),  # not an arithmetic expression
    ("9**9**9", "tool_error"),
    ("1/0", "tool_error: exit code 1: ZeroDivisionError"),
])
def test_calculator_failures_become_tool_error_observations(expr, expect):
    env = get_env("calculator")(context=EnvContext(tool_timeout_s=2))
    run(env.reset({"question": "q", "answer": 1}))
    out = run(env.step(f"<calc>{expr}</calc>"))
    assert out.tool_error and out.observation.startswith("<result>" + expect)


def test_repeated_tool_errors_end_the_episode(tok):
    agent = Agent(ScriptedPolicy(tok, ["<calc>1/0</calc>"] * 3), tok, EnvSpec("calculator"),
                  agent_spec(max_turns=5, token_budget=400, max_model_len=512, max_tokens_per_turn=32))
    t = run(agent.run_episode({"question": "q", "answer": 1}))
    assert t.outcome is Outcome.TOOL_ERROR and t.info["tool_errors"] == 3 and t.terminated


class FlakyTool(Environment):
    """A user environment whose tool fails on every call and which never ends an episode itself: the
    limit on failed tool calls is the agent loop's, for every environment."""

    max_tool_errors = 2

    async def reset(self, prompt):
        return [{"role": "user", "content": "call the tool"}]

    async def step(self, action_text):
        failed = action_text != "ok"
        return StepResult("tool failed" if failed else "fine", tool_error=failed, info={"calls": 1})


def test_max_tool_errors_ends_a_user_environment_episode(tok):
    settings = agent_spec(max_turns=6, token_budget=400, max_model_len=512, max_tokens_per_turn=8)
    # failed calls count over the episode, not in a row: the 2nd failure (turn 3) ends it
    agent = Agent(ScriptedPolicy(tok, ["bad", "ok", "bad", "ok", "bad", "ok"]), tok, EnvSpec(FlakyTool),
                  settings)
    t = run(agent.run_episode({}))
    assert t.outcome is Outcome.TOOL_ERROR and t.terminated and len(t.spans) == 3 \
        and t.info["tool_errors"] == 2
    assert t.info["figures"] == {"calls": 1.0} and t.terminal_reward == 0.0 and agent.stats.tool_errors == 2
    assert tok.decode(t.token_ids).endswith("bad<|im_end|>")  # the ending step's observation is not appended
    assert agent.accept([t]) == [t]  # trained on, as a terminated episode

    class Patient(FlakyTool):
        max_tool_errors = None  # no limit: the turns run out

    agent = Agent(ScriptedPolicy(tok, [f"bad {i}" for i in range(6)]), tok, EnvSpec(Patient), settings)
    t = run(agent.run_episode({}))
    assert t.outcome is Outcome.TRUNCATED_TURNS and t.info["tool_errors"] == 6
    assert t.info["figures"] == {"calls": 1.0}  # a truncated episode's figures: what its last step reported

    class Wrong(FlakyTool):
        max_tool_errors = 0

    with pytest.raises(ValueError, match=r"Wrong.max_tool_errors=0 must be a positive integer or None"):
        Agent(ScriptedPolicy(tok, []), tok, EnvSpec(Wrong), settings)


def test_calculator_leaves_the_tool_error_limit_to_the_agent():
    """The calculator reports each failed call and never ends the episode over them itself."""
    env = get_env("calculator")(context=EnvContext(tool_timeout_s=2))
    run(env.reset({"question": "q", "answer": 1}))
    steps = [run(env.step("<calc>1/0</calc>")) for _ in range(env.max_tool_errors + 1)]
    assert all(s.tool_error and not s.done for s in steps)


class NoSandbox(Environment):
    """Stands for an environment whose tool found that this machine cannot run the sandbox."""

    fail_in = "step"

    async def reset(self, prompt):
        if self.fail_in == "reset":
            raise SandboxUnavailable("cannot run tool code isolated (test)")
        return [{"role": "user", "content": "hi"}]

    async def step(self, action_text):
        raise SandboxUnavailable("cannot run tool code isolated (test)")


def test_sandbox_unavailable_stops_the_rollout_instead_of_becoming_an_episode(tok):
    """Neither an observation nor a counted env_error: the rollout stops (the CLI names it, exit code 2)."""
    class InReset(NoSandbox):
        fail_in = "reset"

    for env in (NoSandbox, InReset):
        agent = Agent(ScriptedPolicy(tok, ["x", "y"]), tok, EnvSpec(env), agent_spec())
        with pytest.raises(SandboxUnavailable, match="cannot run tool code isolated"):
            run(agent.run_groups([{}], samples_per_prompt=2))
        assert not agent.stats.outcomes and not agent.stats.rejected


def test_group_sampling_and_dynamic_sampling(tok):
    class Always(ScriptedPolicy):
        async def agenerate(self, ids, sampling):
            self.turns = ["5"]
            return await super().agenerate(ids, sampling)

    agent = Agent(Always(tok, []), tok, EnvSpec("arithmetic"), agent_spec(max_turns=1))
    prompts = [{"question": "2+3?", "answer": 5}, {"question": "1+1?", "answer": 2}]
    groups = run(agent.run_groups(prompts, samples_per_prompt=3))
    assert [len(g) for g in groups] == [3, 3] and [t.group_id for t in groups[1]] == [1, 1, 1]
    # every group's rewards are all equal for a deterministic policy: all dropped, bounded rounds
    kept = run(agent.dynamic_sampling(lambda k: prompts[:k], groups_wanted=2, samples_per_prompt=2,
                                      max_rounds=2))
    assert kept == [] and agent.stats.dropped_groups == 6


def test_overlong_filter_marks_length_cuts_only(tok):
    agent = Agent(ScriptedPolicy(tok, ["12345678"] * 2), tok, EnvSpec("guess_number"),
                  agent_spec(max_turns=5, token_budget=10))
    cut = run(agent.run_episode({"secret": 3}))
    agent = Agent(ScriptedPolicy(tok, ["1", "2"]), tok, EnvSpec("guess_number"), agent_spec(max_turns=2))
    out_of_turns = run(agent.run_episode({"secret": 9}))
    assert (cut.outcome, out_of_turns.outcome) == (Outcome.TRUNCATED_BUDGET, Outcome.TRUNCATED_TURNS)
    agent.overlong_filter([cut, out_of_turns])
    assert cut.info["loss_excluded"] == "overlong" and "loss_excluded" not in out_of_turns.info
    assert agent.stats.overlong_filtered == 1


def test_env_registry_and_datasets(tmp_path):
    assert {"arithmetic", "calculator", "guess_number"} <= set(env_names())
    with pytest.raises(KeyError, match="did you mean 'guess_number'"):
        get_env("guess_numbr")
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"secret": 3}) + "\n\n" + json.dumps({"secret": 4}) + "\n")
    assert [r["secret"] for r in load_prompts(good, ("secret",))] == [3, 4]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"secret": 3}\n{secret: 4}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2: not valid JSON"):
        load_prompts(bad)
    with pytest.raises(DatasetError, match="p.jsonl:1: missing field"):
        load_prompts(good, ("question",))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1?"], "answer": [2]}), tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.parquet", ("question", "answer")) == [{"question": "1+1?", "answer": 2}]
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DatasetError, match="unsupported dataset format"):
        load_prompts(tmp_path / "x.csv")


class RoutedPolicy(ScriptedPolicy):
    """The scripted policy returning a routing record from `sampling.routes_from` on, like the engine:
    position p of call c routes to experts (c, p % 7) in each of 2 layers (worked by hand below)."""

    async def agenerate(self, ids, sampling):
        res = await super().agenerate(ids, sampling)
        self.starts = getattr(self, "starts", []) + [sampling.routes_from]
        c = len(self.calls) - 1
        end = len(ids) + len(res.token_ids) - 1  # the last sampled token is never computed
        rows = np.array([[[c, p % 7]] * 2 for p in range(sampling.routes_from, end)], dtype=np.uint8)
        res.routes = RoutingRecord.from_rows(rows.reshape(-1, 2, 2), sampling.routes_from, np.uint8)
        return res


def test_routes_across_turns_come_from_the_turn_that_computed_them(tok):
    policy = RoutedPolicy(tok, ["5", "7", "6"])
    agent = Agent(policy, tok, EnvSpec("guess_number"), agent_spec(max_turns=4, token_budget=200))
    t = run(agent.run_episode({"secret": 6, "low": 1, "high": 9}))
    ends = [len(c) + 1 for c in policy.calls]  # computed positions per call: prompt + first sampled token
    assert policy.starts == [0] + ends[:-1]  # each turn asks from where the record ended
    routes, tail = t.routes.to_replay(len(t.token_ids), top_k=2)
    assert tail == 1 and validate_trajectory(t) == []
    for p in range(len(t.token_ids) - 1):
        c = next(i for i, e in enumerate(ends) if p < e)  # the first call that computed position p
        assert routes[p].tolist() == [[c, p % 7]] * 2


def test_observations_are_rendered_by_the_chat_template(tok):
    """What follows a model turn is the chat template's own rendering (the end of the turn, the
    observation message, the next assistant header), appended as tokens: ChatML for the tiny model,
    and another template's markup for another template, never a hard-coded format."""
    import copy

    agent = Agent(ScriptedPolicy(tok, []), tok, EnvSpec("guess_number"), agent_spec())

    def chatml(prefix):
        return tok.encode(f"{prefix}\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)

    assert agent._observation_ids("user", "higher", closed=True) == chatml("")  # the model sampled <|im_end|>
    # cut off: closed for it
    assert agent._observation_ids("user", "higher", closed=False) == chatml("<|im_end|>")
    inst = copy.deepcopy(tok)
    inst.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                          "[/INST]{% else %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}")
    other = Agent(ScriptedPolicy(inst, ["3", "7"]), inst, EnvSpec("guess_number"),
                  agent_spec(max_turns=2))
    assert other._observation_ids("user", "higher", closed=True) == inst.encode("[INST] higher [/INST]",
                                                                                add_special_tokens=False)
    assert other._observation_ids("user", "higher", closed=False) == inst.encode(
        "<|im_end|>[INST] higher [/INST]", add_special_tokens=False)
    episode = run(other.run_episode({"secret": 5, "low": 1, "high": 9}))  # a whole episode in that format
    text = inst.decode(episode.token_ids)
    assert text.startswith("[INST] Guess my number from 1 to 9. [/INST]3") \
        and "[INST] higher [/INST]7" in text, text
    thinking = copy.deepcopy(tok)  # Qwen3's way: an empty thinking block only in the latest assistant turn
    thinking.chat_template = (
        "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = "
        "loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if "
        "m['role'] == 'assistant' and loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}{{ "
        "m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% "
        "endif %}")
    qwen3 = Agent(ScriptedPolicy(thinking, []), thinking, EnvSpec("guess_number"), agent_spec())
    assert qwen3._observation_ids("user", "higher", closed=True) == chatml("")
    broken = copy.deepcopy(tok)
    broken.chat_template = "{{ messages[-1]['content'] }}"  # renders only the last message
    with pytest.raises(ValueError, match="does not render a 'user' message after an assistant turn"):
        Agent(ScriptedPolicy(broken, []), broken, EnvSpec("guess_number"), agent_spec())


def test_the_first_environment_error_is_kept_for_the_stop_line(tok, tmp_path):
    """An episode the environment fails is an env_error, counted as before; the first one's exception
    (type, message, the user's file and line) is kept in the rollout's stats for the stop line."""
    from moe_rl.rollout.envs import EnvContext

    (tmp_path / "scores.py").write_text("def score(row, response):\n    return 1 / 0\n")
    spec = EnvSpec("single_turn", {}, EnvContext(reward_fn=f"{tmp_path / 'scores.py'}:score"))
    agent = Agent(ScriptedPolicy(tok, ["a", "b"]), tok, spec, agent_spec(max_turns=1))
    assert run(agent.run_groups([{"prompt": "q"}], 2)) == []
    assert agent.stats.rejected["env_error"] == 2
    assert agent.stats.first_error == ("step: ZeroDivisionError: division by zero "
                                       f"({tmp_path / 'scores.py'}:2)")
