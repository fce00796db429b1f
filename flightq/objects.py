"""Object fields: one msgpack value per row, declared in the schema, stored as its bytes.

A field of role ``object`` carries what is not a tensor (a prompt's text, a message log,
a reward model's inputs, a dict of a row's extra information) as a column of its own,
declared like any other field: its value travels only with reads that ask for the field,
the server holds it as bytes counted exactly in its budget, and it is not bound by the
cap on a row's tags. On the wire it is a token-less tensor field of dtype ``uint8`` and
shape ``[null]``: a binary payload column (each row's msgpack bytes) beside its shape
column (each row's byte count), so the server stores, slices, merges and answers it as
it does any tensor field.

What a value may hold: ``None``, booleans, integers (signed 64-bit or unsigned 64-bit),
floats, strings, bytes, lists and tuples (which come back as lists) and maps with string
keys, nested freely; numpy scalars, 0-d arrays and 0-d tensors as the Python values they
hold. A row whose value is ``None`` in a put is a row without the field, as in any other
column. Anything else (a set, an array of several elements, a map with keys that are not
strings) is refused, ``EncodeError`` naming the field and the row.

The server checks every value it is sent before storing anything: one msgpack value, no
bytes after it, strings of valid UTF-8, maps with string keys, no extension types, and
at most the server's ``max_request_bytes`` of Python objects once decoded (bounded before
decoding: from its length where it holds no wide header, :func:`flightq.msgcheck.narrow_bound`,
else :func:`flightq.msgcheck.quick_bound` or :func:`flightq.msgcheck.decoded_bytes`).
A put that breaks one is refused whole, ``EncodeError`` naming the field and the row.
The values are not kept decoded: the server holds the bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from .codecs import RAW
from .errors import DecodeError, EncodeError, FlightqError
from .layout import KEY, SHAPE_SUFFIX, binary_offsets
from .msgcheck import (
    DEFAULT_MAX_REQUEST_BYTES,
    decoded_bytes,
    has_wide_headers,
    narrow_bound,
    quick_bound,
)

__all__ = [
    "PackedValues",
    "pack_values",
    "unpack_value",
    "check_value",
    "check_columns",
    "check_sizes",
    "coded",
]

_UNPACK_ERRORS = (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)
#: The first bytes of msgpack's bin and ext types: a value none of whose bytes is one holds
#: neither bytes (so no map key that is bytes) nor an extension value.
_BIN_EXT = tuple(bytes([b]) for b in [*range(0xC4, 0xCA), *range(0xD4, 0xD9)])
#: msgpack's extension values (a Timestamp is one), which no object field holds.
_SPECIAL = (msgpack.ExtType, msgpack.Timestamp)
#: What :func:`_odd` looks inside, or refuses.
_NESTED = (Mapping, list, tuple, *_SPECIAL)
#: Rows of at most this many bytes on average: their column is scanned whole first.
_SMALL_ROWS = 8192


def _plain(v: Any) -> Any:
    """``v`` with numpy scalars and 0-d arrays or tensors as the Python values they hold."""
    item = getattr(v, "item", None)
    if item is not None and getattr(v, "shape", None) == () and callable(item):
        return item()
    raise TypeError(f"can not serialize {type(v).__name__!r} object")


def _odd(v: Any) -> str | None:
    """What in ``v`` (nested) an object field may not hold: a map key that is not a
    string, or a msgpack extension value; None if nothing."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, _SPECIAL):  # an ExtType is a tuple: first
            return f"it holds a msgpack extension value ({type(x).__name__})"
        if isinstance(x, Mapping):
            for k, y in x.items():
                if not isinstance(k, str):
                    return f"its maps have string keys, got key {k!r} ({type(k).__name__})"
                if isinstance(y, _NESTED):
                    stack.append(y)
        elif isinstance(x, (list, tuple)):
            stack.extend(y for y in x if isinstance(y, _NESTED))
    return None


def _no_ext(code: int, data: bytes) -> Any:
    """A read meets an extension value, which no server of flightq's stores."""
    raise ValueError(f"a msgpack extension value (type {code}) is no value of an object field")


def _why(e: Exception) -> str:
    return str(e) or type(e).__name__


class PackedValues(list[Any]):
    """An object column already packed (:func:`pack_values`): given again to a put's
    layers (cut into record batches, split over shards), it passes as it is; its slices
    are packed too."""

    def __getitem__(self, i: Any) -> Any:
        got = super().__getitem__(i)
        return PackedValues(got) if isinstance(i, slice) else got


