"""Check a record batch against its schema from Arrow offsets and shape columns alone.

:func:`validate` never rebuilds a tensor, so the server can use it on every put: each
payload's byte length must equal the product of its shape and the field's item size
(overflow-safe), shapes must keep the declared ranks and fixed dims, token fields of a
row must agree on the sequence length, media segments must point inside their batch's
dictionary. A compressed payload's frame header must declare the byte length its shape
needs, and the payload must then decode to exactly that (decoded once, through a bounded
buffer, and discarded). What an Arrow schema settles (column names, types, field metadata, the
flightq schema it carries) is checked once per distinct schema and remembered.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from .codecs import RAW, codec_from_dict, decode_frames
from .errors import (
    DecodeError,
    EncodeError,
    FlightqError,
    SchemaError,
    SchemaMismatchError,
    ShapeError,
    UndeclaredFieldError,
)
from .layout import (
    FIELD_CODEC,
    FIELD_DTYPE,
    KEY,
    MAX_PAYLOAD_BYTES,
    META_CLAIM,
    META_FINGERPRINT,
    SHAPE_SUFFIX,
    TAGS,
    binary_offsets,
    first_use_bytes,
    in_slices,
    payload_type,
    pylist,
    row_sums,
    schema_of,
    shape_type,
)
from .schema import Field, Schema, diff_schemas

__all__ = ["Checked", "validate", "shape_products"]

_LIMIT = float(MAX_PAYLOAD_BYTES)
#: Bounds on the remembered layouts: how many, and the bytes of metadata their Arrow
#: schemas carry (the least recently used go first).
_MAX_PLANS = 256
#: Rows up to which a column's checks run over Python lists (:func:`_few_one_dim_rows`).
_FEW = 8
_MAX_PLAN_BYTES = 2 * 2**20


@dataclass(frozen=True)
class Checked:
    """What :func:`validate` learned about a batch.

    Attributes
    ----------
    schema:
        The schema the batch carries (or was checked against).
    keys:
        Row keys, in order.
    fields:
        Names of the fields present, in schema order.
    seq_lens:
        Per row, the sequence length shared by its token fields (-1 where it has none).
    nbytes:
        Per row, payload bytes (as sent, compressed where a codec applies).
    flat:
        Per token or tensor column whose every row is present and 1-D with raw payloads
        (the common case, checked in a few array operations): its rows' dims and its
        payloads' int64 byte offsets (N + 1), so a decoder need not derive them again.
        Columns not in it were checked the long way.
    """

    schema: Schema
    keys: list[str]
    fields: list[str]
    seq_lens: np.ndarray
    nbytes: np.ndarray
    flat: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def shape_products(
    offsets: np.ndarray,
    values: np.ndarray,
    itemsize: int,
    where: str,
    at: Callable[[int], str] | None = None,
    *,
    field: str | None = None,
    key: Callable[[int], str] | None = None,
) -> np.ndarray:
    """Byte length of each shape in a flattened shape list, overflow-safe.

    ``offsets`` (n+1) delimit each shape's dims in ``values``. Returns int64 byte lengths.
    ``at(i)`` names shape ``i`` in error messages; ``key(i)`` is the row key of shape
    ``i``, named in the message (where ``at`` is not given) and carried by the error with
    ``field``.

    Raises
    ------
    ShapeError
        On a negative dim or a byte length that does not fit in int64.
    """
    n = len(offsets) - 1
    out = np.full(n, itemsize, dtype=np.int64)
    if n == 0:
        return out
    lo, hi = int(offsets[0]), int(offsets[-1])
    v = values[lo:hi]
    if v.size == 0:
        return out

    def shape(i: int) -> tuple[int, ...]:
        return tuple(int(d) for d in values[offsets[i] : offsets[i + 1]])

    def name(i: int) -> str:
        if at is not None:
            return at(i)
        return _row(key(i)) if key is not None else f" (shape {i})"

    def fault(i: int) -> dict[str, Any]:
        return {
            "field": field,
            "key": key(i) if key is not None else None,
            "actual": list(shape(i)),
        }

    if v.min() < 0:
        i = int(np.searchsorted(offsets[1:], lo + int(np.argmax(v < 0)), side="right"))
        raise ShapeError(f"{where}expected dims >= 0, got shape {shape(i)}{name(i)}", **fault(i))
    ranks = offsets[1:] - offsets[:-1]
    r = int(ranks[0])
    if r and (ranks == r).all() and float(v.max()) ** r * itemsize < _LIMIT:
        # Every shape of one rank, products far from overflow: one reduction.
        return v.reshape(n, r).prod(axis=1) * itemsize if r > 1 else v * itemsize
    nz = ranks > 0
    starts = offsets[:-1][nz] - lo
    fprod = np.multiply.reduceat(v.astype(np.float64), starts) * itemsize
    if fprod.max(initial=0.0) >= _LIMIT:
        i = int(np.nonzero(nz)[0][int(np.argmax(fprod >= _LIMIT))])
        raise ShapeError(
            f"{where}shape {shape(i)} needs {math.prod(shape(i)) * itemsize} bytes, more than "
            f"a payload may hold (2**{MAX_PAYLOAD_BYTES.bit_length() - 1}){name(i)}",
            **fault(i),
        )
    out[nz] = np.multiply.reduceat(v, starts) * itemsize
    return out


def _lengths(offsets: np.ndarray) -> np.ndarray:
    return offsets[1:] - offsets[:-1]


def _np(arr: pa.Array) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False)


def _row(key: str) -> str:
    """How a message names a row."""
    return f" (row key {key!r})"


def _declared(f: Field) -> list[int | None] | None:
    """A field's declared shape as plain data (None for a free dim)."""
    return None if f.shape is None else list(f.shape)


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return _np(arr.is_valid())


