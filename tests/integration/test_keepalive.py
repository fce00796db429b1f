"""gRPC keepalive on the client's connections: on by default, the user's options win, and
the server does not drop a client that pings it through a long idle session or claim."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fixtures_dataplane import TEXT

import flightq
from flightq.client.transport import generic_options, keepalive_options

#: A client timeout of 4 s gives 1 s keepalive: a ping after every idle second.
TIMEOUT = 4.0
#: Seconds the session and the claim stay idle: eight keepalive intervals (25 s found
#: nothing more: a client pinging without the 2-ping limit also passed both ways).
IDLE = 8.0


def test_keepalive_and_reconnection_are_a_quarter_of_the_timeout_between_1_and_20_s() -> None:
    for timeout, ms in ((0.5, 1000), (4.0, 1000), (60.0, 15_000), (3600.0, 20_000)):
        opts = dict(keepalive_options(timeout))
        assert opts["grpc.keepalive_time_ms"] == opts["grpc.keepalive_timeout_ms"] == ms
        assert opts["grpc.keepalive_permit_without_calls"] == 0
        assert opts["grpc.http2.max_pings_without_data"] == 2
        # A client whose server went away tries again at least every max(quarter, 2 s)
        # (gRPC: 120 s); one attempt keeps gRPC's 20 s for a slow handshake.
        assert "grpc.min_reconnect_backoff_ms" not in opts
        assert opts["grpc.initial_reconnect_backoff_ms"] == min(ms, 1000)
        assert opts["grpc.max_reconnect_backoff_ms"] == max(ms, 2000)


def test_a_users_own_generic_options_win_over_the_keepalive_defaults() -> None:
    mine = [("grpc.keepalive_time_ms", 5000), ("grpc.max_receive_message_length", -1)]
    opts = generic_options(60.0, mine)
    assert opts[:2] == mine
    assert dict(opts)["grpc.keepalive_time_ms"] == 5000
    assert dict(opts)["grpc.keepalive_timeout_ms"] == 15_000
    with flightq.Server() as srv, flightq.connect(srv.location, generic_options=mine) as c:
        assert c.health()["ok"] is True


@pytest.mark.timeout(IDLE + 60)
def test_an_idle_session_and_a_waiting_claim_outlive_many_keepalive_pings() -> None:
    ids = [np.arange(3)] * 2
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as other,
    ):
        c.create_partition("held", TEXT, tasks=["train"])
        c.create_partition("later", TEXT, tasks=["train"])
        c.put("held", ["a", "b"], {"input_ids": ids})
        held = c.claim("held", "train", 2, lease=float("inf"), as_="numpy")
        waited: list[object] = []

        def wait() -> None:  # a claim with nothing ready: no byte from the server for IDLE s
            try:
                waited.append(c.claim("later", "train", 2, timeout=IDLE + 20, as_="numpy").keys)
            except Exception as e:
                waited.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(IDLE)
        other.put("later", ["x", "y"], {"input_ids": ids})
        waiter.join(20)
        assert waited == [["x", "y"]]
        # The session lived: its rows are still leased to it, none came back.
        with pytest.raises(flightq.ClaimTimeoutError):
            other.claim("held", "train", 1, timeout=0.5, as_="numpy")
        assert c.ack(held) == 2
