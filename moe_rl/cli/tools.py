"""`moe-rl bench` and `moe-rl convert`: the commands that run the repository's benchmarks (tools/bench/, a
checkout's: not installed with the package) and convert checkpoints."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from moe_rl.cli.errors import UserError, positive
from moe_rl.config import ConfigError

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"  # a checkout's (installed: none)


def _benches() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def _cmd_bench(args) -> int:
    names = _benches()
    if not names:  # an installed package: the benchmarks are the repository's, not the package's
        raise UserError(f"no benchmarks at {BENCH_DIR}: they are the repository's tools/bench/, not "
                        "installed with the package; run moe-rl bench from a checkout (git clone, then make "
                        "setup)")
    if args.name not in names:
        raise UserError(f"unknown benchmark '{args.name}'; available: {', '.join(names) or 'none'}")
    return subprocess.call([sys.executable, str(BENCH_DIR / f"{args.name}.py"), *args.bench_args])


def _cmd_convert(args) -> int:
    from moe_rl.driver.specs import convert_spec
    from moe_rl.train import convert
    from moe_rl.train.parallel import Layout
    from moe_rl.weights.hf import CheckpointError

    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    try:
        layout.check(convert.ranks_for(layout))
        _check_convert_layout(args, layout)
        print(f"converting {args.src} -> {args.out} with tp {args.tp} pp {args.pp} ep {args.ep} "
              f"({convert.ranks_for(layout)} rank(s))", file=sys.stderr)
        if args.direction == "hf-to-mcore":
            done = convert.hf_to_mcore(convert_spec(), args.src, args.out, layout, dtype=args.dtype,
                                       role="critic" if args.critic else "policy",
                                       value_head_from=args.value_head_from)
        else:
            done = convert.mcore_to_hf(convert_spec(), args.src, args.out, hf_config=args.hf_config,
                                       layout=layout, merge=args.merge)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        raise UserError(str(err)) from None
    print(convert.describe(done))
    return 0


def _check_convert_layout(args, layout) -> None:
    """The layout against the model's HF config, before any rank starts: one line naming the flag."""
    import json

    from moe_rl.config.rules import check_layout_fits_hf_config

    hf = Path(args.src) if args.direction == "hf-to-mcore" \
        else Path(args.hf_config or Path(args.src) / "hf_config")
    try:
        check_layout_fits_hf_config(layout, json.loads((hf / "config.json").read_text()))
    except ConfigError as err:
        raise UserError(f"--{err.path.removeprefix('parallel.')} {str(err).split(': ', 1)[1]}") from None
    except (OSError, ValueError):
        return  # the conversion itself names a missing or unreadable config


def add_tool_commands(sub, fmt: dict) -> None:
    """bench and convert."""
    b = sub.add_parser("bench", **fmt,
                       help="run a benchmark from tools/bench (prints ratios and a JSON line)",
                       description=f"Run tools/bench/NAME.py (a checkout's). Available: "
                       f"{', '.join(_benches()) or 'none'}.")
    b.add_argument("name", help="benchmark name")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(fn=_cmd_bench)

    v = sub.add_parser("convert", **fmt, help="convert checkpoints between Hugging Face and Megatron formats",
                       description="Hugging Face safetensors <-> Megatron dist checkpoints (policy or "
                       "critic). The layout (--tp/--pp/--ep) splits the work over local ranks; the dist "
                       "checkpoint itself loads into any layout. mcore-to-hf also exports trained RL "
                       "checkpoints (runs/NAME/checkpoints/step_N/policy or .../critic).",
                       epilog="e.g. moe-rl convert hf-to-mcore models/base ckpt/base --tp 2 --ep 2;  "
                       "moe-rl convert mcore-to-hf runs/quickstart/checkpoints/step_000300/policy export/hf")
    v.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"],
                   help="hf-to-mcore: a Hugging Face model to a Megatron dist checkpoint; mcore-to-hf: back")
    v.add_argument("src", help="HF model directory (hf-to-mcore) or Megatron dist checkpoint (mcore-to-hf)")
    v.add_argument("out", help="output directory (must be new or empty)")
    for flag in ("tp", "pp", "ep"):
        v.add_argument(f"--{flag}", type=positive, default=1,
                       help=f"{flag.upper()} size of the ranks that convert")
    v.add_argument("--etp", type=positive, default=None, help="expert tensor parallel size (default: tp)")
    v.add_argument("--critic", action="store_true",
                   help="hf-to-mcore: build the critic (value head from score.weight if present)")
    v.add_argument("--value-head-from",
                   help="hf-to-mcore --critic: reward-model checkpoint holding the value head")
    v.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="hf-to-mcore: storage dtype (default: the checkpoint's)")
    v.add_argument("--hf-config",
                   help="mcore-to-hf: base model directory (default: the checkpoint's hf_config/)")
    v.add_argument("--merge", action="store_true",
                   help="mcore-to-hf of a LoRA policy checkpoint (model.lora): write the merged model "
                   "W + (alpha/r) B A instead of the PEFT adapter (adapter_config.json, "
                   "adapter_model.safetensors) it writes by default")
    v.set_defaults(fn=_cmd_convert)
