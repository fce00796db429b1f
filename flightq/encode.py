"""Encode columns into one self-describing record batch.

:func:`encode` checks every value against the schema before building anything: an
undeclared column, a wrong dtype, a shape that breaks the declaration, a ragged row whose
token fields disagree on the sequence length are refused with a typed error naming the
column and the row key (and carrying them as attributes). Nothing is cast, padded or
dropped. A media segment that is the same memory in several rows becomes one dictionary
entry. Where each payload column's bytes go is the caller's :class:`flightq.sink.Sink`;
cutting a put into batches of bounded size is :mod:`flightq.chunks`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

from .codecs import RAW, encode_frames
from .digest import BATCH_KEY, MediaRefs, digest_of, hint_of, pack_claims
from .dtypes import DTYPES, from_torch
from .errors import DTypeError, EncodeError, ShapeError, UndeclaredFieldError
from .layout import TAGS, arrow_schema
from .rows import PackedRows, columns_of
from .schema import Field, Schema
from .sink import COPY, Sink
from .tensor import Bulk, Encoded, MemoryIndex, bulk_to_bytes, is_torch, nbytes_for, to_bytes

__all__ = ["encode"]

#: Rows up to which a column's offsets are built in Python, and its shape column memoised.
_FEW = 8
#: Shape columns of a few rows, by their shapes: a bounded memo of a pure function (Arrow
#: arrays are immutable), shared by the threads of a process (a dict's get and set are
#: atomic). Its keys are a few ints each.
_SHAPE_MEMO: dict[tuple[Any, ...], pa.Array] = {}
_SHAPE_MEMO_SIZE = 1024

_CAST_HINT = {
    "torch": "cast with .to(torch.{want})",
    "numpy": "cast with .astype(numpy.{want})",
}


def encode(
    schema: Schema,
    columns: Mapping[str, Any],
    keys: Sequence[str],
    tags: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    zero_copy: bool = False,
    sink: Sink = COPY,
    media: MediaRefs | None = None,
) -> pa.RecordBatch:
    """Encode rows into one self-describing record batch.

    Parameters
    ----------
    schema:
        The schema every column is checked against.
    columns:
        Field name to per-row data. token/tensor: a sequence of N tensors (``None`` for a
        row without the field), a tensor whose first dim is the rows, a nested tensor
        (jagged), or a :class:`flightq.Packed` ``(values, offsets)`` (rows that lie end to
        end in one CPU tensor are checked a column at a time, :mod:`flightq.rows`).
        media: a sequence of N lists of tensors (an empty list is "no media", ``None`` is
        "field absent"), or a tensor / nested tensor of one segment per row.
        scalar: a 1-D tensor/array of N values or a sequence of N Python values (``None``
        allowed). Tensors are torch or numpy. A ``tensordict.TensorDict`` whose batch
        dim is the rows is taken entry by entry (:mod:`flightq.rows`).
    keys:
        N distinct row keys.
    tags:
        N msgpack-serialisable dicts (or ``None``), or None for no tags.
    zero_copy:
        Refuse tensors that would need a copy to normalise (non-contiguous, big-endian,
        not on the CPU) instead of copying them.
    sink:
        Where the payload bytes go (:mod:`flightq.sink`): copied into the batch now by
        default; a put's sender may leave the copies for later, or gather them elsewhere.
    media:
        Address media by content (:mod:`flightq.digest`): equal content becomes one
        entry (payloads whose hints agree are hashed to find out), and media whose hint
        ``media.known`` says the writer sent the partition before go as a reference (digest
        and hint, no payload). The claims ride in the batch's schema metadata
        (:data:`flightq.digest.BATCH_KEY`) to the put's stream, where there are any.
        None: every segment's payload, bare.

    Returns
    -------
    pyarrow.RecordBatch

    Raises
    ------
    UndeclaredFieldError, DTypeError, ShapeError, EncodeError
        Naming the column, the row key, what was expected and what arrived, in the message
        and as the attributes ``field``, ``key``, ``expected``, ``actual``.

    Examples
    --------
    >>> import numpy as np, flightq
    >>> s = flightq.SchemaRegistry.default().get("rollout_text@1")
    >>> rb = flightq.encode(s, {"input_ids": [np.arange(5)]}, keys=["g0_0"])
    >>> flightq.decode(rb, as_="numpy")["input_ids"][0].tolist()
    [0, 1, 2, 3, 4]
    """
    keys = list(keys)
    n = len(keys)
    columns = columns_of(columns, schema, keys)
    for k in keys if set(map(type, keys)) - {str} else ():
        if not isinstance(k, str):
            raise EncodeError(
                f"row keys are strings, got {type(k).__name__} {k!r}",
                expected="str",
                actual=type(k).__name__,
            )
    if len(set(keys)) != n:
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise EncodeError(f"duplicate row key {dup!r} within one put", key=dup)
    for name in columns:
        if name not in schema:
            raise UndeclaredFieldError(
                f"column {name!r} is not declared by schema {schema.ref}; declared: "
                f"{', '.join(f.name for f in schema.fields)}. Declare it in a new schema "
                "version; flightq never drops or registers columns on the fly",
                field=name,
            )
    seq = np.full(n, -1, dtype=np.int64)
    arrays: list[pa.Array] = [pa.array(keys, type=pa.utf8()), _encode_tags(tags, keys)]
    names: list[str] = []
    claims: dict[str, list[bytes]] = {}
    for f in schema.fields:
        if f.name not in columns:
            continue
        names.append(f.name)
        data = columns[f.name]
        if f.role == "scalar":
            arrays.append(_encode_scalar(f, data, keys))
        elif f.role == "media":
            try:
                arrays.extend(_encode_media(f, data, keys, zero_copy, sink, media, claims))
            except ShapeError as e:
                raise _with_grid_hint(e, f, columns, keys) from e
        else:
            arrays.extend(_encode_tensor(f, data, keys, zero_copy, seq, sink))
    arrow = arrow_schema(schema, names)
    if claims and media is not None:
        arrow = arrow.with_metadata({**arrow.metadata, BATCH_KEY: pack_claims(media.hash, claims)})
    batch = pa.RecordBatch.from_arrays(arrays, schema=arrow)
    sink.end_batch()
    return batch


def _with_grid_hint(
    e: ShapeError, f: Field, columns: Mapping[str, Any], keys: list[str]
) -> ShapeError:
    """``e``, saying so when a media column looks like an image processor's output: all
    images of the batch concatenated, their geometry in a ``*_grid_thw`` column."""
    grids = [g for g in columns if g.endswith("grid_thw") and g != f.name]
    if e.actual is None or e.expected != len(keys) or not grids:
        return e
    grid = grids[0]
    msg = (
        f"{e}: {f.name!r} looks like an image processor's output (all images of the batch "
        f"concatenated, {e.actual} patches) with their grids in {grid!r}; split it per row "
        f"with flightq.media.split_by_grid({f.name}, {grid}, images_per_row) and put the "
        "rows it returns"
    )
    return ShapeError(msg, field=f.name, expected=e.expected, actual=e.actual)


def _rows(f: Field, data: Any, keys: list[str]) -> list[Any]:
    if isinstance(data, (str, bytes, Mapping)) or not hasattr(data, "__len__"):
        raise EncodeError(
            f"column {f.name!r}: expected a sequence of {len(keys)} rows, got "
            f"{type(data).__name__}",
            field=f.name,
            actual=type(data).__name__,
        )
    if len(data) != len(keys):
        raise ShapeError(
            f"column {f.name!r}: {len(data)} rows for {len(keys)} keys",
            field=f.name,
            expected=len(keys),
            actual=len(data),
        )
    return list(data)


def _checked(f: Field, x: Any, key: str, zero_copy: bool, what: str = "") -> Encoded:
    where = f"column {f.name!r}{what} (row key {key!r}): "
    enc = to_bytes(x, zero_copy=zero_copy, where=where)
    if enc.dtype != f.dtype:
        lib = "torch" if is_torch(x) else "numpy"
        raise DTypeError(
            f"column {f.name!r}: expected dtype {f.dtype}, got {enc.dtype} (row key {key!r}); "
            f"{_CAST_HINT[lib].format(want=f.dtype)} or declare a new schema version",
            field=f.name,
            key=key,
            expected=f.dtype,
            actual=enc.dtype,
        )
    problem = f.check_shape(enc.shape)
    if problem:
        raise ShapeError(
            f"column {f.name!r}{what}: {problem} (row key {key!r})",
            field=f.name,
            key=key,
            expected=None if f.shape is None else list(f.shape),
            actual=list(enc.shape),
        )
    nbytes_for(enc.shape, f.dt.itemsize, where)
    return enc


def _binary(payloads: list[Any], valid: list[bool] | None, sink: Sink) -> pa.Array:
    """A large_binary array over the payloads, its data buffer given by ``sink``."""
    if len(payloads) <= _FEW:  # a few rows: Python's sums beat numpy's per-call cost
        sizes = [len(memoryview(p).cast("B")) for p in payloads]
        lengths = np.array(sizes, dtype=np.int64)
        offsets = np.array([0, *itertools.accumulate(sizes)], dtype=np.int64)
    else:
        lengths = np.fromiter(
            (len(memoryview(p).cast("B")) for p in payloads), np.int64, len(payloads)
        )
        offsets = _offsets(lengths)
    return _binary_array(offsets, sink.column(payloads, lengths, offsets), valid)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _binary_array(offsets: np.ndarray, data: pa.Buffer, valid: list[bool] | None) -> pa.Array:
    mask = None
    null_count = 0
    if valid is not None and not all(valid):
        mask = pa.array(valid, type=pa.bool_()).buffers()[1]
        null_count = valid.count(False)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(),
        len(offsets) - 1,
        [mask, pa.py_buffer(offsets), data],
        null_count,
    )


def _shapes(shapes: list[tuple[int, ...] | None], large: bool = False) -> pa.Array:
    """The shape column of ``shapes``; for a few rows, the same shapes give the same
    (immutable) array again: a 1-row put sends the shapes of its last put, mostly."""
    if len(shapes) > _FEW:
        return _shape_array(shapes, large)
    memo = (large, *shapes)
    hit = _SHAPE_MEMO.get(memo)
    if hit is None:
        hit = _shape_array(shapes, large)
        if len(_SHAPE_MEMO) >= _SHAPE_MEMO_SIZE:
            _SHAPE_MEMO.clear()
        _SHAPE_MEMO[memo] = hit
    return hit


def _shape_array(shapes: list[tuple[int, ...] | None], large: bool) -> pa.Array:
    valid = [s is not None for s in shapes]
    lens = np.fromiter((len(s) if s is not None else 0 for s in shapes), np.int64, len(shapes))
    offsets = np.zeros(len(shapes) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter((d for s in shapes if s is not None for d in s), np.int64)
    cls = pa.LargeListArray if large else pa.ListArray
    mask = None if all(valid) else pa.array([not v for v in valid], type=pa.bool_())
    return cls.from_arrays(pa.array(offsets), pa.array(flat, type=pa.int64()), mask=mask)


def _encode_tensor(
    f: Field, data: Any, keys: list[str], zero_copy: bool, seq: np.ndarray, sink: Sink
) -> list[pa.Array]:
    if type(data) is PackedRows and len(data) == len(keys):
        packed = _encode_packed(f, data, seq, sink)
        if packed is not None:
            return packed
    rows = _rows(f, data, keys)
    fast = (
        _encode_tensor_few(f, rows, seq, sink)
        if len(rows) <= _FEW
        else _encode_tensor_bulk(f, rows, seq, sink)
    )
    if fast is not None:
        return fast
    payloads: list[Any] = []
    shapes: list[tuple[int, ...] | None] = []
    for i, x in enumerate(rows):
        if x is None:
            payloads.append(b"")
            shapes.append(None)
            continue
        enc = _checked(f, x, keys[i], zero_copy)
        if f.role == "token":
            s, known = enc.shape[0], int(seq[i])
            if known >= 0 and known != s:
                raise ShapeError(
                    f"column {f.name!r}: sequence length {s} differs from the row's other "
                    f"token fields ({known}) (row key {keys[i]!r})",
                    field=f.name,
                    key=keys[i],
                    expected=known,
                    actual=s,
                )
            seq[i] = s
        payloads.append(enc.data)
        shapes.append(enc.shape)
    valid = [s is not None for s in shapes]
    if f.codec is not RAW:  # a column's rows at once: many bytes are split over threads
        at = [i for i, ok in enumerate(valid) if ok]
        for i, frame in zip(at, encode_frames(f.codec, [payloads[i] for i in at]), strict=True):
            payloads[i] = frame
    return [_binary(payloads, valid, sink), _shapes(shapes)]


def _encode_tensor_few(
    f: Field, rows: list[Any], seq: np.ndarray, sink: Sink
) -> list[pa.Array] | None:
    """What the per-row path builds for a few rows that are all plain (present, CPU,
    C-contiguous, not empty, native byte order, the declared dtype and shape, token
    lengths agreeing): a 1-row put's columns, at a third of the per-row path's cost. None
    where any row is not plain: the per-row path then runs and names the fault."""
    if f.codec is not RAW:
        return None
    token = f.role == "token"
    views: list[np.ndarray] = []
    shapes: list[tuple[int, ...] | None] = []
    for i, x in enumerate(rows):
        a = _plain_view(x)
        if a is None or _NUMPY_TAG.get(a.dtype) != f.dtype:
            return None
        shape = a.shape
        if f.check_shape(shape) is not None:
            return None
        if token:
            known = int(seq[i])
            if not shape or (known >= 0 and known != shape[0]):
                return None
        views.append(a)
        shapes.append(shape)
    if token:
        for i, a in enumerate(views):
            seq[i] = a.shape[0]
    sizes = [a.nbytes for a in views]
    lengths = np.array(sizes, dtype=np.int64)
    offsets = np.array([0, *itertools.accumulate(sizes)], dtype=np.int64)
    payloads = [a.reshape(-1).view(np.uint8) for a in views]
    return [_binary_array(offsets, sink.column(payloads, lengths, offsets), None), _shapes(shapes)]


def _encode_packed(f: Field, p: PackedRows, seq: np.ndarray, sink: Sink) -> list[pa.Array] | None:
    """What the per-row path builds, for rows that lie end to end in one tensor, in a few
    array operations and no tensor per row; the sink gets the rows' bytes as one payload
    (a socket put sends them from ``p.values`` as they lie). None where the values are not
    plain (:func:`_plain_view`), of another dtype, or some row breaks the declared shape or
    its token length: the per-row path then runs and names the fault."""
    if f.codec is not RAW:
        return None
    a = _plain_view(p.values)
    if a is None or _NUMPY_TAG.get(a.dtype) != f.dtype:
        return None
    o = p.offsets
    lengths = np.diff(o)
    tail = a.shape[1:]
    n, rank = len(lengths), 1 + len(tail)
    ranks = np.full(n, rank, dtype=np.int64)
    dims = np.empty((n, rank), dtype=np.int64)
    dims[:, 0] = lengths
    dims[:, 1:] = tail
    if not _fits_dims(f, ranks, dims.reshape(-1)):
        return None
    if f.role == "token":
        if ((seq >= 0) & (seq != lengths)).any():
            return None
        seq[:] = lengths
    row = a.itemsize * math.prod(tail)
    lo, hi = int(o[0]), int(o[-1])
    offsets = (o - lo) * row
    total = int(offsets[-1])
    flat = a[lo:hi].reshape(-1).view(np.uint8)
    data = sink.column([flat], np.array([total], dtype=np.int64), np.array([0, total]))
    return [_binary_array(offsets, data, None), _shape_column(ranks, dims.reshape(-1), None)]


#: Native-order numpy dtypes to their tags (``flightq.dtypes.from_numpy``'s common case).
_NUMPY_TAG = {
    np.dtype(d.storage.str.replace("<", "=")): d.name for d in DTYPES.values() if d.native_numpy
}


def _plain_view(x: Any) -> np.ndarray | None:
    """The numpy array (or a torch tensor's numpy view) that ``x`` is, where its memory is
    its value as it stands: not empty, C-contiguous, native byte order; else None."""
    if type(x) is np.ndarray:
        a = x
    elif is_torch(x):
        try:  # torch refuses what is not its memory as it stands (grad, conj, CUDA, bf16)
            a = x.numpy()
        except (TypeError, RuntimeError):
            return None
    else:
        return None
    if not a.size or not a.flags.c_contiguous or not a.dtype.isnative:
        return None
    return a


def _encode_tensor_bulk(
    f: Field, rows: list[Any], seq: np.ndarray, sink: Sink = COPY
) -> list[pa.Array] | None:
    """What the per-row path builds, in a few array operations per column; None if it
    does not apply.

    Applies to a raw field whose present rows convert in bulk
    (:func:`flightq.tensor.bulk_to_bytes`) and all pass the per-row checks: declared
    dtype and shape, token lengths agreeing with the row's other token fields. Otherwise
    the per-row path runs, raising its precise errors. The sink gets the rows' tensors as
    they are (:meth:`flightq.sink.Sink.bulk`).
    """
    if f.codec is not RAW:
        return None
    n = len(rows)
    present = [i for i, x in enumerate(rows) if x is not None]
    if len(present) < 2:  # one tensor: converting it directly is cheaper
        return None
    everyone = len(present) == n
    bulk = bulk_to_bytes(rows if everyone else [rows[i] for i in present])
    if bulk is None or bulk.dtype != f.dtype or not _fits(f, bulk):
        return None
    ranks = bulk.ranks
    if f.role == "token":
        if ranks.min() < 1:
            return None
        firsts = np.zeros(len(ranks), dtype=np.int64)
        np.cumsum(ranks[:-1], out=firsts[1:])
        lens = bulk.dims[firsts]
        at = slice(None) if everyone else np.asarray(present)
        known = seq[at]
        if ((known >= 0) & (known != lens)).any():
            return None
        seq[at] = lens
    lengths = bulk.nbytes
    valid = None
    if not everyone:
        lengths = np.zeros(n, dtype=np.int64)
        lengths[present] = bulk.nbytes
        full = np.zeros(n, dtype=np.int64)
        full[present] = ranks
        ranks = full
        valid = [False] * n
        for i in present:
            valid[i] = True
    offsets = _offsets(lengths)
    data = sink.bulk(bulk, present, offsets)
    return [_binary_array(offsets, data, valid), _shape_column(ranks, bulk.dims, valid)]


def _shape_column(ranks: np.ndarray, dims: np.ndarray, valid: list[bool] | None) -> pa.Array:
    """The shape column :func:`_shapes` builds, from each row's rank (0 where the row is
    null) and every present row's dims end to end."""
    offsets = np.zeros(len(ranks) + 1, dtype=np.int32)
    np.cumsum(ranks, out=offsets[1:])
    mask = None if valid is None else pa.array([not v for v in valid], type=pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(dims, type=pa.int64()), mask=mask)


