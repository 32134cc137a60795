"""The guessing game's rules and the scripted players of environments through the agent loop: the game
ends after its guesses (a true end), ruled-out guesses cost more, a scripted turn longer than the turn
limit is an error, and the game's reference policies are chance and optimal."""

import pytest
from conftest import agent_spec
from scripted_policy import ScriptedPolicy, run
from transformers import AutoTokenizer

from moe_rl.rollout.agent import Agent
from moe_rl.rollout.envs import EnvSpec, get_env
from moe_rl.trajectory import Outcome


@pytest.fixture(scope="module")
def tok(tiny_qwen):
    return AutoTokenizer.from_pretrained(tiny_qwen)


def test_the_guessing_game_ends_after_its_guesses_a_true_termination(tok):
    """Four guesses are the game's rule (environment.options.guesses), not a cut: the fourth wrong guess
    ends the episode (completed, terminal reward 0, no bootstrap from a state the game never reaches),
    whatever environment.max_turns allows; an answer out of range uses a guess too."""
    agent = Agent(ScriptedPolicy(tok, ["1", "x", "2", "3", "4"]), tok, EnvSpec("guess_number"),
                  agent_spec(max_turns=6, token_budget=200))
    t = run(agent.run_episode({"secret": 9}))
    assert t.outcome is Outcome.COMPLETED and t.terminated and len(t.spans) == 4
    assert t.turn_rewards == [-0.05, -0.1, -0.05, -0.05] and t.terminal_reward == 0.0
    assert tok.decode(t.token_ids).endswith("3<|im_end|>")  # no observation after the last guess
    two = Agent(ScriptedPolicy(tok, ["1", "2", "3"]), tok, EnvSpec("guess_number", {"guesses": 2}),
                agent_spec(max_turns=6, token_budget=200))
    t = run(two.run_episode({"secret": 9}))
    assert t.outcome is Outcome.COMPLETED and len(t.spans) == 2
    assert t.info["figures"] == {"guess": 2.0, "ruled_out": 0.0}


def test_a_guess_the_feedback_ruled_out_costs_the_ruled_out_penalty(tok):
    """Secret 6: 5 (higher: 6..9 left), 3 (ruled out), 8 (lower: 6..7 left), 8 again (ruled out), no
    number (ruled out by the range itself), then 6 wins: three ruled-out turns, each 0.25 more than a
    wrong guess's -0.05 or a number-less turn's -0.1 (which so stays the costliest turn). Without the
    option only the count differs."""
    turns = ["5", "3", "8", "8", "x", "6"]
    for penalty in (0.25, 0.0):
        env = EnvSpec("guess_number", {"guesses": 6, "ruled_out_penalty": penalty})
        settings = agent_spec(max_turns=6, token_budget=300)
        agent = Agent(ScriptedPolicy(tok, list(turns)), tok, env, settings)
        t = run(agent.run_episode({"secret": 6}))
        expect = [-0.05, -0.05 - penalty, -0.05, -0.05 - penalty, -0.1 - penalty, 0.0]
        assert t.turn_rewards == pytest.approx(expect) and t.terminal_reward == 1.0
        assert t.info["figures"] == {"guess": 6.0, "ruled_out": 3.0}


def test_a_scripted_turn_longer_than_the_turn_limit_is_an_error_not_a_cut_demonstration(tok):
    """A scripted expert whose turn does not fit rollout.max_new_tokens (here the tool example's
    `<lookup>tiger</lookup>`: 22 tokens + end of turn, under a limit of 16) would train and score on cut
    turns (the tool never sees a whole call): an error naming the setting and the length it needs."""
    from moe_rl.rollout.demos import DemonstrationError, ExpertPolicy

    def lookup(conversation, rng):
        return "<lookup>tiger</lookup>"

    settings = agent_spec(max_turns=2, token_budget=200, max_tokens_per_turn=16)
    agent = Agent(ExpertPolicy(tok, lookup, 0, turn_limit=16), tok, EnvSpec("guess_number"), settings)
    cut = r"lookup played a turn of 22 tokens .* rollout.max_new_tokens=16 cuts it: raise it to at least 23"
    with pytest.raises(DemonstrationError, match=cut):
        run(agent.run_groups([{"secret": 3}], 1))
    settings = agent_spec(max_turns=2, token_budget=200, max_tokens_per_turn=23)
    fits = Agent(ExpertPolicy(tok, lookup, 0, turn_limit=23), tok, EnvSpec("guess_number"), settings)
    assert "<lookup>tiger</lookup>" in tok.decode(run(fits.run_episode({"secret": 3})).token_ids)


def test_the_guessing_games_reference_policies_are_chance_and_optimal(tok):
    """guess_number's reference policies (the baselines a run reports), played through the agent loop:
    binary search wins every game within 4 guesses of 1..9; random guesses in range, the feedback ignored,
    win 1 - (8/9)^4 = 0.376 of them (400 games: within 4 standard deviations, 0.097)."""
    import math

    from moe_rl.rollout.demos import ExpertPolicy

    env = get_env("guess_number")
    prompts = env.generate_prompts(400, seed=5, options=env.Options())
    policies = env.reference_policies()
    assert list(policies) == ["random guesses", "binary search"]
    won = {}
    for name, turn in policies.items():
        settings = agent_spec(max_turns=4, token_budget=128)
        agent = Agent(ExpertPolicy(tok, turn, 1), tok, EnvSpec(env), settings)
        trajs = [t for g in run(agent.run_groups(prompts, 1)) for t in g]
        won[name] = sum(t.terminal_reward == 1.0 for t in trajs) / len(prompts)
        if name == "binary search":
            assert all(len(t.spans) <= 4 for t in trajs)
    assert won["binary search"] == 1.0
    chance = 1 - (8 / 9) ** 4
    assert abs(won["random guesses"] - chance) < 4 * math.sqrt(chance * (1 - chance) / len(prompts))


def test_range_feedback_tells_the_range_the_answers_leave_and_binary_search_still_reads_it(tok):
    """feedback: range. Secret 6: 5 -> "higher: 6 to 9", 8 -> "lower: 6 to 7", then 6 wins; binary search
    reads the same conversation as under "higher" / "lower" alone and wins every game within 4 guesses."""
    from moe_rl.rollout.demos import ExpertPolicy

    env = EnvSpec("guess_number", {"feedback": "range"})
    agent = Agent(ScriptedPolicy(tok, ["5", "8", "6"]), tok, env,
                  agent_spec(max_turns=4, token_budget=200))
    t = run(agent.run_episode({"secret": 6}))
    text = tok.decode(t.token_ids)
    assert "user\nhigher: 6 to 9<|im_end|>" in text and "user\nlower: 6 to 7<|im_end|>" in text
    assert t.terminal_reward == 1.0
    cls = get_env("guess_number")
    prompts = cls.generate_prompts(60, seed=3, options=cls.Options())
    search = Agent(ExpertPolicy(tok, cls.binary_search_turn, 1), tok, env,
                   agent_spec(max_turns=4, token_budget=128))
    trajs = [t for g in run(search.run_groups(prompts, 1)) for t in g]
    assert all(t.terminal_reward == 1.0 and len(t.spans) <= 4 for t in trajs)
    with pytest.raises(ValueError, match="feedback='loud' must be 'direction' or 'range'"):
        cls.Options(feedback="loud").check()
