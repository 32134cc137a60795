"""Hugging Face checkpoints as files and names, no model: safetensors reading (`HFReader`) and writing
(`write_shards`, `write_index`, `save_hf_checkpoint`), the copy of config and tokenizer files, and
the Megatron -> Transformer Engine parameter names mbridge speaks (`to_te_name`). Loading into and
exporting from sharded Megatron models is moe_rl.train.hf_io.

The local spec names differ from TE's in two places (three under multi-latent attention, whose input
norm TE keeps apart: its q and kv norms go to linear_q_up_proj / linear_kv_up_proj.layer_norm_weight):

    decoder.layers.L.input_layernorm.weight                 -> ...self_attention.linear_qkv.layer_norm_weight
    decoder.layers.L.mlp.experts.local_experts.E.linear_fcN.weight -> ...mlp.experts.linear_fcN.weightG

with G = E + the expert offset (the global expert id).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from moe_rl.weights.sync import buckets

HF_CONFIG_DIR = "hf_config"  # a Megatron checkpoint's copy of its HF config and tokenizer files
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TE grouped experts


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, unsafe, or does not fit the model."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint does not fit the model (names, shapes or architecture)."""


# HF model_type values trained, served and tested here
MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe")


def check_model_dir(path: str | Path, field: str = "model.path") -> dict:
    """A Hugging Face model directory this project can train: its config.json names one of
    MODEL_TYPES. Returns the config; CheckpointError (one line, naming the config `field`) otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{field}: '{path}' is not a directory" if path.exists() else
                              f"{field}: '{path}' does not exist")
    try:
        hf = json.loads((path / "config.json").read_text())
        kind = hf.get("model_type", "")
    except FileNotFoundError:
        raise CheckpointError(f"{field}: '{path}' has no config.json (not a Hugging Face model "
                              "directory)") from None
    except (json.JSONDecodeError, AttributeError) as err:
        raise CheckpointError(f"{field}: '{path}/config.json' is not a JSON object ({err})") from None
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"{field}: '{path}' is a '{kind or 'unknown'}' model; supported: "
                              f"{', '.join(MODEL_TYPES)}")
    return hf


VALUE_HEADS = ("score.weight", "v_head.weight", "value_head.weight")  # a reward model's one-label head


def check_reward_model_dir(path: str | Path, field: str = "reward_model.path") -> dict:
    """`check_model_dir`, and a one-label score head among its weights (VALUE_HEADS)."""
    hf = check_model_dir(path, field)
    names = HFReader(path).names()
    if not any(n in names for n in VALUE_HEADS):
        raise CheckpointError(f"{field}: '{path}' has no score head ({' or '.join(VALUE_HEADS)}): a reward "
                              "model is a one-label *ForSequenceClassification or *ForTokenClassification "
                              "checkpoint")
    if "score.bias" in names:
        raise CheckpointError(f"{field}: '{path}' has a score.bias; the reward-model head is a bias-free "
                              "projection (as *ForSequenceClassification's): fold the bias into the rewards "
                              "or drop it")
    if hf.get("num_labels", len(hf.get("id2label", {}) or {0: 0})) != 1:
        raise CheckpointError(f"{field}: '{path}' has {hf.get('num_labels') or len(hf['id2label'])} labels; "
                              "a reward model scores with one")
    return hf


def check_causal_lm_dir(path: str | Path, field: str) -> dict:
    """`check_model_dir`, and an LM head (lm_head.weight, or embeddings tied to it): a model whose next-token
    log-probs can be read (a distillation teacher). A reward model has a score head instead."""
    hf = check_model_dir(path, field)
    names = HFReader(path).names()
    if "lm_head.weight" not in names and not hf.get("tie_word_embeddings"):
        scored = next((n for n in VALUE_HEADS if n in names), None)
        raise CheckpointError(f"{field}: '{path}' has no LM head (lm_head.weight)"
                              f"{f', but a score head ({scored}): a reward model' if scored else ''}; a "
                              "distillation teacher is a causal language model (*ForCausalLM), whose "
                              "next-token log-probs the policy learns from")
    return hf


# multi-latent attention's local-spec norms of the compressed query and key-value, fused by TE into the
# up-projections (its input norm stays apart)
_MLA_NORMS = {".self_attention.q_layernorm.weight": ".self_attention.linear_q_up_proj.layer_norm_weight",
              ".self_attention.kv_layernorm.weight": ".self_attention.linear_kv_up_proj.layer_norm_weight"}


def to_te_name(name: str, expert_offset: int = 0, mla: bool = False) -> str:
    """The TE-style name of a local-spec (or TE) parameter name, expert ids shifted by expert_offset;
    `mla`: the model's attention is multi-latent (DeepSeek-V3)."""
    if name.endswith(".input_layernorm.weight") and not mla:
        return name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    for local, te in _MLA_NORMS.items():
        if mla and name.endswith(local):
            return name.replace(local, te)
    m = _LOCAL_EXPERT.search(name)
    if m:
        return name[: m.start()] + f".mlp.experts.{m.group(2)}.weight{int(m.group(1)) + expert_offset}"
    m = _TE_EXPERT.search(name)
    if m:
        return name[: m.start()] + f".mlp.experts.{m.group(1)}.weight{int(m.group(2)) + expert_offset}"
    return name


def dense_layers(hf_config) -> list[int]:
    """Layers (0-based) of a Qwen2/Qwen3-MoE config whose MLP is dense: listed in `mlp_only_layers`, or
    off the `decoder_sparse_step` pattern (a layer i is MoE when (i + 1) % step == 0), as transformers
    and vLLM build them. Other architectures: [] (DeepSeek-style first_k_dense_replace is mbridge's)."""
    if not hasattr(hf_config, "mlp_only_layers") and not hasattr(hf_config, "decoder_sparse_step"):
        return []
    only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [i for i in range(hf_config.num_hidden_layers) if i in only or (i + 1) % step]


