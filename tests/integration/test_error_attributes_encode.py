"""Errors of an encode and of a put carry the fault as attributes beside the message:
the field, the row key, what was expected and what arrived, and the partition."""

from __future__ import annotations

import numpy as np
import pytest

import flightq

TEXT = "rollout_text@1"


@pytest.fixture(name="schema")
def schema_fixture() -> flightq.Schema:
    return flightq.SchemaRegistry.default().get(TEXT)


def _ids(n: int = 4) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def test_a_wrong_dtype_names_field_key_and_both_dtype_tags(schema: flightq.Schema) -> None:
    cols = {"input_ids": [_ids(), np.zeros(4, dtype=np.int32)]}
    with pytest.raises(flightq.DTypeError, match="expected dtype int64, got int32") as e:
        flightq.encode(schema, cols, keys=["g0_0", "g0_1"])
    assert e.value.attributes() == {
        "field": "input_ids",
        "key": "g0_1",
        "expected": "int64",
        "actual": "int32",
    }


def test_a_shape_that_breaks_the_declaration_carries_both_shapes(schema: flightq.Schema) -> None:
    with pytest.raises(flightq.ShapeError, match="expected rank 1") as e:
        flightq.encode(schema, {"input_ids": [np.zeros((2, 3), dtype=np.int64)]}, keys=["k"])
    assert (e.value.field, e.value.key, e.value.expected, e.value.actual) == (
        "input_ids",
        "k",
        [None],
        [2, 3],
    )


def test_a_ragged_token_row_carries_both_lengths(schema: flightq.Schema) -> None:
    cols = {"input_ids": [_ids(4)], "generation_logprobs": [np.zeros(3, dtype=np.float32)]}
    with pytest.raises(flightq.ShapeError, match="sequence length 3 differs") as e:
        flightq.encode(schema, cols, keys=["k"])
    assert e.value.attributes() == {
        "field": "generation_logprobs",
        "key": "k",
        "expected": 4,
        "actual": 3,
    }


def test_an_undeclared_column_and_a_repeated_key_are_named(schema: flightq.Schema) -> None:
    with pytest.raises(flightq.UndeclaredFieldError, match="'extra' is not declared") as e:
        flightq.encode(schema, {"input_ids": [_ids()], "extra": [_ids()]}, keys=["k"])
    assert e.value.field == "extra"
    with pytest.raises(flightq.EncodeError, match="duplicate row key 'k'") as d:
        flightq.encode(schema, {"input_ids": [_ids(), _ids()]}, keys=["k", "k"])
    assert d.value.key == "k"


def test_a_scalar_of_the_wrong_type_names_its_row(schema: flightq.Schema) -> None:
    cols = {"input_ids": [_ids(), _ids()], "input_lengths": [4, 4.5]}
    with pytest.raises(flightq.DTypeError, match="expected a int32 value, got float") as e:
        flightq.encode(schema, cols, keys=["a", "b"])
    assert e.value.attributes() == {
        "field": "input_lengths",
        "key": "b",
        "expected": "int32",
        "actual": "float",
    }


def test_put_refusals_from_the_server_name_field_key_and_partition() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["train"])
        c.put("p", ["a0", "a1"], {"input_ids": [_ids(), _ids()]})
        logprobs = [np.zeros(4, dtype=np.float32)]
        with pytest.raises(flightq.MissingFieldError, match="lacks required field") as m:
            c.put("p", ["new"], {"generation_logprobs": logprobs})
        assert m.value.attributes() == {"field": "input_ids", "key": "new", "partition": "p"}
        with pytest.raises(flightq.ConflictError, match="already has column 'input_ids'") as k:
            c.put("p", ["a0", "a1"], {"input_ids": [_ids(5), _ids(5)]})
        assert k.value.attributes() == {"field": "input_ids", "key": "a0", "partition": "p"}
        with pytest.raises(flightq.NotFoundError, match="has no row key 'zz'") as n:
            c.get("p", ["a0", "zz", "yy"])
        assert n.value.attributes() == {"key": "zz", "partition": "p"}
        with pytest.raises(flightq.NotFoundError, match="unknown partition 'nope'") as u:
            c.put("nope", ["a0"], {"input_ids": [_ids()]})
        assert u.value.partition == "nope"
