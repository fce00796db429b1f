"""What the server's budget counts for a put's tags, when rows share their tags' bytes.

The server walks each distinct tag map of a record batch once (rows of a prompt group
carry equal bytes); what each row is charged must still be what walking its own decoded
map gives, twice (the put's map and the row's), nothing for a row without tags or with an
empty map, and the whole-batch bound must still refuse tags too large to hold.
"""

from __future__ import annotations

import sys

import msgpack
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flightq import SchemaRegistry, encode
from flightq.errors import EncodeError, ResourceExhaustedError
from flightq.server.budget import PIECE_OVERHEAD, ROW_OVERHEAD, metadata_bytes, tags_size
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


def _expected(
    rb: pa.RecordBatch, keys: list[str], tags: list, payload: np.ndarray
) -> tuple[list[int], list[int]]:
    """Per row, what the piece counts (payload, share of the batch's other buffers and
    objects, the put's decoded tags map) and what the row holds of its own (key, its tags
    map, its objects)."""
    n = len(keys)
    rest = rb.get_total_buffer_size() - int(payload.sum()) + metadata_bytes(rb.schema)
    rest += PIECE_OVERHEAD
    share = -(-max(rest, 0) // n)
    sizes = [tags_size(t) if t else 0 for t in tags]
    piece = [int(payload[i]) + share + sizes[i] for i in range(n)]
    own = [ROW_OVERHEAD + sys.getsizeof(k) + sizes[i] for i, k in enumerate(keys)]
    return piece, own


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
    got = (piece.held.tolist(), piece.own.tolist())
    assert got == _expected(rb, keys, piece.tags, checked.nbytes)


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


def _row_by_row(values: list[bytes | None], keys: list[str], limit: int | None) -> str | None:
    """The first refusal decoding the rows in order gives (its message's start), or None."""
    total = 0
    for k, b in zip(keys, values, strict=True):
        if b is None:
            continue
        try:
            t = msgpack.unpackb(b, raw=False)
        except Exception:
            return f"tags of row {k!r} are not valid msgpack"
        if not isinstance(t, dict):
            return f"tags of row {k!r} must be a msgpack map, got {type(t).__name__}"
        total += tags_size(t)
        if limit is not None and total > limit:
            return (
                f"the tags of a record batch take more than {limit} bytes as Python "
                f"objects (at row {k!r})"
            )
    return None


_BYTES = [
    msgpack.packb({"weight_version": 0, "prompt_idx": 1}),
    msgpack.packb({"prompt_idx": 2, "note": "x" * 40}),
    msgpack.packb({}),
    msgpack.packb([1, 2]),  # not a map
    b"\xc1",  # not msgpack
    msgpack.packb({"a": 1})[:-1],  # truncated
    None,
]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, len(_BYTES) - 1), min_size=1, max_size=24),
    st.one_of(st.none(), st.integers(0, 3000)),
)
def test_tags_are_refused_at_the_first_row_that_fails_as_row_by_row(
    picks: list[int], limit: int | None
) -> None:
    values = [_BYTES[p] for p in picks]
    keys = [f"r{i}" for i in range(len(values))]
    rb = encode(TEXT, {"input_ids": [np.arange(2)] * len(keys)}, keys)
    rb = rb.set_column(1, rb.schema.field(1), pa.array(values, type=pa.binary()))
    checked = validate(rb, TEXT)
    want = _row_by_row(values, keys, limit)
    if want is None:
        piece = make_piece(rb, checked, limit)
        assert piece.tags == [None if b is None else msgpack.unpackb(b) for b in values]
        return
    with pytest.raises((EncodeError, ResourceExhaustedError)) as e:
        make_piece(rb, checked, limit)
    assert str(e.value).startswith(want)


def test_rows_with_equal_tag_bytes_share_one_decoded_map() -> None:
    tags = [{"prompt_idx": i // 4} for i in range(16)]
    keys = [f"r{i}" for i in range(16)]
    rb = encode(TEXT, {"input_ids": [np.arange(2)] * 16}, keys, tags)
    piece = make_piece(rb, validate(rb, TEXT), None)
    assert piece.tags == tags
    assert piece.tags[0] is piece.tags[3] and piece.tags[3] is not piece.tags[4]


def test_a_row_counts_what_each_task_of_its_partition_keeps_of_it() -> None:
    """A partition keeps per row, for each task, an entry in its index of ready rows and,
    once delivered, counts of deliveries and failures and a dead-letter entry: a row of a
    64-task partition, failed until dead for every task, counts at least the Python
    objects tracemalloc sees it take."""
    import gc
    import tracemalloc

    from helpers_store import store_put

    from flightq.server.store import Store

    n = 1500
    tasks = [f"task{i}" for i in range(64)]
    store = Store()
    store.declare("p", TEXT, tasks, None, max_failures=1)
    keys = [f"k{i:06d}" for i in range(n + 100)]
    store_put(store, "p", keys[:100])  # the partition's first indexes made before
    base = store.held()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100, n + 100, 500):
            store_put(store, "p", keys[i : i + 500])
        for t in tasks:  # every row delivered to every task, failed, dead
            _, rows, _, lease = store.claim("p", t, n + 100, None, 0.0)
            assert len(rows) == n + 100
            store.nack("p", lease.id, None, failed=True)
        p = store.partition("p")
        with store._lock:  # the ended claims are records, counted apart: let them go
            while p.progress.ended:
                p.progress.drop_ended()
        gc.collect()
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sum(len(st.dead) for st in p.progress.tasks.values()) == 64 * (n + 100)
    assert taken > 64 * 64 * n  # the tasks' entries are there to be counted
    assert store.held() - base >= taken, (store.held() - base, taken)


def test_a_large_puts_log_of_moved_keys_counts_what_it_holds_until_it_goes() -> None:
    """While a large put merges, each task logs the keys that move in its ready order
    (:attr:`~flightq.server.leases.TaskState.moved`, up to ``MOVED_KEPT``): at its fullest,
    with strings only the log keeps (an ack's keys are the client's), it counts at least
    what tracemalloc sees it take, and nothing once the log goes (overrun, or the merge
    ended)."""
    import gc
    import tracemalloc

    from flightq.server.leases import MOVED_KEPT, Progress

    progress = Progress(["t"])
    progress.watch()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, MOVED_KEPT, 512):
            progress.removed([f"key-{j:08d}" for j in range(i, i + 512)])
        gc.collect()
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    st = progress.tasks["t"]
    assert st.moved is not None and len(st.moved) == MOVED_KEPT
    assert taken > 60 * MOVED_KEPT  # the strings are there to be counted
    assert progress.moved_bytes >= taken, (progress.moved_bytes, taken)
    progress.removed(["one-more"])  # past MOVED_KEPT: the log goes (the merge updates in place)
    assert st.moved == [] and progress.moved_bytes == 0
    progress.removed(["again"])
    assert progress.moved_bytes > 0
    progress.unwatch()
    assert st.moved is None and progress.moved_bytes == 0
