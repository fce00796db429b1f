"""Encode columns into self-describing record batches, in bounded chunks.

:func:`encode` checks every value against the schema before building anything: an
undeclared column, a wrong dtype, a shape that breaks the declaration, a ragged row whose
token fields disagree on the sequence length are refused with a typed error naming the
column and the row key. Nothing is cast, padded or dropped. A media segment that is the
same memory in several rows becomes one dictionary entry. :func:`encode_chunks` cuts a
put into record batches of bounded size without splitting shared media.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

from .codecs import RAW
from .errors import DTypeError, EncodeError, ShapeError, UndeclaredFieldError
from .layout import MEDIA_TYPE, arrow_schema, binary_offsets, media_row_bytes
from .schema import Field, Schema
from .tensor import Bulk, Encoded, bulk_to_bytes, is_torch, nbytes_for, to_bytes

__all__ = [
    "encode",
    "encode_chunks",
    "split_batch",
    "row_nbytes",
    "GATHER",
    "HARD_CHUNK_BYTES",
]

#: A writer that copies payloads straight to their destination (:mod:`flightq.shm`) sets
#: this while it encodes: ``_binary`` then hands it the payloads and offsets and uses the
#: placeholder buffer it returns instead of gathering the bytes itself.
GATHER: contextvars.ContextVar[Callable[[list[Any], np.ndarray], pa.Buffer | None] | None] = (
    contextvars.ContextVar("flightq_gather", default=None)
)
#: Set by :func:`encode_chunks` given ``fills``: ``_binary`` queues its copies here.
_DEFERRED: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "flightq_deferred", default=None
)

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
) -> pa.RecordBatch:
    """Encode rows into one self-describing record batch.

    Parameters
    ----------
    schema:
        The schema every column is checked against.
    columns:
        Field name to per-row data. token/tensor: a sequence of N tensors (``None`` for a
        row without the field). media: a sequence of N lists of tensors (an empty list is
        "no media", ``None`` is "field absent"). scalar: a 1-D tensor/array of N values or
        a sequence of N Python values (``None`` allowed). Tensors are torch or numpy.
    keys:
        N distinct row keys.
    tags:
        N msgpack-serialisable dicts (or ``None``), or None for no tags.
    zero_copy:
        Refuse tensors that would need a copy to normalise (non-contiguous, big-endian,
        not on the CPU) instead of copying them.

    Returns
    -------
    pyarrow.RecordBatch

    Raises
    ------
    UndeclaredFieldError, DTypeError, ShapeError, EncodeError
        Naming the column, the row key, what was expected and what arrived.

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
    for k in keys:
        if not isinstance(k, str):
            raise EncodeError(f"row keys are strings, got {type(k).__name__} {k!r}")
    if len(set(keys)) != n:
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise EncodeError(f"duplicate row key {dup!r} within one put")
    for name in columns:
        if name not in schema:
            raise UndeclaredFieldError(
                f"column {name!r} is not declared by schema {schema.ref}; declared: "
                f"{', '.join(f.name for f in schema.fields)}. Declare it in a new schema "
                "version; flightq never drops or registers columns on the fly"
            )
    seq = [-1] * n
    arrays: list[pa.Array] = [pa.array(keys, type=pa.utf8()), _encode_tags(tags, keys)]
    names: list[str] = []
    for f in schema.fields:
        if f.name not in columns:
            continue
        names.append(f.name)
        data = columns[f.name]
        if f.role == "scalar":
            arrays.append(_encode_scalar(f, data, keys))
        elif f.role == "media":
            arrays.extend(_encode_media(f, data, keys, zero_copy))
        else:
            arrays.extend(_encode_tensor(f, data, keys, zero_copy, seq))
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema(schema, names))


def _rows(f: Field, data: Any, keys: list[str]) -> list[Any]:
    if isinstance(data, (str, bytes, Mapping)) or not hasattr(data, "__len__"):
        raise EncodeError(
            f"column {f.name!r}: expected a sequence of {len(keys)} rows, got {type(data).__name__}"
        )
    if len(data) != len(keys):
        raise ShapeError(f"column {f.name!r}: {len(data)} rows for {len(keys)} keys")
    return list(data)


