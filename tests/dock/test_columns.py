import numpy as np
import pytest
import torch

from relayrl.dock.columns import PackedColumn, normalize_column, pack, unpack


def test_ragged_pack_round_trip_is_unpadded():
    rows = [torch.arange(n, dtype=torch.int64) for n in (3, 0, 5, 1)]
    rows_n, schema, lengths = normalize_column("response_ids", rows, None)
    assert lengths.tolist() == [3, 0, 5, 1]
    packed = pack(rows_n, schema)
    assert packed.flat.shape == (9,)  # sum of lengths, no padding
    assert packed.lengths.tolist() == [3, 0, 5, 1]
    back = unpack(packed)
    assert all(torch.equal(a, b) for a, b in zip(rows, back))
    back[0][0] = 42  # rebuilt rows are writable
    assert back[0][0] == 42


def test_scalar_and_tail_shapes_and_bfloat16():
    rows, schema, lengths = normalize_column("rewards", [1.0, 0.5, -2.0], 3)
    assert lengths.tolist() == [1, 1, 1]
    assert schema.scalar and schema.dtype == torch.float32
    assert [r.item() for r in unpack(pack(rows, schema))] == [1.0, 0.5, -2.0]
    hid = [torch.randn(n, 4).bfloat16() for n in (2, 3)]
    rows, schema, _ = normalize_column("hidden", hid, None)
    assert schema.tail == (4,)
    back = unpack(pack(rows, schema))
    assert back[1].dtype == torch.bfloat16 and torch.equal(back[1], hid[1])


def test_unpack_joins_buffers_read_back_to_back():
    a, s, _ = normalize_column("x", [torch.ones(2), torch.zeros(1)], None)
    b, _, _ = normalize_column("x", [torch.full((3,), 7.0)], None)
    pa, pb = pack(a, s), pack(b, s)
    pa.flat.flags.writeable = False  # as received from Ray's object store
    both = PackedColumn(flat=[pa.flat, pb.flat], lengths=np.concatenate([pa.lengths, pb.lengths]), schema=s)
    rows = unpack(both)
    assert [r.tolist() for r in rows] == [[1.0, 1.0], [0.0], [7.0, 7.0, 7.0]]
    rows[0][0] = 5.0  # a fresh, writable copy
    assert pa.flat[0] == 1.0


@pytest.mark.parametrize(
    "values, match",
    [
        ([torch.ones(2), torch.ones(2, dtype=torch.int64)], "row 1: dtype"),
        ([torch.ones(2, 3), torch.ones(2, 4)], "row 1: shape"),
        ([torch.ones(2), torch.tensor(1.0)], "row 1: shape"),
        ([torch.tensor(1.0), torch.ones(2)], "row 1: shape"),
        ([torch.ones(2), "text"], "row 1: expected a tensor"),
        ([], "no rows"),
    ],
)
def test_bad_rows_name_the_column_and_row(values, match):
    with pytest.raises((TypeError, ValueError), match=match):
        normalize_column("logprobs", values, None)


def test_numpy_rows_are_accepted():
    rows, schema, _ = normalize_column("ids", [np.arange(3), torch.arange(2)], None)
    assert schema.dtype == torch.int64 and rows[0].tolist() == [0, 1, 2]
