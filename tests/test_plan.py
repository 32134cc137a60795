"""`moe-rl plan`: parameter counts from published configs and exactly from transformers' own models,
the shipped recipes fit their stated clusters, and a run that cannot fit is refused, one line per problem."""

import json
import re
import subprocess

import pytest
from conftest import ROOT, moe_rl_cli

from moe_rl.config import TinyModel, from_dict, load_config
from moe_rl.plan import ModelShape, hf_config_of, make_plan, render
from moe_rl.tiny import hf_config as tiny_hf_config

# the published config.json of each model (the fields sizes depend on)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "intermediate_size": 6144, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960,
                 "torch_dtype": "bfloat16"}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 14336, "tie_word_embeddings": False, "max_position_embeddings": 32768,
                "torch_dtype": "bfloat16"}


# DeepSeek-V3 (multi-latent attention with a compressed query, 256 experts, a shared one, 3 dense layers,
# one multi-token-prediction layer), Moonlight-16B-A3B (its smaller sibling: a full query projection) and
# GLM-4.5 (grouped-query attention with biases and q/k norms)
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "vocab_size": 129280, "n_routed_experts": 256, "n_shared_experts": 1,
               "moe_intermediate_size": 2048, "intermediate_size": 18432, "first_k_dense_replace": 3,
               "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 1,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
