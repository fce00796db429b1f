"""A server's metrics over HTTP for Prometheus: ``flightq serve --metrics-port N``.

Read when scraped, from what the server keeps anyway (:mod:`flightq.server.metrics`,
the store's stats and its lease counts); nothing is counted twice. ``prometheus-client``
is an optional extra (``pip install 'flightq[metrics]'``).

=============================================  =========  ==================================
metric                                         type       labels
=============================================  =========  ==================================
``flightq_rows``, ``flightq_partition_bytes``  gauge      ``partition``
``flightq_partition_held_bytes``               gauge      ``partition`` (its budget count)
``flightq_held_bytes``                         gauge      (what the memory budget counts)
``flightq_memory_budget_bytes``                gauge      (absent without a budget)
``flightq_puts_total``, ``_gets_``, ...        counter    (every ``stats`` counter)
``flightq_refusals_total``                     counter    ``class`` (the error's class)
``flightq_lease_redeliveries_total``           counter    ``partition``, ``task``
``flightq_lease_ends_total``                   counter    ``partition``, ``task``, ``why``
``flightq_waiting_claims``                     gauge      ``partition``, ``task``
``flightq_call_seconds``                       histogram  ``kind`` (put, get, claim, ...)
=============================================  =========  ==================================

The lease counters live with their partition: dropping it drops its series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError
from .metrics import COUNTERS
from .replies import Held

if TYPE_CHECKING:
    from .flight import Server

__all__ = ["serve_metrics", "MetricsServer", "collector"]


class MetricsServer:
    """The HTTP endpoint serving one server's metrics; :meth:`close` stops it."""

    def __init__(self, httpd: Any, thread: Any, host: str) -> None:
        self._httpd, self._thread = httpd, thread
        self.port = int(httpd.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        #: Where Prometheus scrapes: ``http://host:port/metrics``.
        self.url = f"http://{shown}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:
        raise ProtocolError(
            "--metrics-port needs the prometheus-client package: pip install 'flightq[metrics]'"
        ) from e
    return prometheus_client


def collector(server: Server) -> Any:
    """A Prometheus collector of ``server``'s metrics, read at each scrape."""
    _prometheus()
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    class _Collector:
        def collect(self) -> Iterator[Any]:
            # A scrape writes every partition's and task's names, as a stats reply does:
            # built within the room for large replies (flightq.server.replies).
            held = Held(server.replies)
            held.hold(server.store.declared(), "metrics")
            try:
                yield from self._collect()
            finally:
                held.release()

        def _collect(self) -> Iterator[Any]:
            stats = server.store.stats()
            counters = server.counters.snapshot()
            rows = GaugeMetricFamily("flightq_rows", "Rows held", labels=["partition"])
            nbytes = GaugeMetricFamily(
                "flightq_partition_bytes", "Payload bytes held", labels=["partition"]
            )
            held = GaugeMetricFamily(
                "flightq_partition_held_bytes",
                "Bytes the memory budget counts for the partition's rows",
                labels=["partition"],
            )
            for name, p in stats["partitions"].items():
                rows.add_metric([name], p["rows"])
                nbytes.add_metric([name], p["bytes"])
                held.add_metric([name], p["held"])
            yield rows
            yield nbytes
            yield held
            yield GaugeMetricFamily(
                "flightq_held_bytes",
                "Bytes the memory budget counts: stored rows and puts on their way in",
                value=server.store.held(),
            )
            yield GaugeMetricFamily(
                "flightq_records_bytes",
                "Bytes the memory budget counts for records of the past (journals, ended "
                "leases, put ids), kept until the budget needs their room",
                value=server.store.records(),
            )
            yield GaugeMetricFamily(
                "flightq_counted_bytes",
                "Bytes the memory budget counts: rows, puts on their way in, declared "
                "partitions, live claims and records of the past",
                value=server.store.counted(),
            )
            if server.store.memory_budget is not None:
                yield GaugeMetricFamily(
                    "flightq_memory_budget_bytes",
                    "The server's memory budget",
                    value=server.store.memory_budget,
                )
            for name in COUNTERS:
                yield CounterMetricFamily(
                    f"flightq_{name}", f"{name} since the server started", value=counters[name]
                )
            refusals = CounterMetricFamily(
                "flightq_refusals", "Calls refused, by error class", labels=["class"]
            )
            for cls, n in counters["refusals"].items():
                refusals.add_metric([cls], n)
            yield refusals
            yield from _leases(server, CounterMetricFamily, GaugeMetricFamily, stats)
            hist = HistogramMetricFamily(
                "flightq_call_seconds",
                "Seconds per call (a DoGet's until its answer starts), by call kind",
                labels=["kind"],
            )
            for kind, h in server.counters.latency().items():
                buckets = [(_bound(b), n) for b, n in h["buckets"]]
                hist.add_metric([kind], buckets, sum_value=h["sum"])
            yield hist

    return _Collector()


def _leases(server: Server, counter: Any, gauge: Any, stats: dict[str, Any]) -> Iterator[Any]:
    again = counter(
        "flightq_lease_redeliveries",
        "Deliveries of a row after its first (it came back)",
        labels=["partition", "task"],
    )
    ends = counter(
        "flightq_lease_ends",
        "Rows whose lease ended without an ack: expired, or the consumer's session ended",
        labels=["partition", "task", "why"],
    )
    for name, tasks in server.store.lease_counts().items():
        for task, c in tasks.items():
            again.add_metric([name, task], c["redelivered"])
            ends.add_metric([name, task, "expired"], c["expired"])
            ends.add_metric([name, task, "gone"], c["gone"])
    yield again
    yield ends
    waiting = gauge(
        "flightq_waiting_claims", "Claims waiting for rows now", labels=["partition", "task"]
    )
    for name, p in stats["partitions"].items():
        for task, n in p.get("waiting", {}).items():
            waiting.add_metric([name, task], n)
    yield waiting


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(b)


def serve_metrics(server: Server, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``server``'s metrics at ``http://host:port/metrics`` from a daemon thread.

    ``port`` 0 picks a free port (``MetricsServer.port``). The default host is loopback:
    metrics name partitions and tasks, so expose them on purpose (``--metrics-host``).

    Raises
    ------
    ProtocolError
        Without prometheus-client (naming the extra), or if the port cannot be bound.
    """
    pc = _prometheus()
    registry = pc.CollectorRegistry()
    registry.register(collector(server))
    try:
        httpd, thread = pc.start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ProtocolError(
            f"metrics: cannot listen on {host}:{port} ({e.strerror or e}); pick a free port "
            "with --metrics-port, or 0 for any"
        ) from e
    return MetricsServer(httpd, thread, host)
