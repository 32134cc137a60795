"""Generated samples (moe_rl/samples.py): an episode's text by hand, the Markdown the trackers get, and
SampleLog's file and TensorBoard text with the tiny model's real tokenizer."""

import json

import pytest

from moe_rl.samples import SAMPLES_FILE, SampleLog, episode_record, markdown
from moe_rl.trajectory import Outcome, Trajectory


def episode(ids: list[int], spans: list[tuple[int, int]], prompt_len: int, reward: float = 1.0,
            group: int = 0, sample: int = 0, outcome: Outcome = Outcome.COMPLETED) -> Trajectory:
    mask = [any(b <= i <= e for b, e in spans) for i in range(len(ids))]
    return Trajectory(ids, mask, [0.0] * len(ids), spans, [], reward, outcome, len(ids), 0, prompt_len,
                      group_id=group, sample_index=sample)


def chars(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_an_episode_is_its_prompt_then_model_turns_and_what_came_between():
    text = "Hi?ab:xy:c!"  # prompt "Hi?", model "ab", observation ":xy:", model "c", then "!" after it
    t = episode([ord(c) for c in text], [(3, 4), (9, 9)], prompt_len=3, reward=0.5, group=2, sample=1,
                outcome=Outcome.TRUNCATED_TURNS)
    assert episode_record(t, chars) == {
        "group": 2, "sample": 1, "prompt": "Hi?",
        "turns": [{"role": "model", "text": "ab"}, {"role": "observation", "text": ":xy:"},
                  {"role": "model", "text": "c"}, {"role": "observation", "text": "!"}],
        "reward": 0.5, "success": True, "outcome": "truncated_turns"}
    # a first turn right after the prompt, nothing after the last: model turns only
    t = episode([ord(c) for c in "Q:ab"], [(2, 3)], prompt_len=2, reward=0.0)
    assert episode_record(t, chars)["turns"] == [{"role": "model", "text": "ab"}]
    assert episode_record(t, chars)["success"] is False


def test_the_markdown_shows_every_text_as_an_indented_block():
    rec = {"group": 0, "sample": 1, "prompt": "# not a heading\nline 2", "reward": 1.0, "success": True,
           "outcome": "completed", "turns": [{"role": "model", "text": "```"}, {"role": "observation",
                                                                                 "text": ""}]}
    md = markdown("eval", 30, [rec])
    assert md.startswith("**eval, step 30: episode 1 of 1** (prompt 0, sample 1): reward 1.000, success, "
                         "completed")
    assert "prompt:\n\n    # not a heading\n    line 2" in md
    assert "model:\n\n    ```" in md and md.endswith("observation:\n\n     ")  # an empty text: a blank block


class Texts:
    """A tracker that keeps its texts (Metrics.text's writers are asked for .text(tag, text, step))."""

    def __init__(self):
        self.texts = []

    def text(self, tag, text, step=0):
        self.texts.append((tag, text, step))


@pytest.mark.slow
def test_sample_log_writes_the_first_episodes_to_its_file_and_the_trackers(tiny_qwen, tmp_path):
    """The tiny model's tokenizer decodes what it encoded; the first episodes by prompt and sample, an
    episode split at a prefix break once; training samples every `every` steps; 0 episodes: nothing."""
    from transformers import AutoTokenizer

    from moe_rl.metrics import Metrics

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    prompt, reply, obs = (tok.encode(s) for s in ("Guess 1-9.", "5", " Higher."))

    def played(group: int, sample: int) -> Trajectory:
        ids = prompt + reply + obs + reply
        n, m = len(prompt), len(reply)
        return episode(ids, [(n, n + m - 1), (n + m + len(obs), len(ids) - 1)], n, group=group, sample=sample)

    episodes = [played(1, 0), played(0, 1), played(0, 0), played(0, 0), played(2, 0)]  # (0, 0) twice: a split
    metrics = Metrics(tmp_path / "tb", progress=False)
    log = SampleLog(tmp_path, str(tiny_qwen), 3, 5, metrics)
    log.write("eval", 0, episodes)
    assert [log.due(s) for s in (1, 5, 10)] == [False, True, True]
    log.write("train", 5, episodes[:1])
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [(r["kind"], r["step"], r["group"], r["sample"]) for r in lines] == [
        ("eval", 0, 0, 0), ("eval", 0, 0, 1), ("eval", 0, 1, 0), ("train", 5, 1, 0)]
    assert lines[0]["prompt"] == "Guess 1-9." and lines[0]["turns"] == [
        {"role": "model", "text": "5"}, {"role": "observation", "text": " Higher."},
        {"role": "model", "text": "5"}]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    (event,) = acc.Tensors("samples/eval/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 0 and "episode 3 of 3" in text and "    Guess 1-9." in text
    assert [e.step for e in acc.Tensors("samples/train/text_summary")] == [5]
    quiet = SampleLog(tmp_path / "none", str(tiny_qwen), 0, 5, Texts())
    quiet.write("eval", 0, episodes)
    assert not quiet.due(5) and quiet.metrics.texts == [] and not (tmp_path / "none").exists()
