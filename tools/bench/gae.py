"""Benchmark: masked GAE with truncation — the fused CPU kernel and the chunked tensor path, each
called by name (backend="kernel", backend="torch"), against the common per-token reverse Python loop.

B=256 sequences of T=16384 positions, 30% observation tokens in spans (multi-turn layout), half the
samples truncated (bootstrapped from a boundary value). All figures are measured side by side in this
one process; the kernel, the tensor path and the elementwise pass are timed in interleaved rounds
(kernel, tensor path, pass, kernel, ...) so machine noise hits them alike, and reported as medians:

  speedup_vs_loop                loop time / kernel time, both on the first --loop-rows rows, all
                                 samples terminated (target >= 50)
  kernel_speedup_vs_torch_path   tensor path time / kernel time
  kernel_vs_elementwise_pass     kernel time / the time of one torch elementwise pass over the same
                                 bytes (reads rewards, values and mask, writes two [B, T] outputs). A
                                 reference point, not a floor: torch's pass makes its own temporaries,
                                 and the fused kernel can beat it (a ratio below 1)
  torch_path_vs_elementwise_pass the same for the tensor path
  max_abs_err                    kernel (float32) vs a float64 evaluation of the same recursion by the
                                 tensor path (an independent implementation)
  torch_path_max_abs_err         tensor path (float32) vs the same float64 reference
  max_abs_err_vs_loop            kernel vs the per-token loop (all samples terminated)

The per-token loop cannot bootstrap truncated samples, so the loop comparison uses termination for
both and the error checks use the float64 reference with truncation. Without the kernel (no C++
compiler) the benchmark stops with an error instead of timing the tensor path under the kernel's name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _timing import timed

from moe_rl.algos.gae import masked_gae, reverse_loop_gae


def span_mask(B: int, T: int, obs_frac: float, gen: torch.Generator) -> torch.Tensor:
    """Alternating model / observation spans with ~obs_frac observation tokens."""
    mean_span = 64
    n = T // 8 + 2
    model_len = torch.randint(1, int(2 * mean_span * (1 - obs_frac)) + 1, (B, n), generator=gen)
    obs_len = torch.randint(1, int(2 * mean_span * obs_frac) + 1, (B, n), generator=gen)
    lens = torch.stack([model_len, obs_len], dim=2).reshape(B, 2 * n)
    ends = lens.cumsum(1)
    pos = torch.arange(T).expand(B, T).contiguous()
    span_idx = torch.searchsorted(ends, pos, right=True)
    return span_idx % 2 == 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--obs-frac", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=7,
                    help="interleaved timing rounds (kernel, tensor path, pass)")
    ap.add_argument("--loop-rows", type=int, default=256,
                    help="rows the Python loop and the kernel it is compared with run on")
    return ap.parse_args()


def time_full_batch(rewards, values, mask, terminated, boundary, gamma, lam, repeats: int):
    """Median seconds of the kernel, the tensor path and one elementwise pass over the same bytes, timed in
    interleaved rounds; and each path's largest error against a float64 evaluation by the tensor path."""
    def kernel():
        return masked_gae(rewards, values, mask, terminated, boundary, gamma, lam, backend="kernel")

    def torch_path():
        return masked_gae(rewards, values, mask, terminated, boundary, gamma, lam, backend="torch")

    def elementwise_pass():
        # reads rewards, values and mask once; writes two fresh [B, T] float outputs
        a = torch.where(mask, rewards, values)
        b = torch.empty_like(values).fill_(0.0)
        return a, b

    try:
        kernel()  # build (first call on a machine) and warm the kernel; no fallback to the tensor path
    except RuntimeError as err:
        sys.exit(f"gae bench: the fused kernel is unavailable, nothing to time under its name: {err}")
    torch_path()
    elementwise_pass()
    times = ([], [], [])
    for _ in range(repeats):
        for fn, t in zip((kernel, torch_path, elementwise_pass), times, strict=True):
            timed(fn, t)
    ref, _ = masked_gae(rewards.double(), values.double(), mask, terminated, boundary.double(), gamma, lam,
                        backend="torch")
    errs = [float((fn()[0].double() - ref).abs().max()) for fn in (kernel, torch_path)]
    return (*(statistics.median(t) for t in times), *errs)


