"""The config, as each component reads it: one function per spec (the typed inputs of workers, engines and
the math), the only place config fields become them (defaults live in the config sections, config/run.py
and config/learning.py). A run builds them once, at start-up (`run_specs`), and hands them down.

    run = run_specs(cfg, model_path)   # run.groups["policy"].model, run.engine, run.targets, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moe_rl.config import RunConfig


@dataclass(frozen=True)
class GroupSpec:
    """What one trainer group's ranks are built from: the model, the optimizer, the seed, what the ranks
    compute ("policy": log-probs, "critic": values), whether they train, and where a value head comes from
    (a critic or reward model from another checkpoint: its score head)."""

    model: Any  # train.model.ModelSpec
    optim: Any  # train.optim.OptimSpec
    seed: int
    role: str = "policy"
    trains: bool = True
    value_head_from: str | None = None


@dataclass(frozen=True)
class RunSpecs:
    """Everything a run's workers and math are built from: each trainer group's (by actor slot, in the
    order they start: policy, critic, reference, reward_model, teachers), the engines', the agent
    loop's, the environment's, the losses' and the targets'."""

    groups: dict[str, GroupSpec]
    engine: Any  # rollout.engine_spec.EngineSpec
    agent: Any  # rollout.agent.AgentSpec
    env: Any  # rollout.envs.EnvSpec
    policy_loss: Any  # train.objectives.PolicyLoss
    value_loss: Any  # train.objectives.ValueLoss
    targets: Any  # algos.targets.TargetSpec


def run_specs(cfg: RunConfig, model_path: str) -> RunSpecs:
    """The run's specs, for its model at `model_path`."""
    return RunSpecs(group_specs(cfg, model_path), engine_spec(cfg, model_path), agent_spec(cfg),
                    env_spec(cfg), policy_loss(cfg), value_loss(cfg), target_spec(cfg))


def group_specs(cfg: RunConfig, model_path: str) -> dict[str, GroupSpec]:
    """The trainer groups the run needs, by actor slot. The critic (critic.init_from: the policy's
    checkpoint, or another one whose score head becomes the value head) and the reward model route
    freely: replaying the policy's rollout routes would force another model's routers onto the policy's
    choices. A LoRA policy's reference is its own frozen base (scored with the adapters off): no group.
    Distillation teachers are frozen and score the student's tokens with their own routing."""
    base, seed = model_spec(cfg, model_path), cfg.run.seed
    policy_optim = optim_spec(cfg, cfg.trainer.lr, cfg.trainer.lr_mult)
    critic_optim = optim_spec(cfg, cfg.critic.lr, cfg.critic.lr_mult)
    groups = {"policy": GroupSpec(policy_spec(cfg, model_path), policy_optim, seed)}
    if cfg.critic_enabled:
        source = None if cfg.critic.init_from == "policy" else cfg.critic.init_from
        critic = dataclasses.replace(base, hf_path=source or model_path, routing_replay=False)
        groups["critic"] = GroupSpec(critic, critic_optim, seed + 1, "critic", value_head_from=source)
    if cfg.actors["reference"]:
        groups["reference"] = GroupSpec(base, policy_optim, seed + 2, trains=False)
    if cfg.reward_model.path:
        rm = cfg.reward_model.path
        groups["reward_model"] = GroupSpec(dataclasses.replace(model_spec(cfg, rm), routing_replay=False),
                                           critic_optim, seed + 3, "critic", trains=False, value_head_from=rm)
    for slot, path in cfg.teachers.items():
        groups[slot] = GroupSpec(teacher_spec(cfg, path), policy_optim, seed + 4, trains=False)
    return groups


def model_spec(cfg: RunConfig, hf_path: str):
    from moe_rl.train.model import ModelSpec

    m = cfg.model
    return ModelSpec(hf_path=hf_path, dtype=m.dtype, layer_spec=m.layer_spec, experts=m.experts, fp8=m.fp8,
                     recompute=m.recompute, moe_dispatcher=m.moe_dispatcher,
                     routing_replay=cfg.rollout.record_routes, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                     moe_z_loss_coeff=m.moe_z_loss_coeff,
                     expert_bias_update_rate=0.0 if cfg.rollout.record_routes else m.expert_bias_update_rate)


def convert_spec():
    """The model settings `moe-rl convert` builds a checkpoint's model with: the default config's (the
    conversion gives it the checkpoint's path and dtype)."""
    return model_spec(RunConfig(), "")


def policy_spec(cfg: RunConfig, hf_path: str):
    """The policy's model: model_spec with model.lora's adapters where model.lora.rank > 0."""
    from moe_rl.train.lora import LoraSpec

    lo = cfg.model.lora
    return dataclasses.replace(model_spec(cfg, hf_path), lora=LoraSpec(
        rank=lo.rank, alpha=lo.alpha, targets=tuple(lo.targets)) if lo.rank else None)


def teacher_spec(cfg: RunConfig, hf_path: str):
    """A distillation teacher's model: routing freely (R3 replays the student's routes), in teacher.dtype
    where set."""
    return dataclasses.replace(model_spec(cfg, hf_path), routing_replay=False,
                               dtype=cfg.teacher.dtype or cfg.model.dtype)


