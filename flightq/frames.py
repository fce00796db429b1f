"""Frames of the request stream: a msgpack header and Arrow IPC record batches in the app
metadata of one Flight message.

A client's small puts, gets and claims travel over one long-lived DoExchange stream (see
``docs/protocol.md``, "The request stream"). A DoExchange writer can send one schema per
stream, and every partition and field subset has its own, so each request and each answer
is one metadata-only Flight message whose ``app_metadata`` is a frame::

    u32 little-endian   header length
    header              msgpack map: "op", "cmd" (requests), "ok" or "error" (answers),
                        and where batches follow: "body" ("rb" or "ipc"), "schema" and
                        "batches" (byte lengths)
    body                "rb": the schema's IPC message, then each record batch's IPC
                        message (no dictionaries); "ipc": one Arrow IPC stream (batches
                        with dictionary columns: shared media)

Every length is checked against the bytes that arrived: a frame whose lengths do not add
up, whose header is no msgpack map or whose IPC bytes do not parse is refused with
:class:`~flightq.errors.ProtocolError`, before anything is stored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from .errors import FlightqError, ProtocolError, ResourceExhaustedError
from .ipccheck import check_message, check_stream
from .protocol import MAX_BODY, pack, unpack

__all__ = [
    "MAX_FRAME_BYTES",
    "STREAM_ACK_ROWS",
    "STREAM_ACTIONS",
    "STREAM_MAX_BYTES",
    "STREAM_READS",
    "Frame",
    "SchemaMemo",
    "pack_frame",
    "parse_frame",
]

#: Largest frame a server takes or sends on the request stream; a larger answer is
#: refused with ``"retry"`` and the client asks again per call.
MAX_FRAME_BYTES = 4 << 20
#: Payload bytes a put sends, or a read is expected to answer, at most to take the stream.
STREAM_MAX_BYTES = 1 << 20
#: The actions that only read (a reply too large for a frame is answered ``"retry"``, and
#: asked again per call, or again after a broken stream, with the same answer).
STREAM_READS = frozenset({"list_keys", "inspect", "stats", "describe", "dead_letters"})
#: The actions a client may send on the stream (op ``"act"``): the small, frequent ones of
#: a training loop. A reply that changes rows is a few integers, except an ack's list of
#: rows lost to another claim, which a client keeps within a frame by sending on the stream
#: only acks of claims of up to :data:`STREAM_ACK_ROWS` rows.
STREAM_ACTIONS = frozenset({"ack", "nack", "clear", "reset"}) | STREAM_READS
#: Largest claim (rows) whose ack a client sends on the stream: the keys it may name as
#: lost (at most 1 KiB each) fit in a frame.
STREAM_ACK_ROWS = 1024
#: Parsed schemas kept per process, by their IPC bytes (their message is a few KiB).
_SCHEMA_CACHE = 256
#: Largest schema (IPC bytes) kept in the cache: well above any flightq schema with its
#: metadata, so 256 of them hold a few MiB at most.
_SCHEMA_CACHED_BYTES = 16 * 1024
_U32 = 4


class Frame:
    """A parsed frame: its header, and the schema and batches it carried (if any).

    ``blocks``: where each batch was read from a block of memory of its own (a checked
    ``"rb"`` body), that block's size in bytes, per batch; None where the batches share
    what they were read from."""

    __slots__ = ("batches", "blocks", "header", "schema")

    def __init__(
        self,
        header: dict[str, Any],
        schema: pa.Schema | None,
        batches: list[pa.RecordBatch],
        blocks: list[int] | None = None,
    ) -> None:
        self.header, self.schema, self.batches, self.blocks = header, schema, batches, blocks


class SchemaMemo:
    """A value computed once per Arrow schema, for the last few schemas seen. Thread-safe.

    Each record batch hands out its own ``pa.Schema`` object, so neither identity nor a
    hash (30 µs) finds the same schema again; ``equals`` does (a fraction of a µs where
    both share one C++ schema, as the batches of one stream do).
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: list[tuple[pa.Schema, Any]] = []

    def get(self, schema: pa.Schema, make: Callable[[pa.Schema], Any]) -> Any:
        """``make(schema)``, or the value it gave for an equal schema."""
        value = self.find(schema)
        if value is None:
            value = make(schema)
            self.keep(schema, value)
        return value

    def find(self, schema: pa.Schema) -> Any:
        """The value kept for a schema equal to ``schema``, or None."""
        for s, v in self._entries:
            if s.equals(schema, check_metadata=True):
                return v
        return None

    def keep(self, schema: pa.Schema, value: Any) -> None:
        """Keep ``value`` for ``schema``, the oldest entry making room."""
        self._entries = [(schema, value), *self._entries[: self._size - 1]]


class _Schemas:
    """Schemas to IPC bytes and back, cached: the same few schemas come again and again,
    and each costs about 13 µs to write or read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out = SchemaMemo()
        self._in: dict[bytes, pa.Schema] = {}

    def write(self, schema: pa.Schema) -> tuple[bytes, bool]:
        """The schema's IPC bytes, and whether it has dictionary columns."""
        return self._out.get(schema, lambda s: (s.serialize().to_pybytes(), _has_dictionary(s)))

    def read(self, raw: bytes) -> pa.Schema:
        hit = self._in.get(raw)
        if hit is not None:
            return hit
        schema = pa.ipc.read_schema(pa.py_buffer(raw))
        if len(raw) > _SCHEMA_CACHED_BYTES:
            return schema  # a hostile one: never kept (the budget's checks refuse it)
        with self._lock:
            if len(self._in) >= _SCHEMA_CACHE:
                self._in.clear()
            self._in[raw] = schema
        return schema


_SCHEMAS = _Schemas()


