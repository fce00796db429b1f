"""What a process still has open of flightq when it exits: its writers' queued puts are
sent, then its servers stop.

A :class:`~flightq.Writer` left open at exit would lose the puts it accepted and had not
sent yet (its thread is a daemon: the interpreter does not wait for it). A
:class:`~flightq.Server` still serving would hang the process (Arrow's own exit hook
shuts it down with no deadline, which waits forever on a call that does not end by
itself: a consumer session, a client's request stream) or, now and then, abort it in
the interpreter's finalization ("terminate called without an active exception"). One
exit hook does both, writers first (they may be sending to a server of this process),
each step within a bound, the servers stopping side by side. It is registered once, at
import, after Arrow's (``weakref.finalize``'s), so it runs before it and after any hook
the application registers later (atexit runs its hooks last registered first, before
finalization, every thread still running), and it runs too where a process that
``multiprocessing`` started with ``fork`` or ``forkserver`` ends (with ``os._exit``,
after its finalizers). A server that does not stop within the bound is logged and left
out of Arrow's hook, so that the exit goes on.

A process forked after its parent used flightq does neither: gRPC's state stayed in the
parent. Nothing runs on ``os._exit``, SIGKILL or a signal without a handler, and Python
waits for the application's non-daemon threads (a claim in a thread pool) before any
exit hook. An application's daemon thread that is inside a Flight call when the
interpreter finalizes can still crash the process in Arrow (a segfault): stop such
threads, or close their clients, before returning.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from typing import Any

from . import forks

__all__ = [
    "EXIT_FLUSH_S",
    "EXIT_STOP_S",
    "server_serving",
    "server_stopped",
    "writer_closed",
    "writer_open",
]

#: Seconds a process's exit waits, in all, for the puts its open writers queued.
EXIT_FLUSH_S = 30.0
#: Seconds a process's exit waits, in all, for its servers still serving to stop.
EXIT_STOP_S = 5.0

log = logging.getLogger("flightq")

# Open writers and serving servers (weakly: a thread of theirs keeps each alive anyway).
_writers: weakref.WeakSet[Any] = weakref.WeakSet()
_servers: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()  # a thread may open a writer while the hook lists them
#: The process the hook ran in (a forked child runs its own).
_ran_in: int | None = None


def writer_open(writer: Any) -> None:
    """``writer`` (with ``close(timeout)``) is closed at exit unless closed before."""
    with _lock:
        _writers.add(writer)


def server_serving(server: Any) -> None:
    """``server`` (with ``stop(deadline)``) is stopped at exit unless stopped before."""
    with _lock:
        _servers.add(server)


def writer_closed(writer: Any) -> None:
    """``writer`` needs nothing more at exit."""
    with _lock:
        _writers.discard(writer)


def server_stopped(server: Any) -> None:
    """``server`` needs nothing more at exit."""
    with _lock:
        _servers.discard(server)


def server_left(server: Any) -> None:
    """``server`` did not stop within its caller's deadline and its caller gave up on it:
    the exit waits for it no more (neither this hook nor Arrow's, which would wait for a
    call that never ends with no deadline)."""
    server_stopped(server)
    _leave_out_of_arrows_hook(server)


def _at_exit() -> None:
    global _ran_in
    if forks.forked() or _ran_in == os.getpid():
        return  # once: atexit, then multiprocessing's finalizers call it
    _ran_in = os.getpid()
    try:
        _close_writers()
    finally:  # a Ctrl-C while writers send: the servers still stop
        _stop_servers()


def _close_writers() -> None:
    deadline = time.monotonic() + EXIT_FLUSH_S
    with _lock:
        writers = list(_writers)
    for writer in writers:
        try:
            writer.close(max(0.0, deadline - time.monotonic()))
        except BaseException as e:  # the next one still goes; the loss is named
            log.error(
                "flightq: a writer was not closed before exit: %s (puts not stored: %d, "
                "maybe stored: %d)",
                e,
                len(getattr(writer, "dropped_puts", ())),
                len(getattr(writer, "unsure_puts", ())),
            )
            if not isinstance(e, Exception):
                raise


def _stop_servers() -> None:
    with _lock:
        servers = list(_servers)
    stopped: dict[int, bool] = {}

    def stop(i: int, server: Any) -> None:
        try:
            stopped[i] = bool(server.stop(EXIT_STOP_S))
        except Exception:
            log.exception("flightq: a server's stop at exit failed")

    threads = [
        threading.Thread(target=stop, args=(i, s), name="flightq-exit-stop", daemon=True)
        for i, s in enumerate(servers)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + EXIT_STOP_S + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for i, server in enumerate(servers):
        if not stopped.get(i):
            log.error(
                "flightq: the server on %s did not stop within %gs at exit (a call that does "
                "not end by itself: a stream its client stalled with idle_timeout off); the "
                "process exits without waiting for it",
                getattr(server, "location", "?"),
                EXIT_STOP_S,
            )
            _leave_out_of_arrows_hook(server)


def _leave_out_of_arrows_hook(server: Any) -> None:
    # Arrow's exit hook would wait for that call with no deadline: forever.
    registry = getattr(weakref.finalize, "_registry", {})
    for f in list(registry):
        with contextlib.suppress(Exception):
            if f.peek() is not None and f.peek()[0] is server:
                f.detach()


weakref.finalize(_at_exit, lambda: None)  # weakref's exit hook is registered by now...
atexit.register(_at_exit)  # ...so this one runs before it
# multiprocessing's children started by fork or forkserver end with os._exit, after these.
multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)
