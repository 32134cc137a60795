"""GPU measurement of the Megatron trainer on its local layer spec (megatron-core's own layers, torch
SDPA attention; no Transformer Engine, vLLM or Ray): one rank on one GPU, started by run_ranks. Run by
tools/gpu_check.sh; progress goes to stderr, JSON lines to stdout: one after the slice's figures and
one after the trainer's (`"partial": true`, in case a later step runs out of time), then the whole one.

    python3 tools/gpu_check.py [--dry-run] [--tests-xml FILE] [--layers N] [--rows B] [--seq S] [--steps N]

The slice (`slice` in the JSON): Qwen3-30B-A3B's real layer shapes, 4 of its 48 layers (hidden 2048, 128
experts top-8 of width 768, 32 query and 4 key/value heads of 128; the tiny vocabulary), 2.5B parameters,
about 0.2B active a token; bf16 PPO policy steps of 8 x 2048 tokens packed into one 16,384-token
microbatch, with megatron-core's SequentialMLP experts and then with GroupedExperts (model.experts),
each in a rank process of its own: step time, tokens/s, MFU and peak memory of each, and the ratio.

Model: a random Qwen3-MoE, hidden 1024, 8 layers, 64 experts top-8 of width 384, 16 query and 4
key/value heads of 128: 647M parameters, 118M active per token. bf16, 8 rows x 2048 tokens a step,
packed into one microbatch (trainer.micro_batch_tokens=16384, as the GPU recipes); production's PPO loss
and value loss; the default experts (model.experts=auto: grouped on Hopper).

Both measured models are built from their config alone, with random weights on the GPU (no checkpoint
written or read); the parity model is a checkpoint of weights (both sides must read the same).

Figures (medians of timed calls after warm-up calls, each call ending in torch.cuda.synchronize):
  train_tokens_per_s, mfu   policy step (routes replayed): tokens / time, and
                            6 * active params * tokens / time / the GPU's dense bf16 peak (attention scores
                            uncounted; peak_bf16_flops: the datasheet figure of the GPU torch names, which
                            peak_flops_source says, or --peak-tflops)
  policy_step_s, critic_step_s
  replay_score_ratio        scoring with the recorded routes replayed / scoring with free routing
                            (median of the ratios of pairs run in alternating order)
  peak_memory_gib           torch.cuda.max_memory_allocated over the policy's training steps
  policy_step_top_ops, critic_step_top_ops
                            one more step of each under torch.profiler: the 8 operators with the most
                            self time on the GPU, [name, ms] (why the critic's step is 1.7x the policy's)
  policy_first_step_s       the first (cold) policy step: kernels warm up once per process, then the
                            timed steps reuse them
  offload_gib, offload_first_s, offload_s, onload_s, offload_bitwise
                            the policy rank's parameters, gradient buffers and Adam state to pinned host
                            memory and back (HostCopies, as colocated runs do around each rollout); the
                            first offload also pins the host buffers, offload_s/onload_s are the second
  dynamo_graphs             torch.compile graphs captured in the rank (0: the local spec compiles nothing,
                            so no recompilation per expert token count)
  logp_max_abs_diff_*       Megatron vs transformers on the GPU, both in fp32 (TF32 off; <= 1e-5
                            expected) and both in bf16, on conftest's tiny Qwen3-MoE

With --tests-xml (pytest's --junitxml of the gpu tests), the JSON also counts their outcomes.

--dry-run needs no GPU: it prints the plan, checks the FLOP/MFU arithmetic on a case worked by hand and
the active-parameter count against the model's own parameters (built on the meta device), then runs
the same measurement on the CPU with conftest's tiny model and a few tokens (DRY_PLAN), JSON included:
every code path of the GPU run, none of its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

import torch
from bench._timing import median_time, timed
from gpu_flops import active_params, arithmetic_problems, mfu, peak_bf16_flops, train_flops

from moe_rl.config import TinyModel
from moe_rl.tiny import VOCAB_SIZE

MEASURED = TinyModel(hidden_size=1024, num_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=384,
                     max_position_embeddings=4096)
# a slice of Qwen3-30B-A3B's real layer shapes (its vocabulary left out: the output layer is the tiny one)
SLICE = TinyModel(hidden_size=2048, num_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, top_k=8, moe_intermediate_size=768, max_position_embeddings=4096)
PARITY = TinyModel()  # conftest's tiny_qwen
PARITY_SHAPE = (4, 64)  # rows x tokens scored for the parity figures


@dataclasses.dataclass(frozen=True)
class Plan:
    rows: int = 8
    seq: int = 2048
    micro_batch_tokens: int = 16384
    warmup: int = 2  # untimed calls before each timed series
    steps: int = 5  # timed policy steps, and timed critic steps
    pairs: int = 6  # timed free/replay scoring pairs

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


SLICE_PLAN = Plan(rows=8, seq=2048, micro_batch_tokens=16384, warmup=1, steps=3, pairs=0)
DRY_PLAN = Plan(rows=2, seq=32, micro_batch_tokens=64, warmup=1, steps=1, pairs=1)  # --dry-run, on the CPU


def synced(fn):
    """fn, returning once the GPU (if any) has finished the work it queued."""
    def call(*args):
        out = fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out
    return call


def top_ops(fn, n: int = 8) -> list[list]:
    """The n operators of one call of fn with the most self time, on the GPU where there is one (else the
    CPU), as [name, milliseconds]: where a step's time goes (the critic's step took 1.7x the policy's on
    the H200 on 2026-12-04, and 0.95x on the CPU at tiny size: the GPU must say why)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [[e.key, round(getattr(e, key) / 1e3, 3)] for e in events]


