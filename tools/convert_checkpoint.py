#!/usr/bin/env python
"""Hugging Face <-> Megatron checkpoint conversion; the same as `moe-rl convert`.

    python tools/convert_checkpoint.py hf-to-mcore models/base ckpt/base --tp 2 --ep 2
    python tools/convert_checkpoint.py mcore-to-hf runs/quickstart/checkpoints/step_000300/policy export/hf

See `moe-rl convert --help` and moe_rl/train/convert.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
