"""The record-batch layout: column names, Arrow types, metadata keys, and validation.

Every flightq record batch has these columns, in this order:

``__key__``
    utf8, the row keys, never null;
``__tags__``
    binary, one msgpack map per row (null means no tags);
``<field>`` and ``<field>__shape``
    for each field present, in schema order. token and tensor fields: ``large_binary``
    payload (the tensor's raw little-endian bytes) and ``list<int64>`` shape. media
    fields: ``large_list<dictionary<int32, large_binary>>`` (one dictionary index per
    segment; a payload shared by several segments is one dictionary entry, so it travels
    once) and ``large_list<list<int64>>`` (one shape per segment). scalar fields: one plain Arrow
    column of the field's type (bfloat16 and float8 as their bit patterns), no shape.

The schema-level metadata carries the whole schema (``flightq.schema``, canonical JSON),
its fingerprint and the wire version; each payload column's metadata names its dtype,
role and codec. :func:`flightq.validation.validate` checks a batch against this layout.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .codecs import RAW
from .errors import DecodeError, SchemaError
from .schema import Field, Schema

__all__ = [
    "SLICE",
    "in_slices",
    "mapped",
    "pylist",
    "DEFAULT_BATCH_BYTES",
    "MAX_PAYLOAD_BYTES",
    "KEY",
    "MEDIA_TYPE",
    "TAGS",
    "SHAPE_SUFFIX",
    "WIRE_VERSION",
    "META_SCHEMA",
    "META_FINGERPRINT",
    "META_WIRE",
    "payload_type",
    "shape_type",
    "arrow_field",
    "arrow_schema",
    "schema_of",
    "binary_offsets",
    "first_use_bytes",
    "media_row_bytes",
    "row_sums",
    "Packed",
    "int_offsets",
]

KEY = "__key__"
TAGS = "__tags__"
SHAPE_SUFFIX = "__shape"
WIRE_VERSION = "1"

META_SCHEMA = b"flightq.schema"
META_FINGERPRINT = b"flightq.fingerprint"
META_WIRE = b"flightq.wire"
#: A claim answer's grant (``flightq.protocol.ClaimGrant``): per answer, no part of its layout.
META_CLAIM = b"flightq.claim"
FIELD_DTYPE = b"flightq.dtype"
FIELD_ROLE = b"flightq.role"
FIELD_CODEC = b"flightq.codec"

#: Payload bytes per record batch, put and answer alike, unless told otherwise: a prompt
#: group stays in one batch when it fits, and each batch is far below gRPC's 2 GiB.
DEFAULT_BATCH_BYTES = 16 * 2**20
#: Most bytes one payload may hold: shape products are checked in float64 against it,
#: with room to spare below int64's offsets.
MAX_PAYLOAD_BYTES = 2**62

#: Bound on the remembered Arrow schemas (cleared when reached).
_MAX_SCHEMAS = 256


#: Media payloads: per row a list of segments, each an index into a per-batch dictionary of
#: distinct payloads, so a segment shared by several rows (the image of a prompt group)
#: travels and is stored once.
MEDIA_TYPE = pa.large_list(pa.dictionary(pa.int32(), pa.large_binary()))


def payload_type(f: Field) -> pa.DataType:
    """The Arrow type of a field's payload column."""
    if f.role == "scalar":
        return f.dt.arrow
    if f.role == "media":
        return MEDIA_TYPE
    return pa.large_binary()


def shape_type(f: Field) -> pa.DataType:
    """The Arrow type of a field's shape column (token, tensor and media fields)."""
    if f.role == "media":
        return pa.large_list(pa.list_(pa.int64()))
    return pa.list_(pa.int64())


def arrow_field(f: Field) -> pa.Field:
    """A field's payload column, with its dtype, role and codec in the metadata."""
    meta = {FIELD_DTYPE: f.dtype.encode(), FIELD_ROLE: f.role.encode()}
    if f.codec is not RAW:
        meta[FIELD_CODEC] = json.dumps(f.codec.to_dict(), sort_keys=True).encode()
    return pa.field(f.name, payload_type(f), nullable=True, metadata=meta)


def arrow_schema(schema: Schema, names: list[str] | None = None) -> pa.Schema:
    """The Arrow schema of a batch carrying ``names`` (all fields when None), schema order."""
    wanted = frozenset(schema[n].name for n in names) if names is not None else None
    # Schemas are frozen and named by their fingerprint: each field subset is built once.
    key = (schema.fingerprint, wanted)
    arrow = _ARROW_SCHEMAS.get(key)
    if arrow is None:
        if len(_ARROW_SCHEMAS) >= _MAX_SCHEMAS:
            _ARROW_SCHEMAS.clear()
        arrow = _ARROW_SCHEMAS[key] = _arrow_schema(schema, wanted)
    return arrow


