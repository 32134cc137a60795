"""Will a recipe fit a cluster? Sizes from the Hugging Face config alone (no weights), per role and per GPU.

    plan = make_plan(cfg, hf_config_of(cfg, None))   # against cfg.cluster.gpus_per_node / gpu_memory_gb
    print(render(plan)); plan.problems               # one line per reason it cannot fit

Parameter counts follow the architectures as transformers builds them (moe_rl/model_shape.py: Qwen3-MoE,
Qwen2-MoE, Mixtral, the DeepSeek-V3 family with multi-latent attention, GLM-4.5). Trainer memory per
rank, with P_d the non-expert parameters on the rank's pipeline stage split over tp, and P_e its
routed-expert parameters split over ep * etp:

    weights      (P_d + P_e) * b                      b = 2 (bf16) or 4 (fp32)
    gradients    (P_d + P_e) * 4                      Megatron's fp32 gradient buffer
    optimizer    P_d * o / (dp * cp) + P_e * o / edp  Adam m, v (+ fp32 master weights under bf16):
                                                      o = 12 (bf16) or 8. The trainer uses megatron's
                                                      distributed optimizer (parallel.distributed_optimizer)
                                                      only where dp > 1 (train/worker.py), which shards
                                                      dense state over the dp * cp ranks and expert state
                                                      over the edp expert-data-parallel ranks; with dp = 1
                                                      the state is whole (also under cp > 1)
    activations  T * (L * a + n) / (tp * cp)          T = the longest microbatch: trainer.micro_batch_tokens,
                                                      or rollout.max_model_len where a row can be longer
                                                      (it is a microbatch alone); 1F1B keeps pp
                                                      microbatches of L / pp layers on the first stage;
                                                      a = bytes per token and layer below (recompute:
                                                      the layer input only, plus one layer recomputed),
                                                      n the final norm's
    logits       c * V / tp * (12 + b) + ...          the log-probs a chunk of c = trainer.logit_chunk_tokens
                                                      tokens at a time (`logits_memory`); with 0, the whole
                                                      T / cp x V / tp logits, l bytes per element

The tensors a layer keeps for backward, per token (`ModelShape.activation_bytes`): under Transformer
Engine's fused kernels, an estimate: attention b (2h + (n_q + 2 n_kv) d + n_q d), MoE MLP
b (h + k (2h + 3f)) + 4E (fp32 router logits), dense MLP b (2h + 3 f_dense); under the local spec, what
its float32 norms, RoPE, padded attention and permuted experts keep, as measured on the CPU trainer
(tests/train/test_plan_memory.py, within 5%). The logits' l (`logit_bytes`; tests/train/test_plan_memory.py
measures it) is the most the log-probs and the entropy hold at once. Training: 24 = the fp32 z - max(z)
and exp(z - max) kept for backward (8) plus the four fp32 temporaries their backward holds together (16:
the gradients of
the entropy's exp(z) * z with respect to both factors, the gather's zeros and its scatter_add), more than
the forward's peak (b for the model's logits + 12 for z, exp(z) and exp(z) * z); the model's logits are
freed before the backward. Scoring (no gradients): b + 12. Engines: weights / engine_tp (where the
engines apply LoRA adapters, vLLM's buffers for two adapters too: `engine_lora_params`), then the KV cache
of what is left, 2 * layers * n_kv * d * b bytes per token.

cluster.gpu_memory_gb is a GPU's memory as its maker names it (H100 80GB: 80, H200 141GB: 141), and GPU
makers' GB are binary: the plan reads it as GiB (2**30 bytes), the unit of every figure it prints (CUDA
reports 79.6 GiB for an H100 80GB, 80.0 for an A100 80GB, 140.4 for an H200 141GB). A GPU's usable
memory is USABLE of that (CUDA context, NCCL buffers and allocator fragmentation take the rest).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from moe_rl.model_shape import ModelShape
from moe_rl.plan_report import colocated_phases, node_host_memory, render  # noqa: F401 (render: plan's API)

GiB = 2**30
USABLE = 0.9  # of a GPU's memory, for tensors
ENGINE_RESERVE_GIB = 2.0  # an engine's CUDA graphs, sampler and runtime buffers beyond weights and KV cache


@dataclass
class RolePlan:
    role: str
    gpus: int
    per_gpu: dict[str, float]  # component -> bytes on the busiest GPU of the role
    notes: list[str] = field(default_factory=list)
    host: float = 0.0  # bytes each rank keeps in host memory (trainer.optimizer_offload's state)

    @property
    def total(self) -> float:
        return sum(self.per_gpu.values())


@dataclass
class Plan:
    shape: ModelShape
    gpus_per_node: int
    gpu_memory_gb: float
    roles: list[RolePlan]
    gpus: int  # the run's GPUs (RunConfig.gpus: colocated roles share theirs)
    nodes: int
    route_bytes: int  # host memory for one step's routes
    sync_bytes: int  # what one weight sync moves
    problems: list[str]
    adapter_params: int = 0  # LoRA's trained parameters in the whole policy (0: no adapters)
    lora_sync: tuple[str, str] = ("", "")  # adapters | merged, and why (engine_spec.resolve_lora_sync)
    colocated: bool = False  # the roles share each GPU (cluster.colocate)
    host_bytes: float = 0.0  # the fullest node's host memory: trainers' offloaded state, one step's routes
    host_memory_gb: float = 0.0  # cluster.host_memory_gb
    # colocated: each phase's bytes on a GPU and what it holds ("generation", "training"; `phases`)
    phases: dict[str, tuple[float, str]] = field(default_factory=dict)

    @property
    def fullest(self) -> tuple[str, float]:
        """The GPU that holds the most: what it holds (the roles sharing it, colocated) and its bytes."""
        if self.colocated:  # the phase that binds
            name, (size, held) = max(self.phases.items(), key=lambda kv: kv[1][0])
            return f"{name} ({held})", size
        top = max(self.roles, key=lambda r: r.total)
        return top.role, top.total

    @property
    def headroom(self) -> float:
        """The share of a GPU's memory the fullest GPU leaves free."""
        return 1 - self.fullest[1] / (self.gpu_memory_gb * GiB)


