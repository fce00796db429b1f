"""Calls in flight, bounded: past the bound a call is refused at once, typed.

Every Flight call holds one of the server's threads while it runs: a put while its stream
comes in (a stalled stream too), a claim while it waits for rows, a read while its answer
goes out. Unbounded, a few hundred stalled streams take a thread each until the process
runs out of address space and aborts. A consumer session (DoExchange) holds a thread for
its client's whole life.

So the server counts them, in server middleware that runs before any handler: sessions
against ``max_sessions``, every other call against ``max_calls``, each on its own count so
that sessions can never starve data calls (nor the other way round). Calls of one request
message (DoAction, GetFlightInfo, ListFlights, ...) are counted against ``max_calls`` on a
count of their own: streams a client stalls never starve another client's control calls
(its schema check, a partition's description); such a call takes its slot only once its
request message is in (gRPC runs its handler then), so a client cannot stall one. A
client's request
stream (:mod:`flightq.server.exchange`, a DoExchange whose call carries the header
:data:`STREAM_HEADER`) also holds a thread for as long as it is open: those are counted
against ``max_sessions`` too, on a third count, so that a consumer's own request stream
never takes the slot its session needs. A claim that waits for rows gives up its slot
among the data calls while it waits and takes one among the claims waiting, counted
against ``max_calls`` on a count of their own: a client's waiting claims (or many
consumers', each waiting for the next step) never take the slots the generators' puts and
the readers' gets need. A claim that would wait when that count is full is refused busy
(a claim that finds its rows at once takes none). A call past its bound
is refused before it takes anything, with :class:`~flightq.errors.ResourceExhaustedError`
("server busy: N calls in flight"); the slot frees the moment a call ends, however it ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pyarrow.flight as fl

from ..errors import RETRY_BUSY, ProtocolError, ResourceExhaustedError
from ..protocol import to_flight_error

__all__ = ["CallLimits", "DEFAULT_MAX_CALLS", "DEFAULT_MAX_SESSIONS", "LIMITS_KEY", "STREAM_HEADER"]

#: Calls (DoPut, DoGet, DoAction, ...) in flight at once, consumer sessions apart.
DEFAULT_MAX_CALLS = 128
#: Consumer sessions (DoExchange) open at once; request streams as many again.
DEFAULT_MAX_SESSIONS = 128
#: The call header (name, value) a client's request stream opens with.
STREAM_HEADER = ("flightq-stream", "requests")


#: The key the limits are installed under in the server's middleware.
LIMITS_KEY = "flightq.limits"


class _Slot(fl.ServerMiddleware):
    """One admitted call; gives its slot back when the call completes (``kind``: the
    count it is on now; a waiting claim moves between two)."""

    def __init__(self, limits: CallLimits, kind: str) -> None:
        self._limits, self.kind = limits, kind
        #: What runs once the call is over (:meth:`CallLimits.at_end`).
        self.ends: list[Callable[[], None]] = []

    def call_completed(self, exception: Any) -> None:
        try:
            for end in self.ends:
                with contextlib.suppress(Exception):
                    end()
        finally:
            self._limits._end(self)


class CallLimits(fl.ServerMiddlewareFactory):
    """Server middleware admitting at most ``max_calls`` calls and ``max_sessions``
    consumer sessions at once; beyond, a call is refused with ResourceExhaustedError.

    Raises
    ------
    ProtocolError
        If a bound is below 1.
    """

    def __init__(
        self,
        max_calls: int = DEFAULT_MAX_CALLS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        for what, n in (("max_calls", max_calls), ("max_sessions", max_sessions)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ProtocolError(f"{what} must be an int >= 1, got {n!r}", actual=n)
        self.max_calls, self.max_sessions = max_calls, max_sessions
        #: Told the error class of each call refused here (the server's refusal counts).
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "actions": 0, "sessions": 0, "streams": 0, "waiting": 0}

    def __repr__(self) -> str:
        return f"CallLimits(max_calls={self.max_calls}, max_sessions={self.max_sessions})"

    def in_flight(self) -> tuple[int, int]:
        """Calls and sessions admitted and not yet completed."""
        with self._lock:
            return self._counts["calls"], self._counts["sessions"]

    def actions(self) -> int:
        """Actions and other one-message calls in flight (bounded by ``max_calls``)."""
        with self._lock:
            return self._counts["actions"]

    def streams(self) -> int:
        """Request streams open (each also bounded by ``max_sessions``)."""
        with self._lock:
            return self._counts["streams"]

    def waiting(self) -> int:
        """Claims waiting for rows that gave up their data call's slot (bounded by
        ``max_calls``)."""
        with self._lock:
            return self._counts["waiting"]

    def park(self, context: fl.ServerCallContext | None) -> Callable[[], None] | None:
        """A claim of ``context`` starts waiting for rows: its slot moves from the data
        calls to the claims waiting. Returns what moves it back (its rows found, it is
        answered as a data call again: that count may pass its bound by the claims that
        come back at once); None where the call holds no data call's slot (a claim on a
        request stream, which waits on the stream's own slot).

        Raises
        ------
        ResourceExhaustedError
            If ``max_calls`` claims wait already.
        """
        slot = None if context is None else context.get_middleware(LIMITS_KEY)
        if not isinstance(slot, _Slot) or slot.kind != "calls":
            return None
        with self._lock:
            n = self._counts["waiting"]
            if n >= self.max_calls:
                refusal = _busy(n, self.max_calls, "waiting")
            else:
                self._counts["waiting"] = n + 1
                self._counts["calls"] -= 1
                slot.kind = "waiting"
                refusal = None
        if refusal is not None:
            if self._on_refused is not None:
                self._on_refused(type(refusal).__name__)
            raise refusal

        def unpark() -> None:
            with self._lock:
                if slot.kind == "waiting":
                    self._counts["waiting"] -= 1
                    self._counts["calls"] += 1
                    slot.kind = "calls"

        return unpark

    def start_call(self, info: fl.CallInfo, headers: dict[str, Any]) -> fl.ServerMiddleware:
        kind = "actions" if info.method in _ONE_MESSAGE else "calls"
        if info.method == fl.FlightMethod.DO_EXCHANGE:
            name, value = STREAM_HEADER
            kind = "streams" if value in headers.get(name, ()) else "sessions"
        limit = self.max_calls if kind in ("calls", "actions") else self.max_sessions
        with self._lock:
            n = self._counts[kind]
            if n < limit:
                self._counts[kind] = n + 1
                return _Slot(self, kind)
        refusal = _busy(n, limit, kind)
        if self._on_refused is not None:
            self._on_refused(type(refusal).__name__)
        raise to_flight_error(refusal)

    def at_end(self, context: fl.ServerCallContext | None, end: Callable[[], None]) -> bool:
        """Run ``end`` once the call of ``context`` is over (its last message sent, or the
        call broken off), whatever its handler returned; False where no slot follows the
        call (no context), and nothing will run."""
        slot = None if context is None else context.get_middleware(LIMITS_KEY)
        if not isinstance(slot, _Slot):
            return False
        slot.ends.append(end)
        return True

    def _end(self, slot: _Slot) -> None:
        with self._lock:
            self._counts[slot.kind] -= 1


#: Calls of one request message (an action, a listing, a lookup): counted apart from the
#: data streams (DoPut, DoGet), so that stalled streams never starve a client's control
#: calls (its schema check, a partition's description, stats).
_ONE_MESSAGE = frozenset(
    {
        fl.FlightMethod.DO_ACTION,
        fl.FlightMethod.LIST_ACTIONS,
        fl.FlightMethod.GET_FLIGHT_INFO,
        fl.FlightMethod.GET_SCHEMA,
        fl.FlightMethod.LIST_FLIGHTS,
        fl.FlightMethod.HANDSHAKE,
    }
)


def _busy(n: int, limit: int, what: str) -> ResourceExhaustedError:
    option = "max_calls" if what in ("calls", "actions", "waiting") else "max_sessions"
    shown = {"streams": "request streams", "waiting": "claims waiting for rows"}.get(what, what)
    return ResourceExhaustedError(
        f"server busy: {n} {shown} in flight, its limit ({option}={limit}); retry shortly, "
        f"or serve with a larger --{option.replace('_', '-')}",
        expected=limit,
        actual=n,
        retry=RETRY_BUSY,
    )
