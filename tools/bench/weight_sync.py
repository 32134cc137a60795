"""Benchmark: trainer -> engine weight sync throughput vs a plain memory copy of the same bytes.

The HF-named tensors of a small MoE are synced into a running vLLM engine in layer-aligned buckets
streamed into one engine update (in-process path, and through safetensors files in shared memory as
the Ray engine actor reads them), and the same bytes are copied once with torch into preallocated
buffers, in this one run.

  sync_vs_memcpy       memcpy time / in-process sync time (target >= 0.5)
  shm_sync_vs_memcpy   memcpy time / shared-memory sync time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moe_rl.config import TinyModel
    from moe_rl.rollout.engine import EngineSettings, RolloutEngine
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.weights.hf import HFReader
    from moe_rl.weights.sync import buckets, read_bucket, shm_dir, write_bucket

    spec = TinyModel(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=args.hidden // 4, num_experts=args.experts, moe_intermediate_size=args.hidden)
    path = build_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "moe_rl_bench_sync"), spec, seed=0)
    reader = HFReader(path)
    # in the order the trainer's export produces them: grouped by layer
    names = sorted(reader.names(), key=lambda n: (int(n.split("layers.")[1].split(".")[0]) if "layers." in n else -1, n))
    named = [(n, reader.get(n)) for n in names]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    engine = RolloutEngine(EngineSettings(str(path), record_routes=False))
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for d, (_, t) in zip(dst, named):
            d.copy_(t)

    def sync_inproc(version):  # what a colocated trainer hands the engine: the buckets, streamed, one call
        engine.update_weights((t for b in buckets(named, args.bucket_mb) for t in b), version)

    shm = shm_dir() / f"moe_rl_bench_{os.getpid()}"

    def sync_shm(version):  # what the Ray engine actor does: trainers write bucket files, it streams them
        paths = [write_bucket(b, shm, i) for i, b in enumerate(buckets(named, args.bucket_mb))]
        engine.update_weights((t for p in paths for t in read_bucket(p)), version)

    t_mem, t_in, t_shm = [], [], []
    sync_inproc(0)
    for r in range(args.rounds):
        t0 = time.perf_counter(); memcpy(); t_mem.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); sync_inproc(r + 1); t_in.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); sync_shm(r + 1); t_shm.append(time.perf_counter() - t0)
    m, i, s = (statistics.median(x) for x in (t_mem, t_in, t_shm))
    mb = nbytes / 2**20
    figures = {"bench": "weight_sync", "megabytes": round(mb, 2), "bucket_mb": args.bucket_mb,
               "memcpy_gbps": round(nbytes / m / 1e9, 2), "sync_gbps": round(nbytes / i / 1e9, 3),
               "shm_sync_gbps": round(nbytes / s / 1e9, 3), "sync_vs_memcpy": round(m / i, 3),
               "shm_sync_vs_memcpy": round(m / s, 3)}
    print(f"weights: {mb:.1f} MiB in {len(named)} tensors, buckets of {args.bucket_mb} MiB")
    print(f"plain memcpy          {m * 1e3:8.2f} ms  {nbytes / m / 1e9:6.2f} GB/s")
    print(f"sync in-process       {i * 1e3:8.2f} ms  {nbytes / i / 1e9:6.3f} GB/s  ({m / i:.1%} of memcpy; target >= 50%)")
    print(f"sync via /dev/shm     {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.3f} GB/s  ({m / s:.1%} of memcpy)")
    print(json.dumps(figures))
    engine.shutdown()


if __name__ == "__main__":
    main()
