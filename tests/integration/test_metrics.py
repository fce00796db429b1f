"""``flightq serve --metrics-port``: Prometheus metrics, scraped over HTTP on loopback.

What a scrape shows after real calls: rows and bytes held (against the budget), calls,
refusals by class, lease redeliveries and ends, latency histograms per call kind.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from fixtures_dataplane import ROOT, TEXT, TIMEOUT, python_env, text_columns, text_keys

import flightq
from flightq.server.exporter import serve_metrics

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("prometheus_client", reason="prometheus-client is not installed")


def _scrape(url: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of every sample at ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_a_scrape_shows_rows_bytes_calls_refusals_redeliveries_and_latency() -> None:
    keys = text_keys(2, 2)
    with flightq.Server(memory_budget=1 << 30) as srv:
        metrics = serve_metrics(srv, 0)
        try:
            assert metrics.url.startswith("http://127.0.0.1:")
            with flightq.connect(srv.location, timeout=TIMEOUT) as c:
                c.create_partition("r", TEXT, tasks=["train"])
                c.put("r", keys, text_columns(keys))
                c.get("r", keys[:1], as_="numpy")
                c.nack(c.claim("r", "train", 2, as_="numpy"))  # the rows come back...
                c.ack(c.claim("r", "train", 4, as_="numpy"))  # ...delivered again
                with pytest.raises(flightq.NotFoundError):
                    c.get("r", ["no_such_row"])  # refused by the server
            m = _scrape(metrics.url)
        finally:
            metrics.close()
    assert m['flightq_rows{partition="r"}'] == 4
    assert m['flightq_partition_bytes{partition="r"}'] > 0
    assert (
        m['flightq_partition_held_bytes{partition="r"}']
        > m['flightq_partition_bytes{partition="r"}']
    )
    assert m["flightq_idle_cuts_total"] == 0
    assert 0 < m["flightq_held_bytes"] <= m["flightq_memory_budget_bytes"] == 1 << 30
    # The acks and the put left records of the past, counted with the rows.
    assert m["flightq_records_bytes"] > 0
    assert m["flightq_counted_bytes"] >= m["flightq_held_bytes"] + m["flightq_records_bytes"]
    assert m["flightq_puts_total"] == 1 and m["flightq_gets_total"] == 1
    assert m["flightq_claims_total"] == 2
    assert m['flightq_refusals_total{class="NotFoundError"}'] == 1
    assert m['flightq_lease_redeliveries_total{partition="r",task="train"}'] == 2
    assert m['flightq_lease_ends_total{partition="r",task="train",why="gone"}'] == 0
    for kind in ("put", "get", "claim", "action:ack"):
        assert m[f'flightq_call_seconds_count{{kind="{kind}"}}'] >= 1, kind
        assert m[f'flightq_call_seconds_bucket{{kind="{kind}",le="+Inf"}}'] >= 1, kind


@contextlib.contextmanager
def _serve(*extra: str) -> Iterator[dict[str, object]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "flightq.cli", "serve", "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=TIMEOUT)[1]
        yield json.loads(line)
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)


def test_flightq_serve_metrics_port_serves_prometheus_metrics_on_loopback() -> None:
    with _serve("--metrics-port", "0") as started:
        url = str(started["metrics"])
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        keys = text_keys(1, 2)
        with flightq.connect(str(started["listening"]), timeout=TIMEOUT) as c:
            c.create_partition("r", TEXT, tasks=["train"], lease=0.2)
            c.put("r", keys, text_columns(keys))
            c.claim("r", "train", 2, as_="numpy")  # never acked: its lease runs out
            again = c.claim("r", "train", 2, as_="numpy", timeout=TIMEOUT)
            assert again.claim.deliveries == (2, 2)
        m = _scrape(url)
    assert m['flightq_rows{partition="r"}'] == 2
    assert m['flightq_lease_ends_total{partition="r",task="train",why="expired"}'] == 2
    assert m['flightq_lease_redeliveries_total{partition="r",task="train"}'] == 2
    assert "flightq_memory_budget_bytes" not in m
