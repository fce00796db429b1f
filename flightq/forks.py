"""gRPC's state does not survive ``fork()``: a process forked after this one used Arrow
Flight (a client or a server) hangs on its first call, whatever its timeout, and so does
a new connection made there. Rather than hang, flightq refuses at once, typed.

A process that only imported flightq forks safely; start processes that use flightq with
``spawn`` or ``forkserver`` (``multiprocessing.get_context("spawn")``), or fork before the
first connection.
"""

from __future__ import annotations

import os

from .errors import ProtocolError

__all__ = ["check", "forked", "used"]

#: The process that used Arrow Flight first (None: none did yet).
_used_in: int | None = None
#: Set in a child forked after that: nothing gRPC made (or makes) works there.
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    if _used_in is not None:
        _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def used() -> None:
    """This process uses Arrow Flight now (a connection, a server); refuses in a child
    forked after a process used it (:func:`check`)."""
    global _used_in
    check("connect")
    if _used_in is None:
        _used_in = os.getpid()


def forked() -> bool:
    """Whether this process was forked after its parent used Arrow Flight."""
    return _forked


def check(what: str) -> None:
    """Refuse ``what`` in a process forked after its parent used Arrow Flight.

    Raises
    ------
    ProtocolError
        In such a process: the call would hang.
    """
    if _forked:
        raise ProtocolError(
            f"{what}: this process was forked after its parent used flightq (a connection "
            "or a server), and gRPC's state does not survive a fork: the call would hang. "
            "Start processes that use flightq with 'spawn' or 'forkserver' "
            "(multiprocessing.get_context('spawn')), or fork before the first connection"
        )