def _fits(f: Field, bulk: Bulk) -> bool:
    """Whether every shape fits the declaration (as ``f.check_shape`` row by row)."""
    return _fits_dims(f, bulk.ranks, bulk.dims)


def _fits_dims(f: Field, ranks: np.ndarray, flat_dims: np.ndarray) -> bool:
    """:func:`_fits` of rows given by their ranks and their dims end to end."""
    if f.shape is None:
        return True
    rank = len(f.shape)
    if (ranks != rank).any():
        return False
    if rank == 0:
        return True
    dims = flat_dims.reshape(-1, rank)
    return all(
        bool((dims[:, axis] == want).all()) for axis, want in enumerate(f.shape) if want is not None
    )


def _encode_media(
    f: Field,
    data: Any,
    keys: list[str],
    zero_copy: bool,
    sink: Sink,
    media: MediaRefs | None = None,
    claims: dict[str, list[bytes]] | None = None,
) -> list[pa.Array]:
    # Segments that are the same memory (the image shared by a prompt group's G rows) become
    # one dictionary entry: it travels, is stored and is decoded once. With ``media``, so do
    # segments of equal content (a processor run once per row), and content sent to the
    # partition before travels as a reference (an empty entry).
    entries: list[Any] = []
    index: list[int] = []
    same: MemoryIndex[tuple[int, tuple[int, ...]]] = MemoryIndex()  # (entry, shape)
    seg_shapes: list[tuple[int, ...] | None] = []
    counts: list[int | None] = []
    claimed: list[bytes] = []
    by_hint: dict[tuple[bytes, tuple[int, ...]], list[_Entry]] = {}
    codec_id = repr(sorted(f.codec.to_dict().items()))
    for i, row in enumerate(_rows(f, data, keys)):
        if row is None:
            counts.append(None)
            continue
        if type(row) is not list and (
            isinstance(row, np.ndarray) or is_torch(row) or not isinstance(row, Sequence)
        ):
            raise EncodeError(
                f"column {f.name!r}: a media row is a list of tensors (one per segment), got "
                f"{type(row).__name__} (row key {keys[i]!r}); wrap one image as [tensor]",
                field=f.name,
                key=keys[i],
                actual=type(row).__name__,
            )
        for j, x in enumerate(row):
            hit = same.get(x)
            if hit is None:
                enc = _checked(f, x, keys[i], zero_copy, what=f" segment {j}")
                if media is None:
                    hit = (len(entries), enc.shape)
                    entries.append(f.codec.encode(enc.data) if f.codec is not RAW else enc.data)
                else:
                    hit = _media_entry(f, x, enc, media, codec_id, entries, claimed, by_hint)
                same.put(x, hit)
            index.append(hit[0])
            seg_shapes.append(hit[1])
        counts.append(len(row))
    if media is not None and claims is not None and any(claimed):
        claims[f.name] = claimed
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum([c or 0 for c in counts], out=offsets[1:])
    mask = None
    if any(c is None for c in counts):
        mask = pa.array([c is None for c in counts], type=pa.bool_())
    segs = pa.DictionaryArray.from_arrays(
        pa.array(index, type=pa.int32()), _binary(entries, None, sink)
    )
    payload = pa.LargeListArray.from_arrays(pa.array(offsets), segs, mask=mask)
    seg_shape_arr = _shapes(seg_shapes)
    shape_col = pa.LargeListArray.from_arrays(pa.array(offsets), seg_shape_arr, mask=mask)
    return [payload, shape_col]


