import dataclasses
import re

import pytest
from conftest import ROOT
from conftest import config_error as _err

from moe_rl.config import ConfigError, RunConfig, from_dict, load_config, parse_overrides, to_dict

QUICKSTART = "configs/quickstart.yaml"


def test_quickstart_loads_and_is_frozen():
    cfg = load_config(QUICKSTART, cuda_available=False)
    assert isinstance(cfg, RunConfig)
    assert cfg.environment.options == {"low": 1, "high": 9, "guesses": 4, "ruled_out_penalty": 0.25}
    assert cfg.critic_enabled  # GAE needs a critic
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.steps = 3


def test_overrides_are_typed_and_nested():
    cfg = load_config(QUICKSTART, ["algorithm.gamma=0.99", "parallel.tp=2", "parallel.world_size=2",
                                   "algorithm.dual_clip=3", "critic.value_clip=null"], cuda_available=False)
    assert cfg.algorithm.gamma == 0.99 and cfg.parallel.tp == 2 and cfg.parallel.dp == 1
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)
    assert cfg.critic.value_clip is None
    # YAML 1.1 quirk
    assert load_config(QUICKSTART, ["trainer.lr=1e-3"], cuda_available=False).trainer.lr == 1e-3


def test_unknown_key_suggests_the_closest():
    assert _err(["algorithm.gama=0.9"]).startswith("algorithm.gama: unknown key (did you mean 'gamma'?)")
    assert "did you mean 'rollout'" in _err(["rolout.temperature=1"])


def test_wrong_type():
    assert _err(["rollout.top_p=abc"]) == "rollout.top_p: expected float, got 'abc' (str)"
    assert "expected int" in _err(["parallel.tp=1.5"])
    assert "expected bool" in _err(["logging.progress_bar=3"])
    assert "not allowed" in _err(["model.dtype=float16"])


def test_out_of_range():
    assert "algorithm.gamma: 1.5 is outside the allowed range [0.0, 1.0]" == _err(["algorithm.gamma=1.5"])
    assert _err(["algorithm.dual_clip=0.5"]).startswith("algorithm.dual_clip: 0.5 must be > 1")
    assert _err(["run.steps=0"]).startswith("run.steps:")
    assert _err(["model.tiny.head_dim=16"]).startswith("model.tiny.head_dim:")
    assert _err(["cluster.trainer_threads=0"]) == "cluster.trainer_threads: 0 must be a positive integer"
    assert _err(['trainer.lr_mult={"*.linear_fc1.weight": -1}']) == \
        "trainer.lr_mult.*.linear_fc1.weight: -1 is outside the allowed range [0.0, inf)"
    assert _err(['critic.lr_mult={"*": fast}']) == "critic.lr_mult.*: 'fast': a number"
    assert _err(['critic.lr_mult={"": 2}']) == "critic.lr_mult: '': its keys are globs over parameter names"


def test_unregistered_method_names_are_rejected_with_choices():
    msg = _err(["algorithm.policy_loss=gsp"])
    assert "did you mean 'gspo'" in msg and "cispo" in msg
    assert "did you mean 'guess_number'" in _err(["environment.name=guess_numbr"])


