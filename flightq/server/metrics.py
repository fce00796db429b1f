"""What a server has done since it started: calls, rows and bytes, refusals by class.

The counters travel in the ``stats`` answer (``"counters"``, docs/protocol.md): a
monitoring loop polls ``flightq stats LOCATION --json`` (or ``Client.stats()``) and takes
differences. They only ever grow; a restarted server starts again from zero. Each call's
seconds go into a histogram per call kind (:meth:`Counters.observe`), which
``flightq serve --metrics-port`` exports to Prometheus (:mod:`flightq.server.exporter`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

from ..protocol import ACTIONS

__all__ = ["Counters", "COUNTERS", "LATENCY_BUCKETS", "call_kind", "read_counter"]

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
    "idle_cuts",
    "media_hashed_bytes",
    "shm_direct_bytes",
    "shm_answers_declined",
    "beats",
    "beats_slowed",
    "cancelled",
)


#: Upper bounds (seconds) of the call-latency histogram's buckets; the last is +inf.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: The server's call handlers (``Server._guard``'s ``fn``), by the kind they serve.
_KINDS = {"_do_put": "put", "_do_exchange": "exchange", "_info": "info"}


def read_counter(op: str) -> str:
    """The counter of a read of ``op`` (a ticket's): ``gets``, ``claims`` or ``scans``."""
    return {"get": "gets", "claim": "claims"}.get(op, "scans")


def call_kind(handler: str, args: Sequence[Any]) -> str | None:
    """The kind of a call, for its latency: ``put``, ``get``, ``claim``, ``scan``,
    ``action:<type>``, ``exchange`` or ``info``, from the handler's name and arguments
    (a DoGet's parsed ticket says whether it reads keys, claims or scans); None for a
    step that is not a whole call (parsing a ticket or a descriptor). An action type the
    server does not know is ``action:?``: a client naming a new type in every call would
    otherwise add a histogram per call, kept for the server's life."""
    if handler == "_do_action" and args:
        kind = getattr(args[0], "type", "?")
        return f"action:{kind if kind in ACTIONS else '?'}"
    if handler == "_do_get" and args:
        op = getattr(args[0], "op", None)
        return op if op in ("get", "claim", "scan") else "get"
    return _KINDS.get(handler)


class Counters:
    """Thread-safe counters of one server (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(COUNTERS, 0)
        self._refused: dict[str, int] = {}
        # Per call kind: [count per bucket (the last one +inf)], sum of seconds.
        self._latency: dict[str, tuple[list[int], list[float]]] = {}

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of :data:`COUNTERS`)."""
        with self._lock:
            self._n[name] += n

    def refused(self, error_class: str) -> None:
        """Count one refused call, by the class of the error it was refused with."""
        with self._lock:
            self._refused[error_class] = self._refused.get(error_class, 0) + 1

    def observe(self, kind: str | None, seconds: float) -> None:
        """Count one call of ``kind`` (:func:`call_kind`; None: not counted) that took
        ``seconds``."""
        if kind is None:
            return
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            counts, total = self._latency.setdefault(
                kind, ([0] * (len(LATENCY_BUCKETS) + 1), [0.0])
            )
            counts[i] += 1
            total[0] += seconds

    def latency(self) -> dict[str, dict[str, Any]]:
        """Per call kind: ``{"buckets": [(upper bound, calls at or under it), ...],
        "count", "sum"}``, cumulative as Prometheus histograms are (the last bound inf)."""
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            items = [(k, list(c), t[0]) for k, (c, t) in sorted(self._latency.items())]
        for kind, counts, total in items:
            bounds = [*LATENCY_BUCKETS, float("inf")]
            running, buckets = 0, []
            for b, n in zip(bounds, counts, strict=True):
                running += n
                buckets.append((b, running))
            out[kind] = {"buckets": buckets, "count": running, "sum": total}
        return out

    def snapshot(self) -> dict[str, Any]:
        """The counters now, and ``"refusals"``: per error class, calls refused with it."""
        with self._lock:
            return {**self._n, "refusals": dict(sorted(self._refused.items()))}
