"""Benchmark: the policy's log-probs and entropy, forward and backward, from the last hidden states and the
output layer: the whole logits at once (train/logprobs.target_logprobs on hidden @ W^T, what the trainer did
before trainer.logit_chunk_tokens) against a chunk of tokens at a time (chunked_target_logprobs, the
default), at Qwen3's vocabulary (V = 151,936) and hidden size 2,048, bf16, one rank.

Each (path, tokens) runs in a process of its own (a peak is a process's), which builds the inputs, then runs
the loss's forward and backward --repeats times after one warm-up:

  peak_gib_*          the process's peak resident memory (ru_maxrss) less its resident memory with the
                      inputs built, just before the first call: what the log-probs step itself added
  time_s_*            median wall time of one forward + backward
  peak_memory_ratio   chunked / whole at the same --tokens (target <= 0.25)
  time_ratio          chunked / whole at the same --tokens (target <= 1.3)

The whole path at 8,192 tokens needs about 30 GiB (24 bytes per logit at its backward's peak: plan.py's
logit_bytes), more than this 24 GiB box has: --tokens (2,048 by default) sets the size both paths run at
for the ratios, and --chunked-tokens (8,192) one more chunked run, whose peak shows what 8,192-token
microbatches cost with chunks. Prints one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

V, H = 151_936, 2_048


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def child(path: str, tokens: int, chunk: int, repeats: int) -> dict:
    import torch

    from moe_rl.train.logprobs import chunked_target_logprobs, target_logprobs

    torch.manual_seed(0)
    hidden = (torch.randn(tokens, H) * 0.5).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(V, H) * 0.02).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, V, (tokens,))

    def step():
        if path == "whole":
            logp, ent = target_logprobs((hidden @ weight.t()).unsqueeze(0), targets.unsqueeze(0))
        else:
            logp, ent = chunked_target_logprobs(hidden, weight, targets, chunk)
        (logp.sum() + 0.01 * ent.sum()).backward()
        hidden.grad = weight.grad = None

    base = rss_kib()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        step()
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_gib": (peak - base) / 2**20, "time_s": statistics.median(times)}


def run(path: str, tokens: int, chunk: int, repeats: int) -> dict:
    print(f"{path}, {tokens} tokens ...", file=sys.stderr, flush=True)
    out = subprocess.run([sys.executable, __file__, "--child", path, "--tokens", str(tokens), "--chunk",
                          str(chunk), "--repeats", str(repeats)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"logprobs bench: the {path} run at {tokens} tokens failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens both paths run at, for the ratios")
    ap.add_argument("--chunked-tokens", type=int, default=8192, help="one more chunked run at this size")
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.logit_chunk_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["whole", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.chunk, args.repeats)))
        return 0
    whole = run("whole", args.tokens, args.chunk, args.repeats)
    chunked = run("chunked", args.tokens, args.chunk, args.repeats)
    big = run("chunked", args.chunked_tokens, args.chunk, args.repeats)
    print(f"V {V}, hidden {H}, bf16, chunks of {args.chunk} tokens")
    print(f"{args.tokens} tokens: whole {whole['peak_gib']:.2f} GiB, {whole['time_s']:.2f} s; chunked "
          f"{chunked['peak_gib']:.2f} GiB, {chunked['time_s']:.2f} s")
    print(f"{args.chunked_tokens} tokens, chunked: {big['peak_gib']:.2f} GiB, {big['time_s']:.2f} s")
    print(json.dumps({"bench": "logprobs", "vocab": V, "hidden": H, "dtype": "bfloat16", "chunk": args.chunk,
                      "tokens": args.tokens, "peak_gib_whole": whole["peak_gib"],
                      "peak_gib_chunked": chunked["peak_gib"], "time_s_whole": whole["time_s"],
                      "time_s_chunked": chunked["time_s"],
                      "peak_memory_ratio": chunked["peak_gib"] / whole["peak_gib"],
                      "time_ratio": chunked["time_s"] / whole["time_s"],
                      "chunked_tokens": args.chunked_tokens,
                      "peak_gib_chunked_at_chunked_tokens": big["peak_gib"],
                      "time_s_chunked_at_chunked_tokens": big["time_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