#: A bounded memo of :func:`_arrow_schema` (schemas are frozen).
_ARROW_SCHEMAS: dict[tuple[str, frozenset[str] | None], pa.Schema] = {}


def _arrow_schema(schema: Schema, wanted: frozenset[str] | None) -> pa.Schema:
    cols = [pa.field(KEY, pa.utf8(), nullable=False), pa.field(TAGS, pa.binary())]
    for f in schema.fields:
        if wanted is not None and f.name not in wanted:
            continue
        cols.append(arrow_field(f))
        if f.role != "scalar":
            cols.append(pa.field(f.name + SHAPE_SUFFIX, shape_type(f)))
    meta = {
        META_WIRE: WIRE_VERSION.encode(),
        META_SCHEMA: schema.canonical_json.encode(),
        META_FINGERPRINT: schema.fingerprint.encode(),
    }
    return pa.schema(cols, metadata=meta)


def schema_of(arrow: pa.Schema) -> Schema:
    """The flightq schema a record batch carries in its metadata.

    Raises
    ------
    DecodeError
        If the metadata is missing, of another wire version, or its fingerprint does not
        match the declarations it carries.
    """
    meta = arrow.metadata or {}
    if META_SCHEMA not in meta:
        raise DecodeError("not a flightq record batch: no 'flightq.schema' in the Arrow metadata")
    wire = meta.get(META_WIRE, b"").decode(errors="replace")
    if wire != WIRE_VERSION:
        raise DecodeError(
            f"wire version {wire!r} is not supported (this flightq reads {WIRE_VERSION!r})",
            expected=WIRE_VERSION,
            actual=wire,
        )
    text, fingerprint = meta[META_SCHEMA], meta.get(META_FINGERPRINT, b"")
    if len(text) > _MAX_CACHED_SCHEMA:
        return _parse_schema.__wrapped__(text, fingerprint)
    return _parse_schema(text, fingerprint)


#: Longest schema text whose parse is remembered: 64 of them stay a few MB.
_MAX_CACHED_SCHEMA = 32 * 1024


@functools.lru_cache(maxsize=64)
def _parse_schema(text: bytes, fingerprint: bytes) -> Schema:
    # Every batch of a stream carries the same metadata: parse it once (schemas are frozen).
    try:
        schema = Schema.from_json(text)
    except SchemaError as e:
        raise DecodeError(f"the schema in the batch metadata is invalid: {e}") from e
    fp = fingerprint.decode(errors="replace")
    if fp != schema.fingerprint:
        raise DecodeError(
            f"schema {schema.ref}: metadata fingerprint {fp!r} does not match its "
            f"declarations ({schema.fingerprint})",
            expected=schema.fingerprint,
            actual=fp,
        )
    return schema


def binary_offsets(arr: pa.Array) -> np.ndarray:
    """The int64 offsets (length + 1) of a large_binary array, honouring its slice offset."""
    buf = arr.buffers()[1]
    n = len(arr) + 1
    if buf is None:
        return np.zeros(n, dtype=np.int64)
    return np.frombuffer(buf, dtype=np.int64, count=n, offset=arr.offset * 8)


def first_use_bytes(indices: np.ndarray, entry_bytes: np.ndarray) -> np.ndarray:
    """Per media segment (dictionary ``indices`` in row order), its entry's bytes where the
    entry is used first, 0 where it repeats: a shared entry counts once, on its first row."""
    _, first = np.unique(indices, return_index=True)
    out = np.zeros(len(indices), dtype=np.int64)
    out[first] = entry_bytes[indices[first]]
    return out


def media_row_bytes(col: pa.Array) -> np.ndarray:
    """Per row of a media column (sliced or not), the bytes of its segments' entries, a
    shared entry counted on the first row that uses it (:func:`first_use_bytes`)."""
    outer = col.offsets.to_numpy()
    segs = col.values.slice(int(outer[0]), int(outer[-1] - outer[0]))
    idx = segs.indices.to_numpy(zero_copy_only=False)
    return row_sums(first_use_bytes(idx, np.diff(binary_offsets(segs.dictionary))), outer)


