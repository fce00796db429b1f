"""Property tests: any rows of any dtype, rank and segment count round-trip bit for bit.

Tensor bytes are drawn raw, so NaN payloads, signed zeros, subnormals and every bfloat16
and float8 bit pattern travel too. Each example builds its own schema: two token fields
sharing the row's sequence length, a fixed-rank tensor field with some dims declared, an
any-rank media field, and a scalar field, optionally with zstd on the payload fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers_wire import HAS_TORCH, assert_same_column, assert_same_tensor, ipc_bytes, read_ipc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flightq
from flightq import Field, Schema, Zstd
from flightq.codecs import RAW
from flightq.dtypes import DTYPES
from flightq.validation import validate

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

dims = st.integers(min_value=0, max_value=3)

# Where torch is absent the cases are numpy arrays of the dtypes numpy has, decoded to numpy.
TAGS = [t for t in DTYPES if HAS_TORCH or DTYPES[t].native_numpy]
DECODE_AS = "torch" if HAS_TORCH else "numpy"


@dataclass
class Case:
    tag: str
    lib: str
    schema: Schema
    keys: list[str]
    columns: dict[str, Any]


def _tensor(draw: st.DrawFn, tag: str, shape: tuple[int, ...], lib: str) -> Any:
    dt = DTYPES[tag]
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    arr = np.frombuffer(raw, dtype=dt.storage).copy()
    if tag == "bool":
        arr = (arr.view(np.uint8) & 1).view(np.bool_)
    arr = arr.reshape(shape)
    if lib == "numpy":
        return arr.astype(arr.dtype.newbyteorder("="))
    import torch

    t = torch.from_numpy(arr)
    return t if dt.native_numpy else t.view(dt.torch())


def _maybe(draw: st.DrawFn, x: Any) -> Any:
    """``x`` or, now and then, None (the row lacks the field)."""
    return None if draw(st.integers(0, 4)) == 0 else x


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tag = draw(st.sampled_from(TAGS))
    # numpy has no bfloat16 or float8: those come in as torch tensors only
    if not HAS_TORCH:
        lib = "numpy"
    else:
        lib = draw(st.sampled_from(["torch", "numpy"])) if DTYPES[tag].native_numpy else "torch"
    codec = draw(st.sampled_from([RAW, Zstd(1)]))
    n = draw(st.integers(0, 4))
    keys = [f"k{i}" for i in range(n)]

    tok_tail = tuple(draw(st.lists(dims, max_size=2)))
    ten_shape = tuple(draw(st.lists(dims, max_size=4)))  # rank 0..4
    ten_decl = tuple(d if draw(st.booleans()) else None for d in ten_shape)
    schema = Schema(
        "prop",
        1,
        [
            Field("tok", tag, "token", (None, *tok_tail), codec=codec),
            Field("tok2", tag, "token", (None, *(None for _ in tok_tail))),
            Field("ten", tag, "tensor", ten_decl, codec=codec),
            Field("med", tag, "media", None, codec=codec),
            Field("sca", tag, "scalar"),
        ],
    )

    seq = [draw(st.integers(0, 5)) for _ in keys]
    tok = [_maybe(draw, _tensor(draw, tag, (s, *tok_tail), lib)) for s in seq]
    tok2 = [_maybe(draw, _tensor(draw, tag, (s, *tok_tail), lib)) for s in seq]
    ten = [
        _maybe(
            draw, _tensor(draw, tag, tuple(draw(dims) if d is None else d for d in ten_decl), lib)
        )
        for _ in keys
    ]
    med = [
        _maybe(
            draw,
            [
                _tensor(draw, tag, tuple(draw(st.lists(dims, max_size=4))), lib)
                for _ in range(draw(st.integers(0, 3)))
            ],
        )
        for _ in keys
    ]
    sca = _tensor(draw, tag, (n,), lib)
    present = draw(st.sets(st.sampled_from(["tok", "tok2", "ten", "med", "sca"])))
    columns = {
        name: col
        for name, col in {"tok": tok, "tok2": tok2, "ten": ten, "med": med, "sca": sca}.items()
        if name in present
    }
    return Case(tag, lib, schema, keys, columns)


def _check(case: Case, out: flightq.Batch, *, bits: bool = False) -> None:
    assert out.keys == case.keys
    assert out.fields == [f.name for f in case.schema if f.name in case.columns]
    for name, want in case.columns.items():
        got = out[name]
        role = case.schema[name].role
        if bits:  # numpy output of a dtype numpy lacks: bit patterns, compared as such
            if role == "scalar":
                assert_same_tensor(got, want, bits_as=case.tag)
                continue
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                if w is None:
                    assert g is None
                elif role == "media":
                    assert len(g) == len(w)
                    for gs, ws in zip(g, w, strict=True):
                        assert_same_tensor(gs, ws, bits_as=case.tag)
                else:
                    assert_same_tensor(g, w, bits_as=case.tag)
        else:
            assert_same_column(case.schema, name, got, want)


@pytest.mark.torch
@SETTINGS
@given(cases())
def test_any_rows_round_trip_bit_exactly_to_torch(case: Case) -> None:
    rb = read_ipc(ipc_bytes(flightq.encode(case.schema, case.columns, case.keys)))
    _check(case, flightq.decode(rb))


@SETTINGS
@given(cases())
def test_any_rows_round_trip_bit_exactly_to_numpy(case: Case) -> None:
    rb = flightq.encode(case.schema, case.columns, case.keys)
    out = flightq.decode(rb, as_="numpy")
    if case.lib == "numpy":
        _check(case, out)
    elif DTYPES[case.tag].native_numpy:
        _check(case, flightq.decode(rb))  # torch in, numpy out: compare through torch
        for name in out.fields:
            rows = out[name]
            assert isinstance(rows, np.ndarray) or all(
                r is None or isinstance(r, np.ndarray | list) for r in rows
            )
    else:
        _check(case, out, bits=True)


@SETTINGS
@given(cases())
def test_decoded_rows_re_encode_to_the_same_bytes(case: Case) -> None:
    rb = flightq.encode(case.schema, case.columns, case.keys)
    out = flightq.decode(read_ipc(ipc_bytes(rb)), as_=DECODE_AS)
    again = flightq.encode(case.schema, out.to_dict(), out.keys)
    assert ipc_bytes(again) == ipc_bytes(rb)


@SETTINGS
@given(cases())
def test_validate_sees_sequence_lengths_and_segment_counts(case: Case) -> None:
    rb = flightq.encode(case.schema, case.columns, case.keys)
    checked = validate(rb)
    want_seq = [-1] * len(case.keys)
    for name in ("tok", "tok2"):
        for i, t in enumerate(case.columns.get(name, [None] * len(case.keys))):
            if t is not None:
                want_seq[i] = int(t.shape[0])
    assert checked.seq_lens.tolist() == want_seq
    if "med" in case.columns:
        counts = flightq.decode(rb, as_=DECODE_AS).column("med").counts
        assert counts.tolist() == [0 if r is None else len(r) for r in case.columns["med"]]
