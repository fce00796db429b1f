"""Object fields without a network: values to msgpack bytes and back through ``encode`` /
``decode``, the checks a server runs on a put's bytes, and a drafted schema's roles."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flightq
from flightq.objects import check_columns, check_value, pack_values, unpack_value
from flightq.schema import Schema

SCHEMA = Schema.from_dict(
    {
        "name": "objs",
        "version": 1,
        "fields": [
            {"name": "input_ids", "dtype": "int64", "role": "token", "shape": [None]},
            {"name": "prompt", "role": "object"},
        ],
    }
)


def test_values_are_their_msgpack_bytes_one_uint8_array_a_row():
    vals = ["text", {"a": [1, 2.5, None, True]}, None, (1, "t"), np.int64(3), b"\x00"]
    packed = pack_values("prompt", vals, [f"k{i}" for i in range(len(vals))])
    assert packed[2] is None
    assert all(p.dtype == np.uint8 and p.ndim == 1 for p in packed if p is not None)
    assert bytes(packed[0]) == msgpack.packb("text")
    back = [None if p is None else unpack_value(p, "prompt", None) for p in packed]
    assert back == ["text", {"a": [1, 2.5, None, True]}, None, [1, "t"], 3, b"\x00"]


def test_a_column_with_a_value_in_every_row_is_packed_end_to_end():
    from flightq.rows import PackedRows

    vals = ["a", {"b": 1}, [2, 3]]
    packed = pack_values("prompt", vals, ["x", "y", "z"])
    assert type(packed) is PackedRows and packed.values.dtype == np.uint8
    assert packed.offsets.tolist() == [0, 2, 6, 9]
    assert [unpack_value(r, "prompt", None) for r in packed] == vals
    assert pack_values("prompt", packed, ["x", "y", "z"]) is packed  # a put's layers pass it
    rb = flightq.encode(SCHEMA, {"prompt": vals}, ["x", "y", "z"])
    assert flightq.decode(rb, as_="numpy")["prompt"] == vals


def test_decode_hands_out_values_by_row_and_by_column_also_over_several_batches():
    keys = [f"k{i}" for i in range(7)]
    vals = [{"turn": i, "text": "é" * i} if i != 3 else None for i in range(7)]
    ids = [np.arange(i + 1) for i in range(7)]
    one = flightq.encode(SCHEMA, {"input_ids": ids, "prompt": vals}, keys)
    whole = flightq.decode(one, as_="numpy")
    assert whole["prompt"] == vals
    assert [whole.column("prompt")[i] for i in (0, 3, -1)] == [vals[0], None, vals[-1]]
    parts = flightq.decode([one.slice(0, 2), one.slice(2, 3), one.slice(5)], as_="numpy")
    assert parts["prompt"] == vals
    assert [parts.column("prompt")[i] for i in (1, 3, 5)] == [vals[1], None, vals[5]]
    for form in ("packed", "jagged"):
        with pytest.raises(flightq.ShapeError, match="'prompt' is an object field"):
            getattr(whole.column("prompt"), form)()


@pytest.mark.parametrize(
    "raw", [b"\xc1", msgpack.packb("a") + b"\x00", msgpack.packb([msgpack.ExtType(3, b"x")])]
)
def test_a_payload_that_is_not_one_msgpack_value_is_a_decode_error_naming_the_row(raw):
    # What no server of flightq's stores, from a server that is not one.
    with pytest.raises(flightq.DecodeError, match=r"column 'prompt' \(row key 'r'\)") as info:
        unpack_value(raw, "prompt", "r")
    assert (info.value.field, info.value.key) == ("prompt", "r")


@pytest.mark.parametrize(
    "raw, says",
    [
        (msgpack.packb({"a": [1, {"b": "c"}]}), None),
        (msgpack.packb("x" * 1000), None),
        (msgpack.packb([{}] * 100), None),
        (msgpack.packb({"a": {3: 1}}, strict_types=False), "map key"),
        (msgpack.packb([msgpack.Timestamp(1, 0)]), r"extension value \(Timestamp\)"),
        (msgpack.packb("a") + msgpack.packb("b"), "extra data"),
        (b"\x92\xa1a", "not one msgpack value"),  # a list of two, one follows
        (b"\x9f" * 64, "not one msgpack value"),  # nested lists, their items missing
        (b"\xdc\x4e\x20" + b"\x80" * 20_000, "would decode to more than"),  # 20 000 maps
    ],
)
def test_the_servers_check_takes_one_value_an_object_field_holds(raw, says):
    if says is None:
        check_value(raw, "prompt", "r", 2**20)
        return
    with pytest.raises(flightq.EncodeError, match=says) as info:
        check_value(raw, "prompt", "r", 2**20)
    assert (info.value.field, info.value.key) == ("prompt", "r")


def test_a_drafted_schema_declares_text_dicts_and_message_logs_as_object_fields():
    sample = {
        "input_ids": [np.arange(3), np.arange(2)],
        "message_log": [[{"role": "user", "content": "x"}], []],
        "uid": np.array(["a", "b"], dtype=object),
        "raw_prompt": ["p0", "p1"],
        "extra": [{"k": 1}, {"k": 2}],
        "pixel_values": [[np.zeros((4, 3), np.float32)], []],
        "reward": [1.0, 0.5],
    }
    roles = {f.name: f.role for f in flightq.draft_schema(sample, "d").fields}
    assert roles == {
        "input_ids": "token",
        "message_log": "object",
        "uid": "object",
        "raw_prompt": "object",
        "extra": "object",
        "pixel_values": "media",
        "reward": "scalar",
    }


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_VALUES, min_size=1, max_size=8))
def test_any_value_an_object_field_holds_comes_back_equal_and_passes_the_servers_check(values):
    keys = [f"k{i}" for i in range(len(values))]
    rb = flightq.encode(SCHEMA, {"prompt": values}, keys)
    check_columns(rb, SCHEMA.fields, 2**20)
    got = flightq.decode(rb, as_="numpy")["prompt"]
    assert got == values
    assert [type(v) for v in got] == [type(v) for v in values]