def pack_values(name: str, values: Sequence[Any], keys: Sequence[str]) -> Sequence[Any]:
    """An object column's values as their msgpack bytes: every row's end to end in one
    ``uint8`` array (:class:`flightq.rows.PackedRows`) where every row has a value, else a
    ``uint8`` array per row (``None`` stays ``None``: a row without the field).

    Raises
    ------
    EncodeError
        Naming the field and the row, for a value msgpack cannot carry or a map whose
        keys are not all strings.
    """
    from .rows import PackedRows

    if type(values) in (PackedValues, PackedRows):
        return values  # packed already
    pack = msgpack.Packer(use_bin_type=True, default=_plain).pack
    out: list[Any] = []
    for k, v in zip(keys, values, strict=True):
        if v is None:
            out.append(None)
            continue
        try:
            b = pack(v)
        except (TypeError, ValueError, OverflowError) as e:
            raise EncodeError(
                f"column {name!r} (row key {k!r}): an object field holds a msgpack value "
                f"(None, bool, int, float, str, bytes, lists and maps with string keys): {e}",
                field=name,
                key=k,
                actual=type(v).__name__,
            ) from e
        odd = _odd(v) if isinstance(v, (Mapping, list, tuple)) else None
        if odd is not None:
            raise EncodeError(
                f"column {name!r} (row key {k!r}): not a value an object field holds: {odd}",
                field=name,
                key=k,
            )
        out.append(b)
    if all(b is not None for b in out):
        # Every row: one buffer and offsets, which the encoder lays out a column at a time.
        offsets = np.zeros(len(out) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in out], out=offsets[1:])
        return PackedRows(np.frombuffer(b"".join(out), dtype=np.uint8), offsets)
    return PackedValues(None if b is None else np.frombuffer(b, dtype=np.uint8) for b in out)


def unpack_value(data: Any, name: str, key: str | None) -> Any:
    """One row's value from its msgpack bytes.

    Raises
    ------
    DecodeError
        Naming the field and the row, for bytes that are not one msgpack value.
    """
    try:
        return msgpack.unpackb(data, raw=False, ext_hook=_no_ext)
    except _UNPACK_ERRORS as e:
        raise DecodeError(
            f"column {name!r}"
            + ("" if key is None else f" (row key {key!r})")
            + f": not one msgpack value: {_why(e)}",
            field=name,
            key=key,
        ) from e


def check_value(
    data: Any,
    name: str,
    key: str | Callable[[], str],
    limit: int,
    narrow: bool = False,
    plain: bool = False,
) -> None:
    """Refuse bytes that are not one msgpack value an object field may hold, decoding to
    at most ``limit`` bytes of Python objects (bounded before anything is decoded).
    ``key``: the row's key, or what finds it (read only for an error).
    ``narrow``: the bytes hold no wide header (:func:`~flightq.msgcheck.has_wide_headers`);
    ``plain``: none of msgpack's bin or ext types (:data:`_BIN_EXT`): what a scan of the
    whole column found, which spares this row the same work (found here otherwise).

    Raises
    ------
    EncodeError
        Naming the field, the row and what is wrong.
    """

    def refused(why: str) -> EncodeError:
        k = key() if callable(key) else key
        return EncodeError(f"column {name!r} (row key {k!r}): {why}", field=name, key=k)

    raw = bytes(data)
    narrow = narrow or not has_wide_headers(raw)
    # A column's scan finds a bin or ext byte in one row (a string's length byte will do):
    # the others still skip the walk below.
    plain = plain or not any(b in raw for b in _BIN_EXT)
    if not (narrow and narrow_bound(len(raw)) <= limit) and quick_bound(raw, limit) is None:
        try:
            bound = decoded_bytes(raw, "its value", limit)
        except FlightqError as e:
            raise refused(str(e)) from None
        if bound > limit:
            raise _too_large(name, key() if callable(key) else key, len(raw), limit)
    try:
        value = msgpack.unpackb(raw, raw=False)
    except _UNPACK_ERRORS as e:
        why = _why(e)
        if "strict_map_key" in why:  # msgpack's words for a map key of another type
            why = f"its maps have string keys ({why.split(' when ')[0]})"
            raise refused(f"not a value an object field holds: {why}") from None
        raise refused(f"not one msgpack value: {why}") from None
    if plain:
        return
    odd = _odd(value) if isinstance(value, (dict, list, *_SPECIAL)) else None
    if odd is not None:
        raise refused(f"not a value an object field holds: {odd}")


