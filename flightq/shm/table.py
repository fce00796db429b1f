"""Reads through shared memory: record batches named by the segments that hold their bytes.

A server answers a read over shared memory (a ticket with ``"shm": true``) with a *buffer
table*: the Arrow schema and, for every record batch of the answer, its arrays as lengths,
offsets and buffer references ``[segment, offset, size]``. A buffer that lies in a segment
the server maps (the bytes a put through shared memory left there) is named where it lies
and is not copied; the few others (keys, tags, a column written over the socket) travel
inline in the table, or in one segment the server writes when they are large. The client
maps each named segment once, copy-on-write, rebuilds the arrays over the mapping, validates
them in full (offsets, dictionary indices, buffer sizes) and decodes them with the same
:func:`flightq.decode`: the tensors it hands out are views of the producer's pages. The
mapping is not populated: each first touch maps the page with its neighbours, which costs
less than filling every page table at the get (13 against 9 GB/s on the 2-core machine)
and nothing for bytes a consumer never reads; a write copies the one page it touches.

A reader holds a shared lock on every segment it maps while any view lives, so the owner
does not fill it again under the reader (:func:`flightq.shm.mapping.map_data`); a segment whose
rows were cleared and that was filled again before the reader came is refused by its
generation.

Answers whose types the table does not describe (none of flightq's layouts) are written
whole into a server segment as one IPC stream instead, as are all answers of a server
whose put bytes did not come through shared memory and exceed :data:`INLINE_BYTES`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import ProtocolError, ResourceExhaustedError
from ..protocol import pack, unpack
from .mapping import MAPPED, map_data, read_private, still_there
from .segments import MARKER, Declined, SegmentPool

__all__ = ["INLINE_BYTES", "KEPT_INLINE_BYTES", "answer", "prepare", "prepare_reply", "take"]

#: Bytes not found in a mapped segment travel inline in the table up to this size.
INLINE_BYTES = 2**20
#: Alignment of each buffer copied into the table's own bytes.
_ALIGN = 64
_TABLE = "table"


class _Unsupported(Exception):
    """A type the buffer table does not describe: the answer goes as one IPC stream."""


class _Describer:
    """Names each buffer of an answer by segment and offset, collecting the others."""

    def __init__(self, keep: bool = False) -> None:
        self.segments: list[dict[str, Any]] = []
        #: With ``keep``: the mapped segments' own references (a kept description checks
        #: each is still there at every answer), and every segment counted live.
        self.refs: list[dict[str, Any]] = []
        self._keep = keep
        self._index: dict[tuple[str, int], int | None] = {}
        self.extra: list[tuple[int, pa.Buffer]] = []
        self.extra_refs: list[list[int]] = []
        self.extra_bytes = 0
        #: Whether the answer was described from kept descriptions alone (:func:`_described`).
        self.kept = False

    def buffer(self, buf: pa.Buffer | None, hit: Any) -> list[int] | None:
        """``buf``'s reference in the answer: its segment and offset where ``hit``
        (:func:`_located`) names one still there, else its place among the answer's own
        bytes."""
        if buf is None:
            return None
        if hit is not None:
            ref, offset = hit
            i = self._segment(ref)
            if i is not None:
                return [i, offset, buf.size]
        out = [-1, self.inline(buf), buf.size]
        self.extra_refs.append(out)
        return out

    def _segment(self, ref: dict[str, Any]) -> int | None:
        """The answer's number for a mapped segment, None where its file is gone: a file
        its owner unlinked (it exited) cannot be opened, so its bytes are copied."""
        key = (ref["path"], ref["gen"])
        if key not in self._index:
            live = self._keep or still_there(ref)
            self._index[key] = len(self.segments) if live else None
            if live:
                self.segments.append({k: ref[k] for k in ("path", "gen", "nbytes")})
                self.refs.append(ref)
        return self._index[key]

    def whole(self, w: Any) -> dict[str, Any]:
        """A stored batch answered whole (:class:`flightq.server.media.WholeAnswer`): its
        table entry from what describing it the first time found (kept on ``w``), its
        buffers' segments and inline bytes numbered for this answer. Raises
        :class:`_Stale` where one of its segments is gone (describe it afresh)."""
        t = w.described
        if t is None:
            t = w.described = _Template(w.batch)
        at = self._segments_of(t)
        base = self.extra_bytes
        self.extra.extend((base + off, buf) for off, buf in t.extra)
        self.extra_bytes = base + t.extra_bytes
        moved = {off: base + off for off, _ in t.extra}
        refs = self.extra_refs
        return {"n": t.rows, "c": [_numbered(c, at, moved, refs) for c in t.columns]}

    def rows(self, r: Any) -> dict[str, Any]:
        """Rows of a stored batch (:class:`flightq.server.media.RowsAnswer`, its form
        described): each column its answer form sliced is described from the form's kept
        description, with the slice's length, offset and nulls, and carries only its own
        inline bytes; the columns made afresh are described buffer by buffer. Raises
        :class:`_Stale` as :meth:`whole`."""
        t = r.whole.described
        at = self._segments_of(t)
        moved: dict[int, int] = {}
        for (off, buf), col in zip(t.extra, t.extra_columns, strict=True):
            if col not in r.made:
                moved[off] = self.inline(buf)
        refs = self.extra_refs
        out = []
        for i, c in enumerate(r.batch.columns):
            if i in r.made:
                out.append(self.array(c))
            else:
                out.append(_sliced(_numbered(t.columns[i], at, moved, refs), c))
        return {"n": r.batch.num_rows, "c": out}

    def _segments_of(self, t: _Template) -> list[int]:
        """The answer's number of each segment of a kept description; raises
        :class:`_Stale` where one is gone."""
        at: list[int] = []
        for ref in t.segments:
            i = self._segment(ref)
            if i is None:
                raise _Stale
            at.append(i)
        return at

    def inline(self, buf: pa.Buffer) -> int:
        """Where ``buf`` goes among the answer's own bytes (appended, aligned)."""
        at = self.extra_bytes
        self.extra.append((at, buf))
        self.extra_bytes = (at + buf.size + _ALIGN - 1) // _ALIGN * _ALIGN
        return at

    def batch(self, b: pa.RecordBatch) -> dict[str, Any]:
        """A batch's table entry, buffer by buffer."""
        return {"n": b.num_rows, "c": [self.array(c) for c in b.columns]}

    def array(self, a: pa.Array) -> dict[str, Any]:
        t = a.type
        if pa.types.is_dictionary(t):
            assert isinstance(a, pa.DictionaryArray)
            return {"i": self.array(a.indices), "d": self.array(a.dictionary)}
        bufs = a.buffers()[: t.num_buffers]
        hits = [_located(b) for b in bufs]
        if not self._keep and _spare_in_heap(a, bufs, hits):
            a = pa.concat_arrays([a])  # its bytes are copied into the answer's: only these
            bufs = a.buffers()[: t.num_buffers]
            hits = [None] * len(bufs)  # the copy lies in no segment
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            children = [self.array(a.values)]
        elif t.num_fields:
            raise _Unsupported(str(t))
        else:
            children = []
        return {
            "n": len(a),
            "o": a.offset,
            "z": a.null_count,
            "b": [self.buffer(b, h) for b, h in zip(bufs, hits, strict=True)],
            "c": children,
        }