def _shape_arrays(shapes: pa.Array, f: Field, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and dims of a ``list<int64>`` array (sliced or not)."""
    if shapes.values.null_count:
        raise ShapeError(f"{where}a shape has a null dim", field=f.name)
    return (
        _np(shapes.offsets).astype(np.int64, copy=False),
        _np(shapes.values).astype(np.int64, copy=False),
    )


def _check_fixed(
    f: Field,
    offsets: np.ndarray,
    values: np.ndarray,
    valid: np.ndarray | None,
    where: str,
    key: Callable[[int], str],
) -> None:
    """Ranks and fixed dims of the valid rows (all when ``valid`` is None) against the
    declaration (vectorised); ``key(i)`` is the row key of shape ``i``."""
    if f.shape is None:
        return
    ranks = offsets[1:] - offsets[:-1]
    rank = len(f.shape)
    wrong = ranks != rank if valid is None else valid & (ranks != rank)
    if wrong.any():
        i = int(wrong.argmax())
        got = tuple(int(x) for x in values[offsets[i] : offsets[i + 1]])
        raise ShapeError(
            f"{where}expected rank {rank} {_fmt(f)}, got shape {got}{_row(key(i))}",
            field=f.name,
            key=key(i),
            expected=_declared(f),
            actual=list(got),
        )
    if all(d is None for d in f.shape):
        return
    if rank == 0 or offsets[-1] == offsets[0]:
        return
    dims = values[offsets[0] : offsets[-1]].reshape(-1, rank)  # the valid rows' shapes
    for axis, want in enumerate(f.shape):
        if want is None:
            continue
        wrong = dims[:, axis] != want
        if wrong.any():
            k = int(wrong.argmax())
            row = k if valid is None else int(valid.nonzero()[0][k])
            got = tuple(int(x) for x in dims[k])
            raise ShapeError(
                f"{where}expected shape {_fmt(f)}, got {got}{_row(key(row))}",
                field=f.name,
                key=key(row),
                expected=_declared(f),
                actual=list(got),
            )


def _fmt(f: Field) -> str:
    assert f.shape is not None
    return "[" + ", ".join("?" if d is None else str(d) for d in f.shape) + "]"


def _payload_lengths(
    f: Field, payload: pa.Array, valid: np.ndarray, where: str, key: Callable[[int], str]
) -> np.ndarray:
    """Decoded byte length of each payload (raw: from offsets; zstd: from frame headers);
    ``key(i)`` names payload ``i``'s row."""
    offs = binary_offsets(payload)
    lengths = np.diff(offs)
    if f.codec is RAW:
        return lengths
    out = np.zeros(len(payload), dtype=np.int64)
    data = payload.buffers()[2]
    for i in np.nonzero(valid)[0]:
        size = f.codec.decoded_size(memoryview(data)[offs[i] : offs[i + 1]]) if data else None
        if size is None:
            raise ShapeError(
                f"{where}{f.codec.id} payload without a readable size{_row(key(int(i)))}",
                field=f.name,
                key=key(int(i)),
            )
        out[i] = size
    return out


@dataclass(frozen=True)
class _Column:
    """A field present in a batch layout: its payload and shape column indices."""

    f: Field
    payload: int
    shape: int  # -1 for a scalar field
    where: str


@dataclass(frozen=True)
class _Plan:
    """What the Arrow schema of a batch settles, checked once per distinct schema."""

    arrow: pa.Schema
    schema: Schema
    present: tuple[str, ...]
    columns: tuple[_Column, ...]


#: Plans by schema fingerprint; each list holds one plan per distinct Arrow schema (field
#: subsets). Every batch of a stream, and every put of a partition, carries the same one.
#: A bounded memo of a pure function: it changes no result, only how often one is computed.
_PLANS: dict[bytes, list[_Plan]] = {}
#: The plans held, and the metadata bytes of their schemas (bounded by the caps above).
_HELD = {"plans": 0, "bytes": 0}
_PLANS_LOCK = threading.Lock()


def _meta_bytes(arrow: pa.Schema) -> int:
    total = sum(len(k) + len(v) for k, v in (arrow.metadata or {}).items())
    return total + sum(len(k) + len(v) for f in arrow for k, v in (f.metadata or {}).items())


def _plan(arrow: pa.Schema) -> _Plan:
    """The checked layout of ``arrow`` (cached; Arrow schemas compare in C++, metadata too).

    A claim's answer carries its grant (:data:`~flightq.layout.META_CLAIM`) in its
    schema's metadata, different for every claim and no part of the layout: it is left out,
    so that every claim of a partition finds one plan (each claim missing the memo cost a
    W4 claim 5 ms: a new plan, and a full memo searched and trimmed).
    """
    meta = arrow.metadata or {}
    if META_CLAIM in meta:
        arrow = arrow.with_metadata({k: v for k, v in meta.items() if k != META_CLAIM})
    fp = meta.get(META_FINGERPRINT, b"")
    with _PLANS_LOCK:
        bucket = _PLANS.pop(fp, None)
        if bucket is not None:
            _PLANS[fp] = bucket  # the most recently used last
            for p in bucket:
                if p.arrow.equals(arrow, check_metadata=True):
                    return p
    p = _make_plan(arrow)
    with _PLANS_LOCK:
        _PLANS.setdefault(fp, []).append(p)
        _HELD["plans"] += 1
        _HELD["bytes"] += _meta_bytes(arrow)
        while _HELD["plans"] > _MAX_PLANS or _HELD["bytes"] > _MAX_PLAN_BYTES:
            oldest = next(iter(_PLANS))
            gone = _PLANS[oldest].pop(0)
            if not _PLANS[oldest]:
                del _PLANS[oldest]
            _HELD["plans"] -= 1
            _HELD["bytes"] -= _meta_bytes(gone.arrow)
    return p


def _make_plan(arrow: pa.Schema) -> _Plan:
    """Check an Arrow schema against the flightq schema its metadata carries."""
    schema = schema_of(arrow)
    try:
        names = arrow.names
    except UnicodeDecodeError as e:
        raise DecodeError(f"malformed record batch: a column name is not UTF-8 ({e})") from e
    if names[:2] != [KEY, TAGS]:
        raise DecodeError(f"a flightq batch starts with columns {KEY!r}, {TAGS!r}; got {names[:2]}")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise DecodeError(
            f"malformed record batch: column {dup!r} appears more than once", field=dup
        )
    if arrow.field(0).type != pa.utf8():
        raise DecodeError(
            f"column {KEY!r} must be non-null utf8, got {arrow.field(0).type}",
            field=KEY,
            expected=str(pa.utf8()),
            actual=str(arrow.field(0).type),
        )
    if arrow.field(1).type != pa.binary():
        raise DecodeError(
            f"column {TAGS!r} must be binary (msgpack), got {arrow.field(1).type}",
            field=TAGS,
            expected=str(pa.binary()),
            actual=str(arrow.field(1).type),
        )
    rest = names[2:]
    shape_cols = {c for c in rest if c.endswith(SHAPE_SUFFIX)}
    present: list[str] = []
    columns: list[_Column] = []
    for name in rest:
        if name in shape_cols:
            base = name[: -len(SHAPE_SUFFIX)]
            if base not in names:
                raise DecodeError(
                    f"shape column {name!r} has no payload column {base!r}", field=base
                )
            if base in schema and schema[base].role == "scalar":
                raise DecodeError(
                    f"shape column {name!r}: scalar field {base!r} has no shape", field=base
                )
            continue
        if name not in schema:
            raise UndeclaredFieldError(
                f"column {name!r} is not declared by schema {schema.ref}; declared: "
                f"{', '.join(f.name for f in schema.fields)}",
                field=name,
            )
        f = schema[name]
        where = f"column {name!r}: "
        i = arrow.get_field_index(name)
        afield = arrow.field(i)
        meta = afield.metadata or {}
        if afield.type != payload_type(f):
            raise DecodeError(
                f"{where}expected Arrow type {payload_type(f)} for role {f.role}, "
                f"got {afield.type}",
                field=name,
                expected=str(payload_type(f)),
                actual=str(afield.type),
            )
        carried = meta.get(FIELD_DTYPE, f.dtype.encode()).decode(errors="replace")
        if carried != f.dtype:
            raise DecodeError(
                f"{where}field metadata says dtype {carried!r}, schema {schema.ref} declares "
                f"{f.dtype!r}",
                field=name,
                expected=f.dtype,
                actual=carried,
            )
        codec_meta = meta.get(FIELD_CODEC)
        if codec_meta is not None:
            try:
                got_codec = codec_from_dict(json.loads(codec_meta))
            except (ValueError, SchemaError) as e:
                raise DecodeError(f"{where}bad codec metadata: {e}", field=name) from e
            if got_codec != f.codec:
                raise DecodeError(
                    f"{where}codec {got_codec.to_dict()} differs from the schema's "
                    f"{f.codec.to_dict()}",
                    field=name,
                )
        present.append(name)
        if f.role == "scalar":
            columns.append(_Column(f, i, -1, where))
            continue
        sname = name + SHAPE_SUFFIX
        if sname not in shape_cols:
            raise ShapeError(
                f"{where}has no shape column {sname!r}; tensors travel with their shapes",
                field=name,
            )
        j = arrow.get_field_index(sname)
        if arrow.field(j).type != shape_type(f):
            raise DecodeError(
                f"column {sname!r}: expected Arrow type {shape_type(f)}, got {arrow.field(j).type}",
                field=name,
                expected=str(shape_type(f)),
                actual=str(arrow.field(j).type),
            )
        columns.append(_Column(f, i, j, where))
    return _Plan(arrow, schema, tuple(present), tuple(columns))


def validate(
    batch: pa.RecordBatch,
    schema: Schema | None = None,
    *,
    duplicate_error: type[FlightqError] = EncodeError,
    decoded: Collection[str] = (),
) -> Checked:
    """Check a record batch against its schema from Arrow offsets and shape columns alone.

    Parameters
    ----------
    batch:
        A record batch as built by :func:`flightq.encode` or any Arrow writer.
    schema:
        The schema to check against; when given, the batch's own metadata must carry the
        same fingerprint. When None, the batch's metadata decides.
    duplicate_error:
        The class that refuses a row key given twice: the writer's fault, so
        :class:`EncodeError` where the batch is a put being checked (the class the
        writer's own :func:`flightq.encode` raises), :class:`DecodeError` where it is a
        batch being decoded.
    decoded:
        Fields with a codec whose frames the caller decodes right after, held to the
        same sizes (the server's check of object fields,
        :func:`flightq.objects.check_columns`): their frame headers are held to their
        shapes here, and the frames are not decoded twice.

    Returns
    -------
    Checked

    Raises
    ------
    DecodeError, ShapeError, UndeclaredFieldError, SchemaMismatchError
        Naming the column, the row key, what was expected and what arrived, also as the
        error's attributes (``field``, ``key``, ``expected``, ``actual``).
    EncodeError
        On a duplicate row key (or ``duplicate_error``).
    """
    plan = _plan(batch.schema)
    carried = plan.schema
    if schema is not None and carried.fingerprint != schema.fingerprint:
        raise SchemaMismatchError(
            f"batch carries schema {carried.ref} ({carried.fingerprint}), expected "
            f"{schema.ref} ({schema.fingerprint}): " + "; ".join(diff_schemas(schema, carried)),
            field=_one_field(schema, carried),
            expected=schema.fingerprint,
            actual=carried.fingerprint,
        )
    try:
        batch.validate(full=True)
    except pa.ArrowException as e:
        raise DecodeError(f"malformed record batch: {e}") from e
    keycol = batch.column(0)
    if keycol.null_count:
        raise DecodeError(f"column {KEY!r} must be non-null utf8, got nulls", field=KEY)
    keys: list[str] = pylist(keycol)
    unique: set[str] = set()
    for part in in_slices(keys):
        unique.update(part)
    if len(unique) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise duplicate_error(f"duplicate row key {dup!r} within one batch", field=KEY, key=dup)

    def key(i: int) -> str:
        return keys[i]

    n = batch.num_rows
    few = _few_rows(plan, batch) if n <= _FEW else None
    if few is not None:
        return Checked(carried, keys, list(plan.present), *few)
    # Made by the first column that has them: on an answer just received each array
    # operation costs a few times more than on warm data, and the first column's arrays
    # serve as they are.
    seq: np.ndarray | None = None
    nbytes: np.ndarray | None = None
    flat: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for c in plan.columns:
        if c.shape < 0:
            continue
        col, shapes = batch.column(c.payload), batch.column(c.shape)
        nulls = bool(col.null_count or shapes.null_count)
        valid = None
        if nulls:
            valid = _valid(col)
            differ = valid != _valid(shapes)
            if differ.any():
                i = int(np.nonzero(differ)[0][0])
                raise ShapeError(
                    f"{c.where}payload and shape disagree on whether the row has the "
                    f"field{_row(key(i))}",
                    field=c.f.name,
                    key=key(i),
                )
        frames = c.f.name not in decoded
        if c.f.role == "media":
            sent = _check_media(c.f, c.where, col, shapes, valid, key, frames)
        else:
            seq, sent, layout = _check_tensor(c.f, c.where, col, shapes, valid, seq, key, frames)
            if layout is not None:
                flat[c.f.name] = layout
        nbytes = sent if nbytes is None else nbytes + sent
    return Checked(
        carried,
        keys,
        list(plan.present),
        np.full(n, -1, dtype=np.int64) if seq is None else seq,
        np.zeros(n, dtype=np.int64) if nbytes is None else nbytes,
        flat,
    )


def _one_field(expected: Schema, actual: Schema) -> str | None:
    """The field two schemas disagree on, where they disagree on one alone."""
    names = [f.name for f in expected.fields if f.name not in actual or actual[f.name] != f]
    names += [f.name for f in actual.fields if f.name not in expected]
    return names[0] if len(names) == 1 else None


def _check_media(
    f: Field,
    where: str,
    col: pa.Array,
    shapes: pa.Array,
    valid: np.ndarray | None,
    key: Callable[[int], str],
    frames: bool = True,
) -> np.ndarray:
    """Check a media column's segments against their shapes; per row, its bytes (a shared
    entry counted on its first use). ``key(i)`` is row ``i``'s key; ``frames`` False: a
    codec's frames held to their segments' shapes by their headers alone."""
    outer_p = _np(col.offsets)  # int64: large_list
    outer_s = _np(shapes.offsets)
    counts_p = outer_p[1:] - outer_p[:-1]
    differ = counts_p != outer_s[1:] - outer_s[:-1]
    wrong = differ if valid is None else differ & valid
    if wrong.any():
        i = int(wrong.argmax())
        got = int(outer_s[i + 1] - outer_s[i])
        raise ShapeError(
            f"{where}{counts_p[i]} segments but {got} shapes{_row(key(i))}",
            field=f.name,
            key=key(i),
            expected=int(counts_p[i]),
            actual=got,
        )
    if valid is not None and np.any(~valid & ((counts_p != 0) | differ)):
        raise DecodeError(f"{where}a null row has segments", field=f.name)
    lo = int(outer_p[0])
    segs = col.values.slice(lo, int(outer_p[-1]) - lo)
    seg_shapes = shapes.values.slice(int(outer_s[0]), int(outer_s[-1] - outer_s[0]))
    if segs.indices.null_count or seg_shapes.null_count:
        raise DecodeError(f"{where}a media segment or its shape is null", field=f.name)
    entries = segs.dictionary
    if entries.null_count:
        raise DecodeError(f"{where}a media dictionary entry is null", field=f.name)
    idx = _np(segs.indices)
    if idx.size and (idx.min() < 0 or idx.max() >= len(entries)):
        raise DecodeError(f"{where}a media segment points outside its dictionary", field=f.name)

    def seg_key(j: int) -> str:
        # The key of segment j's row (computed on failure only).
        return key(int(np.searchsorted(outer_p[1:], lo + j, side="right")))

    so, sv = _shape_arrays(seg_shapes, f, where)
    _check_fixed(f, so, sv, None, where, seg_key)
    want = shape_products(so, sv, f.dt.itemsize, where, field=f.name, key=seg_key)
    entry_bytes = np.diff(binary_offsets(entries))
    if f.codec is RAW:
        if f.dt.itemsize > 1 and np.any(entry_bytes % f.dt.itemsize):
            raise ShapeError(
                f"{where}a media entry is not a whole number of {f.dtype}", field=f.name
            )
        got = entry_bytes[idx]
    else:
        used = np.zeros(len(entries), dtype=bool)
        used[idx] = True
        # An entry's row: that of the first segment using it (found on failure only).
        got = _payload_lengths(
            f, entries, used, where, lambda e: seg_key(int(np.argmax(idx == e)))
        )[idx]
    if not np.array_equal(want, got):
        j = int((want != got).argmax())
        shp = tuple(int(x) for x in sv[so[j] : so[j + 1]])
        raise ShapeError(
            f"{where}segment of shape {shp} needs {want[j]} bytes of {f.dtype}, "
            f"payload has {got[j]}{_row(seg_key(j))}",
            field=f.name,
            key=seg_key(j),
            expected=int(want[j]),
            actual=int(got[j]),
        )
    if f.codec is not RAW and idx.size and frames:
        # Each entry a segment uses, once: its first segment's size (all agree, as above).
        used_entries, first_seg = np.unique(idx, return_index=True)
        sizes = np.zeros(len(entries), dtype=np.int64)
        sizes[used_entries] = want[first_seg]
        first = np.zeros(len(entries), dtype=np.int64)
        first[used_entries] = first_seg
        _check_frames(f, where, entries, used_entries, sizes, lambda e: seg_key(int(first[e])))
    return row_sums(first_use_bytes(idx, entry_bytes), outer_p)


def _check_tensor(
    f: Field,
    where: str,
    col: pa.Array,
    shapes: pa.Array,
    valid: np.ndarray | None,
    seq: np.ndarray | None,
    key: Callable[[int], str],
    frames: bool = True,
) -> tuple[np.ndarray | None, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Check a token or tensor column's payloads against their shapes (``valid`` None: no
    row is null; ``seq`` None: no token column seen yet; ``key(i)`` is row ``i``'s key;
    ``frames`` False: a codec's frames held to their shapes by their headers alone).
    Returns the rows' sequence lengths so far, the bytes sent per row, and where every row
    is present and 1-D with a raw payload, the rows' dims and the payloads' byte offsets
    (:attr:`Checked.flat`)."""
    if valid is None and f.codec is RAW and len(col) <= _FEW:
        few = _few_one_dim_rows(f, shapes, col, seq)
        if few is not None:
            return (*few, None)
    so, sv = _shape_arrays(shapes, f, where)
    if valid is None and f.codec is RAW:
        fast = _one_dim_rows(f, so, sv, col, seq)
        if fast is not None:
            return fast
    if seq is None:
        seq = np.full(len(col), -1, dtype=np.int64)
    if valid is not None and (~valid & (so[1:] != so[:-1])).any():
        raise DecodeError(f"{where}a null row has a shape", field=f.name)
    _check_fixed(f, so, sv, valid, where, key)
    if f.role == "token":
        ranks = so[1:] - so[:-1]
        short = ranks < 1 if valid is None else valid & (ranks < 1)
        if short.any():
            i = int(short.argmax())
            raise ShapeError(
                f"{where}a token tensor has rank >= 1 (its first dim is S){_row(key(i))}",
                field=f.name,
                key=key(i),
            )
        if valid is not None:
            first = np.full(len(seq), -1, dtype=np.int64)
            rows = valid.nonzero()[0]
            first[rows] = sv[so[rows]]
        else:
            first = sv[so[:-1]]
        clash = (first != seq) & (first >= 0) & (seq >= 0)
        if clash.any():
            i = int(clash.argmax())
            raise ShapeError(
                f"{where}sequence length {first[i]} differs from the row's other token "
                f"fields ({seq[i]}){_row(key(i))}",
                field=f.name,
                key=key(i),
                expected=int(seq[i]),
                actual=int(first[i]),
            )
        seq = np.where(first >= 0, first, seq)
    want = shape_products(so, sv, f.dt.itemsize, where, field=f.name, key=key)
    sent = _lengths(binary_offsets(col))
    got = sent if f.codec is RAW else _payload_lengths(f, col, _all(valid, len(sent)), where, key)
    wrong = want != got if valid is None else valid & (want != got)
    if wrong.any():
        i = int(wrong.argmax())
        shp = tuple(int(x) for x in sv[so[i] : so[i + 1]])
        raise ShapeError(
            f"{where}shape {shp} needs {want[i]} bytes of {f.dtype}, payload has {got[i]}"
            f"{_row(key(i))}",
            field=f.name,
            key=key(i),
            expected=int(want[i]),
            actual=int(got[i]),
        )
    if f.codec is not RAW and frames:
        _check_frames(f, where, col, np.nonzero(_all(valid, len(sent)))[0], want, key)
    return seq, sent if valid is None else np.where(valid, sent, 0), None


def _check_frames(
    f: Field,
    where: str,
    payload: pa.Array,
    cells: np.ndarray,
    want: np.ndarray,
    key: Callable[[int], str],
) -> None:
    """Decode each of ``cells`` once, bounded by ``want`` (its header's size, already
    checked against its shape), keeping nothing: it must come to exactly ``want`` bytes.

    Raises
    ------
    DecodeError
        Naming the column and the row key, with the declared size as ``expected``.
    """
    offs = binary_offsets(payload).tolist()
    data = payload.buffers()[2]
    mv = memoryview(data) if data is not None else memoryview(b"")
    at = cells.tolist()
    failed = decode_frames(f.codec, [mv[offs[i] : offs[i + 1]] for i in at], want[at].tolist())
    if failed is not None:
        i, why = at[failed[0]], failed[1]
        raise DecodeError(
            f"{where}{why}{_row(key(i))}",
            field=f.name,
            key=key(i),
            expected=why.expected,
            actual=why.actual,
        ) from why


def _one_dim_rows(
    f: Field, so: np.ndarray, sv: np.ndarray, col: pa.Array, seq: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray, tuple[np.ndarray, np.ndarray]] | None:
    """The common case of :func:`_check_tensor` in a few array operations: every row
    present with one dim (token fields, 1-D tensors), raw payloads. Returns what
    :func:`_check_tensor` returns when every check passes, None when any fails or does
    not apply (the full check then finds and names the fault)."""
    n = len(so) - 1
    if n == 0 or so[-1] - so[0] != n or (so[1:] - so[:-1]).min() != 1:
        return None  # some row has another rank (n dims over n rows, none empty)
    if f.shape is not None and len(f.shape) != 1:
        return None
    dims = sv[so[0] : so[-1]]
    if dims.view(np.uint64).max() >= _LIMIT // f.dt.itemsize:
        return None  # a negative dim, or one whose byte length could wrap around int64
    offs = binary_offsets(col)
    sent = _lengths(offs)
    if not np.array_equal(dims * f.dt.itemsize, sent):
        return None
    if f.shape is not None and f.shape[0] is not None and (dims != f.shape[0]).any():
        return None
    if f.role == "token":
        if seq is None or (seq[0] < 0 and (seq < 0).all()):
            return dims.copy(), sent, (dims, offs)  # the row's first token field sets S
        if not np.array_equal(dims, seq):
            return None
    return seq, sent, (dims, offs)


def _few_one_dim_rows(
    f: Field, shapes: pa.Array, col: pa.Array, seq: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray] | None:
    """:func:`_one_dim_rows` for a few rows, over Python lists: on a handful of values each
    numpy operation costs more than the loop it replaces. Same checks, same contract (a
    null dim, like any other fault, is left to the full check, which names it)."""
    got = _few_dims(f, shapes, col)
    if got is None:
        return None
    dims, sent = got
    out = np.array(sent, dtype=np.int64)
    if f.role == "token":
        known = None if seq is None else seq.tolist()
        if known is None or all(k < 0 for k in known):
            return np.array(dims, dtype=np.int64), out  # the first token field sets S
        if dims != known:
            return None
    return seq, out


def _few_dims(f: Field, shapes: pa.Array, col: pa.Array) -> tuple[list[int], list[int]] | None:
    """Each row's one dim and payload bytes, where every row of a raw token or tensor
    column has one dim that its payload's length matches (and the declaration allows);
    None where any does not."""
    if f.shape is not None and len(f.shape) != 1:
        return None
    itemsize = f.dt.itemsize
    limit = _LIMIT // itemsize
    want = None if f.shape is None else f.shape[0]
    offs = binary_offsets(col).tolist()
    dims: list[int] = []
    sent: list[int] = []
    for i, s in enumerate(shapes.to_pylist()):
        if s is None or len(s) != 1:
            return None
        d = s[0]
        if d is None or d < 0 or d >= limit or (want is not None and d != want):
            return None
        got = offs[i + 1] - offs[i]
        if d * itemsize != got:
            return None
        dims.append(d)
        sent.append(got)
    return dims, sent


def _few_rows(plan: _Plan, batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray] | None:
    """The sequence lengths and bytes per row :func:`validate`'s column loop finds, for a
    few rows whose every token and tensor column takes :func:`_few_dims` (no nulls, no
    media, raw payloads, one dim per row), over Python lists; None where any does not,
    and the column loop then runs (and names the fault)."""
    n = batch.num_rows
    seq: list[int] | None = None
    nbytes = [0] * n
    for c in plan.columns:
        if c.shape < 0:
            continue
        f = c.f
        if f.role == "media" or f.codec is not RAW:
            return None
        col, shapes = batch.column(c.payload), batch.column(c.shape)
        if col.null_count or shapes.null_count:
            return None
        got = _few_dims(f, shapes, col)
        if got is None:
            return None
        dims, sent = got
        if f.role == "token":
            if seq is None:
                seq = dims  # the first token field sets S
            elif dims != seq:
                return None
        nbytes = [a + b for a, b in zip(nbytes, sent, strict=True)]
    lens = np.full(n, -1, dtype=np.int64) if seq is None else np.array(seq, dtype=np.int64)
    return lens, np.array(nbytes, dtype=np.int64)


def _all(valid: np.ndarray | None, n: int) -> np.ndarray:
    return np.ones(n, dtype=bool) if valid is None else valid
