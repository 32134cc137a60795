"""HF <-> Megatron dist checkpoint conversion: bitwise round trips through TP2/PP2/EP2 layouts,
Megatron logits of a converted checkpoint vs transformers, the critic's value head, and refusals
(architecture mismatch, pickled weights, an index that would unpickle arbitrary objects)."""

import json
import pickle
import shutil
import subprocess

import pytest
import torch
from convert_jobs import B, S, score_converted_job, tokens

from moe_rl.driver.specs import convert_spec
from moe_rl.train.checkpoint import read_metadata
from moe_rl.train.convert import hf_to_mcore, mcore_to_hf
from moe_rl.train.hf_parity import hf_token_logprobs
from moe_rl.train.launch_local import run_ranks
from moe_rl.train.parallel import Layout
from moe_rl.weights.hf import HF_CONFIG_DIR, CheckpointError, CheckpointMismatch, HFReader

CONVERT = convert_spec()  # the model settings `moe-rl convert` builds with

pytestmark = pytest.mark.slow


def assert_same_tensors(a, b):
    ra, rb = HFReader(a), HFReader(b)
    assert ra.names() == rb.names()
    for name in ra.names():
        x, y = ra.get(name), rb.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_qwen_round_trip_through_tp2_pp2_ep2_is_bitwise_and_logits_match(tmp_path, tiny_qwen):
    mc = tmp_path / "mcore"
    done = hf_to_mcore(CONVERT, tiny_qwen, mc, Layout(tp=2, pp=2, ep=2, etp=1))  # 4 ranks
    assert done.role == "policy" and (mc / HF_CONFIG_DIR / "config.json").is_file()
    back = mcore_to_hf(CONVERT, mc, tmp_path / "hf", layout=Layout(pp=2, ep=2))  # another layout, 4 ranks
    assert_same_tensors(tiny_qwen, back.out)
    assert (json.loads((back.out / "config.json").read_text())
            == json.loads((tiny_qwen / "config.json").read_text()))
    # the converted checkpoint, loaded by a single-rank trainer, gives transformers' log-probs
    ids, _ = tokens()
    out = run_ranks(score_converted_job, 1, (str(tiny_qwen), str(mc), "policy"))[0]
    assert out.logp_BS.shape == ids.shape == (B, S)
    torch.testing.assert_close(out.logp_BS[:, 1:], hf_token_logprobs(tiny_qwen, ids)[:, 1:], atol=1e-5,
                               rtol=0)


def test_mixtral_round_trip_tp2_is_bitwise(tmp_path, tiny_mixtral):
    mc = tmp_path / "mcore"
    hf_to_mcore(CONVERT, tiny_mixtral, mc, Layout(tp=2))
    back = mcore_to_hf(CONVERT, mc, tmp_path / "hf", layout=Layout(tp=2))
    assert_same_tensors(tiny_mixtral, back.out)


def test_dense_first_layer_round_trip_ep2_is_bitwise_and_logits_match(tmp_path, tiny_qwen_dense):
    """Qwen3-MoE with a dense first layer: loaded in EP2, exported in TP2 (the dense MLP split over TP),
    bitwise; the converted checkpoint scores as transformers does."""
    ep2_to_tp2_is_bitwise_and_scores_as_transformers(tiny_qwen_dense, tmp_path)


