"""Layouts, pack/unpack and the wire format: bitwise round trips, reuse, zero-copy, errors."""
import numpy as np
import pytest
import torch

from relayrl.weights import allocate_buffers, build_layout, from_wire, pack, to_wire, unpack


def mixed_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(17, 8, generator=g)),
        ("norm", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("scale", torch.tensor(3.5, dtype=torch.float16)),  # 0-dim
        ("proj", torch.randn(8, 5, generator=g)),
        ("counts", torch.randint(-2**40, 2**40, (3, 4), generator=g, dtype=torch.int64)),
        ("mask", torch.rand(6, generator=g) > 0.5),
        ("empty", torch.empty(0, 4)),
        ("head", torch.randn(5, 3, 2, generator=g).to(torch.bfloat16)),
        ("nan", torch.tensor([float("nan"), float("-inf"), -0.0])),
    ]


def test_round_trip_is_bitwise_over_mixed_dtypes_and_shapes():
    named = mixed_weights()
    layout = build_layout(named)
    buffers = pack(named, layout)
    assert len(buffers) == len({t.dtype for _, t in named}) == len(layout.buckets)
    out = dict(unpack(buffers, layout))
    assert list(out) != [n for n, _ in named] and set(out) == {n for n, _ in named}  # grouped by dtype
    for name, t in named:
        assert out[name].shape == t.shape and out[name].dtype == t.dtype
        assert torch.equal(out[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_unpack_returns_views_into_the_buffers():
    named = mixed_weights()
    layout = build_layout(named)
    buffers = pack(named, layout)
    starts = {b.untyped_storage().data_ptr() for b in buffers}
    for name, view in unpack(buffers, layout):
        assert view.untyped_storage().data_ptr() in starts, name
    (name, view), *_ = unpack(buffers, layout)
    view.fill_(7)
    assert bool((dict(unpack(buffers, layout))[name] == 7).all())


def test_buffers_are_reused_across_packs():
    layout = build_layout(mixed_weights(0))
    out = allocate_buffers(layout)
    ptrs = [b.data_ptr() for b in out]
    for seed in (1, 2):
        named = mixed_weights(seed)
        again = pack(named, layout, out=out)
        assert [b.data_ptr() for b in again] == ptrs
        assert torch.equal(dict(unpack(again, layout))["proj"], named[3][1])


def test_non_contiguous_inputs_are_packed_by_value():
    base = torch.arange(24.0).reshape(4, 6)
    named = [("t", base.t()), ("s", base[:, ::2])]
    layout = build_layout(named)
    out = dict(unpack(pack(named, layout), layout))
    assert torch.equal(out["t"], base.t()) and torch.equal(out["s"], base[:, ::2])


def test_bucket_size_splits_and_oversized_tensor_gets_its_own_bucket():
    named = [(f"w{i}", torch.zeros(64, 1024)) for i in range(4)] + [("big", torch.zeros(1024, 1024))]  # 256 KiB, 4 MiB
    layout = build_layout(named, bucket_mb=0.5)
    sizes = [[s.name for s in b.slots] for b in layout.buckets]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["big"]]
    assert [s.offset for s in layout.buckets[0].slots] == [0, 64 * 1024]
    assert layout.nbytes == sum(t.numel() * 4 for _, t in named)
    assert len(build_layout(named).buckets) == 1  # default 256 MiB


def test_layout_key_is_stable_and_tracks_names_shapes_dtypes_and_bucket_size():
    a = build_layout(mixed_weights(0))
    assert a.key == build_layout(mixed_weights(5)).key  # values do not matter
    changed = mixed_weights(0)
    changed[3] = ("proj", torch.zeros(5, 8))
    renamed = [("x" + n, t) for n, t in mixed_weights(0)]
    recast = [(n, t.double() if t.is_floating_point() else t) for n, t in mixed_weights(0)]
    keys = {a.key, build_layout(changed).key, build_layout(renamed).key, build_layout(recast).key,
            build_layout(mixed_weights(0), bucket_mb=1).key}
    assert len(keys) == 5


def test_wire_round_trip_keeps_every_dtype_and_shares_memory():
    named = mixed_weights()
    layout = build_layout(named)
    buffers = pack(named, layout)
    wire = [to_wire(b) for b in buffers]
    assert all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in wire)
    back = [from_wire(a, b.dtype, b.numel) for a, b in zip(wire, layout.buckets)]
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(back, buffers))
    ro = wire[0].copy()
    ro.flags.writeable = False  # what ray.get hands back
    t = from_wire(ro, layout.buckets[0].dtype, layout.buckets[0].numel)
    assert torch.equal(t.view(torch.uint8), buffers[0].view(torch.uint8))
    with pytest.raises(ValueError, match="expects"):
        from_wire(wire[0][:-4], layout.buckets[0].dtype, layout.buckets[0].numel)


def test_pack_rejects_weights_that_do_not_match_the_layout():
    layout = build_layout(mixed_weights())
    bad_shape = mixed_weights()
    bad_shape[0] = ("embed", torch.zeros(16, 8))
    with pytest.raises(ValueError, match=r"'embed': layout \(17, 8\) torch.float32 != given \(16, 8\)"):
        pack(bad_shape, layout)
    with pytest.raises(ValueError, match=r"missing \['embed'\]"):
        pack(mixed_weights()[1:], layout)
    with pytest.raises(ValueError, match="3 buffers but layout"):
        pack(mixed_weights(), layout, out=allocate_buffers(layout)[:3])
    with pytest.raises(ValueError, match="buffers\\[0\\]"):
        list(unpack([torch.zeros(3)] + allocate_buffers(layout)[1:], layout))


def test_build_layout_rejects_bad_input_by_index_and_name():
    with pytest.raises(ValueError, match="duplicate name 'a'"):
        build_layout([("a", torch.zeros(1)), ("a", torch.zeros(2))])
    with pytest.raises(TypeError, match=r"named_weights\[1\] \('b'\): expected a torch.Tensor"):
        build_layout([("a", torch.zeros(1)), ("b", [1.0])])
    with pytest.raises(ValueError, match="bucket_mb=0"):
        build_layout([("a", torch.zeros(1))], bucket_mb=0)
