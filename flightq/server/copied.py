"""Bytes the server copies while it makes a read's answer, counted per thread.

Most of an answer is zero-copy slices of stored batches; some is made afresh: rows of
several stored batches joined into one, a prompt group's image copied out of two puts'
dictionaries into one. A read through shared memory lists its answer's batches before it
sends any (:meth:`flightq.server.flight.Server._shm_reply`), so what they copied is held
at once: it stops listing once that passes what the answer could take in shared memory,
and sends the rest over the socket as it is made. Each copy site passes what it made
through :func:`made`; :func:`so_far` reads the thread's running count.
"""

from __future__ import annotations

import threading
from typing import TypeVar

__all__ = ["made", "so_far"]

_local = threading.local()
T = TypeVar("T")


def made(obj: T) -> T:
    """``obj`` (an Arrow array or record batch just copied), counted for this thread: the
    buffers it holds, each once (Arrow's count, a C++ call; ``nbytes`` walks the columns
    in Python and counts a buffer two columns share twice)."""
    size = obj.get_total_buffer_size()  # type: ignore[attr-defined]
    _local.bytes = getattr(_local, "bytes", 0) + size
    return obj


def so_far() -> int:
    """Bytes this thread has copied into answers since it started."""
    return int(getattr(_local, "bytes", 0))
