"""On-policy distillation in the RL loop (through the CLI's main, on a local Ray kept for the module):
teachers of other shapes score the student's own tokens as transformers does, each row by its own
teacher; and the bad inputs a user can give are one line before Ray and vLLM start."""

import dataclasses
import functools
import json

import pytest
import torch
from cli_runs import run_train
from conftest import ROOT

from moe_rl.config import load_config

pytestmark = pytest.mark.slow

STUDENT_ONLY = ["algorithm.advantage=none", "algorithm.distill_coef=1", "critic.lr=1e-5",
                "critic.value_clip=0.2"]


def teachers(tmp_path):
    """Two tiny teachers with the quickstart's tokenizer and shapes of their own: 'big' (hidden 96,
    8 experts) and 'small' (1 layer, 8 experts), each with its logits scaled up (its LM head times 10):
    a random model is nearly uniform, these have preferences of their own (which a student's update can be
    seen to follow)."""
    from safetensors.torch import load_file, save_file

    from moe_rl.tiny import build_tiny_checkpoint

    tiny = load_config(ROOT / "configs" / "quickstart.yaml").model.tiny
    big = build_tiny_checkpoint(tmp_path / "big", dataclasses.replace(tiny, hidden_size=96, num_experts=8),
                                seed=8)
    small = build_tiny_checkpoint(tmp_path / "small", dataclasses.replace(tiny, num_layers=1, num_experts=8),
                                  seed=7)
    for path in (big, small):
        weights = load_file(path / "model.safetensors")
        weights["lm_head.weight"] *= 10
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return big, small


@functools.cache
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def hf_logprobs(path, token_ids: list[int]) -> torch.Tensor:
    """log p(x_t | x_<t) of each token under the transformers model at `path` (0 at t = 0), fp32."""
    from moe_rl.train.hf_parity import model_token_logprobs

    return model_token_logprobs(hf_model(path), torch.tensor([token_ids]))[0]


def test_each_rows_teacher_scores_the_students_tokens_as_transformers_does(tmp_path):
    """Rows alternate between the default teacher (teacher.path: 'big') and a named one (their `teacher`
    field: 'small'); the student in DP2 x EP2, the teachers in a layout of their own, TP2. The
    asynchronous step-1 checkpoint keeps the rollout step 1 trains on: its per-token reverse-KL figures
    (mean and p95 of log mu - log pi_teacher over the model tokens) equal those of each row's teacher
    run by transformers on the same tokens (fp32, <= 1e-5), and the teachers' memory and time are
    reported. And the update moves the student towards each row's own teacher: step 1's update changes
    the log-probs of the tokens it trained on along that teacher's signal, not along the other's."""
    from moe_rl.driver.run_checkpoints import read_in_flight

    big, small = teachers(tmp_path)
    rows = tmp_path / "rows.jsonl"
    named = [{"teacher": "small"} if i % 2 else {} for i in range(16)]
    rows.write_text("".join(json.dumps({"secret": 1 + i % 9, **n}) + "\n" for i, n in enumerate(named)))
    out = tmp_path / "run"
    run_train(out, *STUDENT_ONLY, f"environment.dataset={rows}", f"teacher.path={big}",
              f"teacher.named={{small: {small}}}", "rollout.async_mode=true", "run.steps=2",
              "parallel.ep=2", "parallel.world_size=2", "teacher.tp=2", "teacher.ep=1",
              "checkpoint.export_hf_every=1")
    hist = torch.load(out / "history.pt", weights_only=False)
    kept = [t for ts, _ in read_in_flight(out / "checkpoints" / "step_000001")[0].results for t in ts]
    assert {t.info.get("teacher") for t in kept} == {None, "small"}
    # per model token: k of its row's teacher, k of the other teacher, and its log-prob under the policy
    # before and after step 1's update (the checkpoints of steps 1 and 2, exported in HF format)
    before, after = (out / "hf" / f"step_{s:06d}" for s in (1, 2))
    k, k_other, moved = [], [], []
    for t in kept:
        own, other = (small, big) if t.info.get("teacher") == "small" else (big, small)
        mask, mu = torch.tensor(t.response_mask), torch.tensor(t.logprobs)
        k.append((mu - hf_logprobs(own, t.token_ids))[mask])
        k_other.append((mu - hf_logprobs(other, t.token_ids))[mask])
        moved.append((hf_logprobs(after, t.token_ids) - hf_logprobs(before, t.token_ids))[mask])
    k, k_other, moved = (torch.cat(x).double() for x in (k, k_other, moved))
    figures = hist[1]
    assert figures["distill/reverse_kl_mean"] == pytest.approx(float(k.mean()), abs=1e-5)
    assert figures["distill/reverse_kl_p95"] == pytest.approx(float(torch.quantile(k, 0.95)), abs=1e-5)
    assert float(k.abs().max()) > 0.1  # teachers of other weights: the estimate is not ~0 by accident
    for slot in ("teacher", "teacher_small"):
        assert 0.05 < figures[f"memory/{slot}_rss_gib_max"] < 20
    assert figures["timing/teacher_score_s"] > 0
    # no task reward: the policy moved by the teachers' signal alone, -k of each row's teacher (whitened:
    # an affine map, which a correlation ignores). Measured: 0.74 along the row's own teacher's, 0.02 along
    # the other's (the teachers' preferences are their own); with the teacher left out of the signal
    # (-log mu alone) 0.03 and 0.1
    def along(signal):
        return float(torch.corrcoef(torch.stack([moved, signal]))[0, 1])

    assert all(h["policy/grad_norm"] > 0 for h in hist)
    assert along(-k) > 0.5 and along(-k_other) < along(-k) - 0.3, (along(-k), along(-k_other))


@pytest.mark.parametrize("case, extra, message", [
    ("another tokenizer", [], "teacher.path: '{other}' has another tokenizer than the policy's"),
    ("not a checkpoint", [], "teacher.path: '{tmp}/nowhere' does not exist"),
    ("a row without its teacher", ["teacher.named={{small: {small}}}"],
     "teacher.named: row 2 of {tmp}/rows.jsonl names teacher 'tiny', which is not configured"),
])
def test_bad_teachers_are_one_line_before_anything_starts(tmp_path, case, extra, message):
    from moe_rl.tiny import build_tiny_checkpoint

    tiny = load_config(ROOT / "configs" / "quickstart.yaml").model.tiny
    small = build_tiny_checkpoint(tmp_path / "small", dataclasses.replace(tiny, num_layers=1), seed=7)
    other = tmp_path / "other"
    if case == "another tokenizer":
        build_tiny_checkpoint(other, tiny, seed=7)
        vocab = json.loads((other / "config.json").read_text())
        vocab["vocab_size"] += 64
        (other / "config.json").write_text(json.dumps(vocab))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (other / name).unlink(missing_ok=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"secret": 3}\n{"secret": 4' + (', "teacher": "tiny"' if "row" in case else "") + '}\n')
    path = {"another tokenizer": other, "not a checkpoint": tmp_path / "nowhere"}.get(case, small)
    fmt = dict(tmp=tmp_path, other=other, small=small)
    proc = run_train(tmp_path / "run", *STUDENT_ONLY, f"environment.dataset={rows}", f"teacher.path={path}",
                     *(e.format(**fmt) for e in extra), expect=2)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert any(message.format(**fmt) in ln for ln in lines), lines[-5:]
    assert not any("Traceback" in ln for ln in lines)
    assert not any("starting Ray" in ln or "vLLM" in ln for ln in lines), lines
