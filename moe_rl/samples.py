"""Generated samples: a few episodes as the policy played them, at each held-out evaluation and every
logging.samples_every training steps (logging.samples episodes each time; 0: none).

Each episode is its prompt, its turns in order (the model's text, and what came between two of its turns:
the environment's observations, tool results and the chat template's markers, all marked as such), its
reward, whether it succeeded and how it ended. They go to run.output_dir/samples.jsonl, a line an episode
({"step", "kind": "eval" | "train", "group", "sample", "prompt", "turns": [{"role": "model" |
"observation", "text"}], "reward", "success", "outcome"}), and to every tracker as one text a time
(samples/eval, samples/train: Markdown, each text an indented block). The episodes are the first ones by
prompt and sample: at every evaluation the same held-out prompts, so the steps compare.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_rl.trajectory import Trajectory, trajectory_success

SAMPLES_FILE = "samples.jsonl"


def episode_record(t: Trajectory, decode) -> dict:
    """One episode as text: `decode(token_ids) -> str` (the tokenizer's, special tokens kept: what the
    model saw). Model turns are the trajectory's spans; the tokens between them, and after the last, are
    observations."""
    turns, at = [], t.prompt_len
    for begin, end in t.spans:
        if begin > at:
            turns.append({"role": "observation", "text": decode(t.token_ids[at:begin])})
        turns.append({"role": "model", "text": decode(t.token_ids[begin:end + 1])})
        at = end + 1
    if at < len(t.token_ids):
        turns.append({"role": "observation", "text": decode(t.token_ids[at:])})
    return {"group": t.group_id, "sample": t.sample_index, "prompt": decode(t.token_ids[:t.prompt_len]),
            "turns": turns, "reward": t.total_reward, "success": trajectory_success(t),
            "outcome": t.outcome.value}


def markdown(kind: str, step: int, records: list[dict]) -> str:
    """The records as one Markdown text: a heading line per episode, then its prompt and turns, each an
    indented block (whatever the text holds, it shows as written)."""

    def block(text: str) -> str:
        return "\n".join("    " + line for line in (text or " ").split("\n"))

    parts = []
    for i, r in enumerate(records, 1):
        success = "success" if r["success"] else "no success"
        parts.append(f"**{kind}, step {step}: episode {i} of {len(records)}** (prompt {r['group']}, sample "
                     f"{r['sample']}): reward {r['reward']:.3f}, {success}, {r['outcome']}\n\n"
                     f"prompt:\n\n{block(r['prompt'])}")
        parts += [f"{turn['role']}:\n\n{block(turn['text'])}" for turn in r["turns"]]
    return "\n\n".join(parts)


class SampleLog:
    """Writes the samples of a run (the module's docstring): `episodes` a time, training samples every
    `every` steps (0: at evaluations only), to `out`/samples.jsonl and `metrics`' trackers (its `text`).
    The tokenizer of `model_path` is loaded on first use."""

    def __init__(self, out: Path, model_path: str, episodes: int, every: int, metrics):
        self.path, self.model_path, self.metrics = out / SAMPLES_FILE, model_path, metrics
        self.episodes, self.every, self._tok = episodes, every, None

    def due(self, step: int) -> bool:
        """Training samples of the rollout logged as step `step` (its figures' step)."""
        return bool(self.episodes and self.every) and step % self.every == 0

    def write(self, kind: str, step: int, trajectories: list[Trajectory]) -> None:
        if not self.episodes or not trajectories:
            return
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_path)
        first: dict[tuple[int, int], Trajectory] = {}
        for t in sorted(trajectories, key=lambda t: (t.group_id, t.sample_index)):
            first.setdefault((t.group_id, t.sample_index), t)  # an episode split at prefix breaks: its first
        chosen = list(first.values())[:self.episodes]
        records = [episode_record(t, self._tok.decode) for t in chosen]
        with open(self.path, "a") as f:
            for r in records:
                f.write(json.dumps({"step": step, "kind": kind, **r}) + "\n")
        self.metrics.text(f"samples/{kind}", markdown(kind, step, records), step)
