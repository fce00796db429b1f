"""A put cut into record batches of bounded size, never splitting shared media.

:func:`encode_chunks` cuts rows into consecutive ranges before encoding (each batch carries
its own dictionary of distinct media); :func:`split_batch` cuts an encoded batch into
zero-copy row slices; :func:`row_nbytes` is the size both go by.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .digest import MediaRefs
from .encode import encode
from .layout import MEDIA_TYPE, binary_offsets, media_row_bytes
from .rows import PackedRows, columns_of
from .schema import Schema
from .sink import COPY, DeferredFills, Sink
from .tensor import MemoryIndex, is_torch

__all__ = ["encode_chunks", "split_batch", "row_nbytes", "HARD_CHUNK_BYTES"]


def row_nbytes(batch: pa.RecordBatch) -> np.ndarray:
    """Per row, the bytes of its binary payloads (what dominates a batch's size).

    A media dictionary entry counts once, on the first row of the batch that uses it: it
    travels once per batch (as a dictionary message beside the record batch), however
    many rows of a prompt group view it.
    """
    n = batch.num_rows
    out = np.zeros(n, dtype=np.int64)
    for col in batch.columns:
        t = col.type
        if t == pa.large_binary():
            out += np.diff(binary_offsets(col))
        elif t == MEDIA_TYPE:
            out += media_row_bytes(col)
        elif pa.types.is_primitive(t):
            out += max(t.bit_width // 8, 1)
    return out


#: No chunk grows past this to keep shared media together (well below gRPC's 2 GiB).
HARD_CHUNK_BYTES = 256 * 2**20


def _nbytes(x: Any) -> int:
    # numpy arrays and torch tensors both say; whatever else is there, encode refuses.
    n = getattr(x, "nbytes", 0)
    return n if isinstance(n, int) else 0


_NBYTES = operator.attrgetter("nbytes")


def _column_nbytes(data: Any) -> int:
    """The bytes of a column's tensors: one C-level pass where every row is a tensor, the
    row-by-row sum of :func:`_nbytes` where some row is not (``None``, anything else)."""
    if type(data) is PackedRows:
        return data.nbytes
    try:
        total = sum(map(_NBYTES, data))
    except (AttributeError, TypeError):
        total = None
    return total if type(total) is int else sum(map(_nbytes, data))


def encode_chunks(
    schema: Schema,
    columns: Mapping[str, Any],
    keys: Sequence[str],
    tags: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    max_bytes: int,
    zero_copy: bool = False,
    on_range: Callable[[int, int], None] | None = None,
    fills: list[Callable[[], None]] | None = None,
    sink: Sink = COPY,
    media: MediaRefs | None = None,
) -> list[pa.RecordBatch]:
    """Encode rows as several record batches of about ``max_bytes`` each.

    Rows are cut into consecutive ranges before encoding, so each batch carries its own
    dictionary of distinct media and no message grows with the whole put. A range is never
    cut between rows that share a media segment (a prompt group's image stays one entry)
    unless the range would pass :data:`HARD_CHUNK_BYTES`. Same parameters and errors as
    :func:`encode`; ``on_range(start, stop)`` is called before rows ``[start, stop)`` are
    encoded (CUDA puts wait there for those rows' device-to-host copies). Every batch's
    payload bytes go to ``sink`` (:mod:`flightq.sink`).

    Given ``fills`` (short for ``sink=DeferredFills(fills)``), every check still runs here
    but no payload is copied yet: one callable per batch is appended, to run before that
    batch is written (a sender fills the next batch while the wire carries this one);
    payloads already end to end in memory are referenced, not copied, so the batches must
    be sent while the tensors stay unchanged. ``media`` names media by digest
    (:func:`encode`), one record of it for every batch.
    """
    keys = list(keys)
    n = len(keys)
    columns = columns_of(columns, schema, keys)
    if fills is not None:
        if sink is not COPY:
            raise ValueError("encode_chunks: pass fills or sink, not both")
        sink = DeferredFills(fills)

    def encode_range(cols: Mapping[str, Any], ks: list[str], tg: Any) -> pa.RecordBatch:
        return encode(schema, cols, ks, tg, zero_copy=zero_copy, sink=sink, media=media)

    lengths_ok = all(
        hasattr(v, "__len__") and len(v) == n for name, v in columns.items() if name in schema
    )
    if n <= 1 or not lengths_ok or (tags is not None and len(tags) != n):
        if on_range is not None:
            on_range(0, n)
        return [encode_range(columns, keys, tags)]
    # Plain lists: element-wise updates of numpy arrays cost more than the rows' work.
    sizes = [0] * n
    shares_back = [False] * n  # row i shares media with an earlier row
    first_row: MemoryIndex[int] = MemoryIndex()  # a shared segment's first row
    fixed = 0
    tensor_columns: list[Any] = []  # sized per row only if the put must be cut
    tensor_bytes = 0
    for name, data in columns.items():
        if name not in schema:
            continue
        f = schema[name]
        if f.role == "scalar":
            fixed += f.dt.itemsize
            continue
        if f.role != "media":
            tensor_columns.append(data)
            tensor_bytes += _column_nbytes(data)
            continue
        for i, row in enumerate(data):
            if row is None or not (type(row) is list or isinstance(row, Sequence)):
                continue
            for x in row:
                first = first_row.get(x)
                if first is not None:  # stored once, with its first row
                    if first < i:
                        shares_back[i] = True
                    continue
                first_row.put(x, i)
                sizes[i] += _nbytes(x)
    if sum(sizes) + tensor_bytes + fixed * n <= max_bytes:
        if on_range is not None:
            on_range(0, n)
        return [encode_range(columns, keys, tags)]
    for data in tensor_columns:
        if type(data) is PackedRows:
            sizes = [s + int(b) for s, b in zip(sizes, data.row_nbytes(), strict=True)]
            continue
        for i, row in enumerate(data):
            if row is not None:
                sizes[i] += _nbytes(row)
    cuts = [0]
    acc = 0
    for i in range(n):
        s = sizes[i] + fixed
        over = acc + s > max_bytes
        if i > cuts[-1] and over and (not shares_back[i] or acc + s > HARD_CHUNK_BYTES):
            cuts.append(i)
            acc = 0
        acc += s
    cuts.append(n)
    out = []
    for a, b in itertools.pairwise(cuts):
        if on_range is not None:
            on_range(a, b)
        cols = {name: _rows_slice(v, a, b) for name, v in columns.items()}
        out.append(encode_range(cols, keys[a:b], None if tags is None else tags[a:b]))
    return out


def _rows_slice(v: Any, a: int, b: int) -> Any:
    if isinstance(v, (list, tuple, np.ndarray, PackedRows)) or is_torch(v):
        return v[a:b]
    return list(v)[a:b]


def split_batch(batch: pa.RecordBatch, max_bytes: int) -> list[pa.RecordBatch]:
    """Zero-copy row slices of ``batch``, each under ``max_bytes`` of payload where possible.

    A single row larger than ``max_bytes`` travels alone.
    """
    n = batch.num_rows
    # Every buffer the batch references, counted once: a bound on its payload bytes.
    if n == 0 or batch.get_total_buffer_size() <= max_bytes:
        return [batch]
    sizes = row_nbytes(batch)
    if int(sizes.sum()) <= max_bytes:
        return [batch]
    out = []
    start = 0
    acc = 0
    for i in range(n):
        s = int(sizes[i])
        if i > start and acc + s > max_bytes:
            out.append(batch.slice(start, i - start))
            start, acc = i, 0
        acc += s
    out.append(batch.slice(start, n - start))
    return out
