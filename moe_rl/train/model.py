"""Policy and critic models: megatron-core MoE GPTModels built from a Hugging Face config.

The Hugging Face config is mapped to a megatron TransformerConfig by mbridge (Qwen3-MoE, Mixtral,
Qwen2-MoE with shared experts, DeepSeek-V3, ... — whatever mbridge's registry knows); we then set what
our runtime needs (CPU initialisation, dispatcher, router replay, recompute, FP8) and build the layer
spec ourselves: megatron-core's local spec on CPU, Transformer Engine's on GPU.

The critic is the same backbone with the vocabulary projection replaced by a scalar value head.
The pad token's embedding row trains as in transformers (`keep_pad_row_fixed`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch

from moe_rl.train import cpu_compat
from moe_rl.train.lora import LoraSpec
from moe_rl.weights.hf import dense_layers

# moe_rl name -> (megatron fp8 format, megatron Fp8Recipe)
FP8_RECIPES = {"delayed": ("hybrid", "delayed"), "tensorwise": ("hybrid", "tensorwise"),
               "blockwise": ("e4m3", "blockwise"), "mxfp8": ("e4m3", "mxfp8")}


@dataclass(frozen=True)
class ModelSpec:
    """Built from the config by moe_rl.driver.specs.model_spec (defaults live in the config sections,
    config/run.py and config/learning.py)."""

    hf_path: str
    dtype: str  # model.dtype: float32 | bfloat16
    layer_spec: str  # model.layer_spec: local | transformer_engine
    experts: str  # model.experts: auto | grouped | sequential (local_experts)
    fp8: str  # model.fp8: none | delayed | tensorwise | blockwise | mxfp8
    recompute: bool  # model.recompute
    moe_dispatcher: str  # model.moe_dispatcher: alltoall | allgather
    routing_replay: bool  # rollout.record_routes: replay the rollout's routes (the critic: never)
    moe_aux_loss_coeff: float  # model.*: the switch load-balancing loss (0: off)
    moe_z_loss_coeff: float  # model.*: the router z-loss (0: off)
    expert_bias_update_rate: float  # model.*: aux-loss-free balancing's step (0: the bias frozen)
    lora: LoraSpec | None = None  # model.lora, the policy only: adapters on a frozen base (train/lora.py)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


def check_spec_for_machine(spec: ModelSpec) -> None:
    if not torch.cuda.is_available() and (spec.layer_spec == "transformer_engine" or spec.fp8 != "none"):
        raise ValueError("Transformer Engine layers and FP8 need CUDA; this machine has none (use "
                         "layer_spec=local, fp8=none)")


_DENSE_MLP = re.compile(r"^decoder\.layers\.(\d+)\.mlp\."
                        r"(linear_fc1\.weight|linear_fc2\.weight|linear_fc1\.layer_norm_weight)$")
# TE fuses the pre-MLP norm
_DENSE_MLP_HF = {"linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                 "linear_fc2.weight": ("mlp.down_proj.weight",),
                 "linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",)}


def _map_dense_mlps(bridge) -> None:
    """Teach a Qwen2/Qwen3-MoE bridge the dense MLP layers' names (its own mapping knows MoE layers only);
    mbridge's gate/up fusing and TP splitting already work by parameter name."""
    moe_mapping = bridge._weight_name_mapping_mlp

    def mapping(name: str) -> list[str]:
        m = _DENSE_MLP.match(name)
        if m is None:
            return moe_mapping(name)
        return [f"model.layers.{m.group(1)}.{hf}" for hf in _DENSE_MLP_HF[m.group(2)]]

    bridge._weight_name_mapping_mlp = mapping


