"""Serving rows: record batches built from zero-copy slices of the stored batches.

Consecutive rows whose cells come from consecutive rows of the same stored batches are one
slice per column (the usual case: a claim of what one put wrote, plus the columns a
write-back added); a field a row lacks is null there. A media slice carries only the part
of the stored batch's dictionary that its rows use: Arrow IPC sends a record batch's
dictionaries whole, so the slice of one prompt group would otherwise carry every image of
the put.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pyarrow as pa

from ..layout import KEY, MEDIA_TYPE, SHAPE_SUFFIX, TAGS, arrow_schema
from .partition import Partition, Row

__all__ = ["assemble", "SMALL_RUN_BYTES", "COALESCED_BYTES"]

#: Slices smaller than this are copied together when an answer coalesces.
SMALL_RUN_BYTES = 1 << 20
#: Most payload bytes of one coalesced record batch.
COALESCED_BYTES = 4 << 20


def assemble(
    p: Partition, rows: list[Row], fields: list[str], max_bytes: int, coalesce: bool = False
) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The Arrow schema and record batches that serve ``rows`` with ``fields``.

    Consecutive rows whose cells come from consecutive rows of the same stored batches
    are served as one zero-copy slice per column; a field a row lacks is null there.
    Batches are cut before the row that would take them past ``max_bytes`` of payload
    (a row larger than that goes alone), so a prompt group travels with its image once.
    With ``coalesce``, consecutive slices of less than :data:`SMALL_RUN_BYTES` each (rows
    of many small puts, such as one prompt group of text each) are copied into one batch
    of up to :data:`COALESCED_BYTES` (never past ``max_bytes``): each record batch costs
    both ends a fixed amount of work, more than copying a small one does.
    """
    schema = arrow_schema(p.schema, fields)
    cols = [n for n in schema.names if n not in (KEY, TAGS)]

    def runs() -> Iterator[tuple[int, int]]:
        # A run ends before the row that would take it past max_bytes: that is the row
        # carrying a new image (a row counts a shared image where its group uses it
        # first), so a prompt group's rows and their image stay in one record batch.
        start = 0
        acc = 0
        for i, row in enumerate(rows):
            if i > start and (
                acc + row.nbytes > max_bytes or not _continues(rows[i - 1], row, fields)
            ):
                yield start, i
                start, acc = i, 0
            acc += row.nbytes
        yield start, len(rows)

    def batches() -> Iterator[pa.RecordBatch]:
        if not rows:
            yield pa.RecordBatch.from_pylist([], schema=schema)
            return
        if not coalesce:
            for lo, hi in runs():
                yield sliced(lo, hi)
            return
        limit = min(COALESCED_BYTES, max_bytes)
        small = min(SMALL_RUN_BYTES, limit)
        pending: list[pa.RecordBatch] = []
        pending_keys: set[str] = set()
        held = 0
        for lo, hi in runs():
            batch = sliced(lo, hi)
            # What the slice carries: only the fields asked for, and the images of all its
            # rows (a row's size counts a shared image on the group's first row only).
            size = batch.nbytes
            if size >= small:
                yield from _joined(pending)
                pending, pending_keys, held = [], set(), 0
                yield batch
                continue
            keys = {r.key for r in rows[lo:hi]}
            # A get may name a key twice; one record batch holds each key once.
            if held + size > limit or keys & pending_keys:
                yield from _joined(pending)
                pending, pending_keys, held = [], set(), 0
            pending.append(batch)
            pending_keys |= keys
            held += size
        yield from _joined(pending)

    def sliced(lo: int, hi: int) -> pa.RecordBatch:
        """Rows ``[lo, hi)`` as slices of the stored batches."""
        run = rows[lo:hi]
        n = hi - lo
        pack = msgpack.Packer(use_bin_type=True).pack  # one packer: a third of packb's cost
        arrays: list[pa.Array] = [
            pa.array([r.key for r in run], type=pa.utf8()),
            pa.array([pack(r.tags) if r.tags else None for r in run], type=pa.binary()),
        ]
        first = run[0]
        for c in cols:
            base = c[: -len(SHAPE_SUFFIX)] if c.endswith(SHAPE_SUFFIX) else c
            cell = first.cells.get(base)
            if cell is None:
                arrays.append(pa.nulls(n, type=schema.field(c).type))
            else:
                pc, idx = cell
                col = pc.batch.column(c).slice(idx, n)
                arrays.append(_own_entries(col) if col.type == MEDIA_TYPE else col)
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    return schema, batches()


def _joined(batches: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The batches as one (a copy; media dictionaries unified), or nothing if none."""
    if len(batches) > 1:
        yield pa.concat_batches(batches)
    elif batches:
        yield batches[0]


def _own_entries(col: pa.LargeListArray) -> pa.LargeListArray:
    """A slice of a media column with its dictionary cut to the range of entries its
    segments use (a zero-copy slice of the stored dictionary), indices shifted to match."""
    outer = col.offsets.to_numpy()
    lo, hi = int(outer[0]), int(outer[-1])
    segs = col.values.slice(lo, hi - lo)
    entries = segs.dictionary
    idx = segs.indices.to_numpy(zero_copy_only=False)
    first, stop = (int(idx.min()), int(idx.max()) + 1) if len(idx) else (0, 0)
    if first == 0 and stop == len(entries):
        return col
    own = pa.DictionaryArray.from_arrays(
        pa.array(idx - first, type=pa.int32()), entries.slice(first, stop - first)
    )
    mask = col.is_null() if col.null_count else None
    return pa.LargeListArray.from_arrays(pa.array(outer - lo, type=pa.int64()), own, mask=mask)


def _continues(prev: Row, row: Row, fields: list[str]) -> bool:
    for f in fields:
        a, b = prev.cells.get(f), row.cells.get(f)
        if a is None and b is None:
            continue
        if a is None or b is None or a[0] is not b[0] or b[1] != a[1] + 1:
            return False
    return True