#: Bytes of its buffers a slice may leave unused before an answer copying it out of
#: memory no segment holds compacts it first (:func:`_spare_in_heap`).
SPARE_SLICE_BYTES = 64 << 10


def _located(buf: pa.Buffer | None) -> Any:
    """The mapped segment and offset of ``buf``'s bytes (``MAPPED.locate``), or None."""
    return MAPPED.locate(buf.address, buf.size) if buf is not None and buf.size else None


def _spare_in_heap(a: pa.Array, bufs: list[pa.Buffer | None], hits: list[Any]) -> bool:
    """Whether ``a`` (its own buffers ``bufs``, where each lies: ``hits``) is a slice of a
    large buffer no mapped segment holds, of which it uses much less: an answer would copy
    it whole into its own bytes (rows a put over the socket left in the server's memory,
    read through shared memory)."""
    large = [
        h for b, h in zip(bufs, hits, strict=True) if b is not None and b.size >= SPARE_SLICE_BYTES
    ]
    if not large or any(h is not None for h in large):
        return False
    return a.get_total_buffer_size() - a.nbytes >= SPARE_SLICE_BYTES


class _Stale(Exception):
    """A kept description names a segment no longer there: describe the batch afresh."""


class _Template:
    """A batch's table entry as describing it found it, each segment numbered by its
    place in :attr:`segments` and each inline buffer by its offset in :attr:`extra`."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        d = _Describer(keep=True)
        self.rows = batch.num_rows
        self.columns = []
        #: Per inline buffer, the column whose description names it.
        self.extra_columns: list[int] = []
        for i, c in enumerate(batch.columns):
            before = len(d.extra)
            self.columns.append(d.array(c))
            self.extra_columns.extend([i] * (len(d.extra) - before))
        self.segments = d.refs
        self.extra = d.extra
        self.extra_bytes = d.extra_bytes


def prepare(whole: Any) -> None:
    """Describe a stored batch's kept answer form (:class:`~flightq.server.media.WholeAnswer`,
    ``kept``) now, as its first answer would: that answer then only numbers it."""
    if whole.kept and whole.described is None:
        with contextlib.suppress(_Unsupported):  # each answer writes such a batch out
            whole.described = _Template(whole.batch)


def _sliced(desc: dict[str, Any], a: pa.Array) -> dict[str, Any]:
    """The description of a whole array, ``desc``, made that of ``a``, a slice of it: the
    same buffers, with ``a``'s length, offset and nulls (a dictionary array's indices are
    sliced, its dictionary not: no column of a flightq batch is one but media columns,
    which a slice makes afresh)."""
    if "i" in desc:
        assert isinstance(a, pa.DictionaryArray)
        return {"i": _sliced(desc["i"], a.indices), "d": desc["d"]}
    return {**desc, "n": len(a), "o": a.offset, "z": a.null_count}


def _numbered(
    desc: dict[str, Any], at: list[int], moved: dict[int, int], extra_refs: list[list[int]]
) -> dict[str, Any]:
    """A kept array description with its segments at ``at`` and each inline buffer at
    ``moved[offset]`` among the answer's own bytes: new lists throughout (an answer may
    renumber the inline ones later)."""
    if "i" in desc:
        return {
            "i": _numbered(desc["i"], at, moved, extra_refs),
            "d": _numbered(desc["d"], at, moved, extra_refs),
        }
    bufs: list[list[int] | None] = []
    for ref in desc["b"]:
        if ref is None:
            bufs.append(None)
        elif ref[0] >= 0:
            bufs.append([at[ref[0]], ref[1], ref[2]])
        else:
            out = [-1, moved[ref[1]], ref[2]]
            extra_refs.append(out)
            bufs.append(out)
    return {
        "n": desc["n"],
        "o": desc["o"],
        "z": desc["z"],
        "b": bufs,
        "c": [_numbered(c, at, moved, extra_refs) for c in desc["c"]],
    }


def answer(
    pool: SegmentPool | None,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    what: str,
    room: Callable[[], AbstractContextManager[Callable[[int], bool]]] | None = None,
    wrote: list[dict[str, Any]] | None = None,
    wholes: Sequence[Any] | None = None,
) -> tuple[pa.Schema, list[pa.RecordBatch]] | None:
    """A read's answer over shared memory: the one-row stream that names its bytes.

    An answer that needs a segment of its own writes it in ``pool`` (None: it needs none,
    :func:`prepare_reply`) within ``room()``, a context
    giving ``admit(size)``: whether ``size`` more bytes of segment may wait for their
    reader (asked for the least file first, then for what a larger one reused adds).
    None when it may not, or when the directory has no room for the segment (the caller
    answers over the socket). The reference of a segment written is appended to
    ``wrote``. ``wholes``: where the batches are stored batches answered whole, their
    :class:`~flightq.server.media.WholeAnswer` (each keeps its description for the next
    answer).
    """
    batches = list(batches)
    again = _kept_reply(schema, batches, wholes)
    if again is not None:
        return again
    with contextlib.nullcontext(None) if room is None else room() as admit:
        try:
            d, table = _described(batches, wholes)
        except _Unsupported:
            if pool is None:
                return None
            try:
                ref = pool.write(schema, batches, what, admit=admit)
            except (Declined, ResourceExhaustedError):  # no room: over the socket
                return None
            if wrote is not None:
                wrote.append(ref)
            return _reply(ref)
        if d.extra_bytes > INLINE_BYTES:
            if pool is None:
                return None
            try:
                ref = pool.write_bytes(d.extra, d.extra_bytes, what, admit=admit)
            except (Declined, ResourceExhaustedError):  # no room: over the socket
                return None
            if wrote is not None:
                wrote.append(ref)
            for r in d.extra_refs:
                r[0] = len(d.segments)
            d.segments.append(ref)
    inline = b""
    if d.extra and d.extra_bytes <= INLINE_BYTES:
        out = bytearray(d.extra_bytes)
        for at, buf in d.extra:
            out[at : at + buf.size] = memoryview(buf)
        inline = bytes(out)
    reply = _reply(
        {
            _TABLE: 1,
            "schema": schema.serialize().to_pybytes(),
            "segments": d.segments,
            "inline": inline,
            "batches": table,
        }
    )
    if d.kept and d.extra_bytes <= KEPT_INLINE_BYTES and wholes and all(map(_whole, wholes)):
        wholes[0].reply = _Kept(tuple(map(weakref.ref, wholes)), schema, d.refs, reply)
    return reply


def prepare_reply(wholes: Sequence[Any]) -> None:
    """The answer of a put's stored batches read whole, in order (a get of the step), made
    now from their kept descriptions (:func:`prepare`) and kept for its first reader."""
    if not wholes or not all(_whole(w) and w.described is not None for w in wholes):
        return
    if sum(w.described.extra_bytes for w in wholes) > KEPT_INLINE_BYTES:
        return
    schema = wholes[0].batch.schema
    if all(w.batch.schema.equals(schema, check_metadata=True) for w in wholes[1:]):
        answer(None, schema, [w.batch for w in wholes], "an answer prepared", wholes=wholes)


#: Most inline bytes of an answer of stored batches read whole that its first piece keeps
#: (:class:`_Kept`) for the next reader: beyond, the answer is made afresh each time.
KEPT_INLINE_BYTES = 16 << 10


@dataclass(eq=False)
class _Kept:
    """An answer of stored batches read whole (``wholes``, their answer forms, in order,
    held weakly: the first holds this) as it was sent, for the next reader of exactly
    those: the same table, while its segments' files (``refs``) are still there."""

    wholes: tuple[weakref.ref[Any], ...]
    schema: pa.Schema
    refs: list[dict[str, Any]]
    reply: tuple[pa.Schema, list[pa.RecordBatch]]


