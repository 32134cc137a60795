"""vLLM's prefix cache and weight updates: cached keys and values of old weights never serve a request
after an update (vLLM does not drop them itself), in synchronous and asynchronous use."""

import pytest
from rollout_jobs import vllm_prefix_cache_job

from moe_rl.train.launch_local import run_in_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def out(tiny_qwen, tmp_path_factory):
    return run_in_process(vllm_prefix_cache_job, (str(tiny_qwen), str(tmp_path_factory.mktemp("bucket"))))


def test_no_cached_prefix_of_old_weights_serves_a_request(out):
    assert out["prefix_caching"]
    # rollout.kv_cache_gb null on CPU: the cache vLLM made holds max_num_seqs whole sequences twice over
    s = out["settings"]
    assert s.kv_cache_gb is None and out["kv_tokens"] == 2 * s.max_num_seqs * s.max_model_len
    assert out["cached"].token_ids == out["first"].token_ids
    assert out["cached"].logprobs == pytest.approx(out["first"].logprobs, abs=1e-5)
    # the update changed the model; the request after it equals one computed from scratch
    assert max(abs(a - b)
               for a, b in zip(out["after_sync"].logprobs, out["first"].logprobs, strict=True)) > 1e-2
    assert out["after_sync"].token_ids == out["after_sync_fresh"].token_ids
    assert out["after_sync"].logprobs == pytest.approx(out["after_sync_fresh"].logprobs, abs=1e-5)
    # asynchronous: a request submitted while an older one still runs waits for the cache reset
    assert out["held"]
    running = out["running"]
    assert running.weight_version == 1 and len(running.token_ids) == 40
    # its first tokens were sampled by version 1, the rest by version 2 (the sync landed mid-request)
    switch = running.versions.index(2)
    assert 0 < switch < 40 and running.versions == [1] * switch + [2] * (40 - switch)
    assert out["late"].weight_version == 2
    assert out["late"].token_ids == out["late_fresh"].token_ids
    assert out["late"].logprobs == pytest.approx(out["late_fresh"].logprobs, abs=1e-5)
    # paused (a weight transfer under way), no step runs; resumed, the request completes as usual
    assert out["waited"] and out["after_pause"].token_ids == out["late_fresh"].token_ids


def test_a_request_held_until_an_update_carries_the_new_version_and_is_kept(out):
    """A request that waits (for the prefix-cache reset, or for a weight transfer under way) runs wholly
    on the weights of the moment it starts: every token of it, and its weight version, are those, even
    when another update landed while it waited; asynchronous staleness filtering (max_staleness=0) keeps
    it. It equals the same request computed from scratch with those weights."""
    import torch

    from moe_rl.algos.correction import staleness

    assert out["held_through_update"]  # held when version 4 arrived (a request of version 3 still ran)
    for key, fresh_key, version in (("held_twice", "held_twice_fresh", 4),
                                    ("transfer_late", "transfer_fresh", 5)):
        r, fresh = out[key], out[fresh_key]
        assert r.weight_version == version and r.token_versions() == [version] * len(r.token_ids), key
        assert r.token_ids == fresh.token_ids and r.logprobs == pytest.approx(fresh.logprobs, abs=1e-5), key
        keep, _ = staleness(torch.tensor([r.weight_version]), version, 0)
        assert keep.tolist() == [True], key
    # the request that ran through the transfer: sampled by version 4, then by 5 (paused in between)
    running = out["transfer_running"]
    switch = running.versions.index(5)
    assert running.weight_version == 4 and 0 < switch < 50 \
        and running.versions == [4] * switch + [5] * (50 - switch)
