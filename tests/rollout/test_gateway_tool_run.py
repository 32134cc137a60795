"""A tool-calling harness through the gateway on the real engine (tests/rollout/gateway_tool_job.py): the
model's sampled tool call reaches the harness as `tool_calls` (vLLM's hermes parser; streamed to two of
the four episodes), the harness's tool result extends the same episode, and the trajectory holds the
call's tokens exactly as sampled."""

import pytest
from gateway_tool_job import gateway_tool_job

from moe_rl.train.launch_local import run_in_process
from moe_rl.trajectory import Outcome, validate_trajectory

pytestmark = pytest.mark.slow


def test_a_sampled_tool_call_is_parsed_run_and_answered_in_one_episode(tiny_qwen, tmp_path):
    out = run_in_process(gateway_tool_job, (str(tiny_qwen), str(tmp_path / "taught")))
    assert out["final_loss"] < 0.05  # the model learned to make the call
    trajs, stats = out["trajs"], out["stats"]
    assert len(trajs) == 4 and stats.counts["gateway_requests"] == 8
    assert not stats.counts["gateway_prefix_breaks"]  # the tool result extends the episode
    called = 0
    for t in trajs:
        calls, finish = out["seen"][f"tool-{t.group_id}"]
        assert t.outcome is Outcome.COMPLETED and len(t.spans) == 2 and validate_trajectory(t, 256) == []
        first = t.token_ids[t.spans[0][0]: t.spans[0][1] + 1]
        if calls:  # the parser read the call the model sampled, and the run trains on those very tokens
            called += 1
            assert calls == [("lookup", out["tool_result"])] and finish == "tool_calls"
            assert first[:len(out["call_ids"])] == out["call_ids"] and t.terminal_reward == 1.0
    assert called >= 3 and out["seen"]["tool-1"][0] and out["seen"]["tool-3"][0]  # streamed calls too