def _checked(f: Field, x: Any, key: str, zero_copy: bool, what: str = "") -> Encoded:
    where = f"column {f.name!r}{what} (row key {key!r}): "
    enc = to_bytes(x, zero_copy=zero_copy, where=where)
    if enc.dtype != f.dtype:
        lib = "torch" if is_torch(x) else "numpy"
        raise DTypeError(
            f"column {f.name!r}: expected dtype {f.dtype}, got {enc.dtype} (row key {key!r}); "
            f"{_CAST_HINT[lib].format(want=f.dtype)} or declare a new schema version"
        )
    problem = f.check_shape(enc.shape)
    if problem:
        raise ShapeError(f"column {f.name!r}{what}: {problem} (row key {key!r})")
    nbytes_for(enc.shape, f.dt.itemsize, where)
    return enc


def _binary(payloads: list[Any], valid: list[bool] | None) -> pa.Array:
    """A large_binary array over the payloads, copied once into one contiguous buffer.

    Under :func:`encode_chunks` with ``fills``, the copy is left to the batch's fill, and
    payloads that already lie end to end in one array (a lone payload, views of one
    buffer) become the data buffer as they are: the caller sends the batch at once.
    """
    lengths = np.fromiter((len(memoryview(p).cast("B")) for p in payloads), np.int64, len(payloads))
    offsets = _offsets(lengths)
    gather = GATHER.get()
    data = gather(payloads, offsets) if gather is not None else None
    deferred = _DEFERRED.get()
    if data is None and deferred is not None:
        data = _in_place(payloads, lengths)
    if data is None:
        buf = np.empty(int(offsets[-1]), dtype=np.uint8)
        if deferred is None:
            _gather_into(buf, payloads, offsets)
        else:
            deferred.append(functools.partial(_gather_into, buf, payloads, offsets))
        data = pa.py_buffer(buf)
    return _binary_array(offsets, data, valid)


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


def _gather_into(buf: np.ndarray, payloads: list[Any], offsets: np.ndarray) -> None:
    for p, lo, hi in zip(payloads, offsets[:-1], offsets[1:], strict=True):
        if hi > lo:
            buf[lo:hi] = np.frombuffer(p, dtype=np.uint8)


def _in_place(payloads: list[Any], lengths: np.ndarray) -> pa.Buffer | None:
    """The payloads' own memory as one buffer, if the non-empty ones lie end to end.

    That holds for a lone payload, and for views of one array placed back to back (rows
    split from a packed tensor, a pinned staging buffer). None otherwise: copy them.
    """
    parts = [p for p, n in zip(payloads, lengths.tolist(), strict=True) if n]
    if not parts:
        return None
    if len(parts) == 1:
        return pa.py_buffer(parts[0])
    if not all(type(p) is np.ndarray for p in parts):
        return None
    root = parts[0]
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    start = end = parts[0].ctypes.data
    for p in parts:
        if p.ctypes.data != end:
            return None
        end += p.nbytes
    base = root.ctypes.data
    if start < base or end > base + root.nbytes:
        return None
    return pa.py_buffer(root.reshape(-1).view(np.uint8)[start - base : end - base])


