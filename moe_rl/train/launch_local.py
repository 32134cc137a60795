"""Run a function on N local gloo ranks (subprocesses), for tests, benchmarks and tools.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Each rank is a new process (forked from a server that imported torch and megatron-core once; see
`_context`) with the caller's environment, RANK/WORLD_SIZE/MASTER_* set and OMP_NUM_THREADS=1.
Results come back as plain pickles (tensors are converted with .tolist()-free torch.save bytes).
"""

from __future__ import annotations

import io
import os
import traceback

import torch
import torch.multiprocessing as mp

from moe_rl.train import parallel


def _entry(rank, world_size, port, fn, args, queue, dist_env, environ):
    os.environ.clear()
    os.environ.update(environ, OMP_NUM_THREADS="1")
    if dist_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if torch.cuda._is_in_bad_fork():  # CUDA cannot start in a fork of a process that started it
            raise RuntimeError(f"importing {PRELOAD} initialised CUDA in the fork server: "
                               "run_ranks(start='spawn')")
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


# what every rank imports before its first line: imported once, by the fork server (moe_rl.train first: it
# quiets megatron-core's import-time notices that do not apply here)
PRELOAD = ["moe_rl.train", "torch", "megatron.core.models.gpt.gpt_model",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.dist_checkpointing.strategies", "megatron.core.pipeline_parallel",
           "megatron.core.transformer.moe.router_replay", "moe_rl.train.model"]


def default_start(cuda_available: bool) -> str:
    """"forkserver" on a machine without CUDA, "spawn" with it: there, importing
    megatron.core.models.gpt.gpt_model asks CUDA for its devices, which poisons every later fork of the
    server (seen on an H200 with torch 2.11, 2026-12-04), and a forked rank cannot use CUDA."""
    return "spawn" if cuda_available else "forkserver"


def _context(start: str):
    """start="forkserver": ranks are forked from one server process that imported PRELOAD once, so a rank
    starts in a fraction of a second instead of the seconds of a fresh interpreter's imports, with no
    state of the caller's (the server ran nothing but those imports). "spawn": each rank a fresh
    interpreter (tools/bench/rank_start.py measures the two side by side)."""
    if start not in ("forkserver", "spawn"):
        raise ValueError(f"start: {start!r}; 'forkserver' or 'spawn'")
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_in_process(fn, args: tuple = (), timeout: float = 600.0):
    """Run fn(0, 1, *args) in one fresh process without torch.distributed environment (e.g. vLLM)."""
    return run_ranks(fn, 1, args, timeout, dist_env=False)[0]


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 600.0, dist_env: bool = True,
              start: str | None = None) -> list:
    """start: "forkserver" or "spawn" (`_context`); None: `default_start` for this machine."""
    ctx = _context(start or default_start(torch.cuda.is_available()))
    queue = ctx.Queue()
    port = parallel.free_port("127.0.0.1")
    environ = dict(os.environ)  # the caller's now, not the fork server's from when it started
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, dist_env, environ))
             for r in range(world_size)]
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
