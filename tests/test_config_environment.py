"""Environment options and custom environments in the config: each environment's declared Options are the
schema of environment.options (unknown keys, types, ranges, keys another field sets), environment.name may
name a class by module or file path, and single_turn's reward function is checked where it is named."""

import pytest
from conftest import config_error as _err

from moe_rl.config import from_dict


@pytest.mark.parametrize("data, start", [
    ({"name": "guess_number", "options": {"hgh": 20}},
     "environment.options.hgh: unknown key (did you mean 'high'?); allowed: low, high"),
    ({"name": "guess_number", "options": {"low": "one"}},
     "environment.options.low: expected int, got 'one' (str)"),
    ({"name": "guess_number", "options": {"low": 1.5}}, "environment.options.low: expected int"),
    ({"name": "guess_number", "options": {"low": 5, "high": 3}},
     "environment.options: low=5 must be <= high=3"),
    # default low
    ({"name": "guess_number", "options": {"high": 0}}, "environment.options: low=1 must be <= high=0"),
    ({"name": "arithmetic", "options": {"max_operand": -1}},
     "environment.options: max_operand=-1 must be >= 0"),
    ({"name": "calculator", "options": {"low": 1}},
     "environment.options.low: unknown key; allowed: max_operand"),
    ({"name": "calculator", "options": {"tool_timeout_s": 3}},
     "environment.options.tool_timeout_s: set by environment.tool_timeout_s"),
    ({"name": "math", "dataset": "d.jsonl", "options": {"extract": "first"}},
     "environment.options.extract: 'first' is not allowed; choose one of boxed, boxed_or_last_number"),
    ({"name": "single_turn", "dataset": "d.jsonl"},
     "environment.reward_fn: the single_turn environment scores each answer"),
    ({"name": "single_turn", "dataset": "d.jsonl", "reward_fn": "os:no_such_fn"},
     "environment.reward_fn: 'os:no_such_fn': os has no no_such_fn"),
    ({"name": "single_turn", "dataset": "d.jsonl", "reward_fn": "os:getcwd"},
     "environment.reward_fn: 'os:getcwd' must take (row, response)"),
    ({"name": "guess_number", "reward_fn": "os:getcwd"},
     "environment.reward_fn: only the single_turn environment calls"),
    ({"name": "math"}, "environment.dataset: environment 'math' makes no prompts of its own"),
    ({"name": "no_such_pkg.envs:Task"},
     "environment.name: 'no_such_pkg.envs:Task': importing no_such_pkg.envs failed (ModuleNotFoundError"),
    ({"name": "os:path"}, "environment.name: 'os:path' is not an Environment subclass"),
    ({"name": "examples/nope.py:Task"}, "environment.name: 'examples/nope.py:Task': no file "),
])
def test_environment_options_are_checked_against_the_declaration(data, start):
    msg = _err(["trainer.warm_start_steps=0"], {"environment": data, "algorithm": {"advantage": "gae"}})
    assert msg.startswith(start), msg


def test_environment_option_declarations(monkeypatch):
    import dataclasses
    from dataclasses import dataclass

    from moe_rl.rollout.envs import _ENVS, Environment, build_options, get_env

    guess, calc = get_env("guess_number"), get_env("calculator")
    assert guess.has_expert() and get_env("arithmetic").has_expert() and calc.has_expert()
    assert guess(guess.Options(low=3)).options.low == 3 and guess().options.high == 9
    assert [p["high"]
            for p in guess.generate_prompts(2, seed=0, options=build_options(guess, {"high": 2}))] == [2, 2]
    cfg = from_dict({"environment": {"options": {"low": 2, "high": 2}}}, cuda_available=False)
    assert cfg.environment.options == {"low": 2, "high": 2}

    class Mine(Environment):  # no Options of its own: it takes none; no scripted expert
        @classmethod
        def generate_prompts(cls, n, seed, options):
            return [{}] * n

    monkeypatch.setitem(_ENVS, "mine", Mine)
    assert not Mine.has_expert()
    assert _err(["trainer.warm_start_steps=0"],
                {"environment": {"name": "mine", "options": {"x": 1}}}).startswith(
        "environment.options.x: unknown key; allowed: ")
    assert "trainer.warm_start_steps" in _err([], {"environment": {"name": "mine"},
                                                   "trainer": {"warm_start_steps": 1}})

    class Typed(Mine):
        @dataclass(frozen=True)
        class Options:
            names: list[int] = dataclasses.field(default_factory=list)
            scale: float = 1.0

    monkeypatch.setitem(_ENVS, "typed", Typed)
    cfg = from_dict({"environment": {"name": "typed", "options": {"names": [1, 2], "scale": 2}}},
                    ["trainer.warm_start_steps=0"], cuda_available=False)
    assert build_options(Typed, cfg.environment.options) == Typed.Options(names=[1, 2], scale=2.0)
    assert _err(["trainer.warm_start_steps=0"],
                {"environment": {"name": "typed", "options": {"names": [1, "b"]}}}) \
        == "environment.options.names[1]: expected int, got 'b' (str)"
