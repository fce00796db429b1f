"""Flight's wire messages by hand: FlightData protobufs and IPC headers a client may lie in.

pyarrow's Flight client writes record batches as Arrow's IPC writer lays them out: each
buffer right after the one before. A client writing FlightData itself can say anything in
a batch's flatbuffer header: here, buffers placed with a gap between them, which Arrow's
reader accepts and the server then holds, gap included.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from flightq.ipccheck import _field, _target

__all__ = ["flight_data", "gapped", "schema_header"]

#: FlightDescriptor.DescriptorType CMD (Flight.proto).
_CMD = 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(data)) + data


def flight_data(header: bytes, body: bytes = b"", command: bytes | None = None) -> bytes:
    """A serialized ``FlightData``: ``data_header`` (2), ``data_body`` (1000) and, for a
    stream's first message, a command ``flight_descriptor`` (1)."""
    out = b""
    if command is not None:
        out += _bytes_field(1, _varint(1 << 3) + _varint(_CMD) + _bytes_field(2, command))
    out += _bytes_field(2, header)
    if body:
        out += _bytes_field(1000, body)
    return out


def schema_header(schema: pa.Schema) -> bytes:
    """The flatbuffer header of ``schema``'s IPC message."""
    return pa.ipc.read_message(schema.serialize()).metadata.to_pybytes()


def gapped(batch: pa.RecordBatch, gap: int) -> tuple[bytes, bytes]:
    """``batch``'s IPC header and body with ``gap`` zero bytes before its last buffer
    (that buffer's offset and the body length moved to match): the same batch to Arrow's
    reader, ``gap`` bytes more in the message."""
    msg = pa.ipc.read_message(batch.serialize())
    meta, body = bytearray(msg.metadata.to_pybytes()), msg.body.to_pybytes()
    root = struct.unpack_from("<I", meta, 0)[0]
    header = _target(meta, _field(meta, root, 2))  # Message.header: the RecordBatch
    buffers = _target(meta, _field(meta, header, 2))  # RecordBatch.buffers
    n = struct.unpack_from("<I", meta, buffers)[0]
    last = buffers + 4 + 16 * (n - 1)  # struct Buffer {offset: long; length: long}
    offset = struct.unpack_from("<q", meta, last)[0]
    struct.pack_into("<q", meta, last, offset + gap)
    length_at = _field(meta, root, 3)  # Message.bodyLength
    struct.pack_into("<q", meta, length_at, struct.unpack_from("<q", meta, length_at)[0] + gap)
    return bytes(meta), body[:offset] + b"\0" * gap + body[offset:]