def _whole(w: Any) -> bool:
    """Whether ``w`` is a stored batch's kept answer form read whole (a WholeAnswer)."""
    return getattr(w, "kept", False) and not hasattr(w, "whole")


def _kept_reply(
    schema: pa.Schema, batches: list[pa.RecordBatch], wholes: Sequence[Any] | None
) -> tuple[pa.Schema, list[pa.RecordBatch]] | None:
    """The answer kept for exactly these stored batches read whole, if their segments are
    still there; None otherwise."""
    if not wholes or len(wholes) != len(batches):
        return None
    k = getattr(wholes[0], "reply", None)
    if k is None or len(k.wholes) != len(wholes):
        return None
    if not all(
        a() is b and b.batch is c for a, b, c in zip(k.wholes, wholes, batches, strict=True)
    ):
        return None
    if not (k.schema is schema or k.schema.equals(schema, check_metadata=True)):
        return None
    return k.reply if all(still_there(ref) for ref in k.refs) else None


def _described(
    batches: list[pa.RecordBatch], wholes: Sequence[Any] | None
) -> tuple[_Describer, list[dict[str, Any]]]:
    """The answer's table entries, and what named their buffers: stored batches answered
    whole (``wholes``, one per batch) from their kept descriptions, other batches buffer
    by buffer."""
    if (
        wholes is not None
        and len(wholes) == len(batches)
        and all(w.batch is b for w, b in zip(wholes, batches, strict=True))
    ):
        d = _Describer()
        with contextlib.suppress(_Stale):  # a segment went: located afresh below
            table = [_answered(d, w) for w in wholes]
            d.kept = True
            return d, table
    d = _Describer()
    return d, [d.batch(b) for b in batches]