def dtype_bytes(cfg) -> int:
    return 2 if cfg.model.dtype == "bfloat16" else 4


def stage_layers(shape: ModelShape, pp: int, stage: int) -> tuple[int, int]:
    """(dense, MoE) layers of pipeline stage `stage`: ceil(layers / pp) layers each, the dense layers
    first."""
    per = math.ceil(shape.layers / pp)
    layers = range(stage * per, min((stage + 1) * per, shape.layers))
    dense = sum(1 for i in layers if i < shape.dense_layers)
    return dense, len(layers) - dense


def stage_params(shape: ModelShape, pp: int, stage: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of pipeline stage `stage`: `stage_layers`; the embedding on
    the first stage, final norm and output on the last."""
    dense, moe = stage_layers(shape, pp, stage)
    ends = 0
    if stage == 0:
        ends += shape.vocab * shape.hidden
    if stage == pp - 1:
        ends += shape.hidden + (0 if shape.tied and pp == 1 else shape.vocab * shape.hidden)
    return ((dense + moe) * shape.attention + moe * shape.moe_shared + dense * shape.dense_mlp + ends,
            moe * shape.experts * shape.expert)


def lora_params(shape: ModelShape, rank: int, targets, tp: int = 1, ep: int = 1, pp: int = 1,
                stage: int = 0, etp: int | None = None) -> tuple[float, float]:
    """(non-expert, routed-expert) LoRA adapter parameters on one rank of pipeline stage `stage`
    (train/lora.py): a linear [out, in] gets A [r, in] and B [out, r]; a column-parallel one (linear_qkv,
    linear_fc1) keeps A whole and shards B over tp, a row-parallel one (linear_proj, linear_fc2) shards
    A and keeps B whole; the router [experts, h] keeps both whole. Every MLP is gated (fc1 out = 2 f), each
    routed expert has its own adapters and the experts split over ep (and their linears over etp, the
    expert tensor parallelism: tp where None)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def column(i: int, o: int, name: str, tp: int = tp) -> float:
        return rank * (i + o / tp) if name in targets else 0.0

    def row(i: int, o: int, name: str, tp: int = tp) -> float:
        return rank * (i / tp + o) if name in targets else 0.0

    def mlp(f: int, tp: int = tp) -> float:
        return column(h, 2 * f, "linear_fc1", tp) + row(f, h, "linear_fc2", tp) if f else 0.0

    dense, moe = stage_layers(shape, pp, stage)
    attention = column(h, q + 2 * kv, "linear_qkv") + row(q, h, "linear_proj")
    router = rank * (h + shape.experts) if "router" in targets else 0.0  # whole on every rank
    head = column(h, shape.vocab, "output_layer") if stage == pp - 1 else 0.0  # the last stage's
    return ((dense + moe) * attention + dense * mlp(shape.dense_ffn) + moe * (mlp(shape.shared_ffn) + router)
            + head, moe * shape.experts / ep * mlp(shape.moe_ffn, etp or tp))


def fused_a_copies(shape: ModelShape, rank: int, targets, experts: float) -> float:
    """The A's that a fused linear hands each of its Hugging Face modules beyond its own, with `experts`
    routed experts a layer: linear_qkv's to q, k and v (two more a layer), linear_fc1's to gate and up (one
    more, every MLP and expert)."""
    mlps = shape.dense_layers * bool(shape.dense_ffn) + shape.moe_layers * (bool(shape.shared_ffn) + experts)
    copies = (2 * shape.layers if "linear_qkv" in targets else 0) + (mlps if "linear_fc1" in targets else 0)
    return copies * rank * shape.hidden


def peft_export_params(shape: ModelShape, rank: int, targets) -> int:
    """The whole policy's adapter tensors as an adapter sync moves them (hf_io.export_peft_adapters, PEFT's
    naming): `lora_params` and `fused_a_copies`."""
    return round(sum(lora_params(shape, rank, targets)) + fused_a_copies(shape, rank, targets, shape.experts))


def engine_lora_params(shape: ModelShape, rank: int, targets, tp: int, ep: bool) -> float:
    """Elements of the LoRA buffers vLLM keeps on one engine GPU for one adapter slot (vLLM 0.32's
    create_lora_weights: every targeted module holds max_lora_rank wide A and B, whatever the adapter's
    rank): a module per Hugging Face module, so the fused ones' A's are there per slice (`fused_a_copies`);
    linears shard over the engine's tp as the trainer's do (`lora_params`), and so do the experts' linears,
    or with rollout.engine_ep the experts split over the tp GPUs and stay whole."""
    from moe_rl.rollout.engine_spec import VLLM_LORA_RANKS

    r = min(v for v in VLLM_LORA_RANKS if v >= rank)
    dense, expert = lora_params(shape, r, targets, tp=tp)
    if ep:
        _, expert = lora_params(shape, r, targets, tp=1, ep=tp)
    return dense + expert + fused_a_copies(shape, r, targets, shape.experts / tp if ep else shape.experts)


def trainer_memory(shape: ModelShape, cfg, role: str) -> dict[str, float]:
    """Bytes on the busiest rank of a trainer: policy and critic train, the reference, the reward model
    and the distillation teachers only score (no gradients, no optimizer state); under PPO-EWMA the
    policy also keeps an fp32 anchor of its weights."""
    return trainer_memory_and_host(shape, cfg, role)[0]


def trainer_memory_and_host(shape: ModelShape, cfg, role: str) -> tuple[dict[str, float], float]:
    """`trainer_memory`'s GPU bytes by component, and the bytes the rank keeps in host memory: with
    trainer.optimizer_offload f, megatron's HybridDeviceOptimizer moves f of the Adam moments (8 bytes a
    parameter of the rank's shard) off the GPU, and keeps on the host an fp32 copy of those parameters,
    their fp32 gradients and the moments (16 bytes each); the fp32 main shard stays on the GPU, the
    step's copy target. With trainer.precision_aware_optimizer the optimizer owns the main weights: under
    offload, the host part's with its state (the GPU keeps 12 bytes of (1 - f) of the shard); without,
    Transformer Engine's FusedAdam keeps their 16-bit remainders (2 bytes) and the two moments in
    trainer.adam_moments_dtype."""
    trains = role in ("policy", "critic")
    par, b = cfg.parallel, dtype_bytes(cfg)
    tp, pp, cp, ep, etp = par.tp, par.pp, par.cp, par.ep, par.expert_tp
    p_dense, p_expert = max(((d / tp, e / (ep * etp))
                             for d, e in (stage_params(shape, pp, s) for s in range(pp))),
                            key=sum)  # the stage with the most parameters per rank
    out = {"weights": (p_dense + p_expert) * b}
    # a microbatch: rows up to trainer.micro_batch_tokens, or one longer row alone (Batch.microbatches)
    tokens = max(cfg.trainer.micro_batch_tokens, cfg.rollout.max_model_len) / (tp * cp)
    lora, host = cfg.model.lora, 0.0
    if role == "policy" and lora.rank:  # the base frozen: only the adapters have gradients and Adam state
        p_dense, p_expert = max((lora_params(shape, lora.rank, lora.targets, tp, ep, pp, stage, etp)
                                 for stage in range(pp)), key=sum)
        out["lora_adapters"] = (p_dense + p_expert) * b
    if trains:
        opt = 12 if b == 2 else 8
        edp = max(par.world_size // (pp * ep * etp), 1)
        # as a trainer rank: megatron's distributed optimizer sharding over its dp*cp group, where it shards
        from moe_rl.train.optim import shards_optimizer

        offload, aware = cfg.trainer.optimizer_offload, cfg.trainer.precision_aware_optimizer
        distributed = shards_optimizer(par.distributed_optimizer, par.dp, offload, aware)
        dp_shards, edp_shards = (par.dp * cp, edp) if distributed else (1, 1)
        out["gradients"] = (p_dense + p_expert) * 4
        shard = p_dense / dp_shards + p_expert / edp_shards  # parameters whose Adam state this rank holds
        if aware and offload:
            opt = 12 * (1 - offload)
        elif aware:
            opt = 2 + 2 * (4 if cfg.trainer.adam_moments_dtype == "float32" else 2)
        else:
            opt -= 8 * offload
        out["optimizer"] = shard * opt
        host = shard * 16 * offload
        # 1F1B: pp microbatches of L/pp
        local = cfg.model.layer_spec == "local"
        kept = tokens * (shape.layers * shape.activation_bytes(cfg.model.recompute, b, local)
                         + shape.final_norm_bytes(b, local))
        if cfg.model.recompute:  # and one layer's full activations while it is recomputed
            kept += tokens * shape.activation_bytes(False, b, local)
        out["activations"] = kept
        if role == "policy" and cfg.algorithm.anchor == "ewma":
            out["ewma_anchor"] = (p_dense + p_expert) * 4
    if role not in ("critic", "reward_model"):
        out["logits"] = logits_memory(shape, cfg, role, tokens * tp)
    return out, host if trains else 0.0


def logits_memory(shape: ModelShape, cfg, role: str, rows: float) -> float:
    """The log-probs' and entropy's peak on the last stage, for `rows` tokens of a microbatch on this rank
    (its CP share; all of them under SP: the output layer gathers them). The whole logits
    (trainer.logit_chunk_tokens 0): rows x V/tp x `logit_bytes`. A chunk at a time
    (train/logprobs.chunked_target_logprobs): c = min(chunk, rows) rows of V/tp logits, 12 + b bytes each
    when training (the model-dtype product, then float32 z, p and dz at once in the backward), 8 when only
    scoring (z and exp(z)); where the output weight trains, its gradient summed over the chunks (in bf16,
    float64 for a float32 weight), V/tp x h x b (8); a LoRA-adapted output
    layer's W + s B A, V/tp x h x b; and the hidden states' gradient, rows x h x 2b."""
    b, chunk, par = dtype_bytes(cfg), cfg.trainer.logit_chunk_tokens, cfg.parallel
    trains = role in ("policy", "critic")
    vocab = shape.vocab / par.tp
    if not chunk:
        return rows * vocab * logit_bytes(b, trains)
    c = min(chunk, rows)
    lora_out = role == "policy" and cfg.model.lora.rank and "output_layer" in cfg.model.lora.targets
    weight_trains = trains and (lora_out or not cfg.model.lora.rank)
    total = c * vocab * ((12 + b) if trains else 8) + rows * shape.hidden * (2 * b if trains else b)
    if weight_trains:
        total += vocab * shape.hidden * (8 if b == 4 else b)
    if lora_out:
        total += vocab * shape.hidden * b
    return total


def logit_bytes(model_bytes: int, trains: bool) -> int:
    """The most bytes per logit element that the log-probs and entropy of train/logprobs.py hold at once
    (see the module docstring): 24 when training (fp32 z and exp(z) kept for backward, and four fp32
    temporaries of their backward), model_bytes + 12 when only scoring (the model's logits, fp32 z,
    exp(z) and exp(z) * z)."""
    return 24 if trains else model_bytes + 12


def engine_memory(shape: ModelShape, cfg, gpu_bytes: float, adapters: bool) -> tuple[dict[str, float], float]:
    """(bytes per engine GPU, KV-cache tokens an engine holds). An engine spans rollout.engine_tp GPUs,
    each with 1/engine_tp of the weights and of the KV heads; `adapters` (the engines apply the policy's
    LoRA adapters): its LORA_SLOTS slots of LoRA buffers (`engine_lora_params`) too, before the KV cache."""
    from moe_rl.rollout.engine_spec import LORA_SLOTS

    b, tp, r, lo = dtype_bytes(cfg), cfg.rollout.engine_tp, cfg.rollout, cfg.model.lora
    held = {"weights": shape.total * b / tp}
    if adapters:
        per_slot = engine_lora_params(shape, lo.rank, lo.targets, tp, r.engine_ep)
        held["lora_buffers"] = LORA_SLOTS * per_slot * b
    held["runtime"] = ENGINE_RESERVE_GIB * GiB
    kv = r.kv_cache_gb * GiB if r.kv_cache_gb is not None \
        else max(0.0, cfg.engine_gpu_share * gpu_bytes - sum(held.values()))
    return held | {"kv_cache": kv}, kv / shape.kv_bytes_per_token(b, tp)


def make_plan(cfg, hf_config: dict) -> Plan:
    shape = ModelShape.from_hf(hf_config)
    cluster = cfg.cluster
    gpu = cluster.gpu_memory_gb * GiB  # GPU makers' GB are GiB (module docstring)
    usable = USABLE * gpu
    actors = cfg.actors
    problems: list[str] = []
    roles = []
    # a reward model and each teacher have their own shape, where their config is here
    paths = {"reward_model": cfg.reward_model.path, **cfg.teachers}
    shapes = {role: ModelShape.from_hf(json.loads((Path(path) / "config.json").read_text()))
              for role, path in paths.items() if path and (Path(path) / "config.json").is_file()}
    for role in ("policy", "critic", "reference", "reward_model", *cfg.teachers):
        if actors[role]:  # the teachers in their own layout and dtype
            own = dataclasses.replace(cfg, parallel=cfg.teacher_parallel, model=dataclasses.replace(
                cfg.model, dtype=cfg.teacher.dtype or cfg.model.dtype)) if role in cfg.teachers else cfg
            gpu_bytes, host = trainer_memory_and_host(shapes.get(role, shape), own, role)
            roles.append(RolePlan(role, actors[role], gpu_bytes, host=host))
    lora, lora_sync = cfg.model.lora, ("", "")
    if lora.rank:  # on the GPU engines a plan is for
        lora_sync = cfg.lora_sync(True)
    engine, kv_tokens = engine_memory(shape, cfg, gpu, lora_sync[0] == "adapters")
    engines = RolePlan("engine", actors["engine"] * cfg.rollout.engine_tp, engine,
                       [f"{kv_tokens:,.0f} KV-cache tokens ({kv_tokens / cfg.rollout.max_model_len:.1f} "
                        f"sequences of max_model_len={cfg.rollout.max_model_len})"])
    roles.append(engines)
    # GPU i holds rank i of every model and an engine worker (placement.gpu_layout): the peak of each phase
    phases = colocated_phases(roles, cfg) if cfg.cluster.colocate else {}  # moe_rl/plan_phases.py
    for name, (size, held) in phases.items():
        if size > usable:
            problems.append(f"colocated, {name}: {held} = {size / GiB:.1f} GiB per GPU does not fit "
                            f"{usable / GiB:.1f} GiB ({USABLE:.0%} of {cluster.gpu_memory_gb:g} GiB)")
    for rp in roles[:-1] if not cfg.cluster.colocate else ():
        if rp.total > usable:
            problems.append(f"{rp.role}: {rp.total / GiB:.1f} GiB per GPU does not fit {usable / GiB:.1f} "
                            f"GiB ({USABLE:.0%} of {cluster.gpu_memory_gb:g} GiB)")
    if engines.total > gpu:  # vLLM's utilisation is a share of the whole GPU; a fixed KV cache may overshoot
        problems.append(f"engine: {engines.total / GiB:.1f} GiB per GPU does not fit a "
                        f"{cluster.gpu_memory_gb:g} GiB GPU")
    if kv_tokens < cfg.rollout.max_model_len:
        problems.append(f"engine: {kv_tokens:,.0f} KV-cache tokens cannot hold one sequence of max_model_len="
                        f"{cfg.rollout.max_model_len} ({engine['weights'] / GiB:.1f} GiB of weights on each "
                        f"{cluster.gpu_memory_gb:g} GiB GPU; rollout.engine_tp={cfg.rollout.engine_tp})")
    if cfg.rollout.engine_tp > cluster.gpus_per_node:
        problems.append(f"rollout.engine_tp={cfg.rollout.engine_tp} spans nodes ({cluster.gpus_per_node} "
                        "GPUs per node): an engine's workers share one node")
    for setting, tp in (("parallel.tp", cfg.parallel.tp),
                        *((("teacher.tp", cfg.teacher_parallel.tp),) if cfg.teachers else ())):
        if tp > cluster.gpus_per_node:
            problems.append(f"{setting}={tp} spans nodes ({cluster.gpus_per_node} GPUs per node): tensor "
                            "parallelism needs one node's links")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    route_bytes = (samples * cfg.rollout.max_model_len * shape.moe_layers * shape.top_k
                   * (1 if shape.experts <= 256 else 2))
    host = node_host_memory(roles, cfg) + route_bytes
    if host > USABLE * cluster.host_memory_gb * GiB:
        problems.append(f"host memory: {host / GiB:.1f} GiB on the fullest node (offloaded state and one "
                        f"step's routes) does not fit {USABLE * cluster.host_memory_gb:.1f} "
                        "GiB "
                        f"({USABLE:.0%} of cluster.host_memory_gb={cluster.host_memory_gb:g})")
    adapters = round(sum(lora_params(shape, lora.rank, lora.targets))) if lora.rank else 0
    # a sync moves the adapters alone where the engines apply them, else the whole (merged) model
    synced = peft_export_params(shape, lora.rank, lora.targets) if lora_sync[0] == "adapters" else shape.total
    sync_bytes = synced * dtype_bytes(cfg)
    return Plan(shape, cluster.gpus_per_node, cluster.gpu_memory_gb, roles, cfg.gpus,
                math.ceil(cfg.gpus / cluster.gpus_per_node), route_bytes, sync_bytes, problems, adapters,
                lora_sync, cfg.cluster.colocate, host, cluster.host_memory_gb, phases)


def hf_config_of(cfg, model_config: str | None) -> dict:
    """The HF config dict: `model_config` (a config.json or a directory holding one), else model.path's,
    else the tiny model's."""
    if model_config or cfg.model.path:
        path = Path(model_config or cfg.model.path)
        path = path if path.suffix == ".json" else path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no model config at {path}; pass --model-config PATH (a config.json)")
        return json.loads(path.read_text())
    from moe_rl.tiny import VOCAB_SIZE, hf_config

    return hf_config(cfg.model.tiny, eos_token_id=VOCAB_SIZE - 1, pad_token_id=VOCAB_SIZE - 2).to_dict()