class _Entry:
    """An entry of one put's media column: where it is, and its digest once known."""

    __slots__ = ("digest", "index")

    def __init__(self, index: int, digest: bytes | None) -> None:
        self.index = index
        self.digest = digest


def _media_entry(
    f: Field,
    x: Any,
    enc: Encoded,
    media: MediaRefs,
    codec_id: str,
    entries: list[Any],
    claimed: list[bytes],
    by_hint: dict[tuple[bytes, tuple[int, ...]], list[_Entry]],
) -> tuple[int, tuple[int, ...]]:
    """The dictionary entry of segment ``x`` (checked: ``enc``), found among the put's
    entries or added: its payload, or a reference where the writer sent its hint to the
    partition before. Hashes only a segment that may recur (a reference, or one whose
    hint another entry of the put shares), or every one where the put claims digests."""
    payload = None
    cached = media.cache.get(x, codec_id)
    if cached is None:
        payload = f.codec.encode(enc.data) if f.codec is not RAW else enc.data
        h, d = hint_of(payload), None
    else:
        h, d = cached
    shape = enc.shape
    named = (f.name, h, shape)
    ref = named in media.known and bool(shape) and 0 not in shape
    twins = by_hint.get((h, shape))
    if d is None and (ref or twins or media.claim):
        if payload is None:
            payload = f.codec.encode(enc.data) if f.codec is not RAW else enc.data
        d = digest_of(payload, media.hash)
    media.cache.put(x, codec_id, h, d)
    for t in twins or ():
        if t.digest is None:
            t.digest = digest_of(entries[t.index], media.hash)
        if t.digest == d:
            return t.index, shape
    media.sent.add(named)
    if ref:
        assert d is not None
        payload, claim = b"", d + h
        media.references += 1
    else:
        if payload is None:
            payload = f.codec.encode(enc.data) if f.codec is not RAW else enc.data
        claim = d if media.claim and d is not None else b""
    by_hint.setdefault((h, shape), []).append(_Entry(len(entries), d))
    entries.append(payload)
    claimed.append(claim)
    return len(entries) - 1, shape


