"""Compare two runs step by step: how many of their logged figures are equal at every step.

    .venv/bin/python tools/compare_runs.py RUN_A RUN_B [--exclude PREFIX ...] [--rtol R]

RUN_A and RUN_B are run output directories (run.output_dir) or their history.pt files: the list of
per-step dicts of scalar figures the driver writes at the end of a run. Figures whose name starts
with an excluded prefix are left out: by default timing/, memory/ and perf/ (wall-clock times, process
memory, and the throughputs computed from times), which differ between any two runs. The rest are
compared step by step, as floats: equal means equal (NaN equals NaN), or, with --rtol R, within R of
each other relative to the larger magnitude.

Prints each figure that differs (the first step where it does and the largest difference), the
figures only one run has, then a summary line and, last, one JSON line:
{"compared": N, "equal_every_step": K, "differ": [...], "steps": S, ...}. Exit code 0 whether or not the
runs are equal (the figures say it); 2 for a missing file or runs of different lengths without
--common-steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_EXCLUDE = ("timing/", "memory/", "perf/")


def load_history(path: str) -> list[dict[str, float]]:
    import torch

    p = Path(path)
    if p.is_dir():
        p = p / "history.pt"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no history.pt (a run writes it to run.output_dir when it ends)")
    return torch.load(p, weights_only=False)


def same(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if a == b:
        return True
    return rtol > 0 and abs(a - b) <= rtol * max(abs(a), abs(b))


def compare(hist_a: list[dict], hist_b: list[dict], exclude: tuple[str, ...], rtol: float = 0.0) -> dict:
    """Per figure (not excluded, logged by both runs at some step): equal at every step where either
    logs it, or the first step (1-based) where it differs and the largest absolute difference."""
    steps = min(len(hist_a), len(hist_b))
    keys_a = {k for h in hist_a[:steps] for k in h if not k.startswith(exclude)}
    keys_b = {k for h in hist_b[:steps] for k in h if not k.startswith(exclude)}
    differ: dict[str, dict] = {}
    for key in sorted(keys_a & keys_b):
        first, largest = None, 0.0
        for i, (ha, hb) in enumerate(zip(hist_a[:steps], hist_b[:steps], strict=True)):
            a, b = ha.get(key), hb.get(key)
            if a is None and b is None:  # a figure of some steps only (e.g. the routing diagnostics)
                continue
            if a is None or b is None or not same(float(a), float(b), rtol):
                first = i + 1 if first is None else first
                if a is not None and b is not None and not (math.isnan(a) or math.isnan(b)):
                    largest = max(largest, abs(float(a) - float(b)))
                else:
                    largest = math.inf
        if first is not None:
            differ[key] = {"first_step": first, "max_abs_diff": largest}
    compared = len(keys_a & keys_b)
    return {"steps": steps, "compared": compared, "equal_every_step": compared - len(differ),
            "differ": differ, "only_a": sorted(keys_a - keys_b), "only_b": sorted(keys_b - keys_a)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_a", help="a run's output directory or its history.pt")
    ap.add_argument("run_b", help="the other run's output directory or its history.pt")
    ap.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE),
                    help="figure-name prefixes left out (default: %(default)s)")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exactly equal)")
    ap.add_argument("--common-steps", action="store_true",
                    help="compare the steps both runs have when their lengths differ (default: refuse)")
    args = ap.parse_args(argv)
    try:
        hist_a, hist_b = load_history(args.run_a), load_history(args.run_b)
    except FileNotFoundError as err:
        print(f"compare_runs: {err}", file=sys.stderr)
        return 2
    if len(hist_a) != len(hist_b) and not args.common_steps:
        print(f"compare_runs: the runs have {len(hist_a)} and {len(hist_b)} steps (--common-steps compares "
              f"the first {min(len(hist_a), len(hist_b))})", file=sys.stderr)
        return 2
    res = compare(hist_a, hist_b, tuple(args.exclude), args.rtol)
    for key, d in res["differ"].items():
        print(f"differs: {key}  first at step {d['first_step']}, largest difference {d['max_abs_diff']:.3g}")
    for side in ("only_a", "only_b"):
        for key in res[side]:
            print(f"only in run {side[-1].upper()}: {key}")
    equal = "exactly" if args.rtol == 0 else f"within rtol {args.rtol:g}"
    print(f"{res['equal_every_step']} of {res['compared']} figures (excluding "
          f"{', '.join(args.exclude) or 'none'}) equal {equal} at every one of the {res['steps']} steps; "
          f"{len(res['differ'])} differ")
    print(json.dumps({"compare_runs": [str(args.run_a), str(args.run_b)], "steps": res["steps"],
                      "excluded_prefixes": list(args.exclude), "rtol": args.rtol, "compared": res["compared"],
                      "equal_every_step": res["equal_every_step"], "differ": sorted(res["differ"]),
                      "only_a": res["only_a"], "only_b": res["only_b"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