def kernel_settings(layer_spec: str, fused_wgrad: bool, grouped_experts: bool = True) -> dict[str, bool]:
    """TransformerConfig's kernel and fusion flags for a layer spec (`fused_wgrad`: whether apex's
    fused_weight_gradient_mlp_cuda extension is importable, see below; `grouped_experts`: False for
    model.experts=sequential, which on Transformer Engine's spec runs its SequentialMLP).

    local (megatron-core's own layers: CPU, and GPU without Transformer Engine): none. Its
    bias-activation and bias-dropout-add fusions are functions megatron-core wraps in `torch.compile`
    (`megatron.core.jit.jit_fuser`, torch >= 2.2), which every rank would compile at its first step and
    again for new shapes: the local experts (SequentialMLP) run one MLP per expert on that expert's
    tokens, a count that changes with every microbatch. The other fusions are Transformer Engine's
    (RoPE, token permutation, grouped GEMM: the local spec groups its experts' GEMMs with torch's
    kernel instead, `local_experts`) or apex's (masked softmax, which SdpaAttention does not use;
    persistent layer norm, which the torch norms refuse).

    transformer_engine: what Megatron-LM trains MoE models with (its MoE README's performance flags,
    the Mixtral and Qwen3 example scripts, over Megatron-LM's own defaults): grouped GEMM, fused token
    permutation (TE >= 2.1, checked by megatron-core when the config is built), fused RoPE (TE >= 1.4),
    gradient accumulation fused into the weight-gradient GEMMs, persistent layer norm, bias-activation
    and bias-dropout-add fusions (compiled once per rank, and once more with dynamic shapes when token
    counts change), masked-softmax fusion off (the scripts' --no-masked-softmax-fusion: TE's attention
    has its own softmax). Router fusion (--moe-router-fusion) stays off: megatron-core's fused top-k
    bypasses RouterReplay, so routes would be neither replayed (R3) nor recorded.
    Gradient-accumulation fusion: TE's linears fuse by themselves, but megatron-core's own
    ColumnParallelLinear (the output layer) refuses the flag unless apex's extension is importable
    (as in upstream Megatron-LM): without apex the flag stays off (a speed difference, same results).
    """
    if layer_spec == "local":
        return dict(moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
                    apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                    bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False)
    if layer_spec == "transformer_engine":
        return dict(moe_grouped_gemm=grouped_experts, moe_permute_fusion=True, moe_router_fusion=False,
                    apply_rope_fusion=True, gradient_accumulation_fusion=fused_wgrad, persist_layer_norm=True,
                    bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=False)
    raise ValueError(f"layer spec {layer_spec!r}: 'local' or 'transformer_engine'")


def import_megatron(layer_spec: str) -> None:
    """Import megatron-core as a trainer rank of `layer_spec` needs it (before any other import of it):

    - without W&B: megatron-core imports it for an inference context's logging, which a rank never does
      (W&B logging lives in the driver): 0.5-0.9 s of a rank's ~5 s of imports;
    - on the local spec, with megatron-core's JIT fuser off (`megatron.core.jit.disable_jit_fuser`'s
      effect): the functions it wraps in torch.compile are the fusions `kernel_settings` turns off, never
      called there, yet wrapping them imports dynamo and inductor (~1.3 s). megatron-core's switch acts
      only on modules imported after it, and its package imports them first; jit.py takes
      `jit_fuser = torch.compile` as it loads, so torch.compile returns functions as they are while it
      loads."""
    if "megatron.core" in sys.modules:
        return
    sys.modules.setdefault("wandb", None)
    if layer_spec != "local":
        import megatron.core  # noqa: F401
        return
    compile_ = torch.compile
    torch.compile = _as_it_is
    try:
        import megatron.core.jit  # noqa: F401
    finally:
        torch.compile = compile_


def _as_it_is(fn=None, **_options):
    """torch.compile's two forms, compiling nothing: compile(fn) and compile(**options)(fn)."""
    return _as_it_is if fn is None else fn


def fused_wgrad_available() -> bool:
    """Whether apex's fused weight-gradient extension, which megatron-core's ColumnParallelLinear needs
    for gradient_accumulation_fusion, is importable here."""
    import importlib.util

    try:
        return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    except (ImportError, ValueError):  # held absent (sys.modules[name] = None)
        return False