def offload_round_trip(worker) -> dict[str, float]:
    """The rank's storages to host memory and back, twice, timed: the first offload also allocates the
    pinned host buffers (HostCopies keeps them), the second is what every later rollout costs; whether
    every parameter came back bitwise."""
    before = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        moved = synced(worker.offload)()
        t1 = time.perf_counter()
        synced(worker.onload)()
        times.append((t1 - t0, time.perf_counter() - t1))
    same = all(torch.equal(p, before[n]) for n, p in worker.module.named_parameters())
    (first_off, _), (off, on) = times
    return {"offload_gib": moved / 2**30, "offload_first_s": first_off, "offload_s": off, "onload_s": on,
            "offload_bitwise": same}


def measure_job(rank, world, hf_path, plan: Plan) -> dict[str, float]:
    """One bf16 rank: scoring free vs replayed, policy steps (routes replayed), then critic steps."""
    from torch._dynamo.utils import counters

    from moe_rl.algos import aggregate
    from moe_rl.batch import Batch
    from moe_rl.config import RunConfig, TrainerSection
    from moe_rl.driver import specs
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    cuda = torch.cuda.is_available()
    cfg = RunConfig(trainer=TrainerSection(proximal_pass="separate"))  # the PPO step is given pi_old
    policy, step, free, replayed = policy_step_setup(cfg, hf_path, plan)
    t_free, t_replay = [], []
    for i in range(plan.warmup + plan.pairs):  # alternating order: drift hits both alike
        for batch, times in ((free, t_free), (replayed, t_replay))[:: 1 if i % 2 == 0 else -1]:
            timed(synced(policy.score), times if i >= plan.warmup else [], batch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = []
    timed(step, first)  # cold: the process's first step
    t_policy = median_time(step, plan.steps, max(0, plan.warmup - 1), label="policy step")
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    profiles = {"policy_step_top_ops": top_ops(step)}
    trip = offload_round_trip(policy)

    rows, seq = free.input_ids_BS.shape
    mask = torch.arange(seq).expand(rows, -1) > 0
    critic = TrainWorker(dataclasses.replace(policy.spec, routing_replay=False), role="critic",
                         optim=policy.optim_spec, load_weights=False)
    values = Batch(free.input_ids_BS, free.lengths_B, mask_BS=mask,
                   returns_BS=torch.randn(rows, seq, generator=torch.Generator().manual_seed(1)),
                   values_old_BS=torch.zeros(rows, seq))
    value_loss, denominator = specs.value_loss(cfg), aggregate.loss_denominator(mask, "token_mean")
    critic_step = synced(lambda: critic.train_step(values, value_loss, denominator))
    t_critic = median_time(critic_step, plan.steps, plan.warmup, label="critic step")
    profiles["critic_step_top_ops"] = top_ops(critic_step)
    return {"policy_step_s": t_policy, "policy_first_step_s": first[0], "critic_step_s": t_critic,
            "peak_memory_gib": peak, **trip, **profiles,
            "replay_score_ratio": statistics.median(r / f for f, r in zip(t_free, t_replay, strict=True)),
            "dynamo_graphs": int(counters["stats"].get("unique_graphs", 0))}


def policy_step_setup(cfg, hf_path: str, plan: Plan, **changes):
    """The bf16 policy (ModelSpec `changes` applied; random weights, from a config_only_checkpoint) and its
    PPO step on plan.rows x plan.seq random tokens with the routes it recorded replayed: (worker, step,
    the batch unrouted, the batch with its routes), step() one synced update."""
    from moe_rl.algos.targets import policy_denominators
    from moe_rl.batch import Batch
    from moe_rl.driver import specs
    from moe_rl.train.worker import TrainWorker

    spec = dataclasses.replace(specs.model_spec(cfg, hf_path), dtype="bfloat16", **changes)
    optim = dataclasses.replace(specs.optim_spec(cfg, cfg.trainer.lr, cfg.trainer.lr_mult),
                                micro_batch_tokens=plan.micro_batch_tokens)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB_SIZE, (plan.rows, plan.seq), generator=g)  # on the CPU, as from Ray
    lengths = torch.full((plan.rows,), plan.seq)
    mask = torch.arange(plan.seq).expand(plan.rows, -1) > 0  # every token after the first is an action
    policy = TrainWorker(spec, optim=optim, load_weights=False)  # config_only_checkpoint's: random weights
    free = Batch(ids, lengths)
    routes = policy.score(free, record_routes=True).routes_BSLK
    replayed = Batch(ids, lengths, routes)
    weight, adv = torch.ones(plan.rows, plan.seq), torch.randn(plan.rows, plan.seq, generator=g) * mask
    ppo = Batch(ids, lengths, routes, pg_mask_BS=mask, loss_mask_BS=mask, is_weight_BS=weight, adv_BS=adv,
                logp_old_BS=policy.score(replayed).logp_BS)
    loss = specs.policy_loss(cfg)
    denominators = policy_denominators(mask, mask, weight, specs.target_spec(cfg))
    return policy, synced(lambda: policy.train_step(ppo, loss, denominators)), free, replayed