def time_against_loop(rewards, values, mask, boundary, gamma, lam, repeats: int):
    """The per-token loop's seconds, the kernel's median seconds on the same rows (all terminated: the loop
    cannot bootstrap) and their largest difference. The loop's steps are vectorised over rows, so its time
    is not proportional to the rows: it is never scaled from fewer rows to B."""
    ones = torch.ones(rewards.shape[0], dtype=torch.bool)
    t0 = time.perf_counter()
    loop_adv, _ = reverse_loop_gae(rewards, values, mask, gamma, lam)
    loop = time.perf_counter() - t0
    t_kernel = []
    for _ in range(repeats):
        kernel_adv, _ = timed(masked_gae, t_kernel, rewards, values, mask, ones, boundary, gamma, lam,
                              "kernel")
    return loop, statistics.median(t_kernel), float((kernel_adv - loop_adv).abs().max())


def main() -> None:
    args = parse_args()
    B, T = args.B, args.T
    gen = torch.Generator().manual_seed(0)
    mask = span_mask(B, T, args.obs_frac, gen)
    values = torch.randn(B, T, generator=gen)
    rewards = torch.randn(B, T, generator=gen) * mask * 0.01
    terminated = torch.rand(B, generator=gen) < 0.5
    boundary = torch.randn(B, generator=gen)
    gamma, lam = 1.0, 0.95
    print(f"masked GAE  B={B} T={T}  observation tokens {1 - mask.float().mean():.1%}  threads "
          f"{torch.get_num_threads()}")
    fast, slow, ew, err, torch_err = time_full_batch(rewards, values, mask, terminated, boundary, gamma, lam,
                                                     args.repeats)
    rows = min(args.loop_rows, B)
    loop, fast_rows, loop_err = time_against_loop(rewards[:rows], values[:rows], mask[:rows], boundary[:rows],
                                                  gamma, lam, args.repeats)
    figures = {
        "bench": "gae", "B": B, "T": T, "obs_frac": round(1 - float(mask.float().mean()), 3),
        "rounds": args.repeats, "kernel_ms": round(fast * 1e3, 2), "torch_path_ms": round(slow * 1e3, 2),
        "elementwise_pass_ms": round(ew * 1e3, 2), "loop_ms": round(loop * 1e3, 1),
        "loop_rows": rows, "kernel_loop_rows_ms": round(fast_rows * 1e3, 2),
        "speedup_vs_loop": round(loop / fast_rows, 1), "kernel_speedup_vs_torch_path": round(slow / fast, 2),
        "kernel_vs_elementwise_pass": round(fast / ew, 2),
        "torch_path_vs_elementwise_pass": round(slow / ew, 2), "max_abs_err": err,
        "torch_path_max_abs_err": torch_err, "max_abs_err_vs_loop": loop_err,
    }
    print(f"fused kernel      {fast * 1e3:9.2f} ms   (backend='kernel', median of {args.repeats})")
    print(f"tensor path       {slow * 1e3:9.2f} ms   (backend='torch', used off-CPU; kernel "
          f"{slow / fast:.2f}x faster)")
    print(f"elementwise pass  {ew * 1e3:9.2f} ms   (one torch pass over the same bytes; kernel "
          f"{fast / ew:.2f}x, tensor path {slow / ew:.2f}x of it)")
    print(f"Python loop       {loop * 1e3:9.1f} ms   (per-token reverse loop on {rows} rows, all terminated; "
          f"the kernel on the same rows {fast_rows * 1e3:.2f} ms)")
    print(f"speedup vs loop {loop / fast_rows:.1f}x (target >= 50)")
    print(f"max abs error vs float64: kernel {err:.2e}, tensor path {torch_err:.2e}; kernel vs loop "
          f"{loop_err:.2e}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