def test_critic_round_trip_keeps_value_head_and_matches_transformers(tmp_path, tiny_qwen):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForTokenClassification

    rm = tmp_path / "reward_model"  # a reward model: the base weights plus a scalar head
    shutil.copytree(tiny_qwen, rm)
    weights = load_file(rm / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    weights["score.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    save_file(weights, rm / "model.safetensors", metadata={"format": "pt"})

    mc = tmp_path / "critic_mcore"
    hf_to_mcore(CONVERT, rm, mc, Layout(pp=2), role="critic")
    back = mcore_to_hf(CONVERT, mc, tmp_path / "critic_hf")
    assert back.role == "critic"
    exported = HFReader(back.out)
    assert "lm_head.weight" not in exported.names()
    for name in exported.names():
        assert torch.equal(exported.get(name), weights[name]), name
    # the export is a transformers token-classification model whose one label is the critic's value
    ids, _ = tokens()
    ours = run_ranks(score_converted_job, 1, (str(rm), str(mc), "critic"))[0].critic_out_BS
    with torch.no_grad():
        theirs = AutoModelForTokenClassification.from_pretrained(back.out)(ids).logits[..., 0]
    assert ours.shape == theirs.shape == (B, S)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert float(ours.abs().max()) > 0.01  # a real head (random, std 1) on real hidden states, not zeros


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_mismatched_architectures_are_refused(tmp_path, tiny_qwen):
    # config with fewer layers than the weights: the extra tensors are named, nothing is written
    fewer = _edit_config(tiny_qwen, tmp_path / "fewer", num_hidden_layers=1)
    with pytest.raises(CheckpointMismatch, match="tensor\\(s\\) its config does not describe.*layers.1"):
        hf_to_mcore(CONVERT, fewer, tmp_path / "out1")
    assert not (tmp_path / "out1").exists()
    # config with more experts than the weights
    more = _edit_config(tiny_qwen, tmp_path / "more", num_local_experts=8)
    with pytest.raises(CheckpointMismatch, match="router.weight.*does not fit the model"):
        hf_to_mcore(CONVERT, more, tmp_path / "out2")
    # a dist checkpoint exported with another architecture's config
    mc = tmp_path / "mcore"
    hf_to_mcore(CONVERT, tiny_qwen, mc)
    wider = _edit_config(tiny_qwen, tmp_path / "wider", moe_intermediate_size=128)
    with pytest.raises(CheckpointError, match="does not fit this model's architecture.*shape mismatch"):
        mcore_to_hf(CONVERT, mc, tmp_path / "out3", hf_config=wider)
    assert not (tmp_path / "out3").exists()


def test_pickles_are_never_loaded(tmp_path, tiny_qwen):
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    shutil.copy(tiny_qwen / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointMismatch, match="pickled .bin weights"):
        hf_to_mcore(CONVERT, bin_only, tmp_path / "out")

    mc = tmp_path / "mcore"
    hf_to_mcore(CONVERT, tiny_qwen, mc)
    read_metadata(mc)  # the genuine index passes the restricted unpickler

    class Payload:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    (mc / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="subprocess.call, which is not checkpoint metadata"):
        read_metadata(mc)
    with pytest.raises(CheckpointError, match="not checkpoint metadata"):
        mcore_to_hf(CONVERT, mc, tmp_path / "hf")
    assert not (tmp_path / "pwned").exists()


def test_cli_and_tool_script(tmp_path, tiny_qwen):
    import sys

    from moe_rl.cli import REPO_ROOT

    env_cmd = [sys.executable, str(REPO_ROOT / "tools" / "convert_checkpoint.py")]
    r = subprocess.run([*env_cmd, "hf-to-mcore", str(tiny_qwen), str(tmp_path / "mc"), "--tp", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "policy checkpoint written to" in r.stdout
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "mcore-to-hf", str(tmp_path / "mc"),
                        str(tmp_path / "hf")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert_same_tensors(tiny_qwen, tmp_path / "hf")
    # user errors: one line, exit 2
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "mcore-to-hf",
                        str(tmp_path / "nothing"), str(tmp_path / "hf2")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"moe-rl: error: {tmp_path / 'nothing'}: no such checkpoint "
                                                 "directory")


def test_convert_seeds_megatrons_rng_streams_on_a_gpu_machine(monkeypatch, tiny_qwen):
    """On a GPU, megatron-core's weight init draws from the CUDA RNG tracker's model-parallel stream:
    `moe-rl convert` must seed it (megatron's model_parallel_cuda_manual_seed), as the trainer ranks do,
    or the model's build stops on "cuda rng state model-parallel-rng is not added". A CPU machine posing as
    a GPU one (torch.cuda.is_available) up to the seeding, which stops the build."""
    from megatron.core import tensor_parallel

    from moe_rl.train import convert, parallel

    class Seeded(Exception):
        pass

    def megatron_seed(seed):
        raise Seeded(seed)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(parallel, "init_distributed", lambda layout: None)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", megatron_seed)
    with pytest.raises(Seeded) as seeded:
        convert._build(CONVERT, str(tiny_qwen), "float32", "policy", Layout())
    assert seeded.value.args == (0,)


def test_deepseek_multi_token_prediction_layers_survive_the_round_trip(tmp_path, tiny_deepseek_v3):
    """A DeepSeek-V3 checkpoint with a multi-token-prediction layer, which the trainer does not build:
    HF -> Megatron (EP2) -> HF (TP2) gives every tensor back bitwise, the MTP layer's included; the
    converted checkpoint scores as transformers scores the model. A checkpoint that lost its copy of them
    (copied without the run directory's mtp/) exports the rest, says so, and declares no MTP layer."""
    from conftest import with_mtp_layer

    from moe_rl.train.convert import describe
    from moe_rl.weights.hf import mtp_names

    src = tmp_path / "with_mtp"
    mtp = with_mtp_layer(tiny_deepseek_v3, src)
    ep2_to_tp2_is_bitwise_and_scores_as_transformers(src, tmp_path)
    shutil.rmtree(tmp_path / "mcore" / "mtp")
    lost = mcore_to_hf(CONVERT, tmp_path / "mcore", tmp_path / "lost")
    assert describe(lost).splitlines()[-1].startswith(f"warning: {tmp_path / 'mcore' / 'mtp'} is missing")
    assert HFReader(lost.out).names() == HFReader(src).names() - set(mtp) and not mtp_names(lost.out)
    assert json.loads((lost.out / "config.json").read_text())["num_nextn_predict_layers"] == 0


def ep2_to_tp2_is_bitwise_and_scores_as_transformers(src, tmp_path):
    """HF -> Megatron in EP2 -> HF in TP2 gives `src`'s tensors back bitwise, and the Megatron checkpoint,
    loaded by one rank, scores as transformers scores `src`."""
    mc = tmp_path / "mcore"
    hf_to_mcore(CONVERT, src, mc, Layout(ep=2))
    back = mcore_to_hf(CONVERT, mc, tmp_path / "hf", layout=Layout(tp=2))
    assert_same_tensors(src, back.out)
    ids, _ = tokens()
    out = run_ranks(score_converted_job, 1, (str(src), str(mc), "policy"))[0]
    torch.testing.assert_close(out.logp_BS[:, 1:], hf_token_logprobs(src, ids)[:, 1:], atol=1e-5, rtol=0)
