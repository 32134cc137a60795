"""The math environment on hand-written responses: answer extraction (the last \\boxed{}, else the last
number), symbolic equivalence through math-verify (not string match), format and correctness rewards,
malformed and adversarial answers, and its rows checked at load."""

import asyncio
import re

import pytest

from moe_rl.rollout.envs import build_options, get_env
from moe_rl.rollout.envs.math_answer import extract_answer, last_boxed

MathEnv = get_env("math")


def score(response: str, answer: str, **options):
    env = MathEnv(build_options(MathEnv, {"format_reward": 0.1, **options}))

    async def episode():
        await env.reset({"prompt": "q", "answer": answer})
        return await env.step(response)

    r = asyncio.run(episode())
    assert r.done and r.observation is None
    return r.final_reward, r.info


@pytest.mark.parametrize("response, answer, reward", [
    ("So the total is \\boxed{12}.", "12", 1.1),  # right, boxed: correctness + format
    ("The answer is 12.", "12", 1.0),  # right, the last number (not boxed: no format reward)
    ("\\boxed{13}", "12", 0.1),  # wrong but boxed
    ("First 3, then 4, so 7", "7", 1.0),  # the last number, not the first
    ("I think 7 or maybe 8", "7", 0.0),  # the last number is 8
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.1),  # equivalent forms
    ("\\boxed{0.5}", "1/2", 1.1),
    ("\\boxed{12.0}", "12", 1.1),
    ("\\boxed{x = 3}", "3", 1.1),
    ("\\boxed{2^{3}}", "8", 1.1),
    ("\\boxed{1,000}", "1000", 1.1),
    ("so it is 1,000", "1000", 1.0),  # thousands separators in a bare number
    ("\\boxed{\\sqrt{4}}", "2", 1.1),
    ("\\boxed{-5}", "5", 0.1),  # sign matters
    ("\\boxed{5} wait no \\boxed{6}", "6", 1.1),  # the last box counts
    ("no number here", "3", 0.0),  # malformed: nothing to extract
    ("\\boxed{", "3", 0.0),  # an unclosed box is not an answer (and no number)
    ("\\boxed{{2}+{2}}", "4", 1.1),  # nested braces balanced
    ("", "3", 0.0),
])
def test_hand_written_responses(response, answer, reward):
    got, info = score(response, answer)
    assert got == pytest.approx(reward), (response, info)
    assert info["success"] == info["correct"] == float(reward >= 1.0)


def test_extraction_modes_and_limits():
    assert last_boxed("a \\boxed{1} b \\fbox{2}") == "2" and last_boxed("none") is None
    assert extract_answer("it is 42", "boxed") == (None, False)  # boxed only: a bare number does not count
    assert score("it is 42", "42", extract="boxed")[0] == 0.0
    assert extract_answer("3/4 of it", "boxed_or_last_number") == ("3/4", False)
    long_answer = "\\boxed{" + "1+" * 200 + "1}"
    assert score(long_answer, "201")[0] == pytest.approx(0.1)  # too long to parse: wrong, still boxed
    # adversarial: the check is bounded
    reward, info = score("\\boxed{9^{9^{9^{9}}}}", "1", verify_timeout_s=1.0)
    assert reward == pytest.approx(0.1) and info["correct"] == 0.0
    assert score("\\boxed{4}", "4")[0] == pytest.approx(1.1)  # and the next answer is checked as usual


def test_rows_are_checked_for_prompt_and_answer(tmp_path):
    import json

    from moe_rl.rollout.data import DatasetError, load_prompts

    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 2+2?", "answer": 4}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"}) + "\n")
    assert len(load_prompts(rows, MathEnv.required_fields, MathEnv.check_row)) == 2
    for row, message in (({"prompt": "q"}, "p.jsonl:1: missing field(s) answer"),
                         ({"prompt": "q", "answer": ""},
                          "p.jsonl:1: answer must be a non-empty string or a number"),
                         ({"prompt": [{"role": "robot", "content": "x"}], "answer": "1"},
                          "p.jsonl:1: prompt[0].role is 'robot'"),
                         ({"prompt": 3, "answer": "1"},
                          "p.jsonl:1: prompt must be a string or a non-empty list")):
        rows.write_text(json.dumps(row) + "\n")
        with pytest.raises(DatasetError, match=re.escape(message)):
            load_prompts(rows, MathEnv.required_fields, MathEnv.check_row)


