"""Calls in flight, bounded: past the bound a call is refused at once, typed.

Every Flight call holds one of the server's threads while it runs: a put while its stream
comes in (a stalled stream too), a claim while it waits for rows, a read while its answer
goes out. Unbounded, a few hundred stalled streams take a thread each until the process
runs out of address space and aborts. A consumer session (DoExchange) holds a thread for
its client's whole life.

So the server counts them, in server middleware that runs before any handler: sessions
against ``max_sessions``, every other call against ``max_calls``, each on its own count so
that sessions can never starve data calls (nor the other way round). A call past its bound
is refused before it takes anything, with :class:`~flightq.errors.ResourceExhaustedError`
("server busy: N calls in flight"); the slot frees the moment a call ends, however it ends.
"""

from __future__ import annotations

import threading
from typing import Any

import pyarrow.flight as fl

from ..errors import ProtocolError, ResourceExhaustedError
from ..protocol import to_flight_error

__all__ = ["CallLimits", "DEFAULT_MAX_CALLS", "DEFAULT_MAX_SESSIONS"]

#: Calls (DoPut, DoGet, DoAction, ...) in flight at once, consumer sessions apart.
DEFAULT_MAX_CALLS = 128
#: Consumer sessions (DoExchange) open at once.
DEFAULT_MAX_SESSIONS = 128


class _Slot(fl.ServerMiddleware):
    """One admitted call; gives its slot back when the call completes."""

    def __init__(self, limits: CallLimits, session: bool) -> None:
        self._limits, self._session = limits, session

    def call_completed(self, exception: Any) -> None:
        self._limits._end(self._session)


class CallLimits(fl.ServerMiddlewareFactory):
    """Server middleware admitting at most ``max_calls`` calls and ``max_sessions``
    consumer sessions at once; beyond, a call is refused with ResourceExhaustedError.

    Raises
    ------
    ProtocolError
        If a bound is below 1.
    """

    def __init__(
        self, max_calls: int = DEFAULT_MAX_CALLS, max_sessions: int = DEFAULT_MAX_SESSIONS
    ) -> None:
        for what, n in (("max_calls", max_calls), ("max_sessions", max_sessions)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ProtocolError(f"{what} must be an int >= 1, got {n!r}", actual=n)
        self.max_calls, self.max_sessions = max_calls, max_sessions
        self._lock = threading.Lock()
        self._calls = self._sessions = 0

    def __repr__(self) -> str:
        return f"CallLimits(max_calls={self.max_calls}, max_sessions={self.max_sessions})"

    def in_flight(self) -> tuple[int, int]:
        """Calls and sessions admitted and not yet completed."""
        with self._lock:
            return self._calls, self._sessions

    def start_call(self, info: fl.CallInfo, headers: dict[str, Any]) -> fl.ServerMiddleware:
        session = info.method == fl.FlightMethod.DO_EXCHANGE
        with self._lock:
            if session:
                if self._sessions >= self.max_sessions:
                    raise to_flight_error(_busy(self._sessions, self.max_sessions, "sessions"))
                self._sessions += 1
            else:
                if self._calls >= self.max_calls:
                    raise to_flight_error(_busy(self._calls, self.max_calls, "calls"))
                self._calls += 1
        return _Slot(self, session)

    def _end(self, session: bool) -> None:
        with self._lock:
            if session:
                self._sessions -= 1
            else:
                self._calls -= 1


def _busy(n: int, limit: int, what: str) -> ResourceExhaustedError:
    option = "max_sessions" if what == "sessions" else "max_calls"
    return ResourceExhaustedError(
        f"server busy: {n} {what} in flight, its limit ({option}={limit}); retry shortly, "
        f"or serve with a larger --{option.replace('_', '-')}",
        expected=limit,
        actual=n,
    )
