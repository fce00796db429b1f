"""Errors carry structured attributes a caller can act on without parsing the message.

``field``, ``key``, ``expected`` and ``actual`` (where they apply) are shown here through
the public API: :func:`flightq.encode`, :func:`flightq.decode`, a real server refusing a
put sent with ``pyarrow.flight`` alone, and pickling. Bad tags follow one rule: the
writer's fault raises :class:`flightq.EncodeError` wherever the writer's data is checked
(its own ``encode``, the server's check of a put), with the same attributes on both
sides; a reader decoding a received batch raises :class:`flightq.DecodeError`.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from helpers_reliability import plain_put, put_command

import flightq
from flightq.layout import KEY, TAGS
from flightq.protocol import from_flight_error
from flightq.validation import validate

pytestmark = pytest.mark.timeout(120)

SCHEMA = flightq.Schema(
    "attrs",
    1,
    [
        flightq.Field("ids", "int32", "token", [None]),
        flightq.Field("box", "float32", "tensor", [4]),
    ],
)


def _with_column(rb: pa.RecordBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    """``rb`` with column ``name`` replaced, its schema and metadata kept."""
    cols = list(rb.columns)
    cols[rb.schema.get_field_index(name)] = array
    return pa.RecordBatch.from_arrays(cols, schema=rb.schema)


def _valid(keys: list[str]) -> pa.RecordBatch:
    return flightq.encode(SCHEMA, {"ids": [np.arange(3, dtype=np.int32) for _ in keys]}, keys)


def test_an_int64_tensor_in_an_int32_field_names_field_key_and_both_dtypes() -> None:
    ids = [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)]
    with pytest.raises(
        flightq.DTypeError, match=r"column 'ids': expected dtype int32, got int64 \(row key 'b'\)"
    ) as e:
        flightq.encode(SCHEMA, {"ids": ids}, ["a", "b"])
    assert e.value.attributes() == {
        "field": "ids",
        "key": "b",
        "expected": "int32",
        "actual": "int64",
    }


def test_a_torch_tensor_of_the_wrong_dtype_carries_the_same_attributes(torch: ModuleType) -> None:
    with pytest.raises(flightq.DTypeError, match=r"expected dtype int32, got int64") as e:
        flightq.encode(SCHEMA, {"ids": [torch.arange(3)]}, ["a"])
    assert (e.value.field, e.value.key, e.value.expected, e.value.actual) == (
        "ids",
        "a",
        "int32",
        "int64",
    )


def test_a_tensor_of_the_wrong_shape_names_the_declared_and_the_given_shape() -> None:
    box = [np.zeros(4, np.float32), np.zeros(3, np.float32)]
    with pytest.raises(flightq.ShapeError, match=r"column 'box'.*\(row key 'b'\)") as e:
        flightq.encode(SCHEMA, {"ids": [np.arange(2, dtype=np.int32)] * 2, "box": box}, ["a", "b"])
    assert e.value.attributes() == {"field": "box", "key": "b", "expected": [4], "actual": [3]}


def test_a_received_payload_shorter_than_its_shape_names_the_bytes() -> None:
    rb = _valid(["a", "b"])
    short = pa.array([np.arange(3, dtype=np.int32).tobytes(), b"\0" * 11], pa.large_binary())
    with pytest.raises(
        flightq.ShapeError,
        match=r"column 'ids': shape \(3,\) needs 12 bytes of int32, payload has 11 "
        r"\(row key 'b'\)",
    ) as e:
        flightq.decode(_with_column(rb, "ids", short), as_="numpy")
    assert e.value.attributes() == {"field": "ids", "key": "b", "expected": 12, "actual": 11}


def test_a_received_shape_of_the_wrong_rank_names_both_shapes() -> None:
    rb = flightq.encode(
        SCHEMA, {"box": [np.zeros(4, np.float32), np.zeros(4, np.float32)]}, ["a", "b"]
    )
    shapes = pa.array([[4], [2, 2]], pa.list_(pa.int64()))
    with pytest.raises(
        flightq.ShapeError, match=r"column 'box': expected rank 1 \[4\], got shape \(2, 2\)"
    ) as e:
        flightq.decode(_with_column(rb, "box__shape", shapes), as_="numpy")
    assert e.value.attributes() == {"field": "box", "key": "b", "expected": [4], "actual": [2, 2]}


def test_duplicate_keys_in_a_received_batch_are_a_decode_error() -> None:
    rb = _with_column(_valid(["a", "b"]), KEY, pa.array(["a", "a"]))
    with pytest.raises(flightq.DecodeError, match=r"duplicate row key 'a' within one batch") as e:
        flightq.decode(rb, as_="numpy")
    assert not isinstance(e.value, flightq.EncodeError)
    assert e.value.attributes() == {"field": KEY, "key": "a"}


def test_a_field_absent_from_a_decoded_batch_names_the_field_and_first_row() -> None:
    b = flightq.decode(_valid(["a", "b"]), as_="numpy")
    with pytest.raises(flightq.MissingFieldError, match=r"field 'box' is not in this batch") as e:
        b["box"]
    assert e.value.attributes() == {"field": "box", "key": "a"}


def test_an_undeclared_column_names_the_field() -> None:
    with pytest.raises(
        flightq.UndeclaredFieldError, match=r"column 'frob' is not declared by schema attrs@1"
    ) as e:
        flightq.encode(SCHEMA, {"frob": [1]}, ["a"])
    assert e.value.field == "frob"


def test_a_schema_mismatch_names_both_fingerprints_and_the_one_field() -> None:
    drifted = flightq.Schema(
        "attrs",
        1,
        [
            flightq.Field("ids", "int64", "token", [None]),
            flightq.Field("box", "float32", "tensor", [4]),
        ],
    )
    rb = flightq.encode(drifted, {"ids": [np.arange(3)]}, ["a"])
    with pytest.raises(
        flightq.SchemaMismatchError, match=r"field 'ids': dtype expected 'int32', actual 'int64'"
    ) as e:
        validate(rb, SCHEMA)
    assert e.value.attributes() == {
        "field": "ids",
        "expected": SCHEMA.fingerprint,
        "actual": drifted.fingerprint,
    }


def test_an_unknown_schema_names_the_reference_asked_for() -> None:
    reg = flightq.SchemaRegistry()
    reg.register(SCHEMA)
    with pytest.raises(flightq.UnknownSchemaError, match=r"unknown schema version attrs@7") as e:
        reg.get("attrs@7")
    assert e.value.expected == "attrs@7"
    with pytest.raises(flightq.UnknownSchemaError, match=r"unknown schema 'nope'") as e:
        reg.get("nope", 2)
    assert e.value.expected == "nope@2"


def test_pickling_keeps_class_message_and_attributes() -> None:
    with pytest.raises(flightq.DTypeError) as e:
        flightq.encode(SCHEMA, {"ids": [np.arange(3, dtype=np.int64)]}, ["a"])
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is flightq.DTypeError
    assert str(back) == str(e.value)
    assert (
        back.attributes()
        == e.value.attributes()
        == {
            "field": "ids",
            "key": "a",
            "expected": "int32",
            "actual": "int64",
        }
    )


# --------------------------------------------------------------------------- bad tags


def _deep(n: int) -> Any:
    """A map nested ``n`` deep: more than msgpack packs or unpacks."""
    t: Any = {}
    for _ in range(n):
        t = {"x": t}
    return t


#: Bad tags a writer can hand to its own encode, and the same bytes sent by a plain client.
BAD_TAGS: list[tuple[str, Any, bytes, dict[str, Any]]] = [
    ("not a map", [1, 2], msgpack.packb([1, 2]), {"actual": "list"}),
    ("too deep", _deep(2000), b"\x81\xa1x" * 2000 + b"\x80", {}),
]


@pytest.fixture(scope="module")
def server() -> Iterator[flightq.Server]:
    reg = flightq.SchemaRegistry()
    reg.register(SCHEMA)
    with flightq.Server(registry=reg) as srv, flightq.connect(srv.location, [SCHEMA]) as c:
        c.create_partition("p", SCHEMA)
        yield srv


def _refused_put(location: str, rb: pa.RecordBatch) -> flightq.FlightqError:
    with pytest.raises(fl.FlightError) as e:
        plain_put(location, put_command("p"), [rb])
    return from_flight_error(e.value)


@pytest.mark.parametrize(("case", "tags", "wire", "extra"), BAD_TAGS, ids=[c[0] for c in BAD_TAGS])
def test_bad_tags_raise_the_same_class_and_attributes_at_encode_and_at_the_server(
    server: flightq.Server, case: str, tags: Any, wire: bytes, extra: dict[str, Any]
) -> None:
    want = {"field": TAGS, "key": "b", **extra}
    with pytest.raises(flightq.EncodeError, match=r"tags of row 'b' ") as local:
        flightq.encode(SCHEMA, {"ids": [np.arange(2, dtype=np.int32)] * 2}, ["a", "b"], [{}, tags])
    crafted = _with_column(_valid(["a", "b"]), TAGS, pa.array([None, wire], pa.binary()))
    remote = _refused_put(server.location, crafted)
    assert type(remote) is type(local.value) is flightq.EncodeError
    assert str(remote).startswith("tags of row 'b' ")
    assert local.value.attributes() == want
    assert remote.attributes() == want


@pytest.mark.parametrize(("case", "tags", "wire", "extra"), BAD_TAGS, ids=[c[0] for c in BAD_TAGS])
def test_bad_tags_in_a_received_batch_are_a_decode_error_with_the_same_attributes(
    case: str, tags: Any, wire: bytes, extra: dict[str, Any]
) -> None:
    crafted = _with_column(_valid(["a", "b"]), TAGS, pa.array([None, wire], pa.binary()))
    b = flightq.decode(crafted, as_="numpy")
    with pytest.raises(flightq.DecodeError, match=r"tags of row 'b' are not ") as e:
        _ = b.tags
    assert e.value.attributes() == {"field": TAGS, "key": "b", **extra}