def _shapes(shapes: list[tuple[int, ...] | None], large: bool = False) -> pa.Array:
    valid = [s is not None for s in shapes]
    lens = np.fromiter((len(s) if s is not None else 0 for s in shapes), np.int64, len(shapes))
    offsets = np.zeros(len(shapes) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter((d for s in shapes if s is not None for d in s), np.int64)
    cls = pa.LargeListArray if large else pa.ListArray
    mask = None if all(valid) else pa.array([not v for v in valid], type=pa.bool_())
    return cls.from_arrays(pa.array(offsets), pa.array(flat, type=pa.int64()), mask=mask)


def _encode_tensor(
    f: Field, data: Any, keys: list[str], zero_copy: bool, seq: list[int]
) -> list[pa.Array]:
    rows = _rows(f, data, keys)
    fast = _encode_tensor_bulk(f, rows, seq)
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
            s = enc.shape[0]
            if seq[i] >= 0 and seq[i] != s:
                raise ShapeError(
                    f"column {f.name!r}: sequence length {s} differs from the row's other "
                    f"token fields ({seq[i]}) (row key {keys[i]!r})"
                )
            seq[i] = s
        payloads.append(f.codec.encode(enc.data) if f.codec is not RAW else enc.data)
        shapes.append(enc.shape)
    valid = [s is not None for s in shapes]
    return [_binary(payloads, valid), _shapes(shapes)]


def _encode_tensor_bulk(f: Field, rows: list[Any], seq: list[int]) -> list[pa.Array] | None:
    """What the per-row path builds, in a few calls per column; None if it does not apply.

    Applies to a raw field whose present rows convert in bulk
    (:func:`flightq.tensor.bulk_to_bytes`) and all pass the per-row checks: declared
    dtype and shape, token lengths agreeing with the row's other token fields. Otherwise
    the per-row path runs, raising its precise errors. Under shared-memory gathering the
    rows' memory is handed to the gatherer as it is; deferred fills get the one copy.
    """
    if f.codec is not RAW:
        return None
    present = [i for i, x in enumerate(rows) if x is not None]
    if len(present) < 2:  # one tensor: converting it directly is cheaper
        return None
    bulk = bulk_to_bytes(rows if len(present) == len(rows) else [rows[i] for i in present])
    if bulk is None or bulk.dtype != f.dtype or not _fits(f, bulk):
        return None
    if f.role == "token":
        lens = [s[0] for s in bulk.shapes]
        if any(seq[i] >= 0 and seq[i] != s for i, s in zip(present, lens, strict=True)):
            return None
        for i, s in zip(present, lens, strict=True):
            seq[i] = s
    n = len(rows)
    lengths = bulk.nbytes
    shapes: list[tuple[int, ...] | None] = list(bulk.shapes)
    valid = None
    if len(present) < n:
        lengths = np.zeros(n, dtype=np.int64)
        lengths[present] = bulk.nbytes
        shapes = [None] * n
        for i, shape in zip(present, bulk.shapes, strict=True):
            shapes[i] = shape
        valid = [shape is not None for shape in shapes]
    offsets = _offsets(lengths)
    gather = GATHER.get()
    views = bulk.byte_views() if gather is not None else None
    if gather is not None and views is not None:
        payloads: list[Any] = views
        if len(present) < n:
            payloads = [b""] * n
            for i, v in zip(present, views, strict=True):
                payloads[i] = v
        data = gather(payloads, offsets)
        if data is not None:
            return [_binary_array(offsets, data, valid), _shapes(shapes)]
    buf = np.empty(int(offsets[-1]), dtype=np.uint8)
    deferred = _DEFERRED.get()
    if deferred is None:
        bulk.copy_into(buf)
    else:
        deferred.append(functools.partial(bulk.copy_into, buf))
    return [_binary_array(offsets, pa.py_buffer(buf), valid), _shapes(shapes)]


def _fits(f: Field, bulk: Bulk) -> bool:
    """Whether every shape fits the declaration (as ``f.check_shape`` row by row)."""
    if f.shape is None:
        return True
    rank = len(f.shape)
    if any(len(s) != rank for s in bulk.shapes):
        return False
    return all(
        all(s[axis] == want for s in bulk.shapes)
        for axis, want in enumerate(f.shape)
        if want is not None
    )


def _memory_key(x: Any) -> tuple[Any, ...] | None:
    """Identity of a tensor's memory: equal keys hold equal bytes during one encode.

    Empty tensors get no key: their addresses may coincide, and sharing saves nothing.
    """
    if isinstance(x, np.ndarray) and x.size:
        return ("np", x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str)
    if is_torch(x) and x.numel():
        return ("torch", x.device, x.data_ptr(), x.shape, x.stride(), x.dtype)
    return None


def _encode_media(f: Field, data: Any, keys: list[str], zero_copy: bool) -> list[pa.Array]:
    # Segments that are the same memory (the image shared by a prompt group's G rows) become
    # one dictionary entry: it travels, is stored and is decoded once.
    entries: list[Any] = []
    index: list[int] = []
    seen: dict[tuple[Any, ...], tuple[int, tuple[int, ...]]] = {}
    same: dict[int, tuple[Any, tuple[int, tuple[int, ...]]]] = {}  # id -> (object, hit)
    seg_shapes: list[tuple[int, ...] | None] = []
    counts: list[int | None] = []
    for i, row in enumerate(_rows(f, data, keys)):
        if row is None:
            counts.append(None)
            continue
        if type(row) is not list and (
            isinstance(row, np.ndarray) or is_torch(row) or not isinstance(row, Sequence)
        ):
            raise EncodeError(
                f"column {f.name!r}: a media row is a list of tensors (one per segment), got "
                f"{type(row).__name__} (row key {keys[i]!r}); wrap one image as [tensor]"
            )
        for j, x in enumerate(row):
            # The same object is the same memory. ``same`` holds every object it names:
            # a segment built on access dies otherwise, and its id can come back.
            known = same.get(id(x))
            hit = known[1] if known is not None else None
            if hit is None:
                mkey = _memory_key(x)
                hit = seen.get(mkey) if mkey is not None else None
                if hit is None:
                    enc = _checked(f, x, keys[i], zero_copy, what=f" segment {j}")
                    hit = (len(entries), enc.shape)
                    entries.append(f.codec.encode(enc.data) if f.codec is not RAW else enc.data)
                    if mkey is not None:
                        seen[mkey] = hit
                if mkey is not None:
                    same[id(x)] = (x, hit)
            index.append(hit[0])
            seg_shapes.append(hit[1])
        counts.append(len(row))
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum([c or 0 for c in counts], out=offsets[1:])
    mask = None
    if any(c is None for c in counts):
        mask = pa.array([c is None for c in counts], type=pa.bool_())
    segs = pa.DictionaryArray.from_arrays(pa.array(index, type=pa.int32()), _binary(entries, None))
    payload = pa.LargeListArray.from_arrays(pa.array(offsets), segs, mask=mask)
    seg_shape_arr = _shapes(seg_shapes)
    shape_col = pa.LargeListArray.from_arrays(pa.array(offsets), seg_shape_arr, mask=mask)
    return [payload, shape_col]


def _encode_scalar(f: Field, data: Any, keys: list[str]) -> pa.Array:
    dt = f.dt
    n = len(keys)
    where = f"column {f.name!r}: "
    if isinstance(data, np.ndarray) or is_torch(data):
        enc = to_bytes(data, where=where)
        if enc.dtype != f.dtype:
            lib = "torch" if is_torch(data) else "numpy"
            raise DTypeError(
                f"column {f.name!r}: expected dtype {f.dtype}, got {enc.dtype}; "
                f"{_CAST_HINT[lib].format(want=f.dtype)} or declare a new schema version"
            )
        if enc.shape != (n,):
            raise ShapeError(
                f"{where}a scalar column is one value per row: expected shape ({n},), got "
                f"{enc.shape}"
            )
        values = enc.data.view(dt.storage)
        if dt.name == "bool":
            return pa.array(values.view(np.bool_), type=pa.bool_())
        return pa.Array.from_buffers(dt.arrow, n, [None, pa.py_buffer(values)])
    rows = _rows(f, data, keys)
    out: list[Any] = []
    for i, v in enumerate(rows):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, np.ndarray | np.generic) or is_torch(v):
            enc = to_bytes(np.asarray(v) if isinstance(v, np.generic) else v, where=where)
            if enc.dtype != f.dtype or enc.shape != ():
                raise DTypeError(
                    f"{where}expected a {f.dtype} scalar, got {enc.dtype} of shape {enc.shape} "
                    f"(row key {keys[i]!r})"
                )
            out.append(enc.data.view(dt.storage)[0].item())
            continue
        if not dt.native_numpy:
            raise DTypeError(
                f"{where}{f.dtype} scalars are given as tensors of that dtype, got "
                f"{type(v).__name__} (row key {keys[i]!r})"
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
                f"(row key {keys[i]!r})"
            )
        out.append(v)
    try:
        return pa.array(out, type=dt.arrow)
    except (pa.ArrowException, OverflowError, TypeError) as e:
        raise DTypeError(f"{where}values do not fit {f.dtype}: {e}") from e


