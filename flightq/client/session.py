"""A client's consumer session: the link that ends its claims' leases when it goes.

The first claim a :class:`~flightq.Client` makes opens a session on the server: a
DoExchange stream, without a deadline, that the client holds open while it lives (no
thread, no traffic: gRPC keeps the connection alive). Every claim names the session. When
the stream ends (the client closes, its process dies, its connection drops) the server
ends the leases of those claims at once, and their rows are ready for another consumer:
a preempted worker's rows come back in well under a second instead of after the lease.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .transport import Transport

__all__ = ["Session"]


class Session:
    """One consumer session on ``transport``'s server, opened on first use. Thread-safe."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._stream: tuple[Any, Any] | None = None
        self._id: str | None = None

    def id(self, timeout: float | None = None) -> str:
        """The session's id, opening the session if it is not open."""
        with self._lock:
            if self._id is None:
                writer, reader, sid = self._transport.session(timeout)
                self._stream, self._id = (writer, reader), sid
            return self._id

    def reopen(self, stale: str, timeout: float | None = None) -> str:
        """A new session in place of ``stale`` (which the server no longer knows: it
        restarted, or the stream broke); another thread's new one is kept."""
        with self._lock:
            if self._id == stale:
                self._close()
        return self.id(timeout)

    def _close(self) -> None:
        stream, self._stream, self._id = self._stream, None, None
        if stream is None:
            return
        writer, reader = stream
        # Cancelling is how a session ends (the server then ends its leases); the
        # writer's close then reports the cancel, which is expected.
        with contextlib.suppress(Exception):
            reader.cancel()
        with contextlib.suppress(Exception):
            writer.close()

    def close(self) -> None:
        """End the session: the server ends its claims' leases (unacknowledged rows are
        ready again)."""
        with self._lock:
            self._close()
