"""The yardstick for the trainer's scores: the same checkpoint's token log-probs in plain transformers.

    exact_fp32_matmuls()                                   # before comparing at ~1e-5 on a GPU
    logp_BS = hf_token_logprobs(path, ids_BS, device="cuda")

Aligned as the trainer's (train/logprobs.py): logp_BS[:, t] = log pi(x_t | x_<t), position 0 gets 0.
Rows are scored whole; causal attention makes the positions before a row's length independent of the
padding after it, so callers compare valid positions only.
"""

from __future__ import annotations

from pathlib import Path

import torch


def exact_fp32_matmuls() -> None:
    """fp32 matrix products and convolutions in full fp32 on CUDA (TF32 off), in this process."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@torch.no_grad()
def hf_token_logprobs(hf_path: str | Path, ids_BS: torch.Tensor, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log pi(x_t | x_<t) of transformers' model of `hf_path` in `dtype` on `device`.

    ids_BS: [B, S] token ids (any device). Returns [B, S] float32 on the CPU, position 0 -> 0.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_path), dtype=dtype).to(device).eval()
    return model_token_logprobs(model, ids_BS.to(device))


@torch.no_grad()
def model_token_logprobs(model, ids_BS: torch.Tensor) -> torch.Tensor:
    """log pi(x_t | x_<t) of a loaded causal LM (transformers', or PEFT's around one), on `ids_BS`' device.

    ids_BS: [B, S] token ids. Returns [B, S] float32 on the CPU, position 0 -> 0.
    """
    logp_BSV = torch.log_softmax(model(input_ids=ids_BS).logits.float(), -1)
    out = torch.zeros(ids_BS.shape, dtype=torch.float32)
    out[:, 1:] = logp_BSV[:, :-1].gather(-1, ids_BS[:, 1:, None]).squeeze(-1).cpu()
    return out