def slice_job(rank, world, hf_path, plan: Plan, experts: str) -> dict[str, float]:
    """One bf16 rank, the slice built from its config alone (random weights, on the GPU) with `experts`
    (model.experts): its PPO policy step time and peak memory (one process per arm: the GPU holds one
    2.5B-parameter model with its Adam state at a time)."""
    from moe_rl.config import RunConfig, TrainerSection
    from moe_rl.train import parallel

    parallel.init_distributed(parallel.Layout())
    cuda = torch.cuda.is_available()
    cfg = RunConfig(trainer=TrainerSection(proximal_pass="separate"))
    _, step, _, _ = policy_step_setup(cfg, hf_path, plan, experts=experts)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = median_time(step, plan.steps, plan.warmup, label=f"slice policy step, {experts} experts")
    return {"policy_step_s": seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def parity_job(rank, world, hf_path, ids_BS: torch.Tensor) -> dict[str, torch.Tensor]:
    """Megatron's log-probs [B, S] of ids_BS (whole rows), in fp32 (TF32 off) and in bf16."""
    from moe_rl.batch import Batch
    from moe_rl.config import RunConfig
    from moe_rl.driver import specs
    from moe_rl.train import parallel
    from moe_rl.train.hf_parity import exact_fp32_matmuls
    from moe_rl.train.worker import TrainWorker

    exact_fp32_matmuls()
    parallel.init_distributed(parallel.Layout())
    cfg = RunConfig()
    lengths = torch.full((ids_BS.shape[0],), ids_BS.shape[1])
    out = {}
    for dtype in ("float32", "bfloat16"):
        w = TrainWorker(dataclasses.replace(specs.model_spec(cfg, hf_path), dtype=dtype),
                        optim=specs.optim_spec(cfg, cfg.trainer.lr, cfg.trainer.lr_mult))
        out[dtype] = w.score(Batch(ids_BS, lengths)).logp_BS
    return out


def config_only_checkpoint(out_dir: Path, spec: TinyModel) -> Path:
    """A checkpoint directory with `spec`'s config.json and the tokenizer but no weights: the trainer
    builds it with random weights on its device (load_weights=False), without seconds of writing and
    reading a multi-GiB file."""
    from moe_rl.tiny import build_tokenizer, hf_config

    tok = build_tokenizer(out_dir)
    hf_config(spec, tok.eos_token_id, tok.pad_token_id).save_pretrained(str(out_dir))
    return out_dir


def slice_figures(slice_spec: TinyModel, plan: Plan, arms: dict[str, dict], peak: float | None) -> dict:
    """The slice's JSON figures from slice_job's: each arm's step time, tokens/s, MFU and peak memory,
    and grouped's speedup over sequential."""
    active = active_params(slice_spec)
    out = {"model": dataclasses.asdict(slice_spec) | {"active_params": active},
           "plan": dataclasses.asdict(plan)}
    for experts, f in arms.items():
        out[experts] = f | {"train_tokens_per_s": plan.tokens / f["policy_step_s"],
                            "mfu": mfu(active, plan.tokens, f["policy_step_s"], peak)}
    out["grouped_vs_sequential"] = arms["sequential"]["policy_step_s"] / arms["grouped"]["policy_step_s"]
    return out


def describe(spec: TinyModel, plan: Plan) -> str:
    active = active_params(spec)
    flops = train_flops(active, plan.tokens)
    slice_active = active_params(SLICE)
    return "\n".join([
        f"slice of Qwen3-30B-A3B: hidden {SLICE.hidden_size}, {SLICE.num_layers} layers, {SLICE.num_experts} "
        f"experts top-{SLICE.top_k} of width {SLICE.moe_intermediate_size}, {SLICE.num_attention_heads} "
        "heads "
        f"({SLICE.num_key_value_heads} kv) of {SLICE.head_dim}: {slice_active / 1e6:.1f}M active parameters "
        f"per token; bf16 policy steps of {SLICE_PLAN.rows} x {SLICE_PLAN.seq} tokens packed into "
        f"{SLICE_PLAN.micro_batch_tokens}-token microbatches, sequential then grouped experts, "
        f"{SLICE_PLAN.warmup} warm-up + {SLICE_PLAN.steps} timed steps each "
        f"({train_flops(slice_active, SLICE_PLAN.tokens) / 1e12:.1f} TFLOP a step: 25% MFU on an H100 SXM is "
        f"{train_flops(slice_active, SLICE_PLAN.tokens) / (0.25 * 989e12):.3f} s a step)",
        f"model: random Qwen3-MoE, hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_experts} "
        f"experts top-{spec.top_k} of width {spec.moe_intermediate_size}, {spec.num_attention_heads} heads "
        f"({spec.num_key_value_heads} kv) of {spec.head_dim}: {active / 1e6:.1f}M active parameters per "
        "token",
        f"bf16, one rank on cuda:0: {plan.rows} rows x {plan.seq} tokens a step, packed into microbatches of "
        f"<= {plan.micro_batch_tokens} tokens",
        f"timed after {plan.warmup} warm-up calls each: {plan.pairs} free/replay scoring pairs, {plan.steps} "
        f"policy steps (PPO, routes replayed), {plan.steps} critic steps",
        f"MFU = 6 x {active / 1e6:.1f}M x {plan.tokens} tokens = {flops / 1e12:.2f} TFLOP per policy step "
        "/ step time / the GPU's dense bf16 peak (H100 SXM / H200: 989 TFLOP/s, where 10% MFU is "
        f"{flops / (0.1 * 989e12):.3f} s a step)",
        f"parity: tiny Qwen3-MoE (hidden {PARITY.hidden_size}, {PARITY.num_experts} experts) vs transformers "
        f"on the GPU, fp32 and bf16, {PARITY_SHAPE[0]} x {PARITY_SHAPE[1]} tokens",
    ])


def largest_gap(a_BS: torch.Tensor, b_BS: torch.Tensor) -> float:
    return float((a_BS - b_BS).abs().max())


def tests_outcomes(xml_path: str | None) -> dict:
    """The gpu tests' outcomes from pytest's --junitxml file: counts and the failing tests' names."""
    if not xml_path:
        return {}
    if not Path(xml_path).is_file():
        return {"tests": {"report": f"missing: {xml_path} (the tests did not finish)"}}
    cases = ET.parse(xml_path).getroot().iter("testcase")
    counts, failed = {"passed": 0, "failed": 0, "skipped": 0}, []
    for case in cases:
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcome = "failed" if outcome in ("failure", "error") else outcome
        counts[outcome] += 1
        if outcome == "failed":
            failed.append(case.get("name"))
    return {"tests": counts | {"failed_names": failed}}


def versions() -> dict[str, str]:
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "megatron_core": version("megatron-core"), "mbridge": version("mbridge"),
            "transformers": version("transformers")}


