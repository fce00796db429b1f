"""Reference point: bare pyarrow Flight DoPut / DoGet of the step's bytes.

``bare-flight`` moves every row's payloads (a group's shared image once per row, the
logical bytes); ``bare-flight-once`` moves the step's distinct bytes (each shared image
once): the Flight transport alone, on the bytes a design that sends media once must move.
``bare-flight-records`` moves flightq's own record batches (the step encoded by
:func:`flightq.encode_chunks` as a put encodes it, before the timer) and reads them back
without validating or decoding them: the wire format's transport alone. flightq's speed
against it (below 1x) is what its own work (encode, checks, store, assembly, decode)
costs. It replays the put's batches on the get; flightq answers a whole step put at once
with the same batches (answers are cut at the stored batches and at the same size).
``bare-flight-exchange`` moves the same record batches as messages on one DoExchange
stream that the producer and the consumer each hold open: a put is one message (split
past :data:`EXCHANGE_PART_BYTES`) answered by one, a get one request answered by the
stored messages. It is the least a design that keeps a session per client (as flightq's
request stream does for small calls) can take on Flight: no call set-up, no schema per
call, nothing parsed on either side.

``bare-flight`` and ``bare-flight-once`` send the step's payloads as one
``large_binary`` column, one element per tensor, in record batches of at most
:data:`CHUNK_BYTES` (``bare-flight-once``: :data:`ONCE_CHUNK_BYTES`, the fastest of 4,
16 and 64 MiB for W1's distinct bytes on the 2-core machine: get 26, 11 and 7 GB/s
logical, medians of 7 noisy repetitions). The column is built before the timer starts
(it is the serialisation a real system would add; this point measures the transport).
The server keeps the table in memory and streams it back unchanged.

Run as a module (``python -m flightq_bench.arrowflight``) it serves on a free loopback
port, prints ``{"listening": "grpc://127.0.0.1:PORT"}`` and exits on SIGTERM or when its
standard input closes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from .endpoint import Consumer, Producer, now_ns, timed
from .payload import VerifyError, flat_buffers

__all__ = [
    "CHUNK_BYTES",
    "EXCHANGE_PART_BYTES",
    "ONCE_CHUNK_BYTES",
    "BareServer",
    "FlightProducer",
    "FlightConsumer",
    "FlightOnceProducer",
    "FlightOnceConsumer",
    "FlightRecordsProducer",
    "FlightRecordsConsumer",
    "FlightExchangeProducer",
    "FlightExchangeConsumer",
    "main",
]

#: Payload bytes per record batch sent by the bare Flight reference.
CHUNK_BYTES = 64 * 2**20
#: Payload bytes per record batch of ``bare-flight-once``.
ONCE_CHUNK_BYTES = 4 * 2**20

_SCHEMA = pa.schema([pa.field("payload", pa.large_binary())])

#: Most bytes of one ``bare-flight-exchange`` message; a larger put or answer is split.
EXCHANGE_PART_BYTES = 4 * 2**20
# An exchange message's first byte: a part of a put (more follow, or the last), a get.
_MORE, _LAST, _GET = b"m", b"l", b"g"


class BareServer(fl.FlightServerBase):
    """Holds uploaded tables by descriptor path; serves them back; action ``clear``."""

    def __init__(self, location: str = "grpc://127.0.0.1:0") -> None:
        super().__init__(location)
        self._tables: dict[bytes, pa.Table] = {}
        self._parts: dict[bytes, list[pa.Buffer]] = {}
        self._lock = threading.Lock()

    def do_put(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.FlightMetadataWriter,
    ) -> None:
        table = reader.read_all()
        with self._lock:
            self._tables[descriptor.path[0]] = table
        writer.write(pa.py_buffer(b"stored"))

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.RecordBatchStream:
        with self._lock:
            table = self._tables[ticket.ticket]
        return fl.RecordBatchStream(table)

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> list[bytes]:
        if action.type == "clear":
            with self._lock:
                self._tables.pop(action.body.to_pybytes(), None)
                self._parts.pop(action.body.to_pybytes(), None)
        return []

    def do_exchange(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.MetadataRecordBatchWriter,
    ) -> None:
        """Messages of one client until it ends the stream: the parts of a put, stored as
        they came (the last answered ``stored``), or a get, answered with the same
        messages (their first byte still says which is the last)."""
        path = descriptor.command
        held: list[pa.Buffer] = []
        while True:
            try:
                buf = reader.read_chunk().app_metadata
            except StopIteration:
                return
            op = buf.slice(0, 1).to_pybytes()
            if op == _GET:
                with self._lock:
                    parts = self._parts.get(path) or [pa.py_buffer(_LAST)]
                for part in parts:
                    writer.write_metadata(part)
                continue
            held.append(buf)
            if op == _LAST:
                with self._lock:
                    self._parts[path], held = held, []
                writer.write_metadata(pa.py_buffer(b"stored"))


def _column(step_bufs: list[np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> pa.Table:
    lengths = np.fromiter((len(b) for b in step_bufs), np.int64, len(step_bufs))
    offsets = np.zeros(len(step_bufs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    for b, lo in zip(step_bufs, offsets[:-1], strict=True):
        data[lo : lo + len(b)] = b
    arr = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(step_bufs), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    batches = []
    start = 0
    for i in range(1, len(step_bufs) + 1):
        if i == len(step_bufs) or offsets[i + 1] - offsets[start] > chunk_bytes:
            batches.append(pa.record_batch([arr.slice(start, i - start)], schema=_SCHEMA))
            start = i
    return pa.Table.from_batches(batches, schema=_SCHEMA)


class FlightProducer(Producer):
    """DoPut of the prebuilt column; waits for the server's acknowledgement."""

    #: Send each shared media segment once (``bare-flight-once``).
    distinct = False
    #: Ends the table's path on the shared server (default: ``distinct``).
    tag = ""

    def setup(self) -> dict[str, Any]:
        self.client = fl.FlightClient(self.info["location"])
        self.path = f"{self.info['run']}-{self.step.name}-{self.tag or self.distinct}".encode()
        self._table: pa.Table | None = None
        return {}

    def prepare(self) -> None:
        if self._table is None:
            chunk = ONCE_CHUNK_BYTES if self.distinct else CHUNK_BYTES
            self._table = _column(flat_buffers(self.step, self.distinct), chunk)

    def put(self) -> dict[str, Any]:
        assert self._table is not None
        t0 = now_ns()
        self.send(self._table.schema, self._table.to_batches())
        return timed(t0)

    def send(self, schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> None:
        """One DoPut of ``batches``; returns once the server acknowledged it."""
        desc = fl.FlightDescriptor.for_path(self.path)
        writer, reader = self.client.do_put(desc, schema)
        for batch in batches:
            writer.write_batch(batch)
        writer.done_writing()
        if reader.read() is None:
            raise RuntimeError("bare Flight server sent no acknowledgement")
        writer.close()

    def clear(self) -> None:
        list(self.client.do_action(fl.Action("clear", self.path)))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class FlightConsumer(Consumer):
    """DoGet and ``read_all`` of the column."""

    distinct = False
    tag = ""

    def setup(self) -> dict[str, Any]:
        self.client = fl.FlightClient(self.info["location"])
        self.path = f"{self.info['run']}-{self.ref.name}-{self.tag or self.distinct}".encode()
        self._got: pa.Table | None = None
        return {}

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        self._got = self.client.do_get(fl.Ticket(self.path)).read_all()
        return timed(t0)

    def verify(self) -> None:
        assert self._got is not None
        want = flat_buffers(self.ref, self.distinct)
        i = 0
        for chunk in self._got.column(0).chunks:
            offs = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[
                chunk.offset : chunk.offset + len(chunk) + 1
            ]
            data = chunk.buffers()[2]
            values = (
                np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
            )
            for lo, hi in itertools.pairwise(offs):
                if i >= len(want) or not np.array_equal(values[lo:hi], want[i]):
                    raise VerifyError(f"bare-flight: element {i} differs")
                i += 1
        if i != len(want):
            raise VerifyError(f"bare-flight: {i} elements, expected {len(want)}")

    def release(self) -> None:
        self._got = None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class FlightOnceProducer(FlightProducer):
    """DoPut of the step's distinct bytes (a shared image once)."""

    distinct = True


class FlightOnceConsumer(FlightConsumer):
    """DoGet of the step's distinct bytes."""

    distinct = True


class FlightRecordsProducer(FlightProducer):
    """DoPut of the record batches a flightq put of the step sends (encoded untimed)."""

    tag = "records"

    def prepare(self) -> None:
        if self._table is None:
            from flightq.chunks import encode_chunks
            from flightq.client.client import DEFAULT_MAX_BATCH_BYTES
            from flightq.registry import SchemaRegistry
            from flightq.workloads import to_torch

            s = to_torch(self.step)
            schema = SchemaRegistry.default().get(s.schema)
            batches = encode_chunks(
                schema, s.columns, s.keys, s.tags, max_bytes=DEFAULT_MAX_BATCH_BYTES
            )
            self._table = pa.Table.from_batches(batches)


class FlightRecordsConsumer(FlightConsumer):
    """DoGet and ``read_all`` of flightq's record batches; decoded only to verify."""

    tag = "records"

    def verify(self) -> None:
        from flightq.batch import decode

        from .payload import check_rows

        assert self._got is not None
        batch = decode(self._got.to_batches())
        cols = {f: batch[f] for f in batch.fields}
        check_rows(self.ref, batch.keys, cols, batch.tags, "bare-flight-records")


class _HeldExchange:
    """A DoExchange each half opens at setup and holds until it closes."""

    client: fl.FlightClient
    path: bytes

    def _open(self) -> None:
        desc = fl.FlightDescriptor.for_command(self.path)
        self._writer, self._reader = self.client.do_exchange(desc)

    def _end(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.done_writing()
            self._writer.close()


class FlightExchangeProducer(_HeldExchange, FlightRecordsProducer):
    """flightq's record batches (encoded untimed) as messages on a held DoExchange."""

    tag = "exchange"

    def setup(self) -> dict[str, Any]:
        out = super().setup()
        self._open()
        self._messages: list[pa.Buffer] = []
        return out

    def prepare(self) -> None:
        super().prepare()
        if not self._messages:
            assert self._table is not None
            sink = pa.BufferOutputStream()  # an IPC stream: media dictionaries included
            with pa.ipc.new_stream(sink, self._table.schema) as w:
                for b in self._table.to_batches():
                    w.write_batch(b)
            body = sink.getvalue().to_pybytes()
            cuts = range(0, max(len(body), 1), EXCHANGE_PART_BYTES)
            self._messages = [
                pa.py_buffer(
                    (_LAST if at == cuts[-1] else _MORE) + body[at : at + EXCHANGE_PART_BYTES]
                )
                for at in cuts
            ]

    def put(self) -> dict[str, Any]:
        t0 = now_ns()
        for m in self._messages:
            self._writer.write_metadata(m)
        if self._reader.read_chunk().app_metadata.to_pybytes() != b"stored":
            raise RuntimeError("bare Flight server did not acknowledge the put")
        return timed(t0)

    def close(self) -> None:
        self._end()
        super().close()


class FlightExchangeConsumer(_HeldExchange, FlightRecordsConsumer):
    """A get on a held DoExchange: one request, the stored messages back; decoded only to
    verify."""

    tag = "exchange"

    def setup(self) -> dict[str, Any]:
        out = super().setup()
        self._open()
        self._parts: list[pa.Buffer] = []
        return out

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        self._writer.write_metadata(pa.py_buffer(_GET))
        parts = []
        while True:
            part = self._reader.read_chunk().app_metadata
            parts.append(part)
            if part.slice(0, 1).to_pybytes() == _LAST:
                break
        self._parts = parts
        return timed(t0)

    def verify(self) -> None:
        body = b"".join(p.slice(1).to_pybytes() for p in self._parts)
        self._got = pa.ipc.open_stream(body).read_all()
        super().verify()

    def release(self) -> None:
        self._parts = []
        super().release()

    def close(self) -> None:
        self._end()
        super().close()


def _until_eof(stop: threading.Event) -> None:
    sys.stdin.read()
    stop.set()


def main() -> int:
    """Serve until SIGTERM or standard input closes (``--host ADDR``: bind that address,
    a testbed host's, instead of loopback)."""
    host = sys.argv[sys.argv.index("--host") + 1] if "--host" in sys.argv else "127.0.0.1"
    server = BareServer(f"grpc://{host}:0")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=_until_eof, args=(stop,), daemon=True).start()
    threading.Thread(target=server.serve, daemon=True).start()
    print(json.dumps({"listening": f"grpc://{host}:{server.port}"}), flush=True)
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