def optim_spec(cfg: RunConfig, lr: float, lr_mult: dict[str, float]):
    from moe_rl.train.optim import OptimSpec

    tr = cfg.trainer
    return OptimSpec(lr=lr, lr_mult=tuple(lr_mult.items()), weight_decay=tr.weight_decay,
                         adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, grad_clip=tr.grad_clip,
                         distributed_optimizer=cfg.parallel.distributed_optimizer,
                         micro_batch_tokens=tr.micro_batch_tokens, pack_sequences=tr.pack_sequences,
                         logit_chunk_tokens=tr.logit_chunk_tokens, optimizer_offload=tr.optimizer_offload,
                         precision_aware=tr.precision_aware_optimizer,
                         adam_moments_dtype=tr.adam_moments_dtype)


def engine_spec(cfg: RunConfig, model_path: str):
    from moe_rl.rollout.engine_spec import EngineSpec

    r = cfg.rollout
    return EngineSpec(model_path, dtype=cfg.model.dtype, max_model_len=r.max_model_len, seed=cfg.run.seed,
                      record_routes=r.record_routes, kv_cache_gb=r.kv_cache_gb, route_source=r.route_source,
                      weight_transfer=r.weight_transfer, max_num_seqs=r.max_num_seqs,
                      max_num_batched_tokens=r.max_num_batched_tokens,
                      gpu_memory_utilization=cfg.engine_gpu_share, cpu_kv_cache_max_gb=r.CPU_KV_CACHE_GB,
                      cpu_kv_fills=r.CPU_KV_FILLS, gpu_batched_tokens=r.GPU_BATCHED_TOKENS,
                      sleep=r.sleep_engines, tensor_parallel_size=r.engine_tp, expert_parallel=r.engine_ep,
                      lora=engine_lora(cfg))


def engine_lora(cfg: RunConfig):
    """The policy's adapters as the engines see them (None without model.lora)."""
    from moe_rl.rollout.engine_spec import EngineLoraSpec

    lo = cfg.model.lora
    return EngineLoraSpec(lo.rank, lo.alpha, tuple(lo.targets), lo.sync) if lo.rank else None


def agent_spec(cfg: RunConfig):
    from moe_rl.rollout.agent import AgentSpec

    env, r = cfg.environment, cfg.rollout
    return AgentSpec(max_turns=env.max_turns, token_budget=env.token_budget,
                         max_model_len=r.max_model_len, max_tokens_per_turn=r.max_new_tokens,
                         temperature=r.temperature, top_p=r.top_p, overlong_filter=env.overlong_filter)


def env_spec(cfg: RunConfig):
    """The run's environments as any process can make them (rollout.envs.EnvSpec): the name and the
    reward function (file paths made absolute), the options as data, the run-level settings."""
    from moe_rl.rollout.envs import EnvContext, EnvSpec, absolute_name

    e = cfg.environment
    name = absolute_name(e.name)
    return EnvSpec(name, EnvSpec(name).env_cls.portable_options(dict(e.options)),
                   EnvContext(e.tool_timeout_s, absolute_name(e.reward_fn) if e.reward_fn else ""))


def policy_loss(cfg: RunConfig):
    from moe_rl.algos import registry
    from moe_rl.algos.losses import PolicyLossSpec
    from moe_rl.train.objectives import PolicyLoss

    a = cfg.algorithm
    # pi_old from the update's own forward (not under bypass, where pi_old is mu), mu = pi_old checked
    # there in a synchronous step
    from_forward = cfg.proximal_from_update and not registry.meta("correction", a.correction).old_is_behaviour
    hp = PolicyLossSpec(**{f.name: getattr(a, f.name) for f in dataclasses.fields(PolicyLossSpec)})
    return PolicyLoss(a.policy_loss, hp, a.aggregation, a.kl_loss_coef,
                      a.kl_loss_estimator, a.entropy_coef, old_from_forward=from_forward,
                      check_sync=from_forward and not cfg.rollout.async_mode, policy_mask=a.policy_mask,
                      mask_spec=mask_spec(cfg))


def mask_spec(cfg: RunConfig):
    from moe_rl.algos.masking import PolicyMaskSpec

    return PolicyMaskSpec(cfg.algorithm.opsm_delta, cfg.algorithm.m2po_tau)


def value_loss(cfg: RunConfig):
    from moe_rl.train.objectives import ValueLoss

    return ValueLoss(cfg.critic.value_clip)


def target_spec(cfg: RunConfig):
    from moe_rl.algos.correction import CorrectionSpec
    from moe_rl.algos.targets import TargetSpec

    a = cfg.algorithm
    return TargetSpec(
        advantage=a.advantage, gamma=a.gamma, lam=a.lam, lam_critic=a.lam_critic,
        length_adaptive_alpha=a.length_adaptive_alpha, whiten=a.whitens,
        kl_reward_coef=a.kl_reward_coef, kl_reward_estimator=a.kl_reward_estimator,
        needs_reference=cfg.uses_reference, overlong_buffer=a.overlong_buffer,
        overlong_penalty=a.overlong_penalty, token_budget=cfg.environment.token_budget,
        correction=a.correction,
        correction_params=CorrectionSpec(a.is_cap, a.seq_is_cap, a.icepop_min, a.icepop_max, a.geo_min,
                                           a.geo_max),
        ewma_anchor=a.anchor == "ewma", aggregation=a.aggregation,
        loss_constant=a.loss_constant or float(cfg.environment.token_budget), self_normalize=a.self_normalize,
        synchronous=not cfg.rollout.async_mode, reward_model_weight=cfg.reward_model.weight,
        rule_weight=cfg.reward_model.rule_weight, distill_coef=a.distill_coef)
