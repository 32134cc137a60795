"""moe_rl.driver.specs is the one place config fields become component settings, and the config sections
(config/run.py, config/learning.py) the one place their defaults live: every field of a settings object that
mirrors a config field carries the config's value (each set away from its default here), and its
dataclass declares no default for it."""

import dataclasses
from operator import attrgetter

import pytest

from moe_rl.algos.correction import CorrectionSpec
from moe_rl.algos.losses import PolicyLossSpec
from moe_rl.algos.masking import PolicyMaskSpec
from moe_rl.algos.targets import TargetSpec
from moe_rl.config import (
    AlgorithmSection,
    ClusterSection,
    CriticSection,
    EnvironmentSection,
    LoraSection,
    ModelSection,
    ParallelSection,
    RewardModelSection,
    RolloutSection,
    RunConfig,
    RunSection,
    TrainerSection,
)
from moe_rl.driver import specs
from moe_rl.rollout.agent import AgentSpec
from moe_rl.rollout.engine_spec import EngineLoraSpec, EngineSpec
from moe_rl.train.lora import LoraSpec
from moe_rl.train.model import ModelSpec
from moe_rl.train.objectives import PolicyLoss
from moe_rl.train.optim import OptimSpec

# every config field a settings object reads, away from its default
CFG = RunConfig(
    run=RunSection(seed=4321),
    model=ModelSection(dtype="bfloat16", layer_spec="transformer_engine", experts="sequential", fp8="delayed",
                       recompute=True,
                       moe_dispatcher="allgather", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                       expert_bias_update_rate=0.002,  # read with rollout.record_routes=false (below)
                       lora=LoraSection(rank=8, alpha=4.0, targets=["linear_qkv", "linear_fc2"],
                                        sync="merged")),
    parallel=ParallelSection(distributed_optimizer=False),
    rollout=RolloutSection(max_model_len=999, max_new_tokens=77, temperature=0.7, top_p=0.9,
                           record_routes=False, route_source="capture", weight_transfer="nccl",
                           kv_cache_gb=3.5, async_mode=True, max_num_seqs=33, max_num_batched_tokens=4444,
                           gpu_memory_utilization=0.6, sleep_engines=True, engine_tp=2, engine_ep=True),
    cluster=ClusterSection(colocate=False),
    environment=EnvironmentSection(max_turns=7, token_budget=333, overlong_filter=True),
    algorithm=AlgorithmSection(
        advantage="grpo", gamma=0.99, lam=0.9, lam_critic=0.8, length_adaptive_alpha=2.0,
        whiten_advantages=False, policy_loss="gspo", clip_low=0.1, clip_high=0.3, dual_clip=3.0,
        sapo_tau_pos=2.0, sapo_tau_neg=0.5,
        aggregation="seq_mean", loss_constant=50.0, kl_reward_coef=0.01, kl_reward_estimator="k2",
        kl_loss_coef=0.02, kl_loss_estimator="k1", entropy_coef=0.001, correction="tis_token", is_cap=3.0,
        seq_is_cap=11.0, icepop_min=0.4, icepop_max=2.5, geo_min=0.9, geo_max=1.1, policy_mask="opsm",
        opsm_delta=0.05, m2po_tau=0.1, self_normalize=True, anchor="ewma",
        overlong_buffer=20, overlong_penalty=0.5, distill_coef=0.7),
    trainer=TrainerSection(lr=3e-4, weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.95, grad_clip=0.5,
                           micro_batch_tokens=999, pack_sequences=False,
                           logit_chunk_tokens=333, optimizer_offload=0.25, precision_aware_optimizer=True,
                           adam_moments_dtype="bfloat16"),
    critic=CriticSection(lr=7e-4, lr_mult={"*.linear_fc1.weight": 0.5}),
    reward_model=RewardModelSection(path="/rm", weight=0.5, rule_weight=2.0),
)


def at(path: str):
    return attrgetter(path)