def measure(spec: TinyModel, plan: Plan, slice_spec: TinyModel, slice_plan: Plan, device: str,
            tests_xml: str | None = None, peak_tflops: float | None = None) -> dict:
    """The figures (moe_rl's trainer on `device` against transformers'): the slice's policy step with
    sequential and grouped experts, then `spec`'s figures, then the parity with transformers; a JSON
    line printed after each of the first two (`partial`), and returned whole."""
    from moe_rl.tiny import build_tiny_checkpoint
    from moe_rl.train.hf_parity import exact_fp32_matmuls, hf_token_logprobs
    from moe_rl.train.launch_local import run_ranks

    start = time.perf_counter()
    active = active_params(spec)
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU dry run)"
    peak, peak_source = peak_bf16_flops(gpu, peak_tflops)
    out = {"check": "gpu_local_spec",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": device, "gpu": gpu,
           **versions(), "model": dataclasses.asdict(spec) | {"active_params": active},
           "plan": dataclasses.asdict(plan), "dtype": "bfloat16", **tests_outcomes(tests_xml)}
    with tempfile.TemporaryDirectory(prefix="moe_rl_gpu_check_") as tmp:
        print("building the checkpoints (the measured models' configs; the parity model's weights)",
              file=sys.stderr)
        sliced = config_only_checkpoint(Path(tmp) / "slice", slice_spec)
        measured = config_only_checkpoint(Path(tmp) / "measured", spec)
        small = build_tiny_checkpoint(Path(tmp) / "parity", PARITY, seed=0)
        out["checkpoint_build_s"] = time.perf_counter() - start
        print(f"the slice, sequential vs grouped experts (checkpoints built in "
              f"{out['checkpoint_build_s']:.1f} s)", file=sys.stderr)
        arms = {experts: run_ranks(slice_job, 1, (str(sliced), slice_plan, experts))[0]
                for experts in ("sequential", "grouped")}
        out["slice"] = slice_figures(slice_spec, slice_plan, arms, peak)
        print(json.dumps(out | {"partial": True, "wall_s": time.perf_counter() - start}), flush=True)
        print("measuring the policy and critic", file=sys.stderr)
        figures = run_ranks(measure_job, 1, (str(measured), plan))[0]
        out |= {"train_tokens_per_s": plan.tokens / figures["policy_step_s"],
                "mfu": mfu(active, plan.tokens, figures["policy_step_s"], peak), "peak_flops": peak,
                "peak_flops_source": peak_source, **figures}
        print(json.dumps(out | {"partial": True, "wall_s": time.perf_counter() - start}), flush=True)
        print("parity with transformers", file=sys.stderr)
        ids = torch.randint(0, VOCAB_SIZE, PARITY_SHAPE, generator=torch.Generator().manual_seed(1))
        megatron = run_ranks(parity_job, 1, (str(small), ids))[0]
        exact_fp32_matmuls()
        out["logp_max_abs_diff_fp32"] = largest_gap(megatron["float32"],
                                                    hf_token_logprobs(small, ids, device, torch.float32))
        out["logp_max_abs_diff_bf16"] = largest_gap(megatron["bfloat16"],
                                                    hf_token_logprobs(small, ids, device, torch.bfloat16))
    return out | {"wall_s": time.perf_counter() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: print the plan, check the FLOP/MFU arithmetic, run the measurement small "
                         "on the CPU")
    ap.add_argument("--tests-xml", help="pytest's --junitxml report of the gpu tests, counted in the JSON")
    ap.add_argument("--layers", type=int, default=MEASURED.num_layers)
    ap.add_argument("--rows", type=int, default=Plan.rows)
    ap.add_argument("--seq", type=int, default=Plan.seq)
    ap.add_argument("--steps", type=int, default=Plan.steps)
    ap.add_argument("--peak-tflops", type=float,
                    help="the GPU's dense bf16 peak for the MFU (default: the datasheet figure of the GPU "
                         "torch names, from PEAK_BF16_FLOPS)")
    args = ap.parse_args()
    spec = dataclasses.replace(MEASURED, num_layers=args.layers,
                               max_position_embeddings=max(args.seq, MEASURED.max_position_embeddings))
    plan = Plan(rows=args.rows, seq=args.seq, steps=args.steps,
                micro_batch_tokens=max(Plan.micro_batch_tokens, args.seq))
    if args.dry_run:
        print(describe(spec, plan))
        problems = arithmetic_problems(spec)
        for p in problems:
            print(f"gpu_check: problem: {p}")
        if problems:
            return 1
        print("FLOP/MFU arithmetic: the hand-worked case and the model's own parameter count agree")
        print(f"the same measurement on the CPU: {PARITY.num_layers}-layer tiny model, {DRY_PLAN.rows} x "
              f"{DRY_PLAN.seq} "
              "tokens (figures meaningless; every step of the GPU run)")
        dry = measure(PARITY, DRY_PLAN, PARITY, DRY_PLAN, "cpu", args.tests_xml, args.peak_tflops)
        print(json.dumps(dry | {"dry_run": True}))
        return 0
    if not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device here; use --dry-run", file=sys.stderr)
        return 2
    print(describe(spec, plan), file=sys.stderr)
    print(json.dumps(measure(spec, plan, SLICE, SLICE_PLAN, "cuda", args.tests_xml, args.peak_tflops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
