import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_rl.config import TinyModel
from moe_rl.tiny import VOCAB_SIZE, build_tiny_checkpoint


def test_tokenizer_round_trips_and_has_chat_template(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    text = "Guess a number 1-9. Lower! ünïcode ok"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(chat)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and max(ids) < VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>"


def test_both_architectures_build_and_run(tiny_qwen, tiny_mixtral):
    for path, model_type in ((tiny_qwen, "qwen3_moe"), (tiny_mixtral, "mixtral")):
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["model_type"] == model_type and cfg["head_dim"] == 32
        assert (path / "model.safetensors").is_file()
        model = AutoModelForCausalLM.from_pretrained(path)
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
        assert logits.shape == (1, 4, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_same_spec_and_seed_reuse_the_checkpoint(tmp_path):
    spec = TinyModel(num_layers=1)
    p = build_tiny_checkpoint(tmp_path, spec, seed=3)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    build_tiny_checkpoint(tmp_path, spec, seed=3)
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    build_tiny_checkpoint(tmp_path, spec, seed=4)
    assert (p / "model.safetensors").stat().st_mtime_ns != mtime
