"""Rank functions for the conversion tests (spawned by moe_rl.train.launch_local)."""

import torch
from conftest import model_spec, optim_spec

B, S = 3, 10


def tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 300, (B, S), generator=g), torch.full((B,), S)


def score_converted_job(rank, world, hf_config, ckpt, role):
    """Build a trainer on one rank without HF weights, load the converted dist checkpoint, score."""
    from moe_rl.batch import Batch
    from moe_rl.train import checkpoint, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(hf_config), role=role, load_weights=False,
                    optim=optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    checkpoint.load(w, ckpt, optimizer=False)
    return w.score(Batch(*tokens()))
