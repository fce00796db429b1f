"""The client's one edge to Arrow Flight: connections, call options, and error mapping.

A :class:`Transport` owns the Flight connections to one server (the main one, and the
extra connections a get or put split over parallel streams uses, opened on first need),
the default timeout, and the translation of every Flight or Arrow error into the flightq
error it stands for (:func:`flightq.protocol.from_flight_error`). It speaks the protocol's
types: an action's request gives the action's name and its reply's type, a put sends a
:class:`~flightq.protocol.PutCommand` and parses the :class:`~flightq.protocol.PutAck` and
the :class:`~flightq.protocol.PutCreated` after it.

Nothing above this module handles a ``pyarrow.flight`` object or catches a Flight error;
the client, the parallel streams, shared memory and the sharded client all go through it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as fl

from .. import forks
from ..chunks import split_batch
from ..digest import split_claims
from ..errors import FlightqError, FlightqTimeoutError, ProtocolError
from ..protocol import (
    ACTIONS,
    ActionSpec,
    Message,
    PutAck,
    PutCommand,
    PutCreated,
    SessionCommand,
    SessionReply,
    Ticket,
    from_flight_error,
)

__all__ = [
    "Acked",
    "Transport",
    "action_spec",
    "generic_options",
    "keepalive_options",
    "with_scheme",
]

R = TypeVar("R", bound=Message)
#: A put's answer: the rows acknowledged, and what it created (None: the server did not say).
Acked = tuple[int, PutCreated | None]

#: Each action's name and spec, by its request type.
_BY_REQUEST: dict[type[Message], tuple[str, ActionSpec]] = {
    spec.request: (name, spec) for name, spec in ACTIONS.items()
}
#: Flight and Arrow errors: what the transport translates.
_FOREIGN = (pa.ArrowException, fl.FlightError)


def keepalive_options(timeout: float) -> list[tuple[str, int]]:
    """The gRPC keepalive a connection gets by default, scaled to the client's timeout.

    A put whose stream is blocked on a dead link (the far end stopped acknowledging, the
    flow-control window is full) never returns by itself: pyarrow's ``write_batch``
    ignores the call's deadline there. Keepalive drops such a connection, and so fails
    the put: after ``time`` seconds without a byte from the server the client pings it,
    and closes the connection when ``timeout`` more pass without an answer. Both are a
    quarter of the client's timeout, between 1 and 20 seconds, so a dead link fails a
    call within about half of it (within 40 s at most).

    Pings go out only while a call is open (a claimer's session is one), and at most 2
    between two messages the client sends: gRPC servers, flightq's among them, answer a
    client that pings more often than every 5 minutes without data with a GOAWAY
    ("too_many_pings"), which would end the session and its leases.

    Reconnection is on the same scale: a client whose server went away tries again at
    least every ``max(quarter, 2 s)``, so that it finds a restarted server within about
    that much of its return, whatever the outage lasted (one attempt may still take
    gRPC's 20 s, for a slow handshake).

    Parameters
    ----------
    timeout:
        The client's default seconds per call.

    Returns
    -------
    list of (str, int)
        ``generic_options`` entries for ``pyarrow.flight.FlightClient``.
    """
    ms = int(1000 * min(20.0, max(1.0, timeout / 4)))
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 2),
        # Attempts to reconnect back off up to the maximum (gRPC's default 120 s: after
        # a 30 s outage a client calling in a loop reached its restarted server 13.9 s
        # late). One attempt keeps gRPC's 20 s at least (the minimum backoff), so that a
        # slow handshake (a lost SYN, a busy or distant server) still connects.
        ("grpc.initial_reconnect_backoff_ms", min(ms, 1000)),
        ("grpc.max_reconnect_backoff_ms", max(ms, 2000)),
    ]


def generic_options(
    timeout: float, options: Iterable[tuple[str, Any]] | None = None
) -> list[tuple[str, Any]]:
    """A caller's ``generic_options``, then each of :func:`keepalive_options` whose key
    they do not set: the caller's own value wins."""
    mine = list(options or [])
    given = {k for k, _ in mine}
    return mine + [(k, v) for k, v in keepalive_options(timeout) if k not in given]


def action_spec(request: Message) -> tuple[str, ActionSpec]:
    """The action name and spec of a request (its type names it).

    Raises
    ------
    TypeError
        If ``request`` is no action's request type.
    """
    try:
        return _BY_REQUEST[type(request)]
    except KeyError:
        raise TypeError(f"{type(request).__name__} is not an action's request") from None


class Transport:
    """The Flight connections to one server, and the only place Flight errors are caught.

    Thread-safe. The main connection opens at once; :meth:`connection` opens the extra
    ones (for parallel streams) on first use and keeps them for later calls.

    Parameters
    ----------
    location:
        ``grpc://host:port`` (a bare ``host:port`` means that), ``grpc+tls://``, ``grpc+unix://``.
    timeout:
        Seconds a call may take when it is not told otherwise.
    token:
        A bearer token for a server that requires one.
    **flight_kwargs:
        Anything ``pyarrow.flight.FlightClient`` takes (``tls_root_certs``, ``middleware``).
        ``generic_options`` gets the keepalive of :func:`keepalive_options` for every
        key it does not set itself.

    Raises
    ------
    FlightqError
        If the location cannot be used (a bad URI, TLS settings).
    """

    def __init__(
        self, location: str, *, timeout: float, token: str | None = None, **flight_kwargs: Any
    ) -> None:
        if token is not None:
            from ..auth import BearerTokenClientMiddlewareFactory

            flight_kwargs["middleware"] = [
                *(flight_kwargs.get("middleware") or []),
                BearerTokenClientMiddlewareFactory(token),
            ]
        flight_kwargs["generic_options"] = generic_options(
            timeout, flight_kwargs.get("generic_options")
        )
        self.location = with_scheme(location)
        self.timeout = timeout
        self._kwargs = flight_kwargs
        self._lock = threading.Lock()
        self._extra: list[fl.FlightClient] = []
        self._closed = False
        self._main = self._open()

    # ------------------------------------------------------------------ connections

    def _open(self) -> fl.FlightClient:
        forks.used()
        try:
            return fl.FlightClient(self.location, **self._kwargs)
        except _FOREIGN as e:
            raise from_flight_error(e, f"connect to {self.location}") from e

    def connection(self, i: int = 0) -> fl.FlightClient:
        """Connection ``i``: 0 is the main one, ``i >= 1`` the i-th extra one (opened now
        if it is not yet)."""
        if i == 0:
            return self._main
        with self._lock:
            while len(self._extra) < i:
                self._extra.append(self._open())
            return self._extra[i - 1]

    def _check(self, what: str) -> None:
        # Refused here, typed, before Arrow: its own refusal of a closed connection comes
        # back as an untyped ArrowInvalid.
        forks.check(what)
        if self._closed:
            raise FlightqError(f"{what}: the client is closed")

    def options(self, timeout: float | None = None) -> fl.FlightCallOptions:
        """Call options with ``timeout`` seconds (None: the transport's default). Every
        call takes them: refused here in a process forked after flightq was used, and once
        the client is closed."""
        self._check(f"a call to {self.location}")
        return fl.FlightCallOptions(timeout=self.timeout if timeout is None else timeout)

    # ------------------------------------------------------------------ calls

    def action(self, request: Message, timeout: float | None = None) -> Any:
        """Run the action ``request`` stands for; returns its parsed reply.

        Raises
        ------
        FlightqError
            The server's error (same class and message), or the transport's.
        ProtocolError
            If the reply does not parse as the action's reply type.
        """
        name, spec = action_spec(request)
        try:
            # One Result, and no more: a server that keeps sending is not read to its end.
            results = self._main.do_action(
                fl.Action(name, request.to_wire()), options=self.options(timeout)
            )
            first = next(results, None)
            extra = None if first is None else next(results, None)
            results.close()
        except _FOREIGN as e:
            raise from_flight_error(e, f"{name} on {self.location}") from e
        if first is None:
            raise FlightqError(f"{name} on {self.location}: the server sent no answer")
        if extra is not None:
            raise ProtocolError(
                f"{name} on {self.location}: the server sent more than one answer; a flightq "
                "server sends one"
            )
        return spec.reply.parse(first.body)

    def put(
        self,
        command: PutCommand,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        *,
        max_batch_bytes: int,
        timeout: float | None = None,
        connection: int = 0,
    ) -> Acked:
        """One DoPut: the command, ``batches`` cut at ``max_batch_bytes``, then the server's
        acknowledgement; returns the rows it acknowledged, and what the put created (None
        from a server that does not say: :class:`~flightq.protocol.PutCreated`).

        Raises
        ------
        FlightqError
            The server's error, the transport's, or no acknowledgement.
        """
        what = f"put to {command.partition!r}"
        flight = self.connection(connection)
        desc = fl.FlightDescriptor.for_command(command.to_wire())
        schema, claims = split_claims(schema)
        try:
            writer, reader = flight.do_put(desc, schema, options=self.options(timeout))
            with writer:
                for b in batches:
                    _, claims = split_claims(b.schema)
                    for chunk in split_batch(b, max_batch_bytes):
                        if claims is None:
                            writer.write_batch(chunk)
                        else:  # the media digests travel as the batch's app metadata
                            writer.write_with_metadata(chunk, claims)
                writer.done_writing()
                ack = reader.read()
                # A second message says what the put created; a server that sends none
                # (an older one) ends the stream instead.
                created = None if ack is None else reader.read()
        except _FOREIGN as e:
            raise from_flight_error(e, what) from e
        if ack is None:
            raise FlightqError(f"{what}: the server sent no acknowledgement")
        rows = acknowledged(PutAck.parse(ack).rows, command, what)
        return rows, None if created is None else PutCreated.parse(created)

    def get(
        self,
        ticket: Ticket,
        what: str,
        *,
        timeout: float | None = None,
        connection: int = 0,
        got: list[pa.RecordBatch] | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """One DoGet's record batches as they arrive (each also appended to ``got``); ends
        early once ``stop`` is set. Errors name ``what``.

        Raises
        ------
        FlightqError
            The server's error or the transport's, while iterating.
        """
        flight = self.connection(connection)
        try:
            reader = flight.do_get(fl.Ticket(ticket.to_wire()), options=self.options(timeout))
            for chunk in reader:
                if got is not None:
                    got.append(chunk.data)
                yield chunk.data
                if stop is not None and stop.is_set():
                    reader.cancel()
                    return
        except _FOREIGN as e:
            raise from_flight_error(e, what) from e

    def session(
        self, timeout: float | None = None, silence: float | None = None
    ) -> tuple[fl.FlightStreamWriter, fl.FlightStreamReader, SessionReply]:
        """Open a consumer session: a DoExchange stream without a deadline, held open
        until closed; returns its writer, its reader and the server's reply (its session
        id, and whether it ends the session after ``silence`` seconds without a beat),
        read within ``timeout``.

        Raises
        ------
        FlightqError
            The server's error, the transport's, or no session id.
        """
        what = f"open a session on {self.location}"
        self._check(what)
        desc = fl.FlightDescriptor.for_command(SessionCommand(silence=silence).to_wire())
        wait = self.timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            # No deadline: the stream lives as long as the client.
            opened = exchange_within(self._main, desc, fl.FlightCallOptions(), wait)
            if opened is None:
                raise FlightqTimeoutError(f"{what}: timed out connecting to the server")
            writer, reader = opened
            first: list[Any] = []

            def read() -> None:
                try:
                    first.append(reader.read_chunk())
                except StopIteration:
                    first.append(None)  # the stream ended before its first message
                except BaseException as e:  # handed to the caller's thread
                    first.append(e)

            got = threading.Thread(target=read, name="flightq-session-open", daemon=True)
            got.start()
            got.join(max(0.0, started + wait - time.monotonic()))
            if first and isinstance(first[0], BaseException):
                raise first[0]
        except _FOREIGN as e:
            raise from_flight_error(e, what) from e
        try:
            if not first:
                raise FlightqTimeoutError(f"{what}: timed out waiting for the session id")
            if first[0] is None:
                raise ProtocolError(f"{what}: the server ended the stream without a session id")
            if first[0].app_metadata is None:
                raise FlightqError(f"{what}: the server sent no session id")
            return writer, reader, SessionReply.parse(first[0].app_metadata)
        except FlightqError:
            with contextlib.suppress(Exception):
                reader.cancel()  # never wait on a server that does not answer
                writer.close()
            raise

    def list_flights(self, timeout: float | None = None) -> list[str]:
        """The names of the partitions the server lists (ListFlights)."""
        try:
            return [
                info.descriptor.path[0].decode()
                for info in self._main.list_flights(options=self.options(timeout))
            ]
        except _FOREIGN as e:
            raise from_flight_error(e, "list partitions") from e

    # ------------------------------------------------------------------ lifetime

    @property
    def extra_connections(self) -> int:
        """How many extra connections (for parallel streams) are open."""
        with self._lock:
            return len(self._extra)

    def close(self) -> None:
        """Close every connection; errors on the way are ignored."""
        with self._lock:
            self._closed = True
            flights, self._extra = [self._main, *self._extra], []
        if forks.forked():  # gRPC's state did not survive the fork: closing it hangs
            return
        for flight in flights:
            with contextlib.suppress(*_FOREIGN):
                flight.close()


def acknowledged(rows: int, command: PutCommand, what: str, sent: int | None = None) -> int:
    """``rows``, the rows a put's acknowledgement names, where they are the ``sent`` rows
    (default: the command's; a part of a put in parts is acknowledged with the whole
    put's rows, checked by its caller).

    Raises
    ------
    ProtocolError
        If they are not (a server that is not flightq's, or a bug).
    """
    if sent is None:
        sent = command.rows if command.parts is None else None
    if sent is not None and rows != sent:
        raise ProtocolError(f"{what}: the server acknowledged {rows} rows of the {sent} sent")
    return rows


def with_scheme(location: str) -> str:
    """A location as Flight takes it: a bare ``host:port`` means ``grpc://host:port``."""
    return location if "://" in location else f"grpc://{location}"


def exchange_within(
    flight: fl.FlightClient,
    descriptor: fl.FlightDescriptor,
    options: fl.FlightCallOptions,
    limit: float,
) -> tuple[Any, Any] | None:
    """``flight.do_exchange(descriptor)`` (writer, reader) within ``limit`` seconds, or None.

    A DoExchange on a connection being made waits for gRPC's connection attempt, which
    the call's deadline cannot bound for a stream that has none (20 s where the server
    accepts connections and says nothing: restarting, stopped): it runs on a thread of its
    own, which cancels and closes the stream should it open past ``limit``.

    Raises
    ------
    Exception
        What the DoExchange raised within ``limit`` (a Flight or Arrow error).
    """
    got: list[Any] = []
    lock = threading.Lock()
    late = False

    def opening() -> None:
        try:
            opened: Any = flight.do_exchange(descriptor, options=options)
        except Exception as e:  # handed to the caller, or dropped once it is too late
            opened = e
        with lock:
            if not late:
                got.append(opened)
                return
        if not isinstance(opened, BaseException):
            writer, reader = opened
            with contextlib.suppress(Exception):
                reader.cancel()
            with contextlib.suppress(Exception):
                writer.close()

    thread = threading.Thread(target=opening, name="flightq-exchange-open", daemon=True)
    thread.start()
    thread.join(limit)
    with lock:
        if not got:
            late = True
            return None
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]
