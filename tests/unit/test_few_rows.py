"""The few-row paths (a W4 put and get: one row) give exactly what the array paths give.

Validation, encode and decode take Python lists for a handful of rows, where numpy's
per-call cost outweighs the work. Each is compared here with its array path (``_FEW``
set to 0) on the same input: the same record batch byte for byte, the same checks' results,
and for a faulty batch the same typed error with the same message.
"""

from __future__ import annotations

import importlib

import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import LIBS, as_lib

from flightq import SchemaRegistry, decode
from flightq.errors import DecodeError, FlightqError, ShapeError
from flightq.layout import SHAPE_SUFFIX
from flightq.tensor import to_bytes
from flightq.validation import validate

encode_module = importlib.import_module("flightq.encode")
validation_module = importlib.import_module("flightq.validation")
columns_module = importlib.import_module("flightq.columns")
TEXT = SchemaRegistry.default().get("rollout_text@1")


def _columns(lib: str, lens: list[int | None], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def row(s: int | None, dt: type) -> object:
        return None if s is None else as_lib((rng.random(s) * 100).astype(dt), lib)

    return {
        "input_ids": [row(s, np.int64) for s in lens],
        "generation_logprobs": [row(s, np.float32) for s in lens],
        "token_mask": [row(s, np.int64) for s in lens],
        "input_lengths": np.asarray([s or 0 for s in lens], dtype=np.int32),
    }


def _keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def _array_paths(m: pytest.MonkeyPatch) -> None:
    for mod in (encode_module, validation_module, columns_module):
        m.setattr(mod, "_FEW", 0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lens", [[128], [0], [3, 5], [4, None, 2], [None], [7] * 8])
def test_few_rows_encode_validate_and_decode_as_the_array_paths(
    monkeypatch: pytest.MonkeyPatch, lib: str, lens: list[int | None]
) -> None:
    cols, keys = _columns(lib, lens), _keys(len(lens))
    tags = [{"i": i} for i in range(len(lens))]
    few = encode_module.encode(TEXT, cols, keys, tags)
    with monkeypatch.context() as m:
        _array_paths(m)
        arrays = encode_module.encode(TEXT, cols, keys, tags)
        checked_arrays = validate(arrays, TEXT)
        decoded_arrays = decode(arrays, as_="numpy")
    assert few.equals(arrays, check_metadata=True)
    checked = validate(few, TEXT)
    assert checked.keys == checked_arrays.keys
    assert checked.seq_lens.tolist() == checked_arrays.seq_lens.tolist()
    assert checked.nbytes.tolist() == checked_arrays.nbytes.tolist()
    decoded = decode(few, as_="numpy")
    for f in decoded_arrays.fields:
        for a, b in zip(decoded[f], decoded_arrays[f], strict=True):
            assert (a is None and b is None) or np.array_equal(np.asarray(a), np.asarray(b))


def test_shape_columns_memoised_by_shape_stay_exact() -> None:
    # The memo gives back the array built for the same shapes, never another's.
    a = encode_module.encode(TEXT, _columns("numpy", [5]), ["a"])
    b = encode_module.encode(TEXT, _columns("numpy", [6]), ["a"])
    c = encode_module.encode(TEXT, _columns("numpy", [5]), ["a"])
    assert a.column("input_ids__shape").to_pylist() == [[5]]
    assert b.column("input_ids__shape").to_pylist() == [[6]]
    assert c.equals(a)


def _with_shape(rb: pa.RecordBatch, name: str, shapes: list) -> pa.RecordBatch:
    col = name + SHAPE_SUFFIX
    i = rb.schema.get_field_index(col)
    return rb.set_column(i, rb.schema.field(i), pa.array(shapes, type=pa.list_(pa.int64())))


def _with_payload(rb: pa.RecordBatch, name: str, payloads: list) -> pa.RecordBatch:
    i = rb.schema.get_field_index(name)
    return rb.set_column(i, rb.schema.field(i), pa.array(payloads, type=pa.large_binary()))


FAULTS = {
    "short payload": lambda rb: _with_payload(rb, "input_ids", [b"\0" * 8]),
    "negative dim": lambda rb: _with_shape(rb, "input_ids", [[-1]]),
    "null dim": lambda rb: _with_shape(rb, "input_ids", [[None]]),
    "rank 2": lambda rb: _with_shape(rb, "input_ids", [[2, 2]]),
    "rank 0": lambda rb: _with_shape(rb, "input_ids", [[]]),
    "huge dim": lambda rb: _with_shape(rb, "input_ids", [[2**61]]),
    "token lengths differ": lambda rb: _with_payload(
        _with_shape(rb, "token_mask", [[3]]), "token_mask", [b"\0" * 24]
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_faulty_row_is_refused_as_the_array_path_refuses_it(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    rb = FAULTS[fault](encode_module.encode(TEXT, _columns("numpy", [4]), ["g0_0"]))
    with pytest.raises(FlightqError) as few:
        validate(rb, TEXT)
    with monkeypatch.context() as m:
        _array_paths(m)
        with pytest.raises(FlightqError) as arrays:
            validate(rb, TEXT)
    assert type(few.value) is type(arrays.value)
    assert isinstance(few.value, (ShapeError, DecodeError))
    assert str(few.value) == str(arrays.value)
    assert few.value.field == arrays.value.field


@pytest.mark.torch
def test_torch_rows_encode_as_their_numpy_twins() -> None:
    import torch

    base = torch.arange(12, dtype=torch.float32)
    cases = {
        "contiguous": base,
        "one element, odd stride": base[::3][:1],
        "0-d": base[5],
        "non-contiguous": base.reshape(3, 4).t(),
        "requires grad": base.clone().requires_grad_(True),
        "negative view": torch._neg_view(base),
        "empty": base[:0],
        "bool": base > 5,
    }
    for name, t in cases.items():
        got = to_bytes(t)
        want = to_bytes(t.detach().resolve_neg().contiguous().numpy())
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert got.data.tobytes() == want.data.tobytes(), name
    bf = to_bytes(torch.ones(3, dtype=torch.bfloat16))  # no numpy twin: the checks' path
    assert bf.dtype == "bfloat16" and bf.data.tobytes() == b"\x80\x3f" * 3


@pytest.mark.torch
def test_scalar_rows_as_0d_tensors_encode_as_plain_values() -> None:
    import torch

    cols = _columns("numpy", [2, 3])
    values = [2, 3]
    as_values = encode_module.encode(TEXT, {**cols, "input_lengths": values}, ["a", "b"])
    tensors = [torch.tensor(v, dtype=torch.int32) for v in values]
    as_tensors = encode_module.encode(TEXT, {**cols, "input_lengths": tensors}, ["a", "b"])
    assert as_tensors.equals(as_values, check_metadata=True)
    wrong = [torch.tensor(v, dtype=torch.int64) for v in values]  # the general path refuses
    with pytest.raises(FlightqError, match="expected a int32 scalar, got int64"):
        encode_module.encode(TEXT, {**cols, "input_lengths": wrong}, ["a", "b"])


def _odd_rows() -> dict[str, dict]:
    """Columns a few-row encode must hand to the per-row path: what it cannot take as a
    plain view, and what the per-row path refuses."""
    ids = np.arange(6, dtype=np.int64)
    return {
        "non-contiguous": {"input_ids": [ids[::2]]},
        "big-endian": {"input_ids": [ids.astype(">i8")]},
        "empty": {"input_ids": [ids[:0]]},
        "rank 2": {"input_ids": [ids.reshape(2, 3)]},
        "0-d": {"input_ids": [ids[0]]},
        "wrong dtype": {"input_ids": [ids.astype(np.int32)]},
        "token lengths differ": {"input_ids": [ids], "token_mask": [ids[:4].copy()]},
        "scalar wrong dtype": {"input_ids": [ids], "input_lengths": np.array([6], np.int64)},
        "scalar big-endian": {"input_ids": [ids], "input_lengths": np.array([6], ">i4")},
        "scalar 2-d": {"input_ids": [ids], "input_lengths": np.array([[6]], np.int32)},
        "scalar bool": {"input_ids": [ids], "truncated": np.array([True])},
        "scalar values": {"input_ids": [ids], "total_reward": [0.5]},
    }


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("case", sorted(_odd_rows()))
def test_odd_few_rows_encode_or_fail_as_the_per_row_path(
    monkeypatch: pytest.MonkeyPatch, lib: str, case: str
) -> None:
    if lib == "torch" and "big-endian" in case:
        pytest.skip("torch holds no big-endian tensors")
    cols = {
        k: v if not isinstance(v, list) else [as_lib(np.asarray(x), lib) for x in v]
        for k, v in _odd_rows()[case].items()
    }

    def run() -> pa.RecordBatch | FlightqError:
        try:
            return encode_module.encode(TEXT, cols, ["g0_0"])
        except FlightqError as e:
            return e

    few = run()
    with monkeypatch.context() as m:
        _array_paths(m)
        arrays = run()
    if isinstance(arrays, FlightqError):
        assert type(few) is type(arrays) and str(few) == str(arrays)
    else:
        assert isinstance(few, pa.RecordBatch) and few.equals(arrays, check_metadata=True)