def make_bridge(spec: ModelSpec):
    """An mbridge Bridge for the checkpoint's architecture, with our runtime settings applied."""
    from mbridge import AutoBridge
    from megatron.core import parallel_state as ps

    check_spec_for_machine(spec)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(spec.hf_path)
    if hf.model_type == "deepseek_v3":
        _fit_mla_bridge()
    if getattr(hf, "rope_theta", None) is None:  # transformers 5 moved it; mbridge's bridges read it
        hf.rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    bridge = AutoBridge.from_config(hf)
    bridge.dtype = spec.torch_dtype
    bridge.make_vocab_size_divisible_by = None  # our vocabularies are padded already; keep HF's size
    tp = ps.get_tensor_model_parallel_world_size()
    sp = tp > 1  # megatron-core MoE needs sequence parallelism under TP; at tp=1 it means nothing
    on_cpu = not torch.cuda.is_available()
    extra = dict(
        use_cpu_initialization=on_cpu,
        params_dtype=spec.torch_dtype,
        pipeline_dtype=spec.torch_dtype,
        bf16=spec.torch_dtype is torch.bfloat16,
        sequence_parallel=sp,
        context_parallel_size=ps.get_context_parallel_world_size(),
        moe_token_dispatcher_type=spec.moe_dispatcher,
        moe_enable_routing_replay=spec.routing_replay,
        moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_z_loss_coeff=spec.moe_z_loss_coeff or None,
        moe_router_dtype=router_dtype(hf),
        # microbatches have their own lengths; only pipeline p2p needs to be told (and the allgather
        # dispatcher refuses the flag, so it is set only where it matters)
        variable_seq_lengths=ps.get_pipeline_model_parallel_world_size() > 1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_shared_expert_overlap=False,
        deallocate_pipeline_outputs=False,
        **kernel_settings(spec.layer_spec, fused_wgrad=fused_wgrad_available(),
                          grouped_experts=spec.experts != "sequential"),
    )
    # aux-loss-free balancing (the expert bias of DeepSeek-V3 / GLM-4.5): mbridge's DeepSeek bridge moves
    # it by 0.001 an update; here it moves only as model.expert_bias_update_rate says, never under replay
    # (megatron counts the replayed assignment, padding included; specs.model_spec gives 0 there)
    extra["moe_router_bias_update_rate"] = 0.0 if spec.routing_replay else spec.expert_bias_update_rate
    if spec.recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.fp8 != "none":
        fmt, recipe = FP8_RECIPES[spec.fp8]
        extra.update(fp8=fmt, fp8_recipe=recipe, fp8_param=False)
    if getattr(bridge.hf_config, "model_type", "") == "mixtral":
        extra["moe_router_pre_softmax"] = False  # softmax after top-k, as Mixtral's HF implementation
    if getattr(bridge.hf_config, "shared_expert_intermediate_size", 0):
        extra["moe_shared_expert_gate"] = True  # Qwen2-MoE: sigmoid(x . w) scales the shared expert
    extra.update(grouped_routing(bridge.hf_config))
    if bridge.hf_config.model_type == "deepseek_v3":
        extra.update(latent_rope(bridge.hf_config))
    # a checkpoint's multi-token-prediction layers are not built (mbridge's DeepSeek bridge asks for them,
    # and megatron takes even 0 as a request: its output path then wants labels)
    extra["mtp_num_layers"] = None
    dense = dense_layers(bridge.hf_config)
    if dense:  # mbridge's Qwen-MoE bridges put experts in every layer
        extra["moe_layer_freq"] = [0 if i in dense else 1 for i in range(bridge.hf_config.num_hidden_layers)]
        _map_dense_mlps(bridge)
    bridge.set_extra_args(**extra)
    return bridge


def _fit_mla_bridge() -> None:
    """mbridge 0.15's DeepSeek-V3 bridge names MLA's original context length `max_position_embeddings`,
    which megatron-core 0.16's MLATransformerConfig calls `original_max_position_embeddings`."""
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def config(**fields):
        if "max_position_embeddings" in fields:  # ours (latent_rope, from config.json) first
            fields.setdefault("original_max_position_embeddings", fields.pop("max_position_embeddings"))
        return MLATransformerConfig(**fields)

    DeepseekV3Bridge.TransformerConfigClass = staticmethod(config)


FP32_ROUTER_MODELS = ("glm4_moe",)  # model_type values whose router vLLM computes in float32


def router_dtype(hf) -> str | None:
    """The routers' GEMM precision (megatron's moe_router_dtype) as the engine's model computes it, since
    the trainer must agree with the engine: vLLM runs GLM-4.5's gate in float32 (GateLinear with float32
    parameters and output), and DeepSeek-V3's where its config asks (moe_router_dtype: float32); every
    other gate of Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V3 in the model's dtype, its logits rounded
    to it before the softmax or sigmoid. "fp32", or None: the model's dtype. In a bfloat16 trainer a
    float32 router picks other experts than the engine where two scores nearly tie (free routing) and
    weighs the replayed ones from other logits: on the tiny Qwen3-MoE, 100% of free routes agree with
    transformers' bfloat16 (whose gate is vLLM's) against 99.95% in float32, and the largest log-prob gap
    falls from 0.014 to 0.008 (tools/bench/bf16_gap.py)."""
    if hf.model_type in FP32_ROUTER_MODELS or getattr(hf, "moe_router_dtype", None) == "float32":
        return "fp32"
    return None


