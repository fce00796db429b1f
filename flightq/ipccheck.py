"""Arrow IPC messages checked before Arrow decodes them: no compressed bodies, no
dictionary deltas.

Arrow's IPC reader decompresses a body buffer compressed with LZ4 or zstd into a buffer of
the size the buffer itself declares, before anything else can look at it: 12 KiB of zstd
frames declaring 400 MB of zeros take 400 MB of the reader's memory, and a 4 MiB message
could ask for about 100 GB. flightq never compresses IPC bodies (its codecs compress
cells, checked against their declared sizes: :mod:`flightq.codecs`), so a reader of bytes
a client sent refuses any record batch or dictionary batch whose message says it is
compressed, before decoding it.

A dictionary delta is refused for the same reason: Arrow's IPC stream reader builds each
delta's dictionary as a new copy of the whole dictionary so far, and each record batch after
it keeps its copy alive; a 4 MiB frame of one 2 MiB image and 2 000 empty deltas took a
server 4.3 GB. flightq's writers never emit deltas.

The check reads the message's flatbuffer header, which Arrow has verified when it framed
the message (:func:`pyarrow.ipc.read_message`): ``Message.header`` is a ``RecordBatch``
(or a ``DictionaryBatch`` holding one), and ``RecordBatch.compression`` is its field 3.
"""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa

from .errors import ProtocolError

__all__ = ["check_message", "check_stream"]

#: ``MessageHeader`` union tags (Arrow's Message.fbs).
_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3


def _field(meta: bytes, table: int, index: int) -> int:
    """Absolute position of field ``index`` of the flatbuffer table at ``table``; 0 when
    the field is absent."""
    vtable = table - struct.unpack_from("<i", meta, table)[0]
    size = struct.unpack_from("<H", meta, vtable)[0]
    at = 4 + 2 * index
    if at + 2 > size:
        return 0
    off = struct.unpack_from("<H", meta, vtable + at)[0]
    return table + off if off else 0


def _target(meta: bytes, pos: int) -> int:
    """The table an offset field at ``pos`` points to."""
    return pos + struct.unpack_from("<I", meta, pos)[0]


def _header(meta: bytes) -> tuple[int, int]:
    """A message's header kind and the position of its table (0, 0 without one)."""
    root = struct.unpack_from("<I", meta, 0)[0]
    kind_at = _field(meta, root, 1)
    header_at = _field(meta, root, 2)
    if not kind_at or not header_at:
        return 0, 0
    return meta[kind_at], _target(meta, header_at)


def _delta(meta: bytes, kind: int, header: int) -> bool:
    """Whether the message (its :func:`_header`) is a dictionary batch that adds to an
    earlier one (``DictionaryBatch.isDelta``, its field 2)."""
    if kind != _DICTIONARY_BATCH:
        return False
    at = _field(meta, header, 2)
    return bool(at and meta[at])


def _compressed(meta: bytes, kind: int, header: int) -> bool:
    """Whether the message (its :func:`_header`) is a record or dictionary batch whose
    body is compressed (``RecordBatch.compression``, its field 3)."""
    if not header:
        return False
    if kind == _DICTIONARY_BATCH:
        data_at = _field(meta, header, 1)
        if not data_at:
            return False
        header = _target(meta, data_at)
    elif kind != _RECORD_BATCH:
        return False
    return bool(_field(meta, header, 3))


def check_message(message: Any, what: str) -> None:
    """Refuse ``message`` (a :class:`pyarrow.ipc.Message`) if its body is compressed, or
    if it is a dictionary delta.

    Raises
    ------
    ProtocolError
        Naming ``what``, if the message is a compressed record or dictionary batch, a
        dictionary batch that adds to an earlier one, or its header cannot be read.
    """
    if message.type not in ("record batch", "dictionary"):
        return
    try:
        meta = message.metadata.to_pybytes()
        kind, header = _header(meta)
        compressed = _compressed(meta, kind, header)
        delta = _delta(meta, kind, header)
    except (struct.error, IndexError) as e:
        raise ProtocolError(f"{what}: an Arrow IPC message header does not parse: {e}") from e
    if delta:
        raise ProtocolError(
            f"{what}: an Arrow IPC dictionary batch is a delta (it adds to an earlier "
            "dictionary); flightq refuses it before decoding (Arrow's reader copies the "
            "whole dictionary at each delta, and every batch keeps its copy): send each "
            "stream's dictionaries whole, as flightq's writers do"
        )
    if compressed:
        raise ProtocolError(
            f"{what}: an Arrow IPC {message.type} has a compressed body (IPC compression); "
            "flightq refuses it before decoding (its size is whatever the sender declares): "
            "send uncompressed IPC, and compress cells with a field codec instead"
        )


def check_stream(buf: pa.Buffer, what: str) -> None:
    """Refuse an Arrow IPC stream in ``buf`` if any of its batches is compressed (its
    messages are framed, not decoded: the check reads headers only).

    Raises
    ------
    ProtocolError
        As :func:`check_message`; or if the stream's framing does not parse.
    """
    try:
        reader = pa.ipc.MessageReader.open_stream(buf)
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                return
            if message is None:
                return
            check_message(message, what)
    except ProtocolError:
        raise
    except (pa.ArrowException, EOFError, OSError, ValueError) as e:
        raise ProtocolError(f"{what}: the Arrow IPC stream does not parse: {e}") from e
