"""What the server's budget counts for a put's tags, when rows share their tags' bytes.

The server walks each distinct tag map of a record batch once (rows of a prompt group
carry equal bytes); what each row is charged must still be what walking its own decoded
map gives, twice (the put's map and the row's), nothing for a row without tags or with an
empty map, and the whole-batch bound must still refuse tags too large to hold.
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flightq import SchemaRegistry, encode
from flightq.errors import ResourceExhaustedError
from flightq.server.budget import ROW_OVERHEAD, metadata_bytes, tags_size
from flightq.server.partition import make_piece
from flightq.validation import validate

TEXT = SchemaRegistry.default().get("rollout_text@1")

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(0, 9), max_size=4),
)
maps = st.one_of(st.none(), st.dictionaries(st.text(max_size=6), values, max_size=4))


def _expected(rb: pa.RecordBatch, keys: list[str], tags: list, payload: np.ndarray) -> list[int]:
    n = len(keys)
    rest = rb.get_total_buffer_size() - int(payload.sum()) + metadata_bytes(rb.schema)
    share = -(-max(rest, 0) // n)
    return [
        int(payload[i]) + share + ROW_OVERHEAD + sys.getsizeof(k) + (2 * tags_size(t) if t else 0)
        for i, (k, t) in enumerate(zip(keys, tags, strict=True))
    ]


@settings(max_examples=150, deadline=None)
@given(st.lists(maps, min_size=1, max_size=6), st.lists(st.integers(0, 5), max_size=12))
def test_each_row_is_charged_for_its_own_tags(distinct: list, picks: list[int]) -> None:
    tags = [distinct[p % len(distinct)] for p in picks] or distinct
    keys = [f"r{i}" for i in range(len(tags))]
    rows = [np.arange(i % 3 + 1, dtype=np.int64) for i in range(len(keys))]
    rb = encode(TEXT, {"input_ids": rows}, keys, tags)
    checked = validate(rb, TEXT)
    piece = make_piece(rb, checked, None)
    assert piece.tags == tags
    assert piece.held.tolist() == _expected(rb, keys, piece.tags, checked.nbytes)


def test_the_batch_bound_counts_every_row_even_when_rows_share_bytes() -> None:
    tags = [{"weight_version": 0, "prompt_idx": 7, "note": "x" * 200}] * 16
    keys = [f"g{i}" for i in range(16)]
    rb = encode(TEXT, {"input_ids": [np.arange(2)] * 16}, keys, tags)
    checked = validate(rb, TEXT)
    one = tags_size(tags[0])
    make_piece(rb, checked, 16 * one)  # exactly at the bound: taken
    with pytest.raises(ResourceExhaustedError, match=r"at row 'g15'") as e:
        make_piece(rb, checked, 16 * one - 1)
    assert e.value.key == "g15"
