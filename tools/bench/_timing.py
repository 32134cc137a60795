"""Shared timing helper for the benchmarks (run as scripts from tools/bench)."""

from __future__ import annotations

import statistics
import sys
import time


def median_time(fn, repeats: int, warmup: int = 0, label: str | None = None) -> float:
    """Median wall time of fn() over `repeats` calls, after `warmup` untimed calls; with `label`, each
    call's time goes to stderr as it ends ("label: warm-up 1.234 s", "label: 2/3 0.456 s")."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        if i >= warmup:
            times.append(seconds)
        if label:
            which = "warm-up" if i < warmup else f"{i - warmup + 1}/{repeats}"
            print(f"{label}: {which} {seconds:.3f} s", file=sys.stderr, flush=True)
    return statistics.median(times)


def timed(fn, times: list, *args):
    """Call fn(*args), append its wall time to `times`, return its result."""
    t0 = time.perf_counter()
    out = fn(*args)
    times.append(time.perf_counter() - t0)
    return out