def row_sums(per_segment: np.ndarray, outer: np.ndarray) -> np.ndarray:
    """Per row, the sum of its segments' values; ``outer`` (n + 1) are the rows' segment
    offsets, absolute or not (``per_segment`` starts at the first row's first segment)."""
    sums = np.zeros(len(per_segment) + 1, dtype=np.int64)
    np.cumsum(per_segment, out=sums[1:])
    rel = outer - outer[0]
    return sums[rel[1:]] - sums[rel[:-1]]


#: Items per slice of a bulk conversion (:func:`pylist`, :func:`in_slices`).
SLICE = 1 << 13


def pylist(array: pa.Array | np.ndarray) -> list[Any]:
    """An Arrow or numpy array as a Python list, converted a slice at a time.

    One conversion of a million items holds the GIL for a few hundred milliseconds, which
    every other thread of a server waits out; between slices they run.
    """
    n = len(array)
    if n <= SLICE:
        return array.to_pylist() if isinstance(array, pa.Array) else array.tolist()
    out: list[Any] = []
    for i in range(0, n, SLICE):
        part = array[i : i + SLICE]
        out.extend(part.to_pylist() if isinstance(part, pa.Array) else part.tolist())
    return out


def mapped(fn: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
    """``list(map(fn, *columns))`` over equally long sequences, a slice at a time: one
    call over a million items keeps the GIL for tens of milliseconds even where ``fn`` is
    a C function (a dict lookup, a tuple), and every other thread of a server waits."""
    n = len(columns[0]) if columns else 0
    if n <= SLICE:
        return list(map(fn, *columns))
    out: list[Any] = []
    for i in range(0, n, SLICE):
        out.extend(map(fn, *(c[i : i + SLICE] for c in columns)))
    return out


def in_slices(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    """``items`` a slice at a time, for bulk set and dict updates that let other threads
    run between slices (see :func:`pylist`)."""
    for i in range(0, len(items), SLICE):
        yield items[i : i + SLICE]


class Packed(tuple):
    """A column's rows end to end, and where each row starts: ``(values, offsets)``.

    Unpacks as a pair: ``flat, cu_seqlens = batch.column("input_ids").packed()``. A put
    takes one as a token or tensor column (``{"input_ids": flightq.Packed(flat,
    cu_seqlens)}``) and sends ``values`` as it lies, checked a column at a time.

    Attributes
    ----------
    values:
        Every row's elements (a token field's tokens, a media field's segments) along
        dim 0, in row order.
    offsets:
        ``N + 1`` offsets into ``values`` along dim 0: row ``i`` is
        ``values[offsets[i]:offsets[i + 1]]``. From :meth:`TensorColumn.packed`, int32
        (``cu_seqlens`` as flash-attention's varlen kernels take them); from
        :meth:`MediaColumn.cat`, int64.
    max_len:
        The longest row along dim 0 (flash-attention's ``max_seqlen``).
    copied:
        Whether ``values`` had to be copied (rows from several record batches, shared
        media segments repeated per row, a compressed payload decoded); ``False`` means
        ``values`` is a view of the received buffers.
    """

    values: Any
    offsets: Any
    max_len: int
    copied: bool

    def __new__(
        cls, values: Any, offsets: Any, max_len: int | None = None, copied: bool = False
    ) -> Packed:
        self = super().__new__(cls, (values, offsets))
        self.values = values
        self.offsets = offsets
        if max_len is None:
            max_len = _longest(offsets)
        self.max_len = max_len
        self.copied = copied
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.values, self.offsets, self.max_len, self.copied))


def _longest(offsets: Any) -> int:
    """The longest row ``offsets`` bound (0 where they are not integers: a put that takes
    them says what is wrong, naming the column)."""
    o = int_offsets(offsets)
    if o is None or o.ndim != 1 or len(o) < 2:
        return 0
    return max(int(np.diff(o).max()), 0)


def int_offsets(offsets: Any) -> np.ndarray | None:
    """``offsets`` (numpy, torch, a sequence) as an int64 numpy array; None if they are not
    integers that fit."""
    if type(offsets).__module__.startswith("torch"):
        try:  # torch has no numpy view of bf16 or of a tensor that requires grad: detach
            offsets = offsets.detach().cpu().numpy()
        except (TypeError, RuntimeError):
            return None
    try:
        o = np.asarray(offsets)
    except (TypeError, ValueError):
        return None
    if o.dtype.kind not in "iu":
        return None
    if o.dtype.kind == "u" and o.size and o.max() > np.iinfo(np.int64).max:
        return None
    return o.astype(np.int64, copy=False)
