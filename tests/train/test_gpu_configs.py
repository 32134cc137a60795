"""The GPU tests' run configs, checked on the CPU: each loads as it would on a GPU machine (every rule
of moe_rl.config.rules, CUDA assumed) and needs no more GPUs than its skip condition admits, so a GPU
test is never one that fails on the hardware it runs on."""

import pytest
from conftest import ROOT
from test_gpu import TRANSFER_RUNS

from moe_rl.config import load_config


@pytest.mark.parametrize("transfer", list(TRANSFER_RUNS))
def test_each_transfer_run_loads_and_fits_the_gpus_its_skip_admits(tmp_path, transfer):
    overrides, gpus = TRANSFER_RUNS[transfer]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"run.output_dir={tmp_path}", *overrides],
                      cuda_available=True)
    assert cfg.rollout.weight_transfer == transfer
    assert cfg.gpus == gpus  # the skip asks for exactly what the run places: no fewer, no more
    # the trainer and the engines meet on one GPU for CUDA IPC only; NCCL's group refuses that
    assert cfg.cluster.colocate == (transfer == "ipc")
