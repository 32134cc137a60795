import torch

from moe_rl.weights.sync import buckets, layer_of, read_bucket, write_bucket


def _named():
    out = [("model.embed_tokens.weight", torch.zeros(100))]
    for layer in range(3):
        for part in ("q", "k", "v", "o"):
            out.append((f"model.layers.{layer}.self_attn.{part}_proj.weight", torch.zeros(50)))
    out.append(("lm_head.weight", torch.zeros(100)))
    return out


def test_buckets_respect_size_and_never_split_a_layer():
    named = _named()
    bs = list(buckets(named, bucket_mb=(4 * 50 * 4 + 1) / 2**20))  # room for one layer
    assert [n for b in bs for n, _ in b] == [n for n, _ in named]  # nothing lost or reordered
    for b in bs:
        layers = {layer_of(n) for n, _ in b} - {""}
        assert len(layers) <= 1
    assert len(bs) >= 4


def test_one_big_bucket_and_shm_round_trip(tmp_path):
    named = _named()
    (only,) = list(buckets(named, bucket_mb=1024))
    p = write_bucket(only, tmp_path, 0)
    back = dict(read_bucket(p))
    assert not p.exists() and set(back) == {n for n, _ in named}
    assert layer_of("model.layers.12.mlp.gate.weight") == "12" and layer_of("lm_head.weight") == ""


def test_buckets_through_the_object_store_keep_every_tensor_bitwise():
    """as_buffers hands the store each tensor's bytes as a view (no copy); from_buffers views them
    again. Through a real ray.put / ray.get, every dtype, shape and value comes back as it went in."""
    import ray

    from moe_rl.weights.sync import as_buffers, from_buffers

    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("step", torch.tensor(3)),
             ("empty", torch.zeros(0, 4)), ("strided", torch.randn(4, 6).t())]
    buffers = as_buffers(named)
    assert buffers[0][3].ctypes.data == named[0][1].data_ptr()  # a view of the tensor, not a copy
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        back = from_buffers(ray.get(ray.put(buffers)))
    finally:
        ray.shutdown()
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, t), (_, u) in zip(named, back, strict=True):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)


def test_exported_weights_can_still_be_offloaded():
    """The arrays as_buffers makes leave the weights' storage resizable: cluster.offload empties a
    parameter's storage after it was exported (torch's .numpy() would pin its size for good)."""
    from moe_rl.weights.sync import as_buffers

    p = torch.nn.Parameter(torch.randn(4, 3))
    buffers = as_buffers([("p", p.data)])
    assert buffers[0][3].tobytes() == bytes(p.data.reshape(-1).view(torch.uint8).tolist())
    p.data.untyped_storage().resize_(0)
    assert p.data.untyped_storage().nbytes() == 0