def grouped_routing(hf) -> dict:
    """DeepSeek-V3 / GLM-4.5 routing that mbridge's bridges leave out or fix: experts in n_group groups of
    which topk_group are kept per token (each group scored by its top-2 biased scores: megatron's
    topk / group_topk, equal to 2 in these models), and n_shared_experts shared experts of
    moe_intermediate_size each."""
    extra = {}
    if (getattr(hf, "n_group", None) or 1) > 1:
        extra.update(moe_router_num_groups=hf.n_group, moe_router_group_topk=hf.topk_group)
    if getattr(hf, "n_shared_experts", None):
        extra["moe_shared_expert_intermediate_size"] = hf.n_shared_experts * hf.moe_intermediate_size
    return extra


def latent_rope(hf) -> dict:
    """DeepSeek-V3's YaRN RoPE (DeepSeek-V3 / R1, Kimi-K2) for megatron's MLA config: mbridge looks for it
    with `"rope_scaling" in config`, which transformers 5 answers no (it keeps it in rope_parameters), and
    would build plain RoPE. {} for plain RoPE (Moonlight)."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "yarn":
        return {}
    return dict(rope_type="yarn", rotary_scaling_factor=params["factor"], mscale=params.get("mscale", 1.0),
                mscale_all_dim=params.get("mscale_all_dim", 1.0), beta_fast=params.get("beta_fast", 32),
                beta_slow=params.get("beta_slow", 1),
                original_max_position_embeddings=params.get("original_max_position_embeddings", 4096))


def rotary_fraction(hf) -> float:
    """The share of a head's width RoPE rotates (GLM-4.5: half); transformers 5 keeps it in
    rope_parameters."""
    params = getattr(hf, "rope_parameters", None) or {}
    return getattr(hf, "partial_rotary_factor", None) or params.get("partial_rotary_factor") or 1.0


def layer_spec(bridge, spec: ModelSpec, vp_stage: int | None = None):
    """megatron-core's local spec (CPU) or Transformer Engine spec (GPU), MoE in every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = bridge.config
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=spec.layer_spec == "transformer_engine",
                                       normalization="RMSNorm", vp_stage=vp_stage)
    if spec.layer_spec == "local":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from moe_rl.train import local_norm
        from moe_rl.train.attention import SdpaAttention

        local_norm.install()  # its norms under sequence parallelism, on any device
        # the final norm too (with apex installed megatron picks apex's FusedLayerNorm: LayerNorm only)
        block.layer_norm = WrappedTorchNorm
        experts = local_experts(spec, cfg)
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SdpaAttention
            moe = getattr(layer.submodules.mlp, "submodules", None)
            if getattr(moe, "experts", None) is not None:  # an MoE layer (not a dense one)
                moe.experts.module = experts
    return block


def local_experts(spec: ModelSpec, config):
    """The local spec's expert module: GroupedExperts (train/experts.py) for model.experts=grouped, and for
    auto on a GPU where torch's grouped GEMM runs in this dtype at these widths; else megatron-core's
    SequentialMLP. On the CPU auto is sequential: there torch's grouped GEMM is no faster than the loop
    over experts and stacking the weights costs more (`moe-rl bench train_step`: grouped 0.98x at 8
    experts, 0.80x at 64). grouped where it cannot run is refused (ValueError, saying why)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_rl.model_shape import grouped_expert_widths
    from moe_rl.train.experts import GroupedExperts, grouped_runs, settings_refused

    on_gpu = torch.cuda.is_available()
    if spec.experts == "sequential" or (spec.experts == "auto" and not on_gpu):
        return SequentialMLP
    from megatron.core import parallel_state as ps

    lora = spec.lora
    widths = grouped_expert_widths(config.hidden_size, config.moe_ffn_hidden_size,
                                   ps.get_expert_tensor_parallel_world_size(), lora.rank if lora else 0,
                                   lora.targets if lora else ())
    why_not = settings_refused(config) or grouped_runs("cuda" if on_gpu else "cpu", spec.torch_dtype, widths)
    if why_not is None:
        return GroupedExperts
    if spec.experts == "grouped":
        raise ValueError(f"model.experts=grouped: {why_not}; use model.experts=sequential or auto")
    return SequentialMLP


class ValueHead(torch.nn.Module):
    """Scalar head replacing the vocabulary projection: [s, b, h] -> ([s, b, 1], None).

    Replicated on every TP rank; under sequence parallelism it gathers the sequence first, like the
    ColumnParallelLinear it replaces.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        from megatron.core import tensor_parallel

        if self.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden,
                                                                          tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None


