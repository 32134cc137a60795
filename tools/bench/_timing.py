"""Shared timing helper for the benchmarks (run as scripts from tools/bench)."""

from __future__ import annotations

import statistics
import time


def median_time(fn, repeats: int, warmup: int = 0) -> float:
    """Median wall time of fn() over `repeats` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed(fn, times: list, *args):
    """Call fn(*args), append its wall time to `times`, return its result."""
    t0 = time.perf_counter()
    out = fn(*args)
    times.append(time.perf_counter() - t0)
    return out