def _answered(d: _Describer, w: Any) -> dict[str, Any]:
    """The table entry of a stored batch answered whole or of rows of one, from its kept
    description where it keeps one."""
    if hasattr(w, "whole"):  # rows of a stored batch (RowsAnswer)
        return d.rows(w) if w.whole.kept and w.whole.described is not None else d.batch(w.batch)
    return d.whole(w) if w.kept else d.batch(w.batch)


def _reply(body: dict[str, Any]) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    marker = pa.array([pack(body)], type=pa.binary())
    return pa.schema([(MARKER, pa.binary())]), [pa.record_batch([marker], names=[MARKER])]


def take(batches: list[pa.RecordBatch], dirpath: str, what: str) -> list[pa.RecordBatch]:
    """The batches a read's answer names: rebuilt over mapped segments, or as they came.

    Raises
    ------
    ProtocolError
        If the answer is malformed, names segments outside ``dirpath`` or gone, or its
        arrays do not validate.
    """
    if len(batches) != 1 or batches[0].schema.names != [MARKER]:
        return batches
    body = unpack(batches[0].column(0)[0].as_py(), f"{what}: shared-memory answer")
    if _TABLE not in body:
        return read_private(body, dirpath, what)
    try:
        return _rebuild(body, dirpath, what)
    except (pa.ArrowException, KeyError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"{what}: the shared-memory answer is malformed: {e}") from e