def pad_row(hf_config) -> int | None:
    """The embedding row transformers builds as `nn.Embedding(..., padding_idx=config.pad_token_id)` (every
    causal LM mbridge maps: Qwen2/3(-MoE), Mixtral, Llama, DeepSeek-V3, GLM-4-MoE, ...), as a row index;
    None without a pad token (or with one outside the vocabulary, which transformers would refuse)."""
    pad, vocab = getattr(hf_config, "pad_token_id", None), hf_config.vocab_size
    if not isinstance(pad, int) or not -vocab <= pad < vocab:
        return None
    return pad % vocab  # nn.Embedding counts a negative padding_idx from the end


def keep_pad_row_fixed(word_embeddings, pad_id: int):
    """transformers' `padding_idx` semantics on megatron's VocabParallelEmbedding: looking up `pad_id`
    sends no gradient into its row (which transformers initialises to zero and never trains from the
    lookup). Megatron's embedding has no such notion, so when a policy samples the pad token, the
    gradient of the normalised zero row dominates the update and its norm. Returns the hook's handle.

    The gradient reaching the lookup's output is zeroed at the positions whose id is the pad token, so
    the rows' gradients are unchanged except the pad row's, which gets nothing from the lookup. That
    is exactly padding_idx: a tied LM head's gradient into the row still flows (it does not pass
    through the lookup). Layouts: the output is the full [b, s, h] after the TP all-reduce, or with
    sequence parallelism this TP rank's [s/tp, b, h] chunk after the reduce-scatter (whose backward
    all-gathers the masked chunks, so the shard that holds the row sees zeros at every pad position).
    Forward-only passes (scoring) skip it; no host sync either way.
    """

    def lookup_without_pad_gradient(module, args, output):
        if not output.requires_grad:
            return None
        is_pad = args[0] == pad_id  # [b, s]
        if module.reduce_scatter_embeddings:
            chunk = output.shape[0]
            start = module.tp_group.rank() * chunk
            is_pad = is_pad.t()[start:start + chunk]  # [s/tp, b]
        is_pad = is_pad.unsqueeze(-1)
        output.register_hook(lambda grad: grad.masked_fill(is_pad, 0.0))
        return None

    return word_embeddings.register_forward_hook(lookup_without_pad_gradient)


def build_gpt(bridge, spec: ModelSpec, critic: bool = False, vp_stage: int | None = None):
    """One pipeline stage of the policy (or critic) for this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    cpu_compat.apply()
    hf = bridge.hf_config
    pre = ps.is_pipeline_first_stage(ignore_virtual=True)
    post = ps.is_pipeline_last_stage(ignore_virtual=True)
    model = GPTModel(
        config=bridge.config,
        transformer_layer_spec=layer_spec(bridge, spec, vp_stage),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)) and not critic,
        position_embedding_type="rope",
        rotary_base=hf.rope_theta,
        rotary_percent=rotary_fraction(hf),
        parallel_output=True,
    )
    pad = pad_row(hf)
    if pre and pad is not None:
        keep_pad_row_fixed(model.embedding.word_embeddings, pad)
    if critic and post:
        model.output_layer = ValueHead(hf.hidden_size, spec.torch_dtype, bridge.config.sequence_parallel)
    # megatron-core builds its parallel layers on the GPU (without use_cpu_initialization) but the MoE
    # router's weight on the CPU in fp32 (router.py: "TODO: Add support for GPU initialization"), relying
    # on Megatron-LM's get_model: the whole stage moves to this rank's device in the run's dtype, as
    # get_model does (.cuda(), then Float16Module's cast)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return model.to(device=device, dtype=spec.torch_dtype)
