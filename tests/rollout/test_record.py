"""The token record every episode is built in (rollout/record.py: the agent loop's and the gateway's),
on an example worked by hand with the engine's real result type."""

from moe_rl.rollout.engine import GenerationResult
from moe_rl.rollout.record import TokenRecord

EOS = 9


def result(tokens, version, versions=None):
    return GenerationResult("r", [], tokens, [-0.5] * len(tokens), "stop", version, versions=versions)


def test_turns_and_observations_by_hand():
    rec = TokenRecord.of_prompt([1, 2, 3])
    assert rec.add_turn(result([7, EOS], 2), EOS) and rec.closed  # ended with the end-of-turn token
    rec.observe([4, 5])
    # a turn whose request started on version 2 and whose last token was sampled after a sync to 3
    assert rec.add_turn(result([8], 2, versions=[3]), EOS) and not rec.closed
    rec.observe([6])  # a last observation no turn read
    assert rec.ids == [1, 2, 3, 7, EOS, 4, 5, 8, 6] and rec.prompt_len == 3
    assert rec.mask == [False] * 3 + [True] * 2 + [False] * 2 + [True, False]
    assert rec.logps == [0.0] * 3 + [-0.5] * 2 + [0.0] * 2 + [-0.5, 0.0]
    assert rec.spans == [(3, 4), (7, 7)]
    # the prompt by the turn that read it (2), the observation by the next turn (2), its token by 3;
    # the last observation takes the last computed position's
    assert rec.versions == [2, 2, 2, 2, 2, 2, 2, 3] and rec.all_versions(0) == [2, 2, 2, 2, 2, 2, 2, 3, 3]
    # the engine sampled nothing: no span, nothing the model's
    assert not rec.add_turn(result([], 4), EOS)
    assert rec.spans == [(3, 4), (7, 7)] and rec.mask.count(True) == 3
    assert TokenRecord.of_prompt([1]).all_versions(5) == [5]  # nothing computed: the default