def is_expert(te_name: str) -> bool:
    """Whether a TE-style name is a routed expert's weight (split over the expert-TP group)."""
    return ".mlp.experts.linear_fc" in te_name


class HFReader:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            with safe_open(self.path / "model.safetensors", "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointMismatch(f"{self.path} has no model.safetensors or model.safetensors.index.json")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointMismatch(f"checkpoint {self.path} has no tensor '{name}'")
        with safe_open(self.path / self.where[name], "pt") as f:
            return f.get_tensor(name)

    def names(self) -> set[str]:
        return set(self.where)


def copy_hf_config(src: str | Path, dst: str | Path) -> Path:
    """Copy config, generation config and tokenizer files (no weights) from `src` into `dst`."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.startswith("model") \
                and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy2(f, dst / f.name)
    return dst


MTP_DIR = "mtp"  # beside a Megatron checkpoint: its Hugging Face model's multi-token-prediction layers
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_names(path: str | Path) -> list[str]:
    """The tensors of a checkpoint's multi-token-prediction layers (DeepSeek-V3, GLM-4.5:
    num_nextn_predict_layers layers numbered from num_hidden_layers on), which the trainer does not build:
    conversions and exports carry them as they are (`keep_mtp`)."""
    file = Path(path) / "config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}  # no config: checked elsewhere
    if not config.get("num_nextn_predict_layers"):
        return []
    first = config["num_hidden_layers"]
    return sorted(n for n in HFReader(path).names()
                  if (m := _LAYER_NAME.match(n)) and int(m.group(1)) >= first)


def keep_mtp(src: str | Path, dst: str | Path) -> int:
    """Copy `src`'s multi-token-prediction tensors into the directory `dst` as mtp-NNNNN.safetensors with
    their index (mtp.json: name -> [file, bytes]); the tensors copied (0: none, nothing written)."""
    names = mtp_names(src)
    if names:
        reader, dst = HFReader(src), Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        written = write_shards(((n, reader.get(n)) for n in names), dst, prefix="mtp")
        (dst / "mtp.json").write_text(json.dumps(written))
    return len(names)


def kept_mtp(src: str | Path, out: str | Path) -> dict[str, tuple[str, int]]:
    """The multi-token-prediction shards `keep_mtp` wrote in `src`, copied into the Hugging Face
    directory `out`: their index entries ({} where `src` holds none)."""
    index = Path(src) / "mtp.json"
    if not index.is_file():
        return {}
    written = {n: (file, size) for n, (file, size) in json.loads(index.read_text()).items()}
    for file in {file for file, _ in written.values()}:
        shutil.copy2(Path(src) / file, Path(out) / file)
    return written


def write_shards(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, prefix: str = "model",
                 shard_mb: float = 2048) -> dict[str, tuple[str, int]]:
    """Write HF-named tensors as safetensors files `{prefix}-00001.safetensors`, ... of about shard_mb;
    returns {name: (file, bytes)} for the index."""
    from safetensors.torch import save_file

    written = {}
    for i, shard in enumerate(buckets(named, shard_mb)):
        file = f"{prefix}-{i + 1:05d}.safetensors"
        save_file({n: t.detach().contiguous().cpu() for n, t in shard}, str(Path(out_dir) / file),
                  metadata={"format": "pt"})
        written.update({n: (file, t.numel() * t.element_size()) for n, t in shard})
    return written


def write_index(out_dir: str | Path, written: dict[str, tuple[str, int]]) -> Path:
    """model.safetensors.index.json for the files `write_shards` wrote (a stale single-file
    model.safetensors is removed so loaders read the index)."""
    out = Path(out_dir)
    total = sum(size for _, size in written.values())
    weight_map = {n: file for n, (file, _) in sorted(written.items())}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / "model.safetensors").unlink(missing_ok=True)
    return out


def save_hf_checkpoint(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                       config_from: str | Path, shard_mb: float = 2048) -> Path:
    """Write HF-named tensors as a sharded safetensors checkpoint (with index) next to the config and
    tokenizer files of `config_from`. Rank-local: call where the full set of tensors is available."""
    out = copy_hf_config(config_from, out_dir)
    return write_index(out, write_shards(named, out, shard_mb=shard_mb))


def save_peft_adapter(tensors: dict[str, torch.Tensor], out_dir: str | Path, base: str, rank: int,
                      alpha: float) -> Path:
    """A LoRA adapter in Hugging Face PEFT's format, which HF PEFT and vLLM's LoRARequest load:
    adapter_model.safetensors (`tensors`, named `base_model.model.{module}.lora_A.weight` / `.lora_B.weight`,
    as hf_io.export_peft_adapters yields them) and adapter_config.json (its target modules: the names those
    modules end with)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "target_modules": sorted({n.split(".")[-3] for n in tensors}),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True}, indent=2))
    return out


FINGERPRINT_SAMPLES, FINGERPRINT_CHUNK = 64, 64 * 1024


def fingerprint(path: str | Path) -> str:
    """A fingerprint of a Hugging Face checkpoint's weights, independent of where it lies: sha256 over each
    safetensors file's name, size and FINGERPRINT_SAMPLES evenly spaced chunks of FINGERPRINT_CHUNK bytes
    (the header and the end included), at most 4 MiB read a file. Weights changed anywhere a sample falls
    (any retraining changes nearly every sample) change it."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        last = max(size - FINGERPRINT_CHUNK, 0)
        with file.open("rb") as f:
            for k in range(FINGERPRINT_SAMPLES):
                f.seek(last * k // (FINGERPRINT_SAMPLES - 1))
                digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()[:16]
