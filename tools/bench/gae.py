"""Benchmark: masked GAE with truncation vs the common per-token reverse Python loop.

B=256 sequences of T=16384 positions, 30% observation tokens in spans (multi-turn layout), half the
samples truncated (bootstrapped from a boundary value). All figures are measured side by side in this
one process:

  speedup_vs_loop  loop time / fast time (target >= 50)
  floor_ratio      fast time / memory-traffic floor (target <= 3); the floor is the time to read the
                   inputs (rewards, values, mask) and write the two outputs once, measured here with
                   one elementwise pass over exactly those bytes
  max_abs_err      fast vs a float64 evaluation of the same recursion

The per-token loop cannot bootstrap truncated samples, so the speed comparison uses termination for
the loop and the error check uses the float64 kernel with truncation.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _timing import median_time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--obs-frac", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--loop-rows", type=int, default=256, help="rows the Python loop runs on (scaled to B)")
    args = ap.parse_args()
    B, T = args.B, args.T
    gen = torch.Generator().manual_seed(0)
    mask = span_mask(B, T, args.obs_frac, gen)
    values = torch.randn(B, T, generator=gen)
    rewards = torch.randn(B, T, generator=gen) * mask * 0.01
    terminated = torch.rand(B, generator=gen) < 0.5
    boundary = torch.randn(B, generator=gen)
    gamma, lam = 1.0, 0.95
    print(f"masked GAE  B={B} T={T}  observation tokens {1 - mask.float().mean():.1%}  threads {torch.get_num_threads()}")

    masked_gae(rewards, values, mask, terminated, boundary, gamma, lam)  # build/warm the kernel
    fast = median_time(lambda: masked_gae(rewards, values, mask, terminated, boundary, gamma, lam), args.repeats)
    torch_path = median_time(lambda: masked_gae(rewards, values, mask, terminated, boundary, gamma, lam, backend="torch"),
                       max(3, args.repeats // 2))

    def floor_pass():
        # reads rewards, values and mask once; writes two fresh [B, T] float outputs
        a = torch.where(mask, rewards, values)
        b = torch.empty_like(values).fill_(0.0)
        return a, b

    floor_pass()
    floor = median_time(floor_pass, args.repeats)

    rows = min(args.loop_rows, B)
    ones = torch.ones(B, dtype=torch.bool)
    t0 = time.perf_counter()
    loop_adv, _ = reverse_loop_gae(rewards[:rows], values[:rows], mask[:rows], gamma, lam)
    loop = (time.perf_counter() - t0) * (B / rows)
    fast_term, _ = masked_gae(rewards, values, mask, ones, boundary, gamma, lam)
    loop_err = float((fast_term[:rows] - loop_adv).abs().max())

    adv, _ = masked_gae(rewards, values, mask, terminated, boundary, gamma, lam)
    ref, _ = masked_gae(rewards.double(), values.double(), mask, terminated, boundary.double(), gamma, lam)
    err = float((adv.double() - ref).abs().max())

    figures = {
        "bench": "gae", "B": B, "T": T, "obs_frac": round(1 - float(mask.float().mean()), 3),
        "fast_ms": round(fast * 1e3, 2), "torch_path_ms": round(torch_path * 1e3, 2),
        "floor_ms": round(floor * 1e3, 2), "loop_ms": round(loop * 1e3, 1),
        "speedup_vs_loop": round(loop / fast, 1), "floor_ratio": round(fast / floor, 2),
        "torch_path_floor_ratio": round(torch_path / floor, 2),
        "max_abs_err": err, "max_abs_err_vs_loop": loop_err,
    }
    print(f"fused kernel   {fast * 1e3:9.2f} ms")
    print(f"tensor path    {torch_path * 1e3:9.2f} ms   ({torch_path / floor:.1f}x floor; used off-CPU)")
    print(f"memory floor   {floor * 1e3:9.2f} ms")
    print(f"Python loop    {loop * 1e3:9.1f} ms   (per-token reverse loop, all samples terminated)")
    print(f"speedup vs loop {loop / fast:.1f}x (target >= 50)   floor ratio {fast / floor:.2f} (target <= 3)")
    print(f"max abs error vs float64 {err:.2e}   vs loop {loop_err:.2e}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
