"""A client's consumer session: the link that ends its claims' leases when it goes.

The first claim a :class:`~flightq.Client` makes opens a session on the server: a
DoExchange stream, without a deadline, that the client holds open while it lives. Every
claim names the session. When the stream ends (the client closes, its process dies, its
connection drops) the server ends the leases of those claims at once, and their rows are
ready for another consumer: a preempted worker's rows come back in well under a second
instead of after the lease.

A stream the server sees end covers a process that dies, not a host that dies or a link
that is cut: the server then holds a half-open connection and hears nothing more. So the
client asks the server to end the session after ``silence`` seconds without a beat (the
client's ``session_timeout``), and a daemon thread sends a beat, a few bytes of app
metadata, ``BEATS_PER_SILENCE`` times per silence (at least once a second). A server that
runs no idle watch answers without a silence; the client then sends no beats.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from ..errors import NotFoundError
from ..protocol import SessionBeat
from .transport import Transport

__all__ = ["Session", "DEFAULT_SESSION_TIMEOUT", "beat_interval"]

#: Seconds without a beat after which a server ends a client's consumer session.
DEFAULT_SESSION_TIMEOUT = 15.0
#: Beats per silence: a session survives a few late or lost ones.
BEATS_PER_SILENCE = 10
#: Longest pause between two beats (seconds).
MAX_BEAT_INTERVAL = 1.0

_BEAT = pa.py_buffer(SessionBeat().to_wire())
#: Longest a close waits for a beat being written (seconds).
_CLOSE_WAIT = 1.0


def beat_interval(silence: float) -> float:
    """Seconds between two beats of a session the server ends after ``silence``."""
    return min(silence / BEATS_PER_SILENCE, MAX_BEAT_INTERVAL)


class _Beater:
    """The thread that beats one open session until it is stopped or a write fails."""

    def __init__(self, writer: Any, interval: float, lock: threading.Lock) -> None:
        self._writer, self._interval, self._lock = writer, interval, lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flightq-session-beat", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._writer.write_metadata(_BEAT)
            except Exception:
                # The stream is gone (the server ended the session, or the link): the
                # next claim learns that the server no longer knows it, and reopens.
                return

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end. A close joins it so the
        thread never outlives its client: a daemon thread that lets go of the stream's
        writer while the interpreter shuts down aborts the process (the writer's C++
        destructor cannot take the GIL back then)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class Session:
    """One consumer session on ``transport``'s server, opened on first use, that asks the
    server to end it after ``silence`` seconds without a beat (None: never; it then ends
    only with its stream). Thread-safe."""

    def __init__(self, transport: Transport, silence: float | None = None) -> None:
        self._transport = transport
        self._silence = silence
        self._lock = threading.Lock()
        self._write = threading.Lock()  # the beater's writes, and the writer's close
        self._stream: tuple[Any, Any] | None = None
        self._beater: _Beater | None = None
        self._id: str | None = None
        #: Another process's session this client claims under (:meth:`borrow`), and
        #: whether that process still lives (None: not asked).
        self._borrowed: str | None = None
        self._owner_alive: Callable[[], bool] | None = None

    @property
    def beating(self) -> bool:
        """Whether the open session beats (the server agreed to end it when silent)."""
        beater = self._beater
        return beater is not None and beater.alive

    def current(self) -> str | None:
        """The id of the session open now, without opening one (None: none is)."""
        with self._lock:
            return self._id

    def id(self, timeout: float | None = None) -> str:
        """The session's id, opening the session if it is not open, or again where its
        stream is known gone (its beats stopped: the server ended it, or the link)."""
        with self._lock:
            beater = self._beater
            if beater is not None and not beater.alive and self._borrowed is None:
                self._close()
            if self._id is None:
                writer, reader, reply = self._transport.session(timeout, self._silence)
                self._stream, self._id = (writer, reader), reply.session
                if reply.silence is not None:
                    self._beater = _Beater(writer, beat_interval(reply.silence), self._write)
            return self._id

    def borrow(self, session: str, owner_alive: Callable[[], bool] | None = None) -> None:
        """Claim under ``session``, another process's open session, instead of one of
        this client's own (closed if open): the leases of this client's claims then end
        when that session ends. A DataLoader worker claims so for its trainer's process,
        which holds the batches and acknowledges them: the worker's own end (torch retires
        a worker whose share is done while the trainer still holds its last batches) must
        not give them back. Once the server no longer knows that session (its process
        reconnected), this client opens one of its own (:meth:`reopen`), as a claim finds;
        not where ``owner_alive()`` says that process is gone (an orphan claims nothing
        more)."""
        with self._lock:
            self._close()
            self._borrowed = self._id = session
            self._owner_alive = owner_alive

    def reopen(self, stale: str, timeout: float | None = None) -> str:
        """A new session in place of ``stale`` (which the server no longer knows: it
        restarted, it found the session silent, or the stream broke); another thread's
        new one is kept. A borrowed session (:meth:`borrow`) that ended is given up:
        this client opens its own (the process it was borrowed from reconnected).

        Raises
        ------
        NotFoundError
            If ``stale`` is a borrowed session whose process is gone (``owner_alive``).
        """
        with self._lock:
            if self._borrowed is not None and stale == self._borrowed:
                alive = self._owner_alive
                if alive is not None and not alive():
                    raise NotFoundError(
                        f"the session {stale[:64]!r} this client claims under ended with "
                        "the process it was borrowed from; nothing more is claimed for it",
                        key=stale[:64],
                    )
                self._borrowed = None
            if self._id == stale:
                self._close()
        return self.id(timeout)

    def _close(self) -> None:
        stream, self._stream, self._id = self._stream, None, self._borrowed
        beater, self._beater = self._beater, None
        if beater is not None:
            beater.stop()
        if stream is None:
            return
        writer, reader = stream
        # Cancelling is how a session ends (the server then ends its leases); it also
        # frees a beat write that blocks on a dead link. The writer's close then reports
        # the cancel, which is expected.
        with contextlib.suppress(Exception):
            reader.cancel()
        # A beat blocked on a dead link (its window full) holds the lock until keepalive
        # drops the connection: close never waits for that, and leaves the writer to it.
        if self._write.acquire(timeout=_CLOSE_WAIT):
            try:
                with contextlib.suppress(Exception):
                    writer.close()
            finally:
                self._write.release()
            if beater is not None:
                beater.join(_CLOSE_WAIT)

    def close(self) -> None:
        """End the session: the server ends its claims' leases (unacknowledged rows are
        ready again)."""
        with self._lock:
            self._close()
