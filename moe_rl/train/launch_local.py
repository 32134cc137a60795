"""Run a function on N local gloo ranks (subprocesses), for tests, benchmarks and tools.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Each rank is a fresh `spawn` process with RANK/WORLD_SIZE/MASTER_* set and OMP_NUM_THREADS=1.
Results come back as plain pickles (tensors are converted with .tolist()-free torch.save bytes).
"""

from __future__ import annotations

import io
import os
import traceback

import torch
import torch.multiprocessing as mp

from moe_rl.train import parallel


def _entry(rank, world_size, port, fn, args, queue, dist_env=True):
    os.environ["OMP_NUM_THREADS"] = "1"
    if dist_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report, then let the parent raise
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            parallel.shutdown()
        except Exception:
            pass


def run_in_process(fn, args: tuple = (), timeout: float = 600.0):
    """Run fn(0, 1, *args) in one fresh process without torch.distributed environment (e.g. vLLM)."""
    return run_ranks(fn, 1, args, timeout, dist_env=False)[0]


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 600.0, dist_env: bool = True) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = parallel.free_port("127.0.0.1")
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, dist_env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in procs:
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