def _has_dictionary(schema: pa.Schema) -> bool:
    return any(
        pa.types.is_dictionary(f.type)
        or (pa.types.is_large_list(f.type) and pa.types.is_dictionary(f.type.value_type))
        for f in schema
    )


def pack_frame(
    header: dict[str, Any],
    schema: pa.Schema | None = None,
    batches: Sequence[pa.RecordBatch] = (),
) -> pa.Buffer:
    """One frame: ``header`` and, given a ``schema``, the record batches (all of it)."""
    parts: list[Any] = []
    if schema is not None:
        raw, dictionary = _SCHEMAS.write(schema)
        if dictionary:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, schema) as w:
                for b in batches:
                    w.write_batch(b)
            body = sink.getvalue()
            header = {**header, "body": "ipc", "batches": [body.size]}
            parts.append(body)
        else:
            bodies = [b.serialize() for b in batches]
            header = {
                **header,
                "body": "rb",
                "schema": len(raw),
                "batches": [b.size for b in bodies],
            }
            parts.append(raw)
            parts.extend(bodies)
    head = pack(header)
    return pa.py_buffer(b"".join([len(head).to_bytes(_U32, "little"), head, *parts]))


def parse_frame(
    buf: pa.Buffer | None, what: str, *, check: bool = False, limit: int | None = None
) -> Frame:
    """A frame's header, schema and record batches (zero-copy slices of ``buf``).

    ``check=True`` (a server reading a client's batches) also runs Arrow's full
    validation of each batch: its offsets must stay inside its buffers; and the batches
    are read from a copy of their own bytes, so that storing them keeps nothing else of
    the frame alive. ``limit``: the server's cap on the header, a control message
    (:func:`flightq.protocol.unpack`).

    Raises
    ------
    ProtocolError
        No frame, a header that is no msgpack map, lengths that do not add up to the bytes
        that arrived, or IPC bytes that do not parse.
    ResourceExhaustedError
        A frame larger than :data:`MAX_FRAME_BYTES`, or a header past ``limit``.
    """
    if buf is None:
        raise ProtocolError(f"{what}: a request stream message must carry a frame in its metadata")
    size = buf.size
    if size > MAX_FRAME_BYTES:
        raise ResourceExhaustedError(
            f"{what}: a frame of {size} bytes exceeds the request stream's limit of "
            f"{MAX_FRAME_BYTES}; send it per call",
            expected=MAX_FRAME_BYTES,
            actual=size,
        )
    if size < _U32:
        raise ProtocolError(f"{what}: a frame of {size} bytes is too short for its header length")
    n = int.from_bytes(buf.slice(0, _U32).to_pybytes(), "little")
    if n > min(MAX_BODY, size - _U32):
        raise ProtocolError(
            f"{what}: the frame announces a header of {n} bytes; {size - _U32} bytes follow"
        )
    header = unpack(buf.slice(_U32, n), what, limit)
    at = _U32 + n
    kind = header.get("body")
    if kind is None:
        if at != size:
            raise ProtocolError(f"{what}: {size - at} bytes follow a frame that carries no body")
        return Frame(header, None, [])
    lengths = header.get("batches")
    schema_len = header.get("schema", 0) if kind == "rb" else 0
    if (
        kind not in ("rb", "ipc")
        or not isinstance(lengths, list)
        or not all(_length(x) for x in [schema_len, *lengths])
    ):
        raise ProtocolError(
            f"{what}: the frame's body is described as {kind!r} with lengths {lengths!r} "
            f"(schema {schema_len!r}); expected 'rb' or 'ipc' and lists of byte counts"
        )
    if at + schema_len + sum(lengths) != size:
        raise ProtocolError(
            f"{what}: the frame announces {schema_len + sum(lengths)} body bytes; "
            f"{size - at} arrived"
        )
    try:
        if kind == "ipc":
            if len(lengths) != 1:
                raise ProtocolError(f"{what}: an 'ipc' body is one Arrow IPC stream")
            check_stream(buf.slice(at), what)  # before Arrow decodes (and inflates) it
            body = _own(buf.slice(at)) if check else buf.slice(at)
            table = pa.ipc.open_stream(body).read_all()
            schema, batches = table.schema, table.to_batches()
        else:
            schema = _SCHEMAS.read(buf.slice(at, schema_len).to_pybytes())
            at += schema_len
            batches = []
            for length in lengths:
                piece = buf.slice(at, length)
                message = pa.ipc.read_message(_own(piece) if check else piece)
                check_message(message, what)
                batches.append(pa.ipc.read_record_batch(message, schema))
                at += length
        if check:
            schema.names  # noqa: B018  (field names must be UTF-8: refused here, typed)
            for b in batches:
                b.validate(full=True)
    except FlightqError:  # the IPC checks' own refusals, as they are
        raise
    except MemoryError as e:  # Arrow's too (ArrowMemoryError): an allocation past the cap
        raise ResourceExhaustedError(
            f"{what}: the frame's Arrow IPC bytes need more memory than the server can take ({e})"
        ) from e
    except (pa.ArrowException, EOFError, OSError, ValueError) as e:  # what Arrow raises
        raise ProtocolError(f"{what}: the frame's Arrow IPC bytes do not parse: {e}") from e
    # Each checked "rb" batch was read from its own copy of exactly its message's bytes.
    blocks = list(lengths) if check and kind == "rb" else None
    return Frame(header, schema, batches, blocks)


def _length(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_FRAME_BYTES


def _own(piece: pa.Buffer) -> pa.Buffer:
    """A copy of ``piece`` in a buffer of its own: batches a server stores are slices of
    the buffer they were read from, and the rest of the frame (its header, the schema,
    anything a client padded it with) would live, uncounted, as long as they do."""
    return pa.py_buffer(piece.to_pybytes())
