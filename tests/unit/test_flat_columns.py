"""What validation learns of 1-D token and tensor columns (``Checked.flat``), and the
columns a decoder builds from it: the same rows, shapes and packed forms as the columns
it would build reading the shape columns again."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import OUTPUTS, schema_of_fields

import flightq
from flightq import Field
from flightq.codecs import Zstd
from flightq.columns import TensorColumn
from flightq.errors import DecodeError
from flightq.validation import validate

N = 21  # past the few rows whose checks run over Python lists

SCHEMA = schema_of_fields(
    Field("ids", "int64", "token", (None,)),
    Field("lp", "float32", "token", (None,)),
    Field("vec", "float32", "tensor", (None,)),
    Field("mat", "float32", "tensor", (2, None)),
    Field("zt", "int32", "token", (None,), codec=Zstd()),
    Field("gap", "float32", "tensor", (None,)),
    Field("img", "uint8", "media", None),
    Field("r", "float32", "scalar", ()),
)


def _batch(n: int = N) -> pa.RecordBatch:
    return flightq.encode(SCHEMA, _columns(n), [f"k{i}" for i in range(n)])


def _columns(n: int) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    lens = rng.integers(0, 9, n)
    cols: dict[str, Any] = {
        "ids": [rng.integers(0, 1000, s) for s in lens],
        "lp": [rng.standard_normal(s).astype(np.float32) for s in lens],
        "vec": [rng.standard_normal(3 + i % 4).astype(np.float32) for i in range(n)],
        "mat": [rng.standard_normal((2, 1 + i % 3)).astype(np.float32) for i in range(n)],
        "zt": [np.arange(s, dtype=np.int32) for s in lens],
        "gap": [None if i % 5 == 0 else np.ones(2, np.float32) for i in range(n)],
        "img": [[np.full((2, 2), i, np.uint8)] for i in range(n)],
        "r": [float(i) for i in range(n)],
    }
    return cols


def test_validation_hands_on_the_layout_of_every_complete_one_dim_raw_column() -> None:
    rb = _batch()
    checked = validate(rb, duplicate_error=DecodeError)
    assert sorted(checked.flat) == ["ids", "lp", "vec"]  # not 2-D, compressed, gaps, media
    for name, (dims, offs) in checked.flat.items():
        itemsize = SCHEMA[name].dt.itemsize
        shapes = rb.column(name + "__shape").to_pylist()
        assert dims.tolist() == [s[0] for s in shapes]
        payloads = rb.column(name).to_pylist()
        assert np.diff(offs).tolist() == [len(p) for p in payloads]
        assert (np.diff(offs) == dims * itemsize).all()


def test_a_few_rows_hand_on_no_layout_and_decode_as_before() -> None:
    rb = _batch(5)
    assert validate(rb, duplicate_error=DecodeError).flat == {}
    b = flightq.decode(rb, as_="numpy")
    assert [len(r) for r in b["ids"]] == [s[0] for s in rb.column("ids__shape").to_pylist()]


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert np.asarray(a).dtype == np.asarray(b).dtype
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("as_", OUTPUTS)
@pytest.mark.parametrize("sliced", [False, True])
def test_a_column_built_from_the_layout_reads_as_one_built_from_the_shapes(
    as_: str, copy: bool, sliced: bool
) -> None:
    if as_ == "torch":
        pytest.importorskip("torch", reason="torch output needs torch")
    rb, cols = _batch(), _columns(N)
    if sliced:  # payload offsets that do not start at 0
        rb = rb.slice(4, N - 6)
        cols = {k: v[4 : N - 2] for k, v in cols.items()}
    b = flightq.decode(rb, as_=as_, copy=copy)
    for name in ("ids", "lp", "vec"):
        sent = cols[name]  # what was encoded: the reference for both columns
        lens = [len(r) for r in sent]
        packed = b.column(name).packed()
        assert np.asarray(packed.values).tolist() == np.concatenate(sent).tolist()
        assert np.asarray(packed.offsets).tolist() == [0, *np.cumsum(lens).tolist()]
        assert np.asarray(packed.offsets).dtype == np.int32
        assert packed.max_len == max(lens)
        fast = b.column(name)
        assert isinstance(fast, TensorColumn) and fast._offs is None  # built from the layout
        slow = TensorColumn(SCHEMA[name], rb, as_, copy)
        assert slow._offs is not None
        assert fast.shapes == slow.shapes
        assert fast.lengths().tolist() == slow.lengths().tolist()
        for x, y in zip(fast.rows(), slow.rows(), strict=True):
            _same(x, y)
        p, q = fast.packed(), slow.packed()
        _same(p.values, q.values)
        _same(p.offsets, q.offsets)
        assert (p.max_len, p.copied) == (q.max_len, q.copied) == (q.max_len, copy)
        if copy:
            assert np.asarray(p.values).flags.writeable or as_ == "torch"
        if as_ == "torch":
            assert fast.jagged().offsets().tolist() == slow.jagged().offsets().tolist()
        for i in range(len(fast)):
            _same(fast[i], slow[i])


def test_a_copied_packed_column_owns_its_values() -> None:
    rb = _batch()
    p = flightq.decode(rb, as_="numpy", copy=True).column("ids").packed()
    view = flightq.decode(rb, as_="numpy").column("ids").packed()
    assert p.values.flags.writeable and not view.values.flags.writeable
    p.values[:] = -1
    assert (view.values != -1).all()


def test_a_column_over_several_record_batches_has_its_rows_shapes() -> None:
    rb = _batch()
    whole = flightq.decode(rb, as_="numpy")
    parts = flightq.decode([rb.slice(0, 5), rb.slice(5)], as_="numpy")
    for name in ("ids", "vec", "mat", "zt", "gap"):
        assert parts.column(name).shapes == whole.column(name).shapes, name
    with pytest.raises(flightq.ShapeError, match="token and tensor fields"):
        _ = parts.column("img").shapes