def _encode_scalar(f: Field, data: Any, keys: list[str]) -> pa.Array:
    dt = f.dt
    n = len(keys)
    if n <= _FEW:  # a few rows given as a plain array of the declared dtype: as below
        a = _plain_view(data)
        if a is not None and a.shape == (n,) and _NUMPY_TAG.get(a.dtype) == f.dtype:
            if dt.name == "bool":
                return pa.array(a, type=pa.bool_())
            return pa.Array.from_buffers(dt.arrow, n, [None, pa.py_buffer(a.copy())])
    where = f"column {f.name!r}: "
    if isinstance(data, np.ndarray) or is_torch(data):
        enc = to_bytes(data, where=where)
        if enc.dtype != f.dtype:
            lib = "torch" if is_torch(data) else "numpy"
            raise DTypeError(
                f"column {f.name!r}: expected dtype {f.dtype}, got {enc.dtype}; "
                f"{_CAST_HINT[lib].format(want=f.dtype)} or declare a new schema version",
                field=f.name,
                expected=f.dtype,
                actual=enc.dtype,
            )
        if enc.shape != (n,):
            raise ShapeError(
                f"{where}a scalar column is one value per row: expected shape ({n},), got "
                f"{enc.shape}",
                field=f.name,
                expected=[n],
                actual=list(enc.shape),
            )
        values = enc.data.view(dt.storage)
        if dt.name == "bool":
            return pa.array(values.view(np.bool_), type=pa.bool_())
        # A copy (a few bytes a row): the batch never changes with the caller's array.
        return pa.Array.from_buffers(dt.arrow, n, [None, pa.py_buffer(values.copy())])
    rows = _rows(f, data, keys)
    out: list[Any] = []
    for i, v in enumerate(rows):
        if v is None:
            out.append(None)
            continue
        if dt.native_numpy and is_torch(v) and v.dim() == 0 and from_torch(v.dtype) == f.dtype:
            out.append(v.item())  # the value itself, exact: a third of the general path
            continue
        if isinstance(v, np.ndarray | np.generic) or is_torch(v):
            enc = to_bytes(np.asarray(v) if isinstance(v, np.generic) else v, where=where)
            if enc.dtype != f.dtype or enc.shape != ():
                raise DTypeError(
                    f"{where}expected a {f.dtype} scalar, got {enc.dtype} of shape {enc.shape} "
                    f"(row key {keys[i]!r})",
                    field=f.name,
                    key=keys[i],
                    expected=f.dtype,
                    actual=enc.dtype,
                )
            out.append(enc.data.view(dt.storage)[0].item())
            continue
        if not dt.native_numpy:
            raise DTypeError(
                f"{where}{f.dtype} scalars are given as tensors of that dtype, got "
                f"{type(v).__name__} (row key {keys[i]!r})",
                field=f.name,
                key=keys[i],
                expected=f.dtype,
                actual=type(v).__name__,
            )
        ok = (
            isinstance(v, bool)
            if dt.name == "bool"
            else (isinstance(v, int) and not isinstance(v, bool))
            if dt.name.startswith(("int", "uint"))
            else isinstance(v, (int, float)) and not isinstance(v, bool)
        )
        if not ok:
            raise DTypeError(
                f"{where}expected a {f.dtype} value, got {type(v).__name__} {v!r} "
                f"(row key {keys[i]!r})",
                field=f.name,
                key=keys[i],
                expected=f.dtype,
                actual=type(v).__name__,
            )
        out.append(v)
    try:
        return pa.array(out, type=dt.arrow)
    except (pa.ArrowException, OverflowError, TypeError) as e:
        raise DTypeError(
            f"{where}values do not fit {f.dtype}: {e}", field=f.name, expected=f.dtype
        ) from e


def _encode_tags(tags: Sequence[Mapping[str, Any] | None] | None, keys: list[str]) -> pa.Array:
    if tags is None:
        return pa.nulls(len(keys), type=pa.binary())
    if len(tags) != len(keys):
        raise EncodeError(
            f"tags: {len(tags)} entries for {len(keys)} keys",
            field=TAGS,
            expected=len(keys),
            actual=len(tags),
        )
    out: list[bytes | None] = []
    pack = msgpack.Packer(use_bin_type=True).pack  # one packer: a third of packb's cost
    for k, t in zip(keys, tags, strict=True):
        if t is None:
            out.append(None)
            continue
        if type(t) is not dict and not isinstance(t, Mapping):
            raise EncodeError(
                f"tags of row {k!r} must be a dict, got {type(t).__name__}",
                field=TAGS,
                key=k,
                actual=type(t).__name__,
            )
        try:
            out.append(pack(t if type(t) is dict else dict(t)))
        except (TypeError, ValueError, OverflowError) as e:
            raise EncodeError(
                f"tags of row {k!r} are not msgpack-serialisable: {e}", field=TAGS, key=k
            ) from e
    return pa.array(out, type=pa.binary())