@pytest.mark.parametrize("overrides, field", [
    (["parallel.tp=4", "parallel.world_size=4"], "parallel.tp"),  # 2 attention heads
    (["parallel.ep=3", "parallel.world_size=3"], "parallel.ep"),  # 4 experts
    (["parallel.pp=2", "parallel.world_size=2", "model.tiny.num_layers=3"], "parallel.pp"),
    (["parallel.tp=2", "parallel.world_size=3"], "parallel.world_size"),
    (["model.layer_spec=transformer_engine"], "model.layer_spec"),
    (["model.fp8=delayed", "model.layer_spec=transformer_engine"], "model.layer_spec"),
    (["model.fp8=mxfp8"], "model.fp8"),
    (["rollout.route_source=vllm"], "rollout.route_source"),
    (["algorithm.advantage=grpo", "rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),
    (["algorithm.advantage=grpo", "algorithm.lam_critic=0.9", "rollout.samples_per_prompt=4"],
     "algorithm.lam_critic"),
    (["critic.enabled=false"], "critic.enabled"),
    (["algorithm.advantage=reinforce_pp_baseline", "rollout.samples_per_prompt=1"],
     "rollout.samples_per_prompt"),
    (["model.moe_dispatcher=allgather", "parallel.pp=2", "parallel.world_size=2"], "model.moe_dispatcher"),
])
def test_incompatible_combinations(overrides, field):
    assert _err(overrides).startswith(field + ":")


def test_gpu_features_pass_where_cuda_exists():
    cfg = from_dict({}, ["model.layer_spec=transformer_engine", "model.fp8=blockwise",
                         "rollout.route_source=vllm"],
                    cuda_available=True)
    assert cfg.model.fp8 == "blockwise" and cfg.rollout.route_source == "vllm"


def test_engine_memory_settings_on_gpu():
    gpu = ["rollout.gpu_memory_utilization=0.7", "rollout.max_num_batched_tokens=4096"]
    cfg = from_dict({}, gpu, cuda_available=True)
    assert cfg.rollout.gpu_memory_utilization == 0.7 and cfg.rollout.max_num_batched_tokens == 4096
    # a fixed KV cache and the share vLLM checks is free at start-up, together
    assert from_dict({}, gpu + ["rollout.kv_cache_gb=20"], cuda_available=True).rollout.kv_cache_gb == 20
    # our capture hook needs vLLM's CPU model runner
    assert _err(["rollout.route_source=capture"],
                cuda=True).startswith("rollout.route_source: 'capture' hooks")
    assert _err(["rollout.gpu_memory_utilization=1.5"],
                cuda=True).startswith("rollout.gpu_memory_utilization: 1.5 is outside")
    # on CPU the budget holds max_num_seqs whole prompts, or it is refused
    assert from_dict({}, ["rollout.max_num_batched_tokens=32768"],
                     cuda_available=False).rollout.max_num_batched_tokens


def test_colocation_settings_on_gpu():
    cfg = from_dict({}, ["cluster.offload=true", "rollout.sleep_engines=true"], cuda_available=True)
    assert cfg.cluster.offload and cfg.rollout.sleep_engines and cfg.cluster.colocate
    assert _err(["rollout.sleep_engines=true", "cluster.colocate=false"], cuda=True).startswith(
        "rollout.sleep_engines: true needs cluster.colocate=true")
    assert from_dict({}, ["cluster.offload=true"], cuda_available=False).cluster.offload  # a copy on CPU


def test_the_precision_aware_optimizer_on_gpu():
    """For a bfloat16 model; bfloat16 moments only where Transformer Engine's FusedAdam steps them (not under
    optimizer offload); the moments' dtype alone, without the optimizer that reads it, is refused."""
    bf16 = ["model.dtype=bfloat16", "trainer.precision_aware_optimizer=true"]
    cfg = from_dict({}, [*bf16, "trainer.optimizer_offload=1.0"], cuda_available=True)
    assert cfg.trainer.precision_aware_optimizer and cfg.trainer.adam_moments_dtype == "float32"
    assert _err(["trainer.precision_aware_optimizer=true", "trainer.optimizer_offload=1.0"], cuda=True) == (
        "trainer.precision_aware_optimizer: lowers the optimizer's precision below a float32 model's: it is "
        "for bfloat16 models (model.dtype)")
    assert _err([*bf16, "trainer.optimizer_offload=1.0", "trainer.adam_moments_dtype=bfloat16"],
                cuda=True).startswith("trainer.adam_moments_dtype: bfloat16: the offloaded optimizer")
    assert _err(["trainer.adam_moments_dtype=bfloat16"], cuda=True).startswith(
        "trainer.adam_moments_dtype: 'bfloat16' has no effect in this run: only "
        "trainer.precision_aware_optimizer=true reads it")
    assert from_dict({}, [*bf16, "trainer.adam_moments_dtype=bfloat16"],
                     cuda_available=True).trainer.adam_moments_dtype == "bfloat16"


def test_nccl_weight_transfer_needs_separate_gpus():
    """NCCL refuses two ranks on one GPU: colocated trainer and engines cannot share an NCCL group."""
    with pytest.raises(ConfigError, match="^rollout.weight_transfer: 'nccl' joins"):
        from_dict({}, ["rollout.weight_transfer=nccl", "cluster.colocate=true"], cuda_available=True)
    cfg = from_dict({}, ["rollout.weight_transfer=nccl", "cluster.colocate=false"], cuda_available=True)
    assert cfg.rollout.weight_transfer == "nccl"
    assert from_dict({}, ["rollout.weight_transfer=ipc"], cuda_available=True).cluster.colocate


def test_ipc_weight_transfer_needs_colocation():
    """vLLM keys CUDA IPC handles by the sender's GPU: engines on GPUs of their own could not open them, and
    the run would fail at its first weight sync instead of here."""
    assert _err(["rollout.weight_transfer=ipc", "cluster.colocate=false"], cuda=True) == (
        "rollout.weight_transfer: 'ipc' hands engines CUDA IPC handles, which vLLM keys by the sender's GPU: "
        "it needs engines on their trainer ranks' GPUs (cluster.colocate=true); with engines on GPUs of "
        "their own use 'nccl' or 'store'")
    for other in ("nccl", "store"):  # what the message offers instead passes
        cfg = from_dict({}, [f"rollout.weight_transfer={other}", "cluster.colocate=false"],
                        cuda_available=True)
        assert cfg.rollout.weight_transfer == other


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_overrides(["algorithm.gamma"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("run: 3\n")
    with pytest.raises(ConfigError, match="^run: expected a mapping"):
        load_config(notmap)
    with pytest.raises(ConfigError, match="is a value, not a section"):
        from_dict({"run": {"steps": 3}}, ["run.steps.x=1"], cuda_available=False)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(path):
    cuda = "quickstart" not in path  # the recipes are for GPU clusters
    cfg = load_config(ROOT / path, cuda_available=cuda)
    assert from_dict(to_dict(cfg), cuda_available=cuda) == cfg  # what check-config prints loads back the same


def _write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_duplicate_yaml_keys_are_refused_with_path_and_lines(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "run:\n  steps: 2\nalgorithm:\n  gamma: 0.9\nrun:\n  seed: 1\n"),
                    cuda_available=False)
    assert str(info.value).startswith("run: appears twice in") and "(lines 1 and 5)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "rollout:\n  temperature: 1.0\n  top_p: 0.9\n  temperature: 0.5\n"),
                    cuda_available=False)
    assert str(info.value).startswith("rollout.temperature: appears twice") \
        and "(lines 2 and 4)" in str(info.value)
    with pytest.raises(ConfigError, match=r"^environment\.options\.low: appears twice .*lines 2 and 2"):
        load_config(_write(tmp_path, "environment:\n  options: {low: 1, low: 2}\n"), cuda_available=False)
    # the same key in different sections, and anchors/aliases, are fine
    cfg = load_config(_write(tmp_path,
                             "run: &r {steps: 2}\ntrainer:\n  epochs: 2\ncritic:\n  warmup_steps: 2\n"),
                      cuda_available=False)
    assert cfg.run.steps == 2 and cfg.trainer.epochs == 2


@pytest.mark.parametrize("value", ["Auto", "NEVER", " auto", "Never "])
def test_resume_refuses_miscased_keywords(value):
    msg = _err([], {"checkpoint": {"resume": value}})
    assert msg.startswith("checkpoint.resume:") and f"did you mean '{value.strip().lower()}'" in msg


def test_resume_accepts_keywords_and_paths():
    for value in ("auto", "never", "runs/x/checkpoints/step_000002", "./Auto"):
        assert from_dict({"checkpoint": {"resume": value}}, cuda_available=False).checkpoint.resume == value
    assert _err(["checkpoint.resume="]).startswith("checkpoint.resume: is empty")


DISTILL_ONLY = ["algorithm.advantage=none", "critic.lr=1e-5", "critic.value_clip=0.2",
                "algorithm.distill_coef=1", "teacher.path=/t"]


@pytest.mark.parametrize("overrides, start", [
    (["rollout.kv_cache_gb=-1"], "rollout.kv_cache_gb: -1.0 is outside the allowed range (0.0, inf)"),
    (["rollout.kv_cache_gb=0"], "rollout.kv_cache_gb: 0.0 is outside"),
    (["rollout.async_mode=true", "rollout.max_staleness=0"],
     "rollout.max_staleness: 0 with rollout.async_mode=true"),
    (["rollout.async_mode=true", "rollout.async_depth=3", "rollout.max_staleness=2"],
     "rollout.async_depth: 3 with rollout.max_staleness=2: the deepest rollout's samples are 3 versions old"),
    (["rollout.async_mode=true", "rollout.async_depth=0"], "rollout.async_depth: 0 must be a positive"),
    # megatron splits each expert over tp ranks too (expert tensor parallelism = tp): ep * tp must divide
    # dp*cp*tp; 2 ranks of tp 2 hold no room for ep 2 (megatron's initialize_model_parallel refuses it)
    (["parallel.tp=2", "parallel.ep=2", "parallel.world_size=2"],
     "parallel.ep: 2 x expert tensor parallelism 2 must divide dp*cp*tp=2"),
    # expert tensor parallelism below tp needs ep > 1 (replicated experts' gradients would not be reduced)
    (["parallel.tp=2", "parallel.etp=1", "parallel.world_size=2"],
     "parallel.etp: 1 below tp=2 needs expert parallelism (ep > 1)"),
    (["parallel.tp=2", "parallel.world_size=2", "model.tiny.moe_intermediate_size=33"],
     "parallel.tp: expert tensor parallelism 2 does not divide the experts' 33 intermediate size"),
    (["parallel.etp=0"], "parallel.etp: 0 must be a positive"),
    # the optimizer's state to the host: a GPU feature (on CPU it is there already)
    (["trainer.optimizer_offload=0.5"], "trainer.optimizer_offload: 0.5 moves optimizer state from GPUs to "
     "host memory, and this machine has no GPU"),
    (["trainer.optimizer_offload=1.5"], "trainer.optimizer_offload: 1.5 is outside the allowed range"),
    (["trainer.precision_aware_optimizer=true"], "trainer.precision_aware_optimizer: megatron's "
     "precision-aware optimizer needs CUDA (and, without optimizer offload, Transformer Engine), and this "
     "machine has no GPU; use false"),
    (["cluster.host_memory_gb=0"], "cluster.host_memory_gb: 0.0 is outside the allowed range"),
    (["algorithm.distill_coef=1", "teacher.path=/t", "parallel.world_size=2", "teacher.tp=4"],
     "teacher.tp/pp: the teachers' layout over parallel.world_size=2 ranks: 2 is not a multiple of "
     "tp*pp*cp=4"),
    (["algorithm.distill_coef=1"], "algorithm.distill_coef: 1.0 needs a teacher to distil from"),
    # with no task advantage, what acts on the reward has no effect
    *[([*DISTILL_ONLY, change], f"{change.split('=')[0]}: ") for change in (
        "algorithm.kl_reward_coef=0.1", "algorithm.overlong_buffer=8", "reward_model.path=/rm",
        "environment.dynamic_sampling=true")],
    (["algorithm.advantage=none", "critic.lr=1e-5"], "algorithm.advantage: 'none' uses no reward"),
    (["algorithm.distill_coef=1", "teacher.named={'a b': /t}"],
     "teacher.named.a b: '/t': a teacher needs a name"),
    (["algorithm.policy_loss=gspo", "algorithm.aggregation=token_mean"],
     "algorithm.aggregation: 'token_mean'"),
    (["algorithm.policy_loss=gmpo"], "algorithm.aggregation: 'token_mean'"),
    (["algorithm.advantage=grpo", "critic.enabled=true"], "critic.enabled: true with advantage 'grpo'"),
    (["algorithm.advantage=reward_to_go", "critic.enabled=true"],
     "critic.enabled: true with advantage 'reward_to_go'"),
    # the reference is the model before the warm start, the policy RL starts from the one after it
    (["algorithm.kl_loss_coef=0.01", "trainer.warm_start_steps=2"],
     "trainer.warm_start_steps: 2 with a KL term (algorithm.kl_loss_coef=0.01, "
     "algorithm.kl_reward_coef=0.0): the reference policy is the model before the warm start"),
    (["algorithm.kl_reward_coef=0.01", "trainer.warm_start_steps=2"],
     "trainer.warm_start_steps: 2 with a KL"),
    (["environment.name=guess_number", "trainer.warm_start_steps=2", "trainer.warm_start_policy=optimal"],
     "trainer.warm_start_policy: 'optimal' is not a reference policy of environment 'guess_number' (it has: "
     "'random guesses', 'binary search')"),
    (["algorithm.kl_loss_estimator=full"],
     "algorithm.kl_loss_estimator: 'full' is not allowed; choose one of k1, k2, k3"),
    (["algorithm.anchor=ewma", "algorithm.correction=bypass"],
     "algorithm.anchor: 'ewma' with algorithm.correction=bypass"),
    (["algorithm.overlong_buffer=128"],
     "algorithm.overlong_buffer: 128 must be below environment.token_budget=128"),
    (["rollout.gpu_memory_utilization=0.5"], "rollout.gpu_memory_utilization: is a GPU setting"),
    (["rollout.max_num_batched_tokens=1000"],
     "rollout.max_num_batched_tokens: 1000 would make vLLM split prompts"),
    (["rollout.max_num_batched_tokens=64"],
     "rollout.max_num_batched_tokens: 64 is below rollout.max_num_seqs=128"),
    (["rollout.max_num_seqs=0"], "rollout.max_num_seqs: 0 must be a positive integer"),
    (["cluster.offload=true", "cluster.colocate=false"], "cluster.offload: true without cluster.colocate"),
    (["cluster.offload=true", "rollout.async_mode=true"], "cluster.offload: true with rollout.async_mode"),
    (["rollout.sleep_engines=true"], "rollout.sleep_engines: vLLM's sleep mode needs CUDA"),
    (["rollout.engine_tp=2", "rollout.engine_ep=true"],
     "rollout.engine_ep: vLLM's expert parallelism is a GPU feature"),
    (["rollout.engine_ep=true"], "rollout.engine_ep: true with rollout.engine_tp=1"),
    # M2PO masks tokens: not in a loss with one ratio per sequence; and log(pi_theta/pi_old) is 0 with one
    # update a step from the policy as it is (defaults: one epoch, one minibatch)
    (["algorithm.policy_mask=m2po", "algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean",
      "trainer.epochs=2"],
     "algorithm.policy_mask: 'm2po' masks tokens, and 'gspo' has one ratio per sequence"),
    (["algorithm.policy_mask=m2po"], "algorithm.policy_mask: 'm2po' bounds log(pi_theta/pi_old), which is 0"),
    (["algorithm.policy_mask=m2po", "algorithm.correction=tis_token"],
     "algorithm.policy_mask: 'm2po' bounds log(pi_theta/pi_old)"),
    (["algorithm.policy_mask=opsm", "algorithm.m2po_tau=0.1"],
     "algorithm.m2po_tau: 0.1 has no effect in this run: only algorithm.policy_mask=m2po reads it"),
    (["algorithm.correction=geo_tis", "algorithm.geo_min=0.9"],
     "algorithm.geo_min: 0.9 has no effect in this run: only algorithm.correction=geo_mask reads it"),
    (["algorithm.correction=geo_mask", "algorithm.geo_max=0.9"], "algorithm.geo_max: 0.9 is below"),
    (["algorithm.anchor=ewma"], "algorithm.anchor: 'ewma' with algorithm.correction=none (drops the "
     "pi_anchor/mu behaviour weight of the decoupled objective); ewma needs a correction that reweights by "
     "pi_old/mu: geo_mask, geo_tis, icepop, tis_seq, tis_token"),
])
def test_refused_settings(overrides, start):
    assert _err(overrides).startswith(start)


def test_accepted_neighbours_of_refused_settings():
    ok = [DISTILL_ONLY, [*DISTILL_ONLY, "algorithm.advantage=gae", "critic.lr=1e-3"],
          ["rollout.async_mode=true", "rollout.max_staleness=1"],
          ["rollout.async_mode=true", "rollout.max_staleness=2"],
          ["rollout.async_mode=true", "rollout.async_depth=2", "rollout.max_staleness=2"],
          ["algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean"],
          ["algorithm.advantage=grpo", "critic.enabled=false"],
          ["algorithm.advantage=gae", "critic.enabled=true"],
          ["algorithm.anchor=ewma", "algorithm.correction=tis_token"],
          ["algorithm.anchor=ewma", "algorithm.correction=icepop"],
          ["algorithm.anchor=old", "algorithm.correction=bypass"],
          ["algorithm.anchor=ewma", "algorithm.correction=geo_mask"],
          # M2PO: with pi_old := mu (the paper's setting), with more updates a step, under an EWMA anchor
          ["algorithm.policy_mask=m2po", "algorithm.correction=bypass", "algorithm.m2po_tau=0.1"],
          ["algorithm.policy_mask=m2po", "trainer.epochs=2"],
          ["algorithm.policy_mask=m2po", "algorithm.anchor=ewma", "algorithm.correction=tis_seq"],
          ["algorithm.policy_mask=opsm", "algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean",
           "algorithm.opsm_delta=0.05", "algorithm.correction=geo_tis", "algorithm.geo_max=1.05"],
          # the overlong buffer is measured against the episode budget, not the per-turn cap
          ["algorithm.overlong_buffer=64", "environment.token_budget=128", "rollout.max_new_tokens=16"],
          ["environment.name=calculator", "trainer.warm_start_steps=2"],
          ["environment.name=arithmetic", "trainer.warm_start_steps=2"],
          ["environment.name=guess_number", "trainer.warm_start_steps=2",
           "trainer.warm_start_policy=binary search"],
          # expert TP 1 under tp 2 with ep 2; teachers with a tp of their own split their experts over it
          # (parallel.etp is the policy's: with it, ep 1 and tp 2 would be refused)
          ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "parallel.world_size=2"],
          [*DISTILL_ONLY, "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "parallel.world_size=2",
           "teacher.tp=2", "teacher.ep=1"]]
    for overrides in ok:
        from_dict({}, overrides, cuda_available=False)


@pytest.mark.parametrize("field", ["rollout.engine=vllm", "rollout.in_process=false",
                                   "parallel.sequence_parallel=true"])
def test_removed_fields_are_unknown_keys(field):
    key = field.partition("=")[0]
    assert _err([field]).startswith(f"{key}: unknown key (removed: ")


def test_dynamic_sampling_with_a_reward_model_is_refused():
    msg = _err(["trainer.warm_start_steps=0", "environment.dynamic_sampling=true", "reward_model.path=/rm"],
               {})
    assert msg.startswith("environment.dynamic_sampling: drops groups whose environment rewards are all "
                          "equal")
    assert _err(["reward_model.weight=0.5"], {}).startswith("reward_model.weight: 0.5 has no effect in this "
                                                            "run: only reward_model.path reads it")


@pytest.mark.parametrize("overrides, field", [
    (["algorithm.policy_loss=gspo", "algorithm.aggregation=seq_sum_const"], "algorithm.aggregation"),
    (["algorithm.correction=tis_token", "algorithm.self_normalize=true",
      "algorithm.aggregation=seq_sum_const"],
     "algorithm.self_normalize"),
    (["algorithm.advantage=grpo", "rollout.samples_per_prompt=2", "critic.lr=1e-5", "critic.value_clip=0.2",
      "critic.warmup_steps=3"], "critic.warmup_steps"),
    (["critic.init_from=/nonexistent/reward_model"], "critic.init_from"),
    (["run.name=../elsewhere"], "run.name"),
    (["trainer.eval_greedy=true", "trainer.eval_samples=2"], "trainer.eval_samples"),
])
def test_more_refused_combinations(overrides, field):
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}: "):
        load_config(ROOT / "configs" / "quickstart.yaml", overrides, cuda_available=False)


