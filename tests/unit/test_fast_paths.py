"""The per-column fast paths give exactly what the per-row paths give, and step aside.

encode's bulk path (every row a plain tensor of the declared dtype) must build the same
record batch, byte for byte, as the per-row path; anything unusual (a mixed column, a
wrong dtype, a non-contiguous or big-endian row) falls back to the per-row path and its
precise errors. Decoding every row at once gives the same views as row by row.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import LIBS, as_lib

from flightq import SchemaRegistry, decode, encode
from flightq.chunks import encode_chunks
from flightq.errors import DTypeError, EncodeError, ShapeError
from flightq.sink import copy_bulk
from flightq.tensor import bulk_to_bytes, to_bytes

encode_module = importlib.import_module("flightq.encode")  # the package exports encode()
TEXT = SchemaRegistry.default().get("rollout_text@1")
KEYS = ["a", "b", "c"]


def _ipc(rb: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as w:
        w.write_batch(rb)
    return sink.getvalue().to_pybytes()


def _per_row(monkeypatch: pytest.MonkeyPatch, columns: dict, keys: list[str]) -> pa.RecordBatch:
    with monkeypatch.context() as m:
        m.setattr(encode_module, "_encode_tensor_bulk", lambda *a: None)
        return encode_module.encode(TEXT, columns, keys)


def _columns(lib: str, lens: list[int | None]) -> dict:
    rng = np.random.default_rng(0)

    def row(s: int | None, dt: type) -> object:
        if s is None:
            return None
        return as_lib((rng.random(s) * 100).astype(dt), lib)

    return {
        "input_ids": [row(s, np.int64) for s in lens],
        "generation_logprobs": [row(s, np.float32) for s in lens],
        "input_lengths": np.asarray([s or 0 for s in lens], dtype=np.int32),
    }


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lens", [[3, 0, 7], [5, None, 2], [None, 6, 4]])
def test_bulk_encode_is_byte_identical_to_per_row(
    monkeypatch: pytest.MonkeyPatch, lib: str, lens: list[int | None]
) -> None:
    cols = _columns(lib, lens)
    seq = np.full(len(KEYS), -1, dtype=np.int64)
    assert encode_module._encode_tensor_bulk(TEXT["input_ids"], cols["input_ids"], seq)
    fast = encode(TEXT, cols, KEYS)
    assert _ipc(fast) == _ipc(_per_row(monkeypatch, cols, KEYS))
    got = decode(fast, as_="numpy")
    for i, s in enumerate(lens):
        want = cols["input_ids"][i]
        assert (got["input_ids"][i] is None) == (s is None)
        if s is not None:
            np.testing.assert_array_equal(got["input_ids"][i], np.asarray(want))


def test_bulk_takes_plain_columns_only() -> None:
    a = np.arange(4, dtype=np.int64)
    assert bulk_to_bytes([a, a[::-1].copy()]) is not None
    assert bulk_to_bytes([a, a.astype(np.int32)]) is None  # mixed dtypes
    assert bulk_to_bytes([a, np.arange(8)[::2]]) is None  # not contiguous
    assert bulk_to_bytes([a.astype(">i8")]) is None  # big-endian
    assert bulk_to_bytes([]) is None


def test_bulk_takes_plain_torch_columns_only(torch: ModuleType) -> None:
    a = np.arange(4, dtype=np.int64)
    assert bulk_to_bytes([torch.arange(3), torch.arange(2)]) is not None
    assert bulk_to_bytes([a, torch.arange(3)]) is None  # mixed libraries
    assert bulk_to_bytes([torch.arange(6).reshape(2, 3).t()]) is None


@pytest.mark.parametrize("lib", LIBS)
def test_unusual_rows_fall_back_and_still_encode_the_same(
    monkeypatch: pytest.MonkeyPatch, lib: str
) -> None:
    ids = [np.arange(4, dtype=np.int64), np.arange(10, dtype=np.int64)[::2], np.arange(2)]
    if lib == "torch":
        import torch

        ids = [torch.from_numpy(np.ascontiguousarray(x)) for x in ids]
        ids[1] = torch.arange(10)[::2]
    cols = {"input_ids": ids}
    assert _ipc(encode(TEXT, cols, KEYS)) == _ipc(_per_row(monkeypatch, cols, KEYS))


def test_fallback_raises_the_per_row_errors() -> None:
    wrong = [np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int32), np.arange(1)]
    with pytest.raises(DTypeError, match=r"expected dtype int64, got int32 \(row key 'b'\)"):
        encode(TEXT, {"input_ids": wrong}, KEYS)
    ids = [np.arange(n, dtype=np.int64) for n in (3, 4, 5)]
    lps = [np.zeros(n, dtype=np.float32) for n in (3, 9, 5)]
    with pytest.raises(ShapeError, match=r"sequence length 9 differs .*\(row key 'b'\)"):
        encode(TEXT, {"input_ids": ids, "generation_logprobs": lps}, KEYS)
    flat = [np.zeros((2, 2), dtype=np.int64)] * 3
    with pytest.raises(ShapeError, match=r"expected rank 1 .*\(row key 'a'\)"):
        encode(TEXT, {"input_ids": flat}, KEYS)


@pytest.mark.parametrize("as_", LIBS)
def test_decoding_all_rows_at_once_matches_row_by_row(as_: str) -> None:
    cols = _columns("numpy", [3, 0, 7])
    col = decode(encode(TEXT, cols, KEYS), as_=as_).column("input_ids")
    together = col.rows()
    for i in range(len(KEYS)):
        assert tuple(together[i].shape) == tuple(col[i].shape)
        np.testing.assert_array_equal(np.asarray(together[i]), np.asarray(col[i]))


@pytest.mark.parametrize("lib", LIBS)
def test_bulk_copy_waits_for_the_fill_when_deferred(lib: str) -> None:
    cols = _columns(lib, [3, 0, 7])
    fills: list = []
    (deferred,) = encode_chunks(TEXT, cols, KEYS, max_bytes=2**20, fills=fills)
    for fill in fills:
        fill()
    assert _ipc(deferred) == _ipc(encode(TEXT, cols, KEYS))


@pytest.mark.parametrize(
    ("dtype", "grad"),
    [
        ("int64", False),
        ("float32", False),
        ("bool", False),
        ("int32", False),
        ("float32", True),  # requires grad: its memory is its value all the same
        ("bfloat16", False),  # no numpy dtype: copied from memory, or by torch
        ("neg", False),  # a negative view: its memory is not its value, copied by torch
    ],
)
def test_bulk_copy_of_torch_rows_lays_their_bytes_end_to_end(
    dtype: str, grad: bool, torch: ModuleType
) -> None:
    rng = np.random.default_rng(3)
    dt = getattr(torch, "float32" if dtype == "neg" else dtype)
    rows = [torch.from_numpy(rng.random(n) * 50).to(dt) for n in (5, 0, 11, 1)]
    if grad:
        rows = [r.requires_grad_() for r in rows]
    if dtype == "neg":
        rows[2] = rows[2]._neg_view()
    bulk = bulk_to_bytes(rows)
    assert bulk is not None
    assert bulk.plain == (dtype != "neg")
    want = b"".join(bytes(to_bytes(r).data) for r in rows)  # the per-row conversion
    for copy in (bulk.copy_into, functools.partial(copy_bulk, bulk)):
        out = np.zeros(int(bulk.nbytes.sum()), dtype=np.uint8)
        copy(out)
        assert out.tobytes() == want


def test_a_torch_row_resized_before_its_deferred_copy_is_refused(torch: ModuleType) -> None:
    rows = [torch.arange(n % 5 + 2, dtype=torch.int64) for n in range(12)]  # the bulk path
    fills: list = []
    keys = [f"k{i}" for i in range(12)]
    encode_chunks(TEXT, {"input_ids": rows}, keys, max_bytes=2**20, fills=fills)
    rows[1].resize_(50)  # its memory may have moved: the copy must not read the old size
    with pytest.raises(EncodeError, match=r"tensor 1 of a column changed size during the put"):
        for fill in fills:
            fill()
