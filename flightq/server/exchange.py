"""The request stream: one client's small puts, gets, claims and acks over one DoExchange.

A per-call put and get cost two gRPC calls' setup each round trip (about 1.3 ms on two
cores); on a stream held open they cost two messages (about 0.7 ms). So a
:class:`~flightq.Client` opens one stream (descriptor :class:`~flightq.protocol.RequestsCommand`)
and sends its small operations there, each a frame (:mod:`flightq.frames`) answered by one
frame, in order. Each request goes the same way as its per-call twin: the server's put
path (every check, all or nothing, put id replays, the memory budget), its read path (the
same answer, a claim's lease), the handlers of the actions in
:data:`~flightq.frames.STREAM_ACTIONS` (ack, nack, clear, reset: the same request and
reply messages), and errors as the same typed error, carried in the answer's frame
(``{"error": ErrorDetail}``) instead of a Flight status, so the stream keeps serving.
The stream is one Flight call: authentication ran when it opened, and it counts as one
session (``max_sessions``).

The handler blocks reading the next request; it returns when the client ends the stream
(the client closes it after a second idle, so a stopping server is not held for long),
its connection goes, or it sends a request while the server stops (answered
UnavailableError).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from ..errors import FlightqError, ProtocolError, ResourceExhaustedError, UnavailableError
from ..frames import MAX_FRAME_BYTES, STREAM_ACTIONS, pack_frame, parse_frame
from ..protocol import ErrorDetail, PutAck, Ticket, parse_ticket
from .metrics import Counters, read_counter
from .putplan import Stored
from .store import suggest

__all__ = ["serve_requests", "HELLO"]

log = logging.getLogger("flightq.server")

#: The stream's first answer: the server takes requests.
HELLO = {"ok": b"", "max_frame": MAX_FRAME_BYTES, "numbered": True}
#: Room an answer's frame needs beyond its batches (header, schema).
_FRAME_SLACK = 64 << 10

Put = Callable[[bytes, list[pa.RecordBatch], list[bytes | None], list[int] | None, Any], Stored]
Answer = Callable[
    [Ticket, Any, bool],
    tuple[pa.Schema, Iterator[pa.RecordBatch], Callable[..., None] | None, int],
]
Act = Callable[[str, bytes], bytes]


def serve_requests(
    context: fl.ServerCallContext,
    reader: fl.MetadataRecordBatchReader,
    writer: fl.MetadataRecordBatchWriter,
    *,
    put: Put,
    answer: Answer,
    act: Act,
    counters: Counters,
    closing: Callable[[], bool],
    watch: Callable[[Iterator[None]], Iterator[None]] = iter,
    patient: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    limit: int | None = None,
) -> None:
    """Answer ``reader``'s requests in turn until the client ends the stream.

    ``put(command, batches, claims, blocks, context)`` stores a put (``claims``: each batch's
    media digests, as a DoPut batch's app metadata carries them; ``blocks``: the size of the
    copy each batch was read from, :attr:`~flightq.frames.Frame.blocks`) and returns its
    rows; ``answer(ticket, context, count)`` gives a read's schema, batches, for a
    claim what gives its rows back, and its row count (``count=False``: the stream
    counts the read, its rows and its bytes once it sends them); ``act(type, body)``
    runs an action of :data:`~flightq.frames.STREAM_ACTIONS` and gives its reply's bytes.
    ``watch`` marks the write of each answer as a wait on the client (:meth:`IdleWatch.reads
    <flightq.server.idle.IdleWatch.reads>`): a client that stops reading its answers has
    its connection cut; the wait for its next request is by design, cut only once the
    server stops (``patient``, :meth:`IdleWatch.patient
    <flightq.server.idle.IdleWatch.patient>`). ``limit``: the server's cap on a control
    message (``max_request_bytes``), here a frame's header and a read's ticket; ``put``
    and ``act`` apply it to their commands themselves.
    """
    writer.write_metadata(pack_frame(HELLO))
    while True:
        try:
            with patient():
                chunk = reader.read_chunk()
        except StopIteration:
            return
        except pa.ArrowException:
            return  # the client went away
        started = time.perf_counter()
        kind = "stream"
        undo: Callable[..., None] | None = None
        echo: dict[str, int] = {}  # the request's number, once its frame is read
        try:
            if closing():
                raise UnavailableError("the server is shutting down; retry on another server")
            try:
                kind, reply, undo = _handle(chunk, context, put, answer, act, counters, limit, echo)
            except (FlightqError, fl.FlightError):  # typed, or the transport's own
                raise
            except MemoryError as e:  # an allocation past the process's cap (Arrow's too)
                raise ResourceExhaustedError(
                    f"request stream: the server could not take the memory this request needs ({e})"
                ) from e
            except Exception as e:  # hostile bytes deep in Arrow: refused, the stream lives
                log.warning(
                    "request stream: %s handling a request", type(e).__name__, exc_info=True
                )
                raise ProtocolError(
                    f"request stream: the request could not be handled ({type(e).__name__}: {e})"
                ) from e
        except FlightqError as e:
            suggest(e)  # close names of an unknown one, now that no lock is held
            if context.is_cancelled():
                counters.add("cancelled")  # no one to refuse: its client is gone
            else:
                counters.refused(type(e).__name__)
            log.info(
                "refused %s on the request stream (partition %s, key %s): %s",
                type(e).__name__,
                getattr(e, "partition", None),
                getattr(e, "key", None),
                e,
            )
            reply = pack_frame({"error": ErrorDetail.of(e).to_wire(), **echo})

        def write(reply: pa.Buffer = reply) -> Iterator[None]:
            writer.write_metadata(reply)
            yield None

        try:
            for _ in watch(write()):
                pass
        except BaseException:
            if undo is not None:  # the claim's answer never left: its rows go back
                undo()
            raise
        finally:
            counters.observe(kind, time.perf_counter() - started)
        if closing():
            return


def _handle(
    chunk: fl.FlightStreamChunk,
    context: Any,
    put: Put,
    answer: Answer,
    act: Act,
    counters: Counters,
    limit: int | None,
    echo: dict[str, int],
) -> tuple[str, pa.Buffer, Callable[..., None] | None]:
    """One request: its kind (for the latency histogram), its answer's frame, and what
    gives a claim's rows back. The request's number, where it has one, is put in
    ``echo`` as soon as its frame is read, and every answer to it carries it."""
    what = "request stream"
    if chunk.data is not None:
        raise ProtocolError(
            f"{what}: requests are metadata-only messages (a frame); this one carried a "
            "record batch"
        )
    frame = parse_frame(chunk.app_metadata, what, check=True, limit=limit)
    if "n" in frame.header:
        n = frame.header["n"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**63:
            raise ProtocolError(
                f"{what}: a request's number 'n' must be an int in [0, 2**63), got "
                f"{type(n).__name__}"
            )
        echo["n"] = n
    op, cmd = frame.header.get("op"), frame.header.get("cmd")
    if not isinstance(cmd, bytes):
        raise ProtocolError(f"{what}: a request's 'cmd' must be bytes, got {type(cmd).__name__}")
    if op == "put":
        claims = _claims(frame.header, len(frame.batches), what)
        done = put(cmd, frame.batches, claims, frame.blocks, context)
        counters.add("puts")
        # What it created beside the acknowledgement: a client that reads only "ok" (an
        # older one) never parses it.
        ack = {"ok": PutAck(rows=done.rows).to_wire(), "created": done.record().to_wire()}
        return "put", pack_frame({**ack, **echo}), None
    if op == "act":
        kind = frame.header.get("type")
        if kind not in STREAM_ACTIONS:
            raise ProtocolError(
                f"{what}: action {kind!r} goes per call (DoAction); the stream takes "
                f"{sorted(STREAM_ACTIONS)}"
            )
        body = act(kind, cmd)
        if len(body) > MAX_FRAME_BYTES - _FRAME_SLACK:
            # A read's large reply (a partition's keys and tags, every partition's
            # stats): asked again per call. An ack naming more lost rows than a frame
            # holds (a client past STREAM_ACK_ROWS): it ran; acking again is harmless.
            return f"action:{kind}", pack_frame({"retry": len(body), **echo}), None
        return f"action:{kind}", pack_frame({"ok": body, **echo}), None
    if op != "read":
        raise ProtocolError(f"{what}: unknown op {op!r}; expected 'put', 'read' or 'act'")
    t = parse_ticket(cmd, limit)
    # The most payload bytes the client takes on the stream (more: it reads per call).
    asked = frame.header.get("max")
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int)):
        raise ProtocolError(f"{what}: a read's 'max' must be an int, got {type(asked).__name__}")
    schema, batches, undo, rows = answer(t, context, False)
    try:
        limit = MAX_FRAME_BYTES - _FRAME_SLACK
        if asked is not None:
            limit = max(0, min(limit, asked))
        # Past the limit, what was made of it goes and the rest is never made; the frame
        # itself, the batches' IPC framing included (many small ones), is held to it too.
        out, past = _within(batches, limit)
        reply = None if past else pack_frame({"ok": b"", **echo}, schema, out)
        if reply is None or reply.size > MAX_FRAME_BYTES:
            if undo is not None:
                undo(False)  # never sent: back where they were, not a delivery
            retry = {"retry": past if reply is None else reply.size, **echo}
            return t.op, pack_frame(retry), None
        # The read counts once its answer goes, as per call (one answered `retry` sent none).
        counters.add(read_counter(t.op))
        counters.add("rows_sent", rows)
        counters.add("bytes_sent", reply.size)
        return t.op, reply, undo
    except BaseException:
        if undo is not None:
            undo(False)  # nothing of it was sent
        raise


def _within(batches: Iterator[pa.RecordBatch], limit: int) -> tuple[list[pa.RecordBatch], int]:
    """An answer's batches, made one at a time while their bytes stay within ``limit``,
    and 0; once they pass it, the bytes counted so far (past ``limit``: the answer takes
    at least that many), the rest never made (a get naming rows many times over asks for
    an answer far larger than the stream carries, each batch of it a copy).

    All the buffers a batch holds bound its bytes from above (cheap); its exact bytes
    (``nbytes``, tens of µs a batch, less than the bound for a slice of a stored batch)
    are counted only from the batch where that bound first passes the limit."""
    out: list[pa.RecordBatch] = []
    bound, exact = 0, -1
    try:
        for b in batches:
            out.append(b)
            if exact < 0:
                bound += b.get_total_buffer_size()
                if bound > limit:
                    exact = sum(x.nbytes for x in out)
            else:
                exact += b.nbytes
            if exact > limit:
                return [], exact
        return out, 0
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # a generator stopped early runs its cleanup now


def _claims(header: dict[str, Any], batches: int, what: str) -> list[bytes | None]:
    """A put frame's ``"claims"``: per batch, the media digests it claims (what a DoPut
    batch's app metadata carries: ``flightq.digest.pack_claims``), or None; all None
    where the header has none."""
    claims = header.get("claims")
    if claims is None:
        return [None] * batches
    if (
        not isinstance(claims, list)
        or len(claims) != batches
        or not all(c is None or isinstance(c, bytes) for c in claims)
    ):
        raise ProtocolError(
            f"{what}: a put's 'claims' must list bytes or null for each of its {batches} "
            f"record batches, got {type(claims).__name__}"
            + (f" of {len(claims)}" if isinstance(claims, list) else "")
        )
    return claims
