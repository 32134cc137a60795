"""A random checkpoint like a tiny one with some config.json fields changed: for diagnoses that swap one
architectural choice (e.g. as a critic, `critic.init_from=OUT`, which needs no engine).

    .venv/bin/python tools/tiny_variant.py RUN_DIR/base_model OUT '{"qk_nope_head_dim": 64}'

The weights are drawn as `moe-rl tiny` draws them (transformers' initialisation after torch.manual_seed(SEED),
an expert bias of 0.2 x N(0, 1) where the architecture has one), so a variant differs from the checkpoint it
copies only where the changed fields reach; the tokenizer files are copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from moe_rl.tiny import draw_expert_bias


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", type=Path, help="a tiny checkpoint (its config.json and tokenizer)")
    p.add_argument("out", type=Path)
    p.add_argument("changes", type=json.loads, help='config.json fields to change, as JSON')
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.base.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, args.out / f.name)
    cfg = AutoConfig.from_pretrained(args.base)
    for key, value in args.changes.items():
        setattr(cfg, key, value)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draw_expert_bias(model)
    model.save_pretrained(str(args.out), safe_serialization=True)
    print(f"{args.out}: {args.changes}")


if __name__ == "__main__":
    main()