# settings function -> (its dataclass, {field: where in the config its value comes from},
# fields that are no config field: arguments of the function or the component's own defaults)
CASES = {
    "model_spec": (lambda cfg: specs.model_spec(cfg, "ckpt/dir"), ModelSpec, {
        "dtype": at("model.dtype"), "layer_spec": at("model.layer_spec"), "experts": at("model.experts"),
        "fp8": at("model.fp8"),
        "recompute": at("model.recompute"), "moe_dispatcher": at("model.moe_dispatcher"),
        "routing_replay": at("rollout.record_routes"), "moe_aux_loss_coeff": at("model.moe_aux_loss_coeff"),
        "moe_z_loss_coeff": at("model.moe_z_loss_coeff"),
        "expert_bias_update_rate": at("model.expert_bias_update_rate"),
    }, {"hf_path", "lora"}),  # lora: the policy's alone (policy_spec)
    # rank 0 (the default config): no adapters, None; stood in for by rank 0 with the config's other fields
    "policy_spec.lora": (lambda cfg: specs.policy_spec(cfg, "ckpt/dir").lora or LoraSpec(
        0, cfg.model.lora.alpha, tuple(cfg.model.lora.targets)), LoraSpec, {
        "rank": at("model.lora.rank"), "alpha": at("model.lora.alpha"),
        "targets": lambda cfg: tuple(cfg.model.lora.targets),
    }, set()),
    "optim_spec": (lambda cfg: specs.optim_spec(cfg, cfg.critic.lr, cfg.critic.lr_mult), OptimSpec, {
        "lr": at("critic.lr"),  # the arguments: trainer.* for the policy, critic.* for the critic
        "lr_mult": lambda cfg: tuple(cfg.critic.lr_mult.items()),
        "weight_decay": at("trainer.weight_decay"), "adam_beta1": at("trainer.adam_beta1"),
        "adam_beta2": at("trainer.adam_beta2"), "grad_clip": at("trainer.grad_clip"),
        "distributed_optimizer": at("parallel.distributed_optimizer"),
        "micro_batch_tokens": at("trainer.micro_batch_tokens"),
        "pack_sequences": at("trainer.pack_sequences"),
        "logit_chunk_tokens": at("trainer.logit_chunk_tokens"),
        "optimizer_offload": at("trainer.optimizer_offload"),
        "precision_aware": at("trainer.precision_aware_optimizer"),
        "adam_moments_dtype": at("trainer.adam_moments_dtype"),
    }, {"adam_eps"}),
    "engine_spec": (lambda cfg: specs.engine_spec(cfg, "ckpt/dir"), EngineSpec, {
        "dtype": at("model.dtype"), "max_model_len": at("rollout.max_model_len"), "seed": at("run.seed"),
        "record_routes": at("rollout.record_routes"), "kv_cache_gb": at("rollout.kv_cache_gb"),
        "route_source": at("rollout.route_source"), "weight_transfer": at("rollout.weight_transfer"),
        "max_num_seqs": at("rollout.max_num_seqs"),
        "max_num_batched_tokens": at("rollout.max_num_batched_tokens"),
        "gpu_memory_utilization": attrgetter("engine_gpu_share"),  # rollout.*, else cluster.colocate's
        "sleep": at("rollout.sleep_engines"), "tensor_parallel_size": at("rollout.engine_tp"),
        "expert_parallel": at("rollout.engine_ep"),
    }, {"model_path", "lora", "cpu_kv_cache_max_gb", "cpu_kv_fills", "gpu_batched_tokens"}),
    # lora: engine_spec.lora; the CPU KV cache's and the GPU token budget's defaults: RolloutSection's
    "engine_spec.lora": (lambda cfg: specs.engine_spec(cfg, "ckpt/dir").lora or EngineLoraSpec(
        0, cfg.model.lora.alpha, tuple(cfg.model.lora.targets), cfg.model.lora.sync), EngineLoraSpec, {
        "rank": at("model.lora.rank"), "alpha": at("model.lora.alpha"),
        "targets": lambda cfg: tuple(cfg.model.lora.targets), "sync": at("model.lora.sync"),
    }, set()),
    "agent_spec": (specs.agent_spec, AgentSpec, {
        "max_turns": at("environment.max_turns"), "token_budget": at("environment.token_budget"),
        "max_model_len": at("rollout.max_model_len"), "max_tokens_per_turn": at("rollout.max_new_tokens"),
        "temperature": at("rollout.temperature"), "top_p": at("rollout.top_p"),
        "overlong_filter": at("environment.overlong_filter"),
    }, {"repetition_limit", "env_timeout_s"}),
    "policy_loss": (specs.policy_loss, PolicyLoss, {
        "name": at("algorithm.policy_loss"),
        "hp": lambda cfg: PolicyLossSpec(cfg.algorithm.clip_low, cfg.algorithm.clip_high,
                                         cfg.algorithm.dual_clip, cfg.algorithm.sapo_tau_pos,
                                         cfg.algorithm.sapo_tau_neg),
        "aggregation": at("algorithm.aggregation"), "kl_coef": at("algorithm.kl_loss_coef"),
        "kl_estimator": at("algorithm.kl_loss_estimator"), "entropy_coef": at("algorithm.entropy_coef"),
        "old_from_forward": at("proximal_from_update"),
        "check_sync": lambda cfg: cfg.proximal_from_update and not cfg.rollout.async_mode,
        "policy_mask": at("algorithm.policy_mask"),
        "mask_spec": lambda cfg: PolicyMaskSpec(cfg.algorithm.opsm_delta, cfg.algorithm.m2po_tau),
    }, set()),
    "target_spec": (specs.target_spec, TargetSpec, {
        "advantage": at("algorithm.advantage"), "gamma": at("algorithm.gamma"), "lam": at("algorithm.lam"),
        "lam_critic": at("algorithm.lam_critic"),
        "length_adaptive_alpha": at("algorithm.length_adaptive_alpha"),
        "whiten": at("algorithm.whitens"), "kl_reward_coef": at("algorithm.kl_reward_coef"),
        "kl_reward_estimator": at("algorithm.kl_reward_estimator"), "needs_reference": at("uses_reference"),
        "overlong_buffer": at("algorithm.overlong_buffer"),
        "overlong_penalty": at("algorithm.overlong_penalty"), "token_budget": at("environment.token_budget"),
        "correction": at("algorithm.correction"),
        "correction_params": lambda cfg: CorrectionSpec(cfg.algorithm.is_cap, cfg.algorithm.seq_is_cap,
                                                          cfg.algorithm.icepop_min, cfg.algorithm.icepop_max,
                                                          cfg.algorithm.geo_min, cfg.algorithm.geo_max),
        "ewma_anchor": lambda cfg: cfg.algorithm.anchor == "ewma", "aggregation": at("algorithm.aggregation"),
        # algorithm.loss_constant, by default (null) the token budget
        "loss_constant": lambda cfg: cfg.algorithm.loss_constant or float(cfg.environment.token_budget),
        "self_normalize": at("algorithm.self_normalize"),
        "synchronous": lambda cfg: not cfg.rollout.async_mode,
        "reward_model_weight": at("reward_model.weight"), "rule_weight": at("reward_model.rule_weight"),
        "distill_coef": at("algorithm.distill_coef"),
    }, set()),
}