def test_engine_restarts_follow_the_weight_transfer():
    """A failed engine is replaced (3 in a row at most by default) where weights travel as files; under
    vLLM's NCCL transfer a replacement cannot join the group mid-run: 0, and more is refused."""
    assert from_dict({}, cuda_available=False).rollout.engine_restarts == 3
    assert from_dict({}, ["rollout.max_engine_restarts=0"], cuda_available=False).rollout.engine_restarts == 0
    nccl = ["rollout.weight_transfer=nccl", "cluster.colocate=false"]
    assert from_dict({}, nccl, cuda_available=True).rollout.engine_restarts == 0
    assert _err(nccl + ["rollout.max_engine_restarts=2"], cuda=True).startswith(
        "rollout.max_engine_restarts: 2 with weight_transfer=nccl: a replacement engine cannot join")
    assert _err(["rollout.max_engine_restarts=-1"]).startswith("rollout.max_engine_restarts: -1 is outside")


@pytest.mark.parametrize("changes, fused", [
    ({}, True),  # one epoch, one minibatch, anchor old, no correction
    # pi_old is mu: the pass is only for figures, skipped too
    ({"algorithm": {"correction": "bypass"}}, True),
    ({"trainer": {"proximal_pass": "separate"}}, False),
    ({"trainer": {"epochs": 2}}, False),  # the second epoch's ratio needs the policy before the first
    ({"trainer": {"minibatches": 2}}, False),
    ({"algorithm": {"anchor": "ewma", "correction": "tis_token"}, "trainer": {"epochs": 1}}, False),
    ({"algorithm": {"correction": "tis_token"}}, False),  # the weights pi_old / mu come before the update
    # steps without a policy update
    ({"algorithm": {"advantage": "gae"}, "critic": {"warmup_steps": 2}}, False),
    ({"algorithm": {"advantage": "gae"}}, True),
])
def test_pi_old_from_the_update_only_for_a_single_update_from_the_policy_as_it_is(changes, fused):
    assert from_dict(changes).proximal_from_update is fused


def test_every_training_row_has_a_teacher_and_a_null_field_means_the_default():
    """preflight.check_rows_have_teachers: a row's `teacher` names one of teacher.named; absent or null
    (a Parquet row without one) is teacher.path's, refused where that is empty."""
    from moe_rl.driver.preflight import check_rows_have_teachers

    rows = [{"secret": 1, "teacher": None}, {"secret": 2, "teacher": "small"}, {"secret": 3}]
    named = "teacher.named={small: /t/small}"
    check_rows_have_teachers(load_config(ROOT / "configs/distill_quickstart.yaml", [named]), rows)
    no_default = load_config(ROOT / "configs/distill_quickstart.yaml", [named, "teacher.path="])
    with pytest.raises(ConfigError, match="teacher.path: prompt 1 names no teacher and teacher.path is"):
        check_rows_have_teachers(no_default, rows)
    with pytest.raises(ConfigError, match="teacher.named: prompt 2 names teacher 'small', which is not"):
        check_rows_have_teachers(load_config(ROOT / "configs/distill_quickstart.yaml"), rows)
