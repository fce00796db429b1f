"""What a server has done since it started: calls, rows and bytes, refusals by class.

The counters travel in the ``stats`` answer (``"counters"``, docs/protocol.md): a
monitoring loop polls ``flightq stats LOCATION --json`` (or ``Client.stats()``) and takes
differences. They only ever grow; a restarted server starts again from zero.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Counters", "COUNTERS"]

#: Every counter, in the order the answer lists them.
COUNTERS = (
    "puts",
    "rows_put",
    "bytes_received",
    "gets",
    "claims",
    "scans",
    "rows_sent",
    "bytes_sent",
    "actions",
)


class Counters:
    """Thread-safe counters of one server (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(COUNTERS, 0)
        self._refused: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of :data:`COUNTERS`)."""
        with self._lock:
            self._n[name] += n

    def refused(self, error_class: str) -> None:
        """Count one refused call, by the class of the error it was refused with."""
        with self._lock:
            self._refused[error_class] = self._refused.get(error_class, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The counters now, and ``"refusals"``: per error class, calls refused with it."""
        with self._lock:
            return {**self._n, "refusals": dict(sorted(self._refused.items()))}