MOONLIGHT_16B_A3B = {**DEEPSEEK_V3, "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
                     "num_key_value_heads": 16, "q_lora_rank": None, "vocab_size": 163840,
                     "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1408,
                     "intermediate_size": 11264, "first_k_dense_replace": 1, "num_experts_per_tok": 6,
                     "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}
GLM_45 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
          "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
          "vocab_size": 151552, "n_routed_experts": 160, "n_shared_experts": 1, "moe_intermediate_size": 1536,
          "intermediate_size": 12288, "first_k_dense_replace": 3, "num_experts_per_tok": 8,
          "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
          "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_published_models_parameter_counts():
    q = ModelShape.from_hf(QWEN3_30B_A3B)
    assert 30.4e9 < q.total < 30.6e9 and 3.2e9 < q.active < 3.4e9  # "30.5 B total, 3.3 B activated"
    m = ModelShape.from_hf(MIXTRAL_8X7B)
    assert 46.6e9 < m.total < 46.8e9 and 12.8e9 < m.active < 13.0e9  # "46.7 B total, 12.9 B active"
    d = ModelShape.from_hf(DEEPSEEK_V3)
    # "671B total, 37B activated"; "685B" on the hub: with the 14B multi-token-prediction module
    assert 670.5e9 < d.total < 671.5e9 and 37e9 < d.active < 38e9 and 684e9 < d.total + d.mtp < 686e9
    s = ModelShape.from_hf(MOONLIGHT_16B_A3B)
    assert 15.5e9 < s.total < 16.5e9 and 2.5e9 < s.active < 3.5e9 and s.mtp == 0  # "16B", "3B"
    g = ModelShape.from_hf(GLM_45)
    # "355B total, 32B active" (rounded; the active figure leaves the embedding and output head out)
    embeddings = 2 * GLM_45["vocab_size"] * GLM_45["hidden_size"]
    assert 350e9 < g.total < 357e9 and 31.5e9 < g.active - embeddings < 32.5e9 and 3e9 < g.mtp < 6e9
    # the KV cache of a token: MLA's compressed latent and RoPE key, whole on every TP rank
    assert d.kv_bytes_per_token(2, tp=8) == 61 * (512 + 64) * 2
    assert g.kv_bytes_per_token(2, tp=8) == 2 * 92 * 1 * 128 * 2


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_full_q", "glm4_moe", "glm4_moe_plain"])
def test_deepseek_and_glm_counts_equal_transformers_models_exactly(arch):
    """Small configs with every feature on (a compressed or full query, attention biases, q/k norms, two
    shared experts, a dense first layer): the planner's count is transformers' model's, to the parameter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=384, n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=24,
                 intermediate_size=48, first_k_dense_replace=1, num_experts_per_tok=2, n_group=2,
                 topk_group=1, num_nextn_predict_layers=1, tie_word_embeddings=False)
    if arch.startswith("deepseek_v3"):
        hf = AutoConfig.for_model("deepseek_v3", **small, q_lora_rank=None if arch.endswith("full_q") else 32,
                                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                  attention_bias=not arch.endswith("full_q"))
    else:
        hf = AutoConfig.for_model("glm4_moe", **small, head_dim=16, partial_rotary_factor=0.5,
                                  attention_bias=arch == "glm4_moe", use_qk_norm=arch == "glm4_moe")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert ModelShape.from_hf(hf.to_dict()).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", [TinyModel(), TinyModel(arch="mixtral"), TinyModel(arch="qwen2_moe"),
                                  TinyModel(num_layers=3, first_dense_layers=1)],
                         ids=["qwen3", "mixtral", "qwen2", "dense"])
def test_counts_equal_transformers_models_exactly(spec):
    import torch
    from transformers import AutoModelForCausalLM

    # the tiny model's
    hf = hf_config_of(from_dict({"model": {"tiny": spec.__dict__}}, cuda_available=False), None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_hf_config(spec, eos_token_id=383, pad_token_id=382))
    assert ModelShape.from_hf(hf).total == sum(p.numel() for p in model.parameters())


def _plan(path, tmp_path, published, *flags):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(published))
    return subprocess.run([*moe_rl_cli(), "plan", path, "--model-config", str(cfg_file), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_shipped_recipes_fit_their_stated_clusters(tmp_path):
    for recipe, published in (("configs/qwen3_30b_a3b_gspo.yaml", QWEN3_30B_A3B),
                              ("configs/mixtral_8x7b_ppo.yaml", MIXTRAL_8X7B)):
        out = _plan(recipe, tmp_path, published)
        assert out.returncode == 0, out.stderr
        assert "policy" in out.stdout and "engine" in out.stdout and "KV-cache tokens" in out.stdout


# the recipes whose header carries `moe-rl plan`'s output, with the published config of their model
PLANNED = {"configs/qwen3_30b_a3b_grpo_2n8g.yaml": QWEN3_30B_A3B,
           "configs/qwen3_30b_a3b_grpo_1n8g.yaml": QWEN3_30B_A3B,
           "configs/qwen3_30b_a3b_lora_1n8g.yaml": QWEN3_30B_A3B,
           "configs/moonlight_16b_a3b_grpo_1n8g.yaml": MOONLIGHT_16B_A3B}


@pytest.mark.parametrize("recipe", sorted(PLANNED))
def test_a_recipes_header_is_what_plan_prints_for_it(recipe):
    """The header's block between `# plan:` and `# end of plan` is `moe-rl plan`'s output for the recipe
    (the same render), and the recipe fits with at least 10% of every GPU free."""
    assert {str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")
            if "# plan:" in p.read_text()} == set(PLANNED)  # a planned recipe needs its model here
    text = (ROOT / recipe).read_text()
    block = text[text.index("# plan:\n") + len("# plan:\n"):text.index("# end of plan\n")]
    header = [line.removeprefix("#   ") for line in block.splitlines()]
    plan = make_plan(load_config(ROOT / recipe, cuda_available=True), PLANNED[recipe])
    assert header == render(plan).splitlines(), f"{recipe}: rerun moe-rl plan and copy its output"
    assert not plan.problems and plan.headroom >= 0.1 - 1e-9, (plan.problems, plan.headroom)


def test_a_run_that_cannot_fit_is_refused_one_line_per_problem(tmp_path):
    out = _plan("configs/mixtral_8x7b_ppo.yaml", tmp_path, MIXTRAL_8X7B, "--gpu-memory-gb", "80")
    assert out.returncode == 2
    errors = out.stderr.strip().splitlines()
    # --gpu-memory-gb is a GPU's memory as its maker names it (GPU makers' GB are binary), read as GiB
    assert errors == ["moe-rl: error: engine: 89.0 GiB per GPU does not fit a 80 GiB GPU",
                      "moe-rl: error: engine: 0 KV-cache tokens cannot hold one sequence of "
                      "max_model_len=8192 (87.0 GiB of weights on each 80 GiB GPU; rollout.engine_tp=1)"]
    # with engines of two GPUs each, it fits 80 GiB GPUs
    tp2 = _plan("configs/mixtral_8x7b_ppo.yaml", tmp_path, MIXTRAL_8X7B, "--gpu-memory-gb", "80",
                "rollout.engine_tp=2")
    assert tp2.returncode == 0, tp2.stderr
    assert "engine       4 GPU(s)" in tp2.stdout


def test_trainer_memory_worked_by_hand():
    """Qwen3-30B-A3B in the shipped layout (tp 2, pp 2, ep 8, dp 8, bf16, distributed optimizer): stage 1
    holds 24 layers, the final norm and the output projection."""
    cfg = load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", cuda_available=True)
    plan = make_plan(cfg, QWEN3_30B_A3B)
    s = ModelShape.from_hf(QWEN3_30B_A3B)
    dense = (24 * s.attention + 24 * s.moe_shared + s.hidden + s.vocab * s.hidden) / 2  # tp 2
    expert = 24 * 128 * s.expert / (8 * 2)  # ep 8 x etp 2
    policy = plan.roles[0].per_gpu
    assert policy["weights"] == pytest.approx((dense + expert) * 2)
    assert policy["gradients"] == pytest.approx((dense + expert) * 4)
    # Adam: 12 bytes per parameter, dense over dp*cp = 8 ranks, experts over 32 / (pp 2 * ep 8 * etp 2) = 1
    assert policy["optimizer"] == pytest.approx(dense * 12 / 8 + expert * 12 / 1)
    # the log-probs a chunk of 1024 tokens at a time (trainer.logit_chunk_tokens) on the rank's vocabulary
    # slice (tp 2), 12 + 2 bytes per element at the peak of the backward, the output weight's bf16 gradient,
    # and the gradient of the microbatch's 16384 hidden states (cp 1, gathered over SP: 2 x 2 bytes)
    # (tests/train/test_plan_memory.py measures each)
    assert cfg.trainer.micro_batch_tokens == 16384 and cfg.trainer.logit_chunk_tokens == 1024
    chunked = 1024 * s.vocab / 2 * 14 + s.vocab / 2 * s.hidden * 2 + 16384 * s.hidden * 4
    assert policy["logits"] == pytest.approx(chunked)
    # the whole logits at once (trainer.logit_chunk_tokens=0): 24 bytes per element of 16384 x V/2
    recipe = ROOT / "configs/qwen3_30b_a3b_gspo.yaml"
    whole = make_plan(load_config(recipe, ["trainer.logit_chunk_tokens=0"], cuda_available=True),
                      QWEN3_30B_A3B).roles[0].per_gpu
    assert whole["logits"] == pytest.approx(16384 * s.vocab / 2 * 24)
    # a row longer than trainer.micro_batch_tokens is a microbatch alone (Batch.microbatches): the longest
    # one, rollout.max_model_len tokens, sizes the logits and the activations
    short = make_plan(load_config(recipe, ["trainer.micro_batch_tokens=2048", "trainer.logit_chunk_tokens=0"],
                                  cuda_available=True), QWEN3_30B_A3B).roles[0].per_gpu
    assert short["logits"] == whole["logits"] and short["activations"] == policy["activations"]
    shorter = make_plan(load_config(recipe, [
        "trainer.micro_batch_tokens=2048", "rollout.max_model_len=4096", "rollout.max_new_tokens=2048",
        "environment.token_budget=2048", "trainer.logit_chunk_tokens=0"], cuda_available=True),
        QWEN3_30B_A3B).roles[0].per_gpu
    assert shorter["logits"] == pytest.approx(4096 * s.vocab / 2 * 24)


def test_expert_tensor_parallelism_is_its_own_setting(tmp_path):
    """parallel.etp: the routed experts split over ep x etp ranks, their optimizer state over the rest of the
    stage's ranks; etp 1 under tp 2 doubles a rank's expert weights and leaves its dense ones. A layout that
    does not fit the model (ep not dividing the experts) is refused before sizing."""
    recipe = ROOT / "configs/qwen3_30b_a3b_grpo_2n8g.yaml"  # tp 2, pp 2, ep 2, 8 ranks: dp 2
    s = ModelShape.from_hf(QWEN3_30B_A3B)

    def policy(*overrides):
        cfg = load_config(recipe, list(overrides), cuda_available=True)
        return make_plan(cfg, QWEN3_30B_A3B).roles[0].per_gpu

    dense = (24 * s.attention + 24 * s.moe_shared + s.hidden + s.vocab * s.hidden) / 2  # stage 1, tp 2
    for etp, expert_ranks in ((None, 2 * 2), ("1", 2 * 1), ("2", 2 * 2)):
        got = policy(*([f"parallel.etp={etp}"] if etp else []))
        expert = 24 * 128 * s.expert / expert_ranks
        assert got["weights"] == pytest.approx((dense + expert) * 2), etp
        # Adam (12 bytes) of the dense part over dp 2, of the experts over 8 / (pp 2 x ep 2 x etp)
        assert got["optimizer"] == pytest.approx(dense * 12 / 2 + expert * 12 / (8 / (2 * expert_ranks))), etp
    out = _plan(str(recipe), tmp_path, QWEN3_30B_A3B, "parallel.ep=3", "parallel.world_size=24")
    where = str(tmp_path / "config.json")
    assert out.returncode == 2 and out.stderr.strip().endswith(
        f"plan: parallel.ep: 3 does not divide the 128 experts ({where})"), out.stderr
    etp = _plan(str(recipe), tmp_path, QWEN3_30B_A3B, "parallel.etp=1", "parallel.ep=1")
    assert etp.returncode == 2 and "parallel.etp: 1 below tp=2 needs expert parallelism" in etp.stderr


def test_optimizer_offload_moves_adam_state_to_the_host_worked_by_hand():
    """trainer.optimizer_offload f: f of each rank's Adam moments (8 bytes a parameter of its shard) leave the
    GPU, the fp32 main shard (4) stays; the host keeps an fp32 copy, the fp32 gradient and the moments (16)
    of that share. The fullest node holds its 8 ranks' host state and one step's routes, fitted into 90% of
    cluster.host_memory_gb."""
    recipe = ROOT / "configs/qwen3_30b_a3b_grpo_2n8g.yaml"  # tp 2, pp 2, ep 2, 8 trainer ranks: dp 2
    s = ModelShape.from_hf(QWEN3_30B_A3B)
    dense = (24 * s.attention + 24 * s.moe_shared + s.hidden + s.vocab * s.hidden) / 2  # stage 1, tp 2
    expert = 24 * 128 * s.expert / 4  # ep 2 x etp 2
    shard = dense / 2 + expert / (8 / (2 * 4))  # dense over dp 2, experts over 8 / (pp 2 x ep 2 x etp 2)

    def plan(*overrides):
        return make_plan(load_config(recipe, list(overrides), cuda_available=True), QWEN3_30B_A3B)

    for f in (0.0, 0.5, 1.0):
        p = plan(f"trainer.optimizer_offload={f}")
        policy = p.roles[0]
        assert policy.per_gpu["optimizer"] == pytest.approx(shard * (12 - 8 * f)), f
        assert policy.host == pytest.approx(shard * 16 * f), f
        # the policy's 8 ranks share one node (the engines, the other): 8 ranks' state beside the routes
        assert p.host_bytes == pytest.approx(8 * shard * 16 * f + p.route_bytes), f
    assert render(plan("trainer.optimizer_offload=1.0")).endswith(
        "host memory: the fullest node 456.5 of 1024 GiB (offloaded state, the routes; optimizer state: "
        "policy 56.9 GiB a rank)")
    assert "host memory" not in render(plan())
    small = plan("trainer.optimizer_offload=1.0", "cluster.host_memory_gb=256")
    assert small.problems == ["host memory: 456.5 GiB on the fullest node (offloaded state and one step's "
                              "routes) does not fit 230.4 GiB (90% of cluster.host_memory_gb=256)"]


def test_the_precision_aware_optimizer_worked_by_hand():
    """trainer.precision_aware_optimizer: the optimizer owns the fp32 main weights. Without offload,
    Transformer Engine's FusedAdam keeps their 16-bit remainders (2 bytes) and the moments (8 bytes, or 4 in
    bfloat16) of the rank's shard: 10 or 6 bytes a parameter instead of 12; under offload f the host part's
    optimizer holds them with its state, the GPU 12 bytes of the other 1 - f (none at 1.0, the fp32 main
    shard's 4 bytes gone), the host's 16 bytes of f as before."""
    recipe = ROOT / "configs/qwen3_30b_a3b_grpo_2n8g.yaml"  # tp 2, pp 2, ep 2, 8 trainer ranks: dp 2
    s = ModelShape.from_hf(QWEN3_30B_A3B)
    dense = (24 * s.attention + 24 * s.moe_shared + s.hidden + s.vocab * s.hidden) / 2  # stage 1, tp 2
    shard = dense / 2 + 24 * 128 * s.expert / 4 / (8 / (2 * 4))

    def policy(*overrides):
        cfg = load_config(recipe, ["trainer.precision_aware_optimizer=true", *overrides], cuda_available=True)
        return make_plan(cfg, QWEN3_30B_A3B).roles[0]

    assert policy().per_gpu["optimizer"] == pytest.approx(shard * 10)
    assert policy("trainer.adam_moments_dtype=bfloat16").per_gpu["optimizer"] == pytest.approx(shard * 6)
    for f in (0.5, 1.0):
        got = policy(f"trainer.optimizer_offload={f}")
        assert got.per_gpu["optimizer"] == pytest.approx(shard * 12 * (1 - f)) and \
            got.host == pytest.approx(shard * 16 * f), f


def test_colocated_phases_worked_by_hand():
    """Colocated roles share each GPU phase by phase: in generation the engine beside what the trainer keeps
    resident (its weights, gradients and optimizer state; nothing with cluster.offload), in training the
    trainer's peak beside the engine (its runtime alone with rollout.sleep_engines). The binding phase is
    the fullest GPU; the host holds the larger of the two phases' moves beside the optimizer state."""
    recipe = ROOT / "configs/qwen3_30b_a3b_grpo_1n8g.yaml"  # colocated, offload, sleeping engines
    gib = 2**30

    def plan(*overrides):
        return make_plan(load_config(recipe, list(overrides), cuda_available=True), QWEN3_30B_A3B)

    for offload, sleep in ((True, True), (False, True), (True, False), (False, False)):
        p = plan(f"cluster.offload={str(offload).lower()}", f"rollout.sleep_engines={str(sleep).lower()}")
        policy, engine = p.roles
        resident = sum(v for k, v in policy.per_gpu.items() if k not in ("activations", "logits"))
        asleep = engine.per_gpu["runtime"] if sleep else engine.total
        assert p.phases["generation"][0] == pytest.approx(engine.total + (0 if offload else resident))
        assert p.phases["training"][0] == pytest.approx(policy.total + asleep)
        held, size = p.fullest
        assert size == max(v for v, _ in p.phases.values()) and held.startswith(
            "generation" if p.phases["generation"][0] >= p.phases["training"][0] else "training")
        engine_weights = engine.per_gpu["weights"]
        moved = max(8 * resident if offload else 0, 8 * engine_weights if sleep else 0)
        assert p.host_bytes == pytest.approx(8 * policy.host + moved + p.route_bytes)
    # everything resident at once, the fp32 main weights on the GPUs too (no precision-aware optimizer):
    # 38.0 + 44.0 GiB, over 72 GiB (90% of 80): refused, naming the phase
    both = plan("cluster.offload=false", "rollout.sleep_engines=false",
                "trainer.precision_aware_optimizer=false")
    assert both.phases["training"][0] / gib == pytest.approx(82.0, abs=0.1)
    # with it, the recipe's: 23.7 + 44.0 GiB fits even so
    assert plan("cluster.offload=false", "rollout.sleep_engines=false").phases["training"][0] / gib \
        == pytest.approx(67.7, abs=0.1)
    assert [x.split(":")[0] for x in both.problems] == ["colocated, generation", "colocated, training"]


def test_optimizer_state_is_sharded_where_the_trainer_shards_it():
    """train/worker.py uses megatron's distributed optimizer only with dp > 1 (its dp*cp group then shards
    the dense state): with dp 1 the state is whole, context parallelism or not (measured in
    tests/train/test_plan_memory.py)."""
    def optimizer(*overrides):
        cfg = from_dict({}, ["model.dtype=bfloat16", *overrides], cuda_available=True)
        return make_plan(cfg, hf_config_of(cfg, None)).roles[0].per_gpu["optimizer"]

    whole = optimizer()
    assert whole == 12 * ModelShape.from_hf(hf_config_of(from_dict({}, cuda_available=True), None)).total
    assert optimizer("parallel.cp=2", "parallel.world_size=2") == whole  # dp 1
    assert optimizer("parallel.world_size=2") == whole / 2  # dp 2
    assert optimizer("parallel.cp=2", "parallel.world_size=4") == whole / 4  # dp 2: over dp*cp
    assert optimizer("parallel.world_size=2", "parallel.distributed_optimizer=false") == whole


def test_check_config_assume_cuda_sizes_the_run():
    ok = subprocess.run([*moe_rl_cli(), "check-config", "configs/quickstart.yaml", "--assume-cuda"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "# fits 8 x 80 GiB GPUs per node" in ok.stderr
    small = subprocess.run([*moe_rl_cli(), "check-config", "configs/quickstart.yaml",
                            "cluster.gpu_memory_gb=0.5", "--assume-cuda"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    # colocated (the quickstart): GPU i holds policy rank i, critic rank i and an engine worker, all resident
    assert small.returncode == 2 and re.match(r"moe-rl: error: colocated, generation: engine \d+\.\d \+ "
                                              r"policy \d+\.\d \+ critic \d+\.\d = \d+\.\d GiB per GPU does "
                                              r"not fit \d+\.\d GiB \(90% of 0.5 GiB",
                                              small.stderr), small.stderr
    assert len(small.stderr.strip().splitlines()) == 1


def test_a_teacher_is_counted_with_its_own_shape_and_no_training_state(tmp_path):
    """Distillation teachers are scoring roles: their GPUs (placed like the policy) and their weights at
    their own shape (here: Qwen3-30B-A3B's config teaching a student of the recipe's layout), the
    scoring-only logits, and no gradients, optimizer state or activations."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml",
                      ["algorithm.distill_coef=1", f"teacher.named={{big: {teacher}}}"], cuda_available=True)
    alone = load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", cuda_available=True)
    # separate placement (the recipe's): GPUs of their own, as many as the policy's
    assert cfg.actors["teacher_big"] == cfg.parallel.world_size
    assert not cfg.cluster.colocate and cfg.gpus == alone.gpus + cfg.parallel.world_size
    small = dict(QWEN3_30B_A3B, num_hidden_layers=24)  # the student: half the layers
    plan = make_plan(cfg, small)
    roles = {r.role: r for r in plan.roles}
    student, big = roles["policy"].per_gpu, roles["teacher_big"]
    assert big.gpus == cfg.parallel.world_size
    assert set(big.per_gpu) == {"weights", "logits"}
    # the teacher's 48 layers against the student's 24: twice the layer weights on its busiest stage
    s, t = ModelShape.from_hf(small), ModelShape.from_hf(QWEN3_30B_A3B)
    layers = (t.attention + t.moe_shared) / 2 + 128 * t.expert / 16  # per layer: tp 2, ep 8 x etp 2
    assert big.per_gpu["weights"] - student["weights"] == pytest.approx(12 * layers * 2)  # 24 vs 12, bf16
    # scoring: a 1024-token chunk of V/2 logits, 8 bytes each (z and exp(z) in float32), and the microbatch's
    # 16384 gathered hidden states (2 bytes each)
    assert big.per_gpu["logits"] == pytest.approx(1024 * s.vocab / 2 * 8 + 16384 * s.hidden * 2)


def test_lora_trains_the_adapters_alone_worked_by_hand():
    """Qwen3-30B-A3B, the shipped recipe (tp 2, pp 2, ep 8; Transformer Engine, FP8) with rank-16 adapters
    on every linear. Per layer on one rank: linear_qkv
    16 (2048 + 5120 / 2) = 73,728, linear_proj 16 (4096 / 2 + 2048) = 65,536; each of the 128 / 8 = 16
    experts fc1 16 (2048 + 1536 / 2) = 45,056 and fc2 16 (768 / 2 + 2048) = 38,912; 24 layers a stage."""
    cfg = load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", ["model.lora.rank=16"], cuda_available=True)
    full = make_plan(load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", cuda_available=True),
                     QWEN3_30B_A3B)
    plan = make_plan(cfg, QWEN3_30B_A3B)
    dense, expert = 24 * (73_728 + 65_536), 24 * 16 * (45_056 + 38_912)
    policy, whole = plan.roles[0].per_gpu, full.roles[0].per_gpu
    assert policy["weights"] == whole["weights"] and policy["lora_adapters"] == (dense + expert) * 2
    assert policy["gradients"] == (dense + expert) * 4
    # Adam: 12 bytes per parameter, dense over dp*cp = 8 ranks, experts over one expert-data-parallel rank
    assert policy["optimizer"] == pytest.approx(dense * 12 / 8 + expert * 12)
    assert policy["optimizer"] < whole["optimizer"] / 25
    assert plan.roles[1].per_gpu == full.roles[1].per_gpu  # the critic trains whole
    assert "LoRA: 639.37 M adapter parameters (2.09% of the model) train" in render(plan)  # 48 layers' worth
    # the recipe's NCCL weight transfer moves merged weights; through the object store, the GPU engines
    # apply the adapters and a sync moves them alone, the whole model's: per layer 16 (2048 + 5120) qkv +
    # 16 (4096 + 2048) proj + 128 experts x (16 (2048 + 1536) + 16 (768 + 2048)) = 13,320,192, x 48; in
    # PEFT's naming linear_qkv's A goes to q, k and v (two copies more) and each fc1's A to gate and up (one
    # more): (2 + 128) x 16 x 2048 = 4,259,840 a layer, x 48; in bf16
    assert plan.sync_bytes == full.sync_bytes and "rollout.weight_transfer is nccl" in render(plan)
    store = make_plan(load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", [
        "model.lora.rank=16", "rollout.weight_transfer=store"],
        cuda_available=True), QWEN3_30B_A3B)
    assert store.adapter_params == 639_369_216
    assert store.sync_bytes == (639_369_216 + 48 * 4_259_840) * 2
    assert "engines apply the adapters: a sync moves them alone" in render(store)
    # vLLM holds two adapters' buffers (LORA_SLOTS) at max_lora_rank 16, a module per Hugging Face module:
    # with one engine GPU, the sync's tensors twice; merged weights need none
    engine, merged_engine = store.roles[-1].per_gpu, plan.roles[-1].per_gpu
    assert engine["lora_buffers"] == 2 * (639_369_216 + 48 * 4_259_840) * 2
    assert "lora_buffers" not in merged_engine
    assert engine["kv_cache"] == pytest.approx(merged_engine["kv_cache"] - engine["lora_buffers"])
    # rollout.engine_tp=2, per layer on a GPU: qkv A 3 x 16 x 2048 = 98,304 (one per q, k, v) and B
    # 16 x 5120 / 2 = 40,960; o_proj A 16 x 4096 / 2 and B 16 x 2048 (32,768 each); each of the 128 experts
    # (intermediate 768 / 2 = 384 a GPU) gate and up A 2 x 16 x 2048 = 65,536, their B 2 x 384 x 16 =
    # 12,288, down A 16 x 384 = 6,144 and B 2048 x 16 = 32,768: 116,736; with rollout.engine_ep the GPU
    # holds 64 whole experts: 65,536 + 2 x 768 x 16 + 16 x 768 + 32,768 = 135,168 each
    attention = 98_304 + 40_960 + 2 * 32_768
    for extra, experts in ((["rollout.engine_tp=2"], 128 * 116_736),
                           (["rollout.engine_tp=2", "rollout.engine_ep=true"], 64 * 135_168)):
        tp2 = make_plan(load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", [
            "model.lora.rank=16", "rollout.weight_transfer=store", *extra], cuda_available=True),
            QWEN3_30B_A3B)
        assert tp2.roles[-1].per_gpu["lora_buffers"] == 2 * 48 * (attention + experts) * 2, extra


def test_a_lora_policys_reference_is_its_base_not_a_copy():
    """With model.lora a KL term's reference is the policy's frozen base (scored with the adapters off):
    no reference ranks, and nothing of a reference in the plan."""
    kl = ["algorithm.kl_loss_coef=0.05"]
    whole = load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", kl, cuda_available=True)
    lora = load_config(ROOT / "configs/qwen3_30b_a3b_gspo.yaml", [*kl, "model.lora.rank=16"],
                       cuda_available=True)
    assert whole.actors["reference"] == 32 and lora.actors["reference"] == 0 and lora.uses_reference
    assert lora.gpus == whole.gpus - 32
    assert "reference" in {r.role for r in make_plan(whole, QWEN3_30B_A3B).roles}
    assert "reference" not in {r.role for r in make_plan(lora, QWEN3_30B_A3B).roles}


def test_a_deepseek_config_is_sized_with_its_latent_cache(tmp_path):
    """Moonlight's config.json on the 1-node recipe: sized (multi-latent attention's KV cache: the latent
    and the RoPE key per token and layer); DeepSeek-V3's multi-token-prediction layer is named, apart from
    the model's count."""
    out = _plan("configs/qwen3_30b_a3b_grpo_1n8g.yaml", tmp_path, MOONLIGHT_16B_A3B)
    assert out.returncode == 0, out.stderr
    assert "15.96 B parameters, 2.91 B active" in out.stdout and "multi-latent attention, KV rank 512" \
        in out.stdout
    kv_gib, tokens = re.search(r"kv_cache ([\d.]+) GiB\)\n\s+([\d,]+) KV-cache tokens", out.stdout).groups()
    per_token = 27 * (512 + 64) * 2  # bf16
    assert abs(int(tokens.replace(",", "")) * per_token / 2**30 - float(kv_gib)) < 0.05
    out = _plan("configs/qwen3_30b_a3b_grpo_2n8g.yaml", tmp_path, DEEPSEEK_V3, "parallel.pp=1")
    assert "1 multi-token-prediction layer(s) of 13.46 B in the checkpoint, not counted" in out.stdout \
        + out.stderr
