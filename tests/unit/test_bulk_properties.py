"""Property tests: encode's per-column path gives what its per-row path gives, always.

Each example draws a column per field kind (two token fields sharing the row's sequence
length, a ``[?, 1]`` tensor, a ``[2, ?]`` tensor, a rank-0 tensor), rows of any dtype
(bfloat16 and float8 as torch tensors), numpy or torch, now and then a row that is None,
empty, non-contiguous, big-endian, of another dtype, rank or length. Encoding with the
per-column path and with it switched off must give the same record batch byte for byte,
or the same typed error with the same message. The columns a bulk check builds
(:class:`flightq.tensor.Bulk`) must describe the tensors exactly, and a decoded token
column packed in one piece must hold its rows end to end.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from helpers_wire import HAS_TORCH, ipc_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flightq import Field, Schema, decode
from flightq.dtypes import DTYPES
from flightq.errors import FlightqError
from flightq.sink import bulk_buffers, copy_bulk
from flightq.tensor import bulk_to_bytes, to_bytes

encode_module = importlib.import_module("flightq.encode")  # the package exports encode()

SETTINGS = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TAGS = [t for t in DTYPES if HAS_TORCH or DTYPES[t].native_numpy]
FIELDS = {
    "tok": ("token", (None,)),
    "tok2": ("token", (None,)),
    "col": ("tensor", (None, 1)),
    "wide": ("tensor", (2, None)),
    "one": ("tensor", ()),
}


def _schema(tag: str, other: str) -> Schema:
    fields = [Field(n, tag, role, shape) for n, (role, shape) in FIELDS.items()]
    fields[1] = Field("tok2", other, "token", (None,))
    return Schema("bulkprop", 1, fields)


def _as(arr: np.ndarray, tag: str, lib: str) -> Any:
    if lib == "numpy":
        return arr
    import torch

    t = torch.from_numpy(arr)
    dt = DTYPES[tag]
    return t if dt.native_numpy else t.view(dt.torch())


def _array(draw: st.DrawFn, tag: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = DTYPES[tag]
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    arr = np.frombuffer(raw, dtype=dt.storage).copy()
    if tag == "bool":
        arr = (arr.view(np.uint8) & 1).view(np.bool_)
    return arr.reshape(shape)


def _shape(draw: st.DrawFn, name: str, s: int) -> tuple[int, ...]:
    """A shape that fits field ``name`` for a row of sequence length ``s``; now and then
    one that does not."""
    if draw(st.integers(0, 11)) == 0:
        return draw(st.sampled_from([(), (s,), (s, 1), (1, s), (2, 2, 1), (3,)]))
    return {"tok": (s,), "tok2": (s,), "col": (s, 1), "wide": (2, s), "one": ()}[name]


def _row(draw: st.DrawFn, name: str, tag: str, lib: str, s: int) -> Any:
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return None
    shape = _shape(draw, name, s)
    arr = _array(draw, tag, shape)
    if kind == 1 and arr.ndim and arr.size:  # non-contiguous: every other element
        wide = np.repeat(arr, 2, axis=0)
        arr = wide[::2]
    elif kind == 2 and lib == "numpy" and arr.dtype.itemsize > 1 and tag != "bool":
        arr = arr.astype(arr.dtype.newbyteorder(">"))  # big-endian, same values
    elif kind == 3:  # another dtype
        other = draw(st.sampled_from(TAGS))
        arr = _array(draw, other, shape)
        tag = other
        if lib == "numpy" and not DTYPES[other].native_numpy:
            return arr  # bit patterns of another dtype
    if lib == "torch" and arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if lib == "torch" and kind == 1:
        t = _as(np.ascontiguousarray(np.repeat(arr, 2, axis=0)) if arr.ndim else arr, tag, lib)
        return t[::2] if arr.ndim else t
    return _as(arr, tag, lib)


@st.composite
def columns(draw: st.DrawFn) -> tuple[Schema, list[str], dict[str, Any]]:
    tag = draw(st.sampled_from(TAGS))
    other = draw(st.sampled_from(TAGS))
    native = DTYPES[tag].native_numpy and DTYPES[other].native_numpy
    lib = draw(st.sampled_from(["torch", "numpy"])) if HAS_TORCH and native else "numpy"
    if not native:
        lib = "torch"
    n = draw(st.integers(0, 6))
    seqs = [draw(st.integers(0, 4)) for _ in range(n)]
    names = draw(st.lists(st.sampled_from(list(FIELDS)), min_size=1, max_size=5, unique=True))
    cols: dict[str, Any] = {}
    for name in names:
        t = other if name == "tok2" else tag
        cols[name] = [_row(draw, name, t, lib, seqs[i]) for i in range(n)]
    if n and draw(st.booleans()):  # a row whose token lengths disagree
        i = draw(st.integers(0, n - 1))
        cols["tok2"] = list(cols.get("tok2", [None] * n))
        cols["tok2"][i] = _as(_array(draw, other, (seqs[i] + 1,)), other, lib)
    return _schema(tag, other), [f"k{i}" for i in range(n)], cols


@contextmanager
def _per_row() -> Iterator[None]:
    saved = encode_module._encode_tensor_bulk
    encode_module._encode_tensor_bulk = lambda *a: None
    try:
        yield
    finally:
        encode_module._encode_tensor_bulk = saved


def _outcome(schema: Schema, keys: list[str], cols: dict[str, Any]) -> Any:
    try:
        return ipc_bytes(encode_module.encode(schema, cols, keys))
    except FlightqError as e:
        return (type(e), str(e), e.field, e.key, e.expected, e.actual)


@SETTINGS
@given(columns())
def test_bulk_and_per_row_encode_agree(case: tuple[Schema, list[str], dict[str, Any]]) -> None:
    schema, keys, cols = case
    fast = _outcome(schema, keys, cols)
    with _per_row():
        slow = _outcome(schema, keys, cols)
    assert fast == slow


@SETTINGS
@given(columns())
def test_bulk_describes_its_tensors(case: tuple[Schema, list[str], dict[str, Any]]) -> None:
    _, _, cols = case
    for rows in cols.values():
        xs = [x for x in rows if x is not None]
        bulk = bulk_to_bytes(xs)
        if bulk is None:
            continue
        encoded = [to_bytes(x) for x in xs]
        assert bulk.shapes == [e.shape for e in encoded]
        assert bulk.nbytes.tolist() == [len(e.data) for e in encoded]
        assert bulk.ranks.tolist() == [len(e.shape) for e in encoded]
        assert {e.dtype for e in encoded} == {bulk.dtype}
        want = b"".join(e.data.tobytes() for e in encoded)
        out = np.empty(int(bulk.nbytes.sum()), dtype=np.uint8)
        bulk.copy_into(out)
        assert out.tobytes() == want
        out[:] = 0
        copy_bulk(bulk, out)  # torch tensors straight from their memory
        assert out.tobytes() == want
        views = bulk_buffers(bulk)
        if views is not None:
            assert b"".join(bytes(memoryview(v).cast("B")) for v in views) == want


@pytest.mark.torch
def test_torch_rows_that_need_normalising_leave_the_bulk_path(torch: Any) -> None:
    plain = [torch.arange(3), torch.arange(2)]
    assert bulk_to_bytes(plain) is not None
    grad = [torch.zeros(3, requires_grad=True), torch.zeros(2)]
    bulk = bulk_to_bytes(grad)  # a tensor needing grad: its memory is its value
    assert bulk is not None and bulk.plain
    assert bulk_to_bytes([torch.arange(3), torch.arange(4)[::2]]) is None
    assert bulk_to_bytes([torch.zeros(2, dtype=torch.bfloat16)] * 2) is not None
    neg = torch.zeros(3)._neg_view()
    bulk = bulk_to_bytes([neg, torch.zeros(3)])
    assert bulk is None or not bulk.plain
    schema = _schema("float32", "float32")
    rows = [torch.ones(2, requires_grad=True), -torch.ones(3)]
    got = encode_module.encode(schema, {"tok": rows}, ["a", "b"])
    with _per_row():
        want = encode_module.encode(schema, {"tok": rows}, ["a", "b"])
    assert ipc_bytes(got) == ipc_bytes(want)


@SETTINGS
@given(columns())
def test_packed_token_columns_match_their_rows(
    case: tuple[Schema, list[str], dict[str, Any]],
) -> None:
    schema, keys, cols = case
    try:
        batch = decode(encode_module.encode(schema, cols, keys), as_="numpy")
    except FlightqError:
        return  # refused: the first test holds the refusal to the per-row path's
    for name in batch.fields:
        col = batch.column(name)
        if schema[name].role != "token" or not col.complete or not len(col):
            continue
        rows = batch[name]
        assert col.lengths().tolist() == [len(r) for r in rows]
        flat, offsets = col.packed()
        assert flat.shape == (sum(map(len, rows)),)
        assert flat.tobytes() == b"".join(r.tobytes() for r in rows)
        assert offsets.tolist() == np.cumsum([0, *map(len, rows)]).tolist()
