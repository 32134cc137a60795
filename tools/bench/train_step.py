"""Benchmark: one training step (forward + backward + optimizer) of a small MoE through the Megatron
CPU path vs the same model trained with plain transformers, same threads, batch and weights.

Model: Qwen3-MoE, hidden 256, 4 layers, 8 experts top-2, sequence 512 (defaults). Figures, measured
side by side in this one process (medians over --steps after warm-up):

  megatron_vs_hf       Megatron tokens/s / transformers tokens/s (target >= 0.7): medians of --pairs
                       steps each, transformers' and Megatron's steps interleaved (one round: a
                       transformers step, a free-routing step, a replay step; every other round in
                       reverse order), so drift and ordering effects hit both alike
  replay_overhead      step time with router replay / without - 1 (target <= 0.03): the median of the
                       rounds' paired ratios (free-replay, then replay-free, alternately)
  grouped_vs_sequential  Megatron step time with megatron-core's SequentialMLP experts (what
                       model.experts=auto builds on the CPU) / with GroupedExperts (model.experts=grouped,
                       torch._grouped_mm): the median of the rounds' paired ratios (a grouped-experts
                       free-routing step joins each round above); > 1: grouped is faster
  packed_speedup       variable-length rows (lengths uniform in [seq/8, seq]): step time right-padded /
                       packed (THD), same rows, same loss, interleaved; medians of --steps each

transformers runs in a child process, spawned before megatron-core's CPU shims are installed in this
one, so it computes on untouched torch; it steps only when this process asks, and the two never
compute at once (each step is timed where it runs). Both paths use --threads torch threads (default 1:
on 2-core VMs a 2-thread step swings by +-8% from step to step as the other vCPU is shared, which
drowns a 3% effect; one thread keeps the spread near 1%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile

import torch
from _timing import timed


def transformers_steps(conn, path: str, ids: torch.Tensor, threads: int) -> None:
    """Child process: the HF model and its Adam; on each request one forward + backward + clip + Adam
    step on `ids`, its wall time sent back (None ends it). One untimed step first."""
    import time

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.train()
    opt = torch.optim.Adam(hf.parameters(), lr=1e-6)

    def hf_step():
        opt.zero_grad(set_to_none=True)
        out = hf(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    hf_step()
    conn.send(torch.get_num_threads())
    while conn.recv() is not None:
        t0 = time.perf_counter()
        hf_step()
        conn.send(time.perf_counter() - t0)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps of each arm for the packed/padded comparison")
    ap.add_argument("--pairs", type=int, default=16,
                    help="interleaved rounds (a transformers, a free-routing, a replay and a "
                         "grouped-experts step each)")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args()


def hf_child(path, ids: torch.Tensor, threads: int):
    """Plain transformers in a child process (started before this one installs megatron's shims), loaded
    and warmed up: (its thread count, a function that appends one timed step's seconds to a list, a
    function that stops it)."""
    import multiprocessing

    conn, child_conn = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=transformers_steps,
                                                         args=(child_conn, str(path), ids, threads),
                                                         daemon=True)
    child.start()
    hf_threads = conn.recv()

    def step_time(acc: list) -> None:
        conn.send(True)
        acc.append(conn.recv())

    def stop() -> None:
        conn.send(None)
        child.join(timeout=60)

    return hf_threads, step_time, stop


def time_packing(w, nll, rows: int, seq: int, steps: int, g: torch.Generator) -> dict:
    """Variable-length rows: right-padded microbatches vs packed (THD) ones, alternating which goes first,
    round 0 untimed. Median seconds of each, their loss per token, and the padding fraction."""
    from moe_rl.batch import Batch

    var_len = torch.randint(seq // 8, seq + 1, (rows,), generator=g)
    var_ids = torch.randint(0, 300, (rows, seq), generator=g)
    var_mask = (torch.arange(seq) < var_len.unsqueeze(1)) & (torch.arange(seq) > 0)
    var = Batch(var_ids, var_len, mask_BS=var_mask)
    var_denom = var_mask.sum().double()
    padded_settings = w.optim_spec
    packed_settings = dataclasses.replace(padded_settings, pack_sequences=True)
    t_pad, t_pack, loss = [], [], {}
    for i in range(steps + 1):
        arms = (("padded", padded_settings, t_pad), ("packed", packed_settings, t_pack))
        for name, settings, acc in arms[:: 1 if i % 2 == 0 else -1]:
            w.optim_spec = settings
            loss[name] = timed(w.train_step, acc if i else [], var, nll, var_denom).figures["loss"]
    w.optim_spec = padded_settings
    return {"rows": rows, "padded_s": statistics.median(t_pad), "packed_s": statistics.median(t_pack),
            "padding_fraction": 1 - float(var_len.sum()) / (rows * seq),
            **{f"{k}_loss_per_token": v / float(var_denom) for k, v in loss.items()}}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    spec = TinyModel(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=args.hidden // 4, num_experts=args.experts, top_k=2,
                     moe_intermediate_size=args.hidden, max_position_embeddings=max(1024, args.seq))
    path = build_tiny_checkpoint(os.path.join(tempfile.gettempdir(), "moe_rl_bench_train_step"), spec, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (args.batch, args.seq), generator=g)
    tokens = ids.numel()
    print(f"train step: Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-2, "
          f"batch {args.batch} x seq {args.seq}, threads {torch.get_num_threads()}")
    hf_threads, hf_step_time, stop_hf = hf_child(path, ids, args.threads)

    # the Megatron CPU path (one rank, gloo)
    from moe_rl.batch import Batch
    from moe_rl.config import RunConfig, TrainerSection
    from moe_rl.driver.specs import model_spec, optim_spec
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    os.environ.setdefault("MASTER_PORT", "29561")
    parallel.init_distributed(parallel.Layout(), rank=0, world_size=1)
    # padded; packed in time_packing
    cfg = RunConfig(trainer=TrainerSection(micro_batch_tokens=tokens, pack_sequences=False))
    # the trainer as production builds it on the CPU (model.experts=auto: sequential), and grouped
    w = TrainWorker(model_spec(cfg, str(path)), optim=optim_spec(cfg, lr=1e-6, lr_mult={}))
    w_grouped = TrainWorker(dataclasses.replace(model_spec(cfg, str(path)), experts="grouped"),
                            optim=optim_spec(cfg, lr=1e-6, lr_mult={}))
    lengths = torch.full((args.batch,), args.seq)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    denom = mask.sum().double()

    def nll(outputs, mb):
        return -(outputs["logp_BS"] * mb.mask_BS).sum(), {}

    free = Batch(ids, lengths, mask_BS=mask)
    replayed = Batch(ids, lengths, w.score(free, record_routes=True).routes_BSLK, mask_BS=mask)
    t_hf, t_free, t_replay, t_grouped = [], [], [], []
    w.train_step(free, nll, denom)
    w.train_step(replayed, nll, denom)
    w_grouped.train_step(free, nll, denom)
    rounds = (lambda: hf_step_time(t_hf), lambda: timed(w.train_step, t_free, free, nll, denom),
              lambda: timed(w.train_step, t_replay, replayed, nll, denom),
              lambda: timed(w_grouped.train_step, t_grouped, free, nll, denom))
    for i in range(args.pairs):  # interleaved, every other round reversed: drift and ordering hit all alike
        for run in rounds[:: 1 if i % 2 == 0 else -1]:
            run()
    stop_hf()
    packing = time_packing(w, nll, 4 * args.batch, args.seq, args.steps, g)
    parallel.shutdown()
    report(args, tokens, hf_threads, t_hf, t_free, t_replay, t_grouped, packing)


def report(args, tokens: int, hf_threads: int, t_hf: list, t_free: list, t_replay: list, t_grouped: list,
           packing: dict) -> None:
    """Prints the steps' medians and ratios (the module docstring names them), then the JSON line."""
    t_hf_med, t_mg, t_rp = statistics.median(t_hf), statistics.median(t_free), statistics.median(t_replay)
    replay_overhead = statistics.median(r / f for f, r in zip(t_free, t_replay, strict=True)) - 1
    grouped_vs_sequential = statistics.median(f / q for f, q in zip(t_free, t_grouped, strict=True))
    t_pd, t_pk = packing["padded_s"], packing["packed_s"]
    rows = packing["rows"]
    figures = {
        "bench": "train_step", "hidden": args.hidden, "layers": args.layers, "experts": args.experts,
        "seq": args.seq, "batch": args.batch, "rounds": args.pairs,
        "hf_tokens_per_s": round(tokens / t_hf_med, 1), "megatron_tokens_per_s": round(tokens / t_mg, 1),
        "megatron_vs_hf": round(t_hf_med / t_mg, 3), "replay_overhead": round(replay_overhead, 4),
        "grouped_tokens_per_s": round(tokens / statistics.median(t_grouped), 1),
        "grouped_vs_sequential": round(grouped_vs_sequential, 3),
        "threads": args.threads, "variable_rows": rows,
        "padding_fraction": round(packing["padding_fraction"], 3),
        "packed_speedup": round(t_pd / t_pk, 3),
    }
    print(f"transformers   {t_hf_med * 1e3:8.1f} ms/step  {tokens / t_hf_med:8.0f} tokens/s  (child process, "
          f"{hf_threads} threads; median of {args.pairs} steps interleaved with Megatron's)")
    print(f"megatron CPU   {t_mg * 1e3:8.1f} ms/step  {tokens / t_mg:8.0f} tokens/s  ({t_hf_med / t_mg:.2f}x "
          "transformers; target >= 0.7)")
    print(f"  grouped experts {statistics.median(t_grouped) * 1e3:8.1f} ms/step "
          f"({grouped_vs_sequential:.2f}x the sequential experts' speed, median of {args.pairs} paired "
          "ratios)")
    print(f"  with replay  {t_rp * 1e3:8.1f} ms/step  (router replay overhead {100 * replay_overhead:+.1f}%, "
          f"median of {args.pairs} pairs; target <= 3%)")
    print(f"{rows} rows of varied length ({100 * figures['padding_fraction']:.0f}% padding when "
          f"right-padded): padded {t_pd * 1e3:.1f} ms/step, packed {t_pk * 1e3:.1f} ms/step "
          f"({t_pd / t_pk:.2f}x); loss per token {packing['padded_loss_per_token']:.6f} vs "
          f"{packing['packed_loss_per_token']:.6f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
