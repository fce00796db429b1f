"""Serving rows: record batches built from zero-copy slices of the stored batches.

Consecutive rows whose cells come from consecutive rows of the same stored batches are one
slice per column (the usual case: a claim of what one put wrote, plus the columns a
write-back added); a field a row lacks is null there.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pyarrow as pa

from .layout import KEY, SHAPE_SUFFIX, TAGS, arrow_schema
from .rows import Partition, Row

__all__ = ["assemble"]


def assemble(
    p: Partition, rows: list[Row], fields: list[str], max_bytes: int
) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The Arrow schema and record batches that serve ``rows`` with ``fields``.

    Consecutive rows whose cells come from consecutive rows of the same stored batches
    are served as one zero-copy slice per column; a field a row lacks is null there.
    Batches are cut at about ``max_bytes`` of payload.
    """
    schema = arrow_schema(p.schema, fields)
    cols = [n for n in schema.names if n not in (KEY, TAGS)]

    def runs() -> Iterator[tuple[int, int]]:
        start = 0
        acc = 0
        for i in range(1, len(rows) + 1):
            acc += rows[i - 1].nbytes
            if i == len(rows) or acc >= max_bytes or not _continues(rows[i - 1], rows[i], fields):
                yield start, i
                start, acc = i, 0

    def batches() -> Iterator[pa.RecordBatch]:
        if not rows:
            yield pa.RecordBatch.from_pylist([], schema=schema)
            return
        for lo, hi in runs():
            run = rows[lo:hi]
            n = hi - lo
            arrays: list[pa.Array] = [
                pa.array([r.key for r in run], type=pa.utf8()),
                pa.array(
                    [msgpack.packb(r.tags, use_bin_type=True) if r.tags else None for r in run],
                    type=pa.binary(),
                ),
            ]
            first = run[0]
            for c in cols:
                base = c[: -len(SHAPE_SUFFIX)] if c.endswith(SHAPE_SUFFIX) else c
                cell = first.cells.get(base)
                if cell is None:
                    arrays.append(pa.nulls(n, type=schema.field(c).type))
                else:
                    pc, idx = cell
                    arrays.append(pc.batch.column(c).slice(idx, n))
            yield pa.RecordBatch.from_arrays(arrays, schema=schema)

    return schema, batches()


def _continues(prev: Row, row: Row, fields: list[str]) -> bool:
    for f in fields:
        a, b = prev.cells.get(f), row.cells.get(f)
        if a is None and b is None:
            continue
        if a is None or b is None or a[0] is not b[0] or b[1] != a[1] + 1:
            return False
    return True