#: Whether a read fills the page tables of the segments it maps at once (one
#: ``madvise(MADV_POPULATE_READ)`` per segment) instead of on first touch. Off: on the
#: 2-core machine first touch reads faster (see the module's doc); ``benchmarks/
#: consumer_scaling.py --populate`` measures both on a host of many readers.
POPULATE_READS = False


class _Views:
    """The table's bytes: each segment mapped once over the span its buffers use."""

    def __init__(self, body: dict[str, Any], dirpath: str, what: str) -> None:
        segments = body["segments"]
        spans: dict[int, tuple[int, int]] = {}
        for b in body["batches"]:
            for c in b["c"]:
                _spans(c, spans)
        self.maps: dict[int, tuple[int, pa.Buffer]] = {}
        for i, (lo, hi) in spans.items():
            if not 0 <= i < len(segments):
                raise ProtocolError(f"{what}: the answer names segment {i} of {len(segments)}")
            data = map_data(segments[i], dirpath, what, lo, hi, populate=POPULATE_READS)
            self.maps[i] = (lo, pa.py_buffer(data))
        inline = body["inline"]
        buf = pa.allocate_buffer(len(inline))  # aligned for every buffer in it
        np.frombuffer(buf, dtype=np.uint8)[:] = np.frombuffer(inline, dtype=np.uint8)
        self.maps[-1] = (0, buf)
        self.what = what

    def buffer(self, ref: list[int] | None) -> pa.Buffer | None:
        if ref is None:
            return None
        i, at, size = ref
        lo, data = self.maps[i]
        if at < lo or at + size > lo + data.size:
            raise ProtocolError(
                f"{self.what}: buffer [{at}, {at + size}) lies outside segment {i}'s mapping"
            )
        return data.slice(at - lo, size)


def _spans(desc: dict[str, Any], spans: dict[int, tuple[int, int]]) -> None:
    """Widen ``spans`` (segment -> bytes) to cover the buffers of one array."""
    if "i" in desc:
        _spans(desc["i"], spans)
        _spans(desc["d"], spans)
        return
    for ref in desc["b"]:
        if ref is not None and ref[0] >= 0:
            i, at, size = ref
            lo, hi = spans.get(i, (at, at + size))
            spans[i] = (min(lo, at), max(hi, at + size))
    for child in desc["c"]:
        _spans(child, spans)


def _array(t: pa.DataType, desc: dict[str, Any], views: _Views) -> pa.Array:
    if pa.types.is_dictionary(t):
        indices = _array(t.index_type, desc["i"], views)
        dictionary = _array(t.value_type, desc["d"], views)
        return pa.DictionaryArray.from_arrays(indices, dictionary)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        (child,) = desc["c"]
        children = [_array(t.value_type, child, views)]
    else:
        children = []
    bufs = [views.buffer(b) for b in desc["b"]]
    return pa.Array.from_buffers(
        t, desc["n"], bufs, null_count=desc["z"], offset=desc["o"], children=children or None
    )


def _rebuild(body: dict[str, Any], dirpath: str, what: str) -> list[pa.RecordBatch]:
    schema = pa.ipc.read_schema(pa.py_buffer(body["schema"]))
    views = _Views(body, dirpath, what)
    out = []
    for b in body["batches"]:
        if len(b["c"]) != len(schema):
            raise ProtocolError(
                f"{what}: a batch of the answer has {len(b['c'])} columns, the schema {len(schema)}"
            )
        arrays = [_array(f.type, c, views) for f, c in zip(schema, b["c"], strict=True)]
        rb = pa.RecordBatch.from_arrays(arrays, schema=schema)
        if rb.num_rows != b["n"]:
            raise ProtocolError(f"{what}: a batch of {rb.num_rows} rows, {b['n']} announced")
        rb.validate(full=True)
        out.append(rb)
    return out