@pytest.mark.parametrize("name", CASES)
def test_every_mirrored_field_carries_the_configs_value(name):
    build, cls, mirrors, _ = CASES[name]
    got, default = build(CFG), RunConfig()
    assert type(got) is cls
    for field, source in mirrors.items():
        assert source(CFG) != source(default), (f"{name}: the test config leaves the source of {field} at "
                                                "its default")
        assert getattr(got,
                       field) == source(CFG), f"{name}.{field}: {getattr(got, field)!r} != {source(CFG)!r}"
    # and from the default config, the config's defaults (whatever the dataclass would have said)
    got = build(default)
    for field, source in mirrors.items():
        assert getattr(got, field) == source(default), f"{name}.{field} from the default config"


@pytest.mark.parametrize("name", CASES)
def test_settings_dataclasses_declare_no_default_for_config_fields(name):
    _, cls, mirrors, own = CASES[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(mirrors) | own, (f"{cls.__name__}: a field is neither mirrored from the config "
                                               "nor listed as its own")
    for field in mirrors:
        f = fields[field]
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (
            f"{cls.__name__}.{field} declares a default; it comes from the config (defaults live in the "
            "config sections, config/run.py and config/learning.py)")


def test_the_driver_builds_the_specs_once():
    """Outside driver/specs.py the driver reaches the spec builders only through run_specs (loop.main,
    once a run), and each group's ranks get the spec run_specs made for their slot."""
    import ast

    from conftest import ROOT

    builders = {name for name, value in vars(specs).items()
                if callable(value) and getattr(value, "__module__", "") == specs.__name__
                and not isinstance(value, type)} - {"run_specs"}
    assert {"model_spec", "optim_spec", "engine_spec", "env_spec", "target_spec"} <= builders
    called = {}
    for f in sorted((ROOT / "moe_rl" / "driver").glob("*.py")):
        if f.name == "specs.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == specs.__name__:  # import model_spec
                reached = {a.name for a in node.names} & builders
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "specs":  # specs.x(...)
                reached = {node.attr} & builders
            else:
                continue
            if reached:
                called.setdefault(f.name, set()).update(reached)
    assert not called, f"spec builders reached around run_specs: {called}"
    cfg = RunConfig()
    run = specs.run_specs(cfg, "m")
    assert list(run.groups) == ["policy", "critic"] and run.groups["critic"].role == "critic"
    assert run.groups["policy"].model == specs.policy_spec(cfg, "m")
    assert run.engine == specs.engine_spec(cfg, "m")