def _encode_tags(tags: Sequence[Mapping[str, Any] | None] | None, keys: list[str]) -> pa.Array:
    if tags is None:
        return pa.nulls(len(keys), type=pa.binary())
    if len(tags) != len(keys):
        raise EncodeError(f"tags: {len(tags)} entries for {len(keys)} keys")
    out: list[bytes | None] = []
    pack = msgpack.Packer(use_bin_type=True).pack  # one packer: a third of packb's cost
    for k, t in zip(keys, tags, strict=True):
        if t is None:
            out.append(None)
            continue
        if not isinstance(t, Mapping):
            raise EncodeError(f"tags of row {k!r} must be a dict, got {type(t).__name__}")
        try:
            out.append(pack(t if type(t) is dict else dict(t)))
        except (TypeError, ValueError, OverflowError) as e:
            raise EncodeError(f"tags of row {k!r} are not msgpack-serialisable: {e}") from e
    return pa.array(out, type=pa.binary())


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
) -> list[pa.RecordBatch]:
    """Encode rows as several record batches of about ``max_bytes`` each.

    Rows are cut into consecutive ranges before encoding, so each batch carries its own
    dictionary of distinct media and no message grows with the whole put. A range is never
    cut between rows that share a media segment (a prompt group's image stays one entry)
    unless the range would pass :data:`HARD_CHUNK_BYTES`. Same parameters and errors as
    :func:`encode`; ``on_range(start, stop)`` is called before rows ``[start, stop)`` are
    encoded (CUDA puts wait there for those rows' device-to-host copies).

    Given ``fills``, every check still runs here but no payload is copied yet: one
    callable per batch is appended, to run before that batch is written (a sender fills
    the next batch while the wire carries this one); payloads already end to end in
    memory are referenced, not copied, so the batches must be sent while the tensors
    stay unchanged.
    """
    keys = list(keys)
    n = len(keys)

    def encode_range(cols: Mapping[str, Any], ks: list[str], tg: Any) -> pa.RecordBatch:
        if fills is None:
            return encode(schema, cols, ks, tg, zero_copy=zero_copy)
        jobs: list[Callable[[], None]] = []
        token = _DEFERRED.set(jobs)
        try:
            batch = encode(schema, cols, ks, tg, zero_copy=zero_copy)
        finally:
            _DEFERRED.reset(token)

        def fill() -> None:
            for job in jobs:
                job()

        fills.append(fill)
        return batch

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
    first_row: dict[tuple[Any, ...], int] = {}
    keyed: dict[int, tuple[Any, tuple[Any, ...] | None]] = {}  # id -> (object, memory key)
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
            tensor_bytes += sum(map(_nbytes, data))
            continue
        for i, row in enumerate(data):
            if row is None or not (type(row) is list or isinstance(row, Sequence)):
                continue
            for x in row:
                known = keyed.get(id(x))
                if known is None:
                    # Held with its key: an object built on access cannot die and leave
                    # its id to another one during the call.
                    known = keyed[id(x)] = (x, _memory_key(x))
                mkey = known[1]
                if mkey is not None:
                    first = first_row.get(mkey)
                    if first is not None:  # stored once, with its first row
                        if first < i:
                            shares_back[i] = True
                        continue
                    first_row[mkey] = i
                sizes[i] += _nbytes(x)
    if sum(sizes) + tensor_bytes + fixed * n <= max_bytes:
        if on_range is not None:
            on_range(0, n)
        return [encode_range(columns, keys, tags)]
    for data in tensor_columns:
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
    if isinstance(v, (list, tuple, np.ndarray)) or is_torch(v):
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