def check_columns(batch: Any, fields: Sequence[Any], limit: int | None) -> None:
    """Refuse a validated record batch one of whose object fields (``fields``, the
    schema's) holds a row that :func:`check_value` refuses: the server's check of a put,
    before anything is stored. ``limit``: what one value may decode to (the server's
    ``max_request_bytes``; None: the default).

    Raises
    ------
    EncodeError
        Naming the field and the row.
    """
    cap = DEFAULT_MAX_REQUEST_BYTES if limit is None else limit
    for f, col in _object_columns(batch, fields):
        if not len(col) or col.null_count == len(col):
            continue
        if f.codec is not RAW:
            _check_coded(batch, f, col, cap)
            continue
        offs = binary_offsets(col).tolist()
        data = col.buffers()[2]
        mv = memoryview(data if data is not None else b"")
        valid = col.is_valid().to_numpy(zero_copy_only=False).tolist()
        narrow = plain = False
        if offs[-1] - offs[0] <= _SMALL_ROWS * len(valid):
            # Many small rows: one scan of the column's bytes spares most of them their own
            # (text in ASCII, small maps and lists: no wide header, no bin or ext byte).
            whole = bytes(mv[offs[0] : offs[-1]])
            narrow = not has_wide_headers(whole)
            plain = not any(b in whole for b in _BIN_EXT)
        for i, ok in enumerate(valid):
            if ok:
                key = functools.partial(_key, batch, i)
                check_value(mv[offs[i] : offs[i + 1]], f.name, key, cap, narrow, plain)


def check_sizes(batch: Any, fields: Sequence[Any], limit: int | None) -> None:
    """Refuse a put's record batch, before validation decodes any frame, where an object
    field's shape column says a row's msgpack bytes pass ``limit`` (a zstd frame that
    expands to gigabytes would otherwise be decoded to its end first). A shape column of
    another type is left to validation, which names it.

    Raises
    ------
    EncodeError
        Naming the field and the row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    cap = DEFAULT_MAX_REQUEST_BYTES if limit is None else limit
    for f, shapes in _object_columns(batch, fields, SHAPE_SUFFIX):
        if shapes.type != pa.list_(pa.int64()) or not len(shapes):
            continue
        top = pc.max(pc.list_flatten(shapes)).as_py()
        if top is None or top <= cap:
            continue
        i = next(i for i, s in enumerate(shapes.to_pylist()) if s and max(s) > cap)
        raise _too_large(f.name, _key(batch, i), int(top), cap)


def _object_columns(batch: Any, fields: Sequence[Any], suffix: str = "") -> Any:
    """``(field, column)`` of each object field of ``fields`` whose column (its name and
    ``suffix``) ``batch`` has."""
    names = batch.schema.names
    for f in fields:
        if f.role == "object" and f.name + suffix in names:
            yield f, batch.column(f.name + suffix)


def _too_large(name: str, key: str, n: int, cap: int) -> EncodeError:
    return EncodeError(
        f"column {name!r} (row key {key!r}): its value of {n} bytes would decode to more "
        f"than the {cap} bytes of Python objects the server takes of one value "
        "(max_request_bytes); put smaller values, or start the server with a larger "
        "--max-request-bytes",
        field=name,
        key=key,
        expected=cap,
        actual=n,
    )


def coded(fields: Sequence[Any]) -> frozenset[str]:
    """The object fields of ``fields`` with a codec: :func:`check_columns` decodes their
    frames, each once, so validation need not (its ``decoded``)."""
    return frozenset(f.name for f in fields if f.role == "object" and f.codec is not RAW)


def _check_coded(batch: Any, f: Any, col: Any, cap: int) -> None:
    """:func:`check_columns` of an object field with a codec: each row's frame decoded
    (one row at a time, to the size its shape declares, which validation has held the
    frame's header to), refused without decoding where that size passes ``cap``; a frame
    that does not decode to exactly that size is refused as validation refuses it."""
    sizes = batch.column(f.name + SHAPE_SUFFIX).to_pylist()
    offs = binary_offsets(col).tolist()
    data = col.buffers()[2]
    mv = memoryview(data if data is not None else b"")
    ctx = f.codec.context()
    for i, shape in enumerate(sizes):
        if shape is None:
            continue
        n = int(shape[0])
        if n > cap:
            raise _too_large(f.name, _key(batch, i), n, cap)
        try:
            out = f.codec.decode(mv[offs[i] : offs[i + 1]], n, ctx)
        except FlightqError as e:
            k = _key(batch, i)
            raise DecodeError(
                f"column {f.name!r}: {e} (row key {k!r})",
                field=f.name,
                key=k,
                expected=e.expected,
                actual=e.actual,
            ) from None
        check_value(out, f.name, functools.partial(_key, batch, i), cap)


def _key(batch: Any, i: int) -> str:
    return str(batch.column(KEY)[i].as_py())
