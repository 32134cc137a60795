"""Agent settings and rejections that reach the batch: DAPO overlong filtering as a setting, and
trajectories with non-finite rewards rejected and counted (never trained on)."""

import asyncio

from conftest import agent_spec
from test_agent import ScriptedPolicy
from transformers import AutoTokenizer

from moe_rl.rollout.agent import Agent
from moe_rl.rollout.envs import Environment, EnvSpec, StepResult


def test_overlong_filter_setting_excludes_truncated_episodes(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    prompts = [{"secret": 9, "low": 1, "high": 9}]
    for on in (False, True):
        # cut by the token budget
        agent = Agent(ScriptedPolicy(tok, ["12345678"] * 2), tok, EnvSpec("guess_number"),
                      agent_spec(max_turns=5, token_budget=10, overlong_filter=on))
        [[t]] = asyncio.run(agent.run_groups(prompts, 1))
        assert ("loss_excluded" in t.info) is on and agent.stats.overlong_filtered == int(on)


class NanReward(Environment):
    async def reset(self, prompt):
        return [{"role": "user", "content": "say anything"}]

    async def step(self, action_text):
        return StepResult(None, done=True, final_reward=float("nan") if "bad" in action_text else 1.0)


def test_non_finite_rewards_are_rejected_and_counted(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    agent = Agent(ScriptedPolicy(tok, ["good", "bad", "good"]), tok, EnvSpec(NanReward),
                  agent_spec(max_turns=1))
    groups = asyncio.run(agent.run_groups([{}], 3))
    assert [t.terminal_reward for g in groups for t in g] == [1.0, 1.0]
    assert agent.stats.rejected == {"rewards": 1}


def test_a_greedy_evaluation_samples_at_temperature_zero(tiny_qwen):
    """trainer.eval_greedy: the engine actor's collect (the function Rollouts.evaluate calls remotely) asks
    the engine for temperature 0; a rollout's collect for rollout.temperature."""
    from types import SimpleNamespace

    from moe_rl.driver.rollout_actor import RolloutActor

    class Temperatures(ScriptedPolicy):
        async def agenerate(self, ids, sampling):
            self.seen.append(sampling.temperature)
            return await super().agenerate(ids, sampling)

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    collect = RolloutActor.__ray_actor_class__.collect
    for greedy, expected in ((True, 0.0), (False, 0.7)):
        engine = Temperatures(tok, ["5"] * 2)
        engine.seen = []
        actor = SimpleNamespace(agent=Agent(engine, tok, EnvSpec("guess_number"),
                                            agent_spec(temperature=0.7, max_turns=1)))
        trajs, _ = asyncio.run(collect(actor, [{"secret": 5, "low": 1, "high": 9}] * 2, 1, 0, greedy=greedy))
        assert engine.seen == [expected, expected] and len(trajs) == 2
