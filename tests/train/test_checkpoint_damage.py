"""A damaged checkpoint loaded by a trainer rank (a resume's `load`, in the actor): one CheckpointError
line naming the file, not torch's EOFError traceback. (The driver checks the same files before anything
starts: tests/test_preflight.py; this is what a rank says where a file changed after that check.)"""

import pytest
from train_jobs import ckpt_job

from moe_rl.train.launch_local import run_ranks

pytestmark = pytest.mark.slow


def test_a_truncated_shard_is_one_line_naming_it(tmp_path, tiny_qwen):
    import os

    ckpt = tmp_path / "ckpt"
    run_ranks(ckpt_job, 1, (str(tiny_qwen), {}, str(ckpt), "save"))
    shard = max(ckpt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(RuntimeError) as info:
        run_ranks(ckpt_job, 1, (str(tiny_qwen), {}, str(ckpt), "load"))
    assert f"CheckpointError: {shard} is truncated ({shard.stat().st_size} of its" in str(info.value)
    assert "EOFError" not in str(info.value)
