"""What a process still has open of flightq when it exits: its writers' queued puts are
sent, then its servers stop.

A :class:`~flightq.Writer` left open at exit would lose the puts it accepted and had not
sent yet (its thread is a daemon: the interpreter does not wait for it). A
:class:`~flightq.Server` still serving would hang the process (Arrow's own exit hook
shuts it down with no deadline, which waits forever on a call that does not end by
itself: a consumer session, a client's request stream) or, now and then, abort it in
the interpreter's finalization ("terminate called without an active exception"). One
exit hook does both, writers first (they may be sending to a server of this process),
each within a bound; it runs before Arrow's (registered again after each new server:
atexit runs its hooks last registered first, before finalization, every thread still
running). A process forked after its parent used flightq does neither: gRPC's state
stayed in the parent.
"""

from __future__ import annotations

import atexit
import logging
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


def writer_open(writer: Any) -> None:
    """``writer`` (with ``close(timeout)``) is closed at exit unless closed before."""
    _writers.add(writer)
    _hook_last()


def server_serving(server: Any) -> None:
    """``server`` (with ``stop(deadline)``) is stopped at exit unless stopped before."""
    _servers.add(server)
    _hook_last()


def writer_closed(writer: Any) -> None:
    """``writer`` needs nothing more at exit."""
    _writers.discard(writer)


def server_stopped(server: Any) -> None:
    """``server`` needs nothing more at exit."""
    _servers.discard(server)


def _hook_last() -> None:
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    if forks.forked():
        return
    deadline = time.monotonic() + EXIT_FLUSH_S
    for writer in list(_writers):
        try:
            writer.close(max(0.0, deadline - time.monotonic()))
        except Exception as e:  # the next one still goes; the loss is named
            log.error("flightq: a writer was not closed before exit: %s", e)
    deadline = time.monotonic() + EXIT_STOP_S
    for server in list(_servers):
        try:
            server.stop(max(0.1, deadline - time.monotonic()))
        except Exception:
            log.exception("flightq: the server on %s did not stop at exit", server.location)
