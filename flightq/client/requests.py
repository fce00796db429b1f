"""A client's request stream: its small puts, gets, claims and acks on one held DoExchange.

Two calls per round trip cost a W4 put and get about 1.3 ms of gRPC call setup on two
cores; the same two operations as messages on a stream already open cost about 0.7 ms.
So a :class:`~flightq.Client` sends an operation here when it is small (a put of less
than ``stream_max_bytes`` payload bytes, a read the partition's last answer predicts that
small, or any read through shared memory, whose answer only names segments; an ack,
nack, clear or reset; a list_keys, inspect, stats, describe or dead_letters) and no other
thread of the client is using the stream: it is used by one call at a time, and a second
call at the same time goes per call rather than waiting. Everything else (large
transfers, puts through shared memory, device reads, parallel streams) goes per call.

The stream opens on the first small operation, and closes after a second without one
(so that a stopping server is never held by an idle client); the next one opens it
again. A server that refuses it (an older one, or one at its ``max_sessions``) is asked
again after a while, each operation going per call meanwhile. A request the stream
could not send goes per call; one sent but not answered (the link broke, or no answer
within the call's timeout, after which the stream is cancelled) fails as a per-call
operation would; a put sent again per call after its stream ended is taken as a replay,
and a read is asked again, but an action that changes rows, which may have run, is not
sent again: it fails with UnavailableError.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as fl

from .. import forks
from ..digest import split_claims
from ..errors import FlightqError, FlightqTimeoutError, ProtocolError, UnavailableError
from ..frames import STREAM_READS, Frame, pack_frame, parse_frame
from ..protocol import (
    ErrorDetail,
    Message,
    PutAck,
    PutCommand,
    PutCreated,
    RequestsCommand,
    Ticket,
    from_flight_error,
)
from .transport import Acked, Transport, acknowledged, action_spec, exchange_within

__all__ = ["Requests", "IDLE_CLOSE_S", "OPEN_S", "RETRY_OPEN_S"]

#: Seconds without a request after which the stream is closed.
IDLE_CLOSE_S = 1.0
#: Seconds before a server that refused the stream is asked again.
RETRY_OPEN_S = 10.0
#: Most seconds the stream's greeting may take when it opens (less where the call's
#: timeout is shorter).
OPEN_S = 5.0
#: Seconds between the watchdog's looks at the open request (deadline, idleness).
_TICK_S = 0.1
#: Seconds an answer may take beyond the call's timeout before the stream is cancelled:
#: the watchdog's ticks, no more, so that a call on the stream times out as its per-call
#: twin does (a claim's timeout already carries the margin its server's wait needs).
_MARGIN_S = 0.5
_FOREIGN = (pa.ArrowException, fl.FlightError, OSError)
#: No deadline (each answer is watched instead); the header the server counts it by
#: (``flightq.server.limits.STREAM_HEADER``).
_OPTIONS = fl.FlightCallOptions(headers=[(b"flightq-stream", b"requests")])
_T = TypeVar("_T")


class _Stream:
    """One open DoExchange: its writer and reader."""

    __slots__ = ("numbered", "reader", "writer")

    def __init__(self, writer: Any, reader: Any) -> None:
        self.writer, self.reader = writer, reader
        #: The server's greeting said it echoes each request's number in its answer.
        self.numbered = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.done_writing()
        with contextlib.suppress(Exception):
            self.writer.close()

    def cancel(self) -> None:
        """Cancel it and close it at once (not left for the collector to find)."""
        with contextlib.suppress(Exception):
            self.reader.cancel()
        self.close()


def _exchange(flight: fl.FlightClient, limit: float) -> _Stream | None:
    """A request stream opened on ``flight`` within ``limit`` seconds, or None (refused, or
    still opening then: :func:`~.transport.exchange_within`)."""
    desc = fl.FlightDescriptor.for_command(RequestsCommand().to_wire())
    try:
        opened = exchange_within(flight, desc, _OPTIONS, limit)
    except _FOREIGN:
        return None
    return None if opened is None else _Stream(*opened)


class Requests:
    """The request stream of one client's server connection. Thread-safe.

    Parameters
    ----------
    transport:
        The client's connections; the stream opens on the main one.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()  # held by the one call using the stream
        self._state = threading.Lock()  # guards _armed against the watchdog
        self._stream: _Stream | None = None
        self._refused_until = 0.0
        self._armed: float | None = None  # the deadline of the request in flight
        self._fired = False
        self._last = 0.0
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._sent = 0  # the number of the last request sent (its frame's "n")
        self._abandoned = False  # an answer on the stream was refused after its call
        #: Requests answered on the stream (for tests and diagnostics).
        self.served = 0

    # ------------------------------------------------------------------ operations

    def put(
        self,
        cmd: PutCommand,
        schema: pa.Schema,
        batches: Sequence[pa.RecordBatch],
        what: str,
        timeout: float | None,
    ) -> Acked | None:
        """A put on the stream; returns the rows stored and what it created (as
        :meth:`Transport.put`), or None where it must go per call (the stream is busy or
        not open, or broke before an answer)."""
        header: dict[str, Any] = {"op": "put", "cmd": cmd.to_wire()}
        split = [split_claims(b.schema) for b in batches]
        if any(c is not None for _, c in split):
            # The media digests each batch claims (a DoPut batch's app metadata) travel in
            # the header; the batches go without them, under one schema.
            header["claims"] = [None if c is None else c.to_pybytes() for _, c in split]
            schema = split[0][0]
            batches = [b.replace_schema_metadata(schema.metadata) for b in batches]

        def acked(got: Frame) -> Acked:
            # "created" beside "ok" says what the put created; an older server sends none.
            created = got.header.get("created")
            record = None if created is None else PutCreated.parse(created)
            return acknowledged(PutAck.parse(got.header["ok"]).rows, cmd, what), record

        return self._call(header, what, timeout, acked, schema=schema, batches=batches)

    def read(
        self,
        ticket: Ticket,
        what: str,
        timeout: float | None,
        accept: Callable[[Frame], _T],
        max_bytes: int | None = None,
    ) -> _T | None:
        """A get or claim on the stream: ``accept`` of the answer (its schema and record
        batches), or None where it must go per call (the stream is busy or not open, or
        the answer is larger than ``max_bytes`` or than a frame: a claim's rows were given
        back). A :class:`ProtocolError` from ``accept`` closes the stream."""
        header: dict[str, Any] = {"op": "read", "cmd": ticket.to_wire()}
        if max_bytes is not None:
            header["max"] = int(max_bytes)
        return self._call(header, what, timeout, accept)

    def action(self, request: Message, wire: bytes | None = None) -> Any:
        """An action (one of :data:`~flightq.frames.STREAM_ACTIONS`) on the stream: its
        parsed reply, or None where it must go per call (the stream is busy or not open,
        or the server could not send its reply in a frame). ``wire``: the request's bytes,
        if the caller has them already.

        Raises
        ------
        UnavailableError
            If the stream broke after a request that changes rows went out: it may have
            run, so it is not sent again (one that only reads goes per call).
        """
        name, spec = action_spec(request)
        cmd = request.to_wire() if wire is None else wire
        header = {"op": "act", "type": name, "cmd": cmd}
        where = f"{name} on {self._transport.location}"
        return self._call(
            header,
            where,
            None,
            lambda got: spec.reply.parse(got.header["ok"]),
            again=name in STREAM_READS,
        )

    def _call(
        self,
        header: dict[str, Any],
        what: str,
        timeout: float | None,
        accept: Callable[[Frame], _T],
        *,
        again: bool = True,
        schema: pa.Schema | None = None,
        batches: Sequence[pa.RecordBatch] = (),
    ) -> _T | None:
        """``accept(answer)`` of the answer to the request ``header`` (with ``schema`` and
        ``batches``), or None where the request must go per call. ``again``: the request
        may go per call after the stream broke with it sent (a put: a replay).

        The request carries its number (``n``), which a server that says so in its
        greeting echoes in the answer. An answer that does not parse, answers another
        request, or that ``accept`` refuses (a :class:`ProtocolError`, a put's rows
        acknowledged wrongly) closes the stream: answers are taken in turn, so nothing
        after such an answer on it is trusted; the next request opens another."""
        forks.check(what)  # an inherited stream's read would hang (no watchdog thread)
        if self._closed or not self._lock.acquire(blocking=False):
            return None
        try:
            if self._abandoned:
                self._drop()
            wait = self._transport.timeout if timeout is None else timeout
            stream = self._open(wait)
            if stream is None:
                return None
            self._sent += 1
            n = self._sent
            try:
                stream.writer.write_metadata(pack_frame({**header, "n": n}, schema, batches))
            except _FOREIGN:
                self._drop()  # nothing reached the server: per call instead
                return None
            wait = self._transport.timeout if timeout is None else timeout
            with self._state:
                self._armed, self._fired = time.monotonic() + wait + _MARGIN_S, False
            try:
                chunk = stream.reader.read_chunk()
            except (*_FOREIGN, StopIteration) as e:
                fired = self._fired
                self._drop()
                if fired:
                    raise FlightqTimeoutError(
                        f"{what}: timed out: no answer on the request stream within "
                        f"{wait + _MARGIN_S:.1f} s"
                    ) from None
                # The stream broke before an answer (the server stopped or restarted, or
                # the connection dropped): the call goes per call instead, which fails
                # typed if the server is gone. A put the old stream had stored is the
                # same record batches again, so the server takes it as a replay.
                if isinstance(e, StopIteration):
                    return None  # the server's handler had returned: it never read it
                broke = from_flight_error(e, what)
                if isinstance(broke, UnavailableError) and again:
                    return None
                raise broke from e
            finally:
                with self._state:
                    self._armed = None
                self._last = time.monotonic()
            if self._fired:  # cancelled just after its answer came: keep that, not it
                self._drop()
            try:
                got = parse_frame(chunk.app_metadata, what)
                err = _in_turn(got, n, stream.numbered, what)
                value = None if err is not None or "retry" in got.header else accept(got)
            except ProtocolError:
                self._drop()  # an answer not understood: nothing after it is trusted
                raise
            if "retry" in got.header:  # a read too large for the stream is not served
                return None
            self.served += 1
            if err is None:
                return value
            if isinstance(err, UnavailableError):
                # The server is stopping (nothing was stored or taken): drop its stream, and
                # make the call per call, on a server that may be up again at the address.
                self._drop()
                return None
            if stream.numbered and "n" not in got.header:
                self._drop()  # the frame itself refused, naming no request: none follows
            raise err
        finally:
            self._lock.release()

    def abandon(self) -> None:
        """Close the stream after its answer to a request was refused by the caller (a
        read whose rows are not those asked for): nothing after it on the stream is
        trusted; the next request opens another. Never waits: where another call uses
        the stream now, the next call to take it closes it first."""
        self._abandoned = True
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ the stream

    def _open(self, wait: float) -> _Stream | None:
        """The open stream, opened now if it is not (None: the server refuses it, or it
        did not open and greet within ``wait`` seconds, 1 to :data:`OPEN_S`: a server
        that stalls, or a connection still being made to one, is then asked per call,
        with the call's own deadline)."""
        if self._stream is not None:
            return self._stream
        now = time.monotonic()
        if now < self._refused_until:
            return None
        limit = min(max(wait, 1.0), OPEN_S)
        opened = _exchange(self._transport.connection(), limit)
        greeted = threading.Lock()  # taken by the greeting or by the timer, whichever first
        timer: threading.Timer | None = None
        try:
            if opened is None:
                raise StopIteration
            reader = opened.reader

            def too_late() -> None:
                if greeted.acquire(blocking=False):
                    with contextlib.suppress(Exception):
                        reader.cancel()

            timer = threading.Timer(max(0.0, now + limit - time.monotonic()), too_late)
            timer.daemon = True
            timer.start()
            hello = reader.read_chunk()
            if not greeted.acquire(blocking=False):  # cancelled as it came: not this one
                raise StopIteration
            greeting = parse_frame(hello.app_metadata, "request stream").header
            greeting["ok"]
            opened.numbered = greeting.get("numbered") is True
        except (*_FOREIGN, StopIteration, FlightqError, KeyError):
            self._refused_until = now + RETRY_OPEN_S
            if opened is not None:  # closed now, not left for the collector to find
                opened.cancel()
            return None
        finally:
            if timer is not None:
                timer.cancel()
        self._stream = opened
        self._last = now
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="flightq-requests", daemon=True
            )
            self._watchdog.start()
        return self._stream

    def _drop(self) -> None:
        """Close the stream (the lock held); the next request opens another."""
        self._abandoned = False
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()

    def _watch(self) -> None:
        """Cancel a request past its deadline; close the stream once idle, and end with it
        (the next stream starts another watchdog): an idle client holds no thread."""
        while True:
            time.sleep(_TICK_S)
            now = time.monotonic()
            with self._state:
                armed = self._armed
                if armed is not None and now > armed and self._stream is not None:
                    self._fired = True
                    with contextlib.suppress(Exception):
                        self._stream.reader.cancel()
            if armed is not None or not self._lock.acquire(blocking=False):
                continue  # a request is in flight
            try:
                if self._stream is not None and now - self._last > IDLE_CLOSE_S:
                    self._drop()
                if self._stream is None or self._closed:
                    self._watchdog = None
                    return
            finally:
                self._lock.release()

    @property
    def is_open(self) -> bool:
        """Whether the stream is open now."""
        return self._stream is not None

    def close(self) -> None:
        """End the stream; a request in flight on it fails."""
        self._closed = True
        stream = self._stream
        if stream is not None:  # a claim waiting on the stream ends now
            with contextlib.suppress(Exception):
                stream.reader.cancel()
        with self._lock:
            self._drop()


def _in_turn(got: Frame, n: int, numbered: bool, what: str) -> FlightqError | None:
    """The error an answer to request ``n`` carries (None: an answer), where it is one
    the client can take: ``"ok"``, ``"error"`` or ``"retry"``, and on a ``numbered``
    stream echoing ``n`` (or an error of no request, naming none: the frame itself was
    refused).

    Raises
    ------
    ProtocolError
        Naming what the answer lacks or which request it answers.
    """
    h = got.header
    if numbered and h.get("n") != n and not ("error" in h and "n" not in h):
        raise ProtocolError(
            f"{what}: the request stream answered request {str(h.get('n'))[:64]} where "
            f"request {n} was asked (an answer sent twice, or one lost)"
        )
    if "error" in h:
        return ErrorDetail.parse(h["error"]).error()
    if "ok" not in h and "retry" not in h:
        raise ProtocolError(
            f"{what}: the request stream's answer has neither 'ok', 'error' nor 'retry' "
            f"(keys {sorted(map(str, h))[:8]})"
        )
    return None
