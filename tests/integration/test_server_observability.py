"""What a server says about itself: its counters in ``stats``, its log records (the
``flightq`` logger, no handler of flightq's own), and the error of a port in use."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT

import flightq

pytestmark = pytest.mark.timeout(120)


def test_stats_counts_puts_gets_claims_bytes_and_refusals_by_class() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", ["a", "b"], {"input_ids": [np.arange(4), np.arange(2)]})
        c.get("r", ["a"], as_="numpy")
        c.claim("r", "train", 2, as_="numpy")
        with pytest.raises(flightq.NotFoundError):
            c.get("r", ["nope"])
        with pytest.raises(flightq.NotFoundError):
            c.clear("r", ["nope"])
        n = c.stats()["counters"]
    assert (n["puts"], n["rows_put"], n["gets"], n["claims"], n["rows_sent"]) == (1, 2, 1, 1, 3)
    assert n["bytes_received"] > 48 and n["bytes_sent"] > 0 and n["actions"] >= 4
    assert n["refusals"] == {"NotFoundError": 2}


def test_a_sharded_client_sums_the_shards_counters() -> None:
    with flightq.Server() as a, flightq.Server() as b:
        s = flightq.connect_sharded([a.location, b.location], [TEXT], timeout=TIMEOUT)
        try:
            s.create_partition("r", TEXT, tasks=["train"])
            keys = [f"p{i}_g0" for i in range(8)]
            s.put("r", keys, {"input_ids": [np.arange(3)] * 8})
            counters = s.stats()["counters"]
        finally:
            s.close()
    assert counters["rows_put"] == 8 and counters["puts"] >= 1


def test_the_server_logs_start_refusals_and_stop_through_the_flightq_logger(caplog) -> None:
    with (
        caplog.at_level(logging.DEBUG, logger="flightq"),
        flightq.Server() as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
        pytest.raises(flightq.NotFoundError),
    ):
        c.describe("nope")
    records = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("flightq.server", "INFO", f"flightq server listening on {srv.location}") in records
    refused = [m for n, lv, m in records if lv == "INFO" and m.startswith("refused")]
    # describe travels on the client's request stream, which logs its refusals as such.
    assert refused and re.match(
        r"refused NotFoundError( on the request stream)? \(partition nope", refused[0]
    ), refused
    assert any(m.endswith("stopping") for _, _, m in records)


def test_flightq_installs_no_log_handler() -> None:
    code = (
        "import logging, flightq, flightq.server, flightq.client\n"
        "assert not logging.getLogger('flightq').handlers\n"
        "assert not logging.getLogger('flightq.server').handlers\n"
        "assert not logging.getLogger().handlers\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_port_in_use_is_named_with_what_to_do() -> None:
    with flightq.Server() as srv:
        port = srv.location.rsplit(":", 1)[1]
        with pytest.raises(flightq.UnavailableError, match=f"127.0.0.1:{port}: the port is in use"):
            flightq.Server(f"grpc://127.0.0.1:{port}")
        out = subprocess.run(
            [sys.executable, "-m", "flightq.cli", "serve", "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert f"UnavailableError: cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr
    assert "--port 0" in out.stderr


def test_unknown_action_types_are_refused_typed_and_timed_under_one_kind() -> None:
    """Each call's seconds are kept per call kind for the server's life: a client naming
    a new action type in every call (a type of 1 MiB among them) must not add a kind
    per call, nor have its type echoed back whole."""
    import pyarrow.flight as fl

    with flightq.Server() as srv:
        plain = fl.connect(srv.location)
        try:
            for i in range(50):
                kind = f"no-such-action-{i}" + ("x" * (1 << 20) if i == 0 else "")
                with pytest.raises(fl.FlightServerError, match="ProtocolError") as e:
                    list(plain.do_action(fl.Action(kind, b"")))
                assert "unknown action" in str(e.value) and len(str(e.value)) < 1000
            list(plain.do_action(fl.Action("stats", b"")))  # serves on
        finally:
            plain.close()
        kinds = set(srv.counters.latency())
    assert {k for k in kinds if k.startswith("action:")} == {"action:?", "action:stats"}
    assert srv.counters.latency()["action:?"]["count"] == 50