def test_a_dataset_with_its_own_field_names(tmp_path):
    """environment.dataset_fields: rows of `problem` and `answer` (as published math sets have them) read
    as the environment's `prompt`; the production loader (dataset_rows) with the run's config, and the
    config's rules for the setting."""
    import json

    from moe_rl.config import ConfigError, from_dict
    from moe_rl.driver.prompts import dataset_rows
    from moe_rl.rollout.data import DatasetError

    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"problem": "What is 2+2?", "answer": 4, "solution": "2+2=4"}) + "\n")
    math = ["environment.name=math", f"environment.dataset={rows}", "environment.token_budget=64",
            "rollout.max_new_tokens=32", "trainer.warm_start_steps=0", "trainer.warm_start_lr=1e-3",
            "trainer.eval_prompts=0", "trainer.eval_every=0"]
    cfg = from_dict({}, [*math, "environment.dataset_fields={prompt: problem}"], cuda_available=False)
    assert dataset_rows(cfg, str(rows)) == [{"prompt": "What is 2+2?", "answer": 4, "solution": "2+2=4"}]
    with pytest.raises(DatasetError, match=re.escape(
            "p.jsonl:1: missing field(s) prompt (the environment reads prompt, answer; the row has problem, "
            "answer, solution)")):
        dataset_rows(from_dict({}, math, cuda_available=False), str(rows))
    with pytest.raises(DatasetError, match=re.escape(
            "missing field(s) question (the environment reads prompt, answer; environment.dataset_fields: "
            "prompt as question; the row has problem, answer, solution)")):
        dataset_rows(from_dict({}, [*math, "environment.dataset_fields={prompt: question}"],
                               cuda_available=False), str(rows))
    with pytest.raises(ConfigError, match=re.escape(
            "environment.dataset_fields.question: environment 'math' reads no field 'question' from its "
            "rows; it reads prompt, answer")):
        from_dict({}, [*math, "environment.dataset_fields={question: problem}"], cuda_available=False)
    with pytest.raises(ConfigError, match="environment.dataset_fields: .* has no effect in this run: only a "
                                          "dataset"):
        from_dict({}, ["environment.dataset_fields={secret: number}"], cuda_available=False)


def test_a_check_that_times_out_does_not_take_the_others_with_it():
    """Episodes check their answers concurrently on shared helper processes: one adversarial answer
    runs out of time (its process is killed), and every other answer, queued beside it, is still
    checked right."""
    env_opts = build_options(MathEnv, {"verify_timeout_s": 1.0})

    async def one(response, answer):
        env = MathEnv(env_opts)
        await env.reset({"prompt": "q", "answer": answer})
        return (await env.step(response)).info["correct"]

    async def many():
        return await asyncio.gather(one("\\boxed{9^{9^{9^{9}}}}", "1"),
                                    *[one(f"\\boxed{{{k}}}", str(k)) for k in range(6)],
                                    *[one(f"\\boxed{{{k + 1}}}", str(k)) for k in range(3)])

    assert asyncio.run(many()) == [0.0] + [1.0] * 6 + [0.0] * 3


def test_without_math_verify_the_config_is_refused_at_load(monkeypatch):
    import sys

    from moe_rl.schema import ConfigError

    # what find_spec reports for a package not installed
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError,
                       match=r"math-verify, which is not installed: pip install 'moe-rl\[math\]'"):
        build_options(MathEnv, {})
