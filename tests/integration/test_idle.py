"""Streams are timed out when idle: a stream that waits on its client for ``idle_timeout``
has its connection cut, its slot comes back and nothing of it is stored, while slow but
progressing streams, waiting claims and consumer sessions are left alone
(flightq.server.idle, docs/reliability.md).

The stalls are crafted with plain ``pyarrow.flight``; every wait is bounded and none is a
speed check.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import cli_server
from helpers_h2 import HeadersOnly
from helpers_reliability import plain_put, put_command, text_batch

import flightq
from flightq.server.idle import cut_connection

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="idle timeouts cut connections through /proc"
)

TEXT = "rollout_text@1"
#: The idle timeout of these servers (seconds).
IDLE = 1.0
#: Seconds any wait may take before the test fails (never a speed check).
TIMEOUT = 30.0


def _until(what: str, check: object) -> None:
    """Poll ``check()`` until true; fail after TIMEOUT naming ``what``."""
    deadline = time.monotonic() + TIMEOUT
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never {what} within {TIMEOUT} s"
        time.sleep(0.02)


def _cuts(location: str) -> int:
    with flightq.connect(location, timeout=TIMEOUT) as c:
        return int(c.stats()["counters"]["idle_cuts"])


@contextlib.contextmanager
def _stalled_puts(location: str, n: int) -> Iterator[list[object]]:
    """``n`` plain DoPut streams, each on its own connection, that send their schema and
    then nothing; yields their writers."""
    schema = text_batch(["x"]).schema
    clients, writers = [], []
    try:
        for _ in range(n):
            client = fl.connect(location)
            clients.append(client)
            writer, _ = client.do_put(put_command("p", rows=1), schema)
            writers.append(writer)
        yield writers
    finally:
        for client in clients:
            client.close()


def test_stalled_puts_are_cut_after_the_idle_timeout_and_their_slots_free() -> None:
    with flightq.Server(max_calls=4, idle_timeout=IDLE) as srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        with _stalled_puts(srv.location, 4) as writers:
            _until("4 stalled puts on the server", lambda: srv.limits.in_flight()[0] == 4)
            _until("the stalled puts cut", lambda: srv.limits.in_flight()[0] == 0)
            with flightq.connect(srv.location, timeout=TIMEOUT) as c:
                assert c.put_batch("p", text_batch(["a0"])) == 1
                stats = c.stats()
            assert stats["counters"]["idle_cuts"] == 4
            assert stats["partitions"]["p"]["rows"] == 1  # nothing of the stalled puts
            # Their clients see the connection gone: the late batch has nowhere to go.
            for writer in writers:
                with pytest.raises(fl.FlightError, match=r"(?i)unavailable|socket closed"):
                    writer.write_batch(text_batch(["x"]))  # type: ignore[attr-defined]
                    writer.close()  # type: ignore[attr-defined]
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            assert c.get("p", ["a0"], as_="numpy").keys == ["a0"]
            assert c.health()["ok"] is True


@contextlib.contextmanager
def _filled(keys: list[str]) -> Iterator[flightq.Server]:
    """A server whose partition ``p`` holds 8 MiB per key (64 MiB: far more than gRPC's
    window and the socket buffers hold), put before its watchdog starts (``start``): on a
    loaded machine a put of that size from this same process can wait longer than the
    1 s timeout for the GIL, and would be cut as a slow client is."""
    srv = flightq.Server(idle_timeout=IDLE)  # it listens already
    try:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
            c.put("p", keys, {"input_ids": [np.arange(1 << 20) for _ in keys]})
    except BaseException:
        srv.stop()
        raise
    with srv:
        yield srv


def test_a_claim_whose_client_stops_reading_is_cut_and_its_rows_come_back() -> None:
    keys = [f"k{i}" for i in range(8)]
    with _filled(keys) as srv:
        ticket = {"op": "claim", "partition": "p", "task": "t", "batch_size": 8, "timeout": 5.0}
        with fl.connect(srv.location) as plain:
            reader = plain.do_get(fl.Ticket(msgpack.packb(ticket)))  # and never read
            _until("the stalled claim cut", lambda: _cuts(srv.location) == 1)
            with pytest.raises(fl.FlightError, match=r"(?i)unavailable|socket closed"):
                reader.read_all()
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            _until("the rows back", lambda: c.stats()["partitions"]["p"]["leased"] == {"t": 0})
            got = c.claim("p", "t", 8, timeout=TIMEOUT, as_="numpy")
            assert sorted(got.keys) == keys and got.claim.deliveries == (2,) * 8


def test_a_scan_whose_client_stops_reading_is_cut() -> None:
    keys = [f"k{i}" for i in range(8)]
    with _filled(keys) as srv:
        with fl.connect(srv.location) as plain:
            info = plain.get_flight_info(fl.FlightDescriptor.for_path("p"))
            reader = plain.do_get(info.endpoints[0].ticket)
            _until("the stalled scan cut", lambda: _cuts(srv.location) == 1)
            with pytest.raises(fl.FlightError, match=r"(?i)unavailable|socket closed"):
                reader.read_all()
        _until("every slot free", lambda: srv.limits.in_flight() == (0, 0))


def test_a_slow_put_that_keeps_sending_is_not_cut_and_stores() -> None:
    with flightq.Server(idle_timeout=IDLE) as srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        batches = [text_batch([f"a{i}"], seed=i) for i in range(10)]
        with fl.connect(srv.location) as plain:
            writer, acks = plain.do_put(put_command("p", rows=10), batches[0].schema)
            with writer:
                for b in batches:
                    writer.write_batch(b)
                    time.sleep(0.3)  # a batch every 0.3 s; 3 s in all, 3 timeouts
                writer.done_writing()
                ack = acks.read()
        assert ack is not None and msgpack.unpackb(ack.to_pybytes()) == {"rows": 10}
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            stats = c.stats()
        assert stats["partitions"]["p"]["rows"] == 10
        assert stats["counters"]["idle_cuts"] == 0


def test_a_held_session_and_a_waiting_claim_outlive_the_timeout_beside_a_cut_stall() -> None:
    ids = [np.arange(3)] * 2
    with (
        flightq.Server(idle_timeout=IDLE) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
        flightq.connect(srv.location, timeout=TIMEOUT) as other,
    ):
        c.create_partition("held", TEXT, tasks=["t"])
        c.create_partition("later", TEXT, tasks=["t"])
        c.create_partition("p", TEXT, tasks=["t"])
        c.put("held", ["a", "b"], {"input_ids": ids})
        held = c.claim("held", "t", 2, lease=float("inf"), as_="numpy")  # opens the session
        waited: list[object] = []

        def wait() -> None:  # nothing ready for several timeouts: waiting, not stalled
            try:
                waited.append(other.claim("later", "t", 2, timeout=TIMEOUT, as_="numpy").keys)
            except Exception as e:
                waited.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        with _stalled_puts(srv.location, 1):
            _until("the stall cut", lambda: srv.counters.snapshot()["idle_cuts"] == 1)
            time.sleep(3 * IDLE)  # the session and the claim stay idle past the timeout
        c.put("later", ["x", "y"], {"input_ids": ids})
        waiter.join(TIMEOUT)
        assert waited == [["x", "y"]]
        # The session lived: its rows are still leased to it, none came back.
        with pytest.raises(flightq.ClaimTimeoutError):
            other.claim("held", "t", 1, timeout=0.5, as_="numpy")
        assert c.ack(held) == 2
        assert c.stats()["counters"]["idle_cuts"] == 1


def test_a_stall_over_ipv6_loopback_is_cut() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        srv = flightq.Server("grpc://[::1]:0", idle_timeout=IDLE)
    except flightq.UnavailableError as e:
        pytest.skip(f"cannot listen on ::1: {e}")
    with srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        with _stalled_puts(srv.location, 1):
            _until("the stall over ::1 cut", lambda: srv.counters.snapshot()["idle_cuts"] == 1)
        assert plain_put(srv.location, put_command("p", rows=1), [text_batch(["a"])]) == {"rows": 1}


def test_sigterm_stops_the_server_while_a_stalled_stream_is_open() -> None:
    # The default idle timeout (60 s) is longer than the stop deadline: stopping cuts first.
    with cli_server("--max-calls", "1") as (location, proc):
        with flightq.connect(location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])

        def busy() -> bool:  # the stall holds the one data-call slot: it is on the server
            try:
                plain_put(location, put_command("p", rows=1), [text_batch(["x"])])
            except fl.FlightError as e:
                return "server busy" in str(e)
            return False

        with _stalled_puts(location, 1):
            _until("the stall on the server", busy)
            proc.terminate()
            assert proc.wait(timeout=TIMEOUT) == 0
        assert proc.stderr is not None
        assert "cut the connection of ipv4:127.0.0.1:" in proc.stderr.read()


def test_the_idle_timeout_is_checked_and_zero_turns_it_off() -> None:
    with pytest.raises(flightq.ProtocolError, match=r"idle_timeout must be seconds >= 0"):
        flightq.Server(idle_timeout=-1)
    with pytest.raises(flightq.ProtocolError, match=r"idle_timeout must be seconds >= 0"):
        flightq.Server(idle_timeout=float("nan"))
    with flightq.Server(idle_timeout=0) as srv:
        assert srv.idle.timeout is None
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            assert c.stats()["counters"]["idle_cuts"] == 0


def test_cutting_finds_only_a_tcp_connection_this_server_holds() -> None:
    with flightq.Server(idle_timeout=IDLE) as srv, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert not cut_connection(srv.port, "unix:/tmp/flightq.sock")  # not TCP
        assert not cut_connection(srv.port, f"ipv4:127.0.0.1:{s.getsockname()[1]}")  # none
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            assert c.health()["ok"] is True
        assert _cuts(srv.location) == 0


def test_calls_that_never_send_their_first_message_are_cut_and_their_slots_free() -> None:
    # Headers and nothing else: Flight waits for the first message before any handler runs.
    # 3 s: long enough that a loaded machine sees both calls on the server before the cut.
    with flightq.Server(max_calls=3, idle_timeout=3 * IDLE) as srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        with HeadersOnly("127.0.0.1", srv.port) as raw:
            raw.open("DoPut")
            raw.open("DoExchange")
            # A DoExchange counts as a session until its first message says otherwise.
            _until("both stalled calls on the server", lambda: srv.limits.in_flight() == (1, 1))
            assert raw.closed.wait(TIMEOUT), "the stalled calls' connection was never cut"
            _until("their slots free", lambda: srv.limits.in_flight() == (0, 0))
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            assert c.put_batch("p", text_batch(["a0"])) == 1
            stats = c.stats()
        assert stats["counters"]["idle_cuts"] == 1  # one connection carried both
        assert stats["partitions"]["p"]["rows"] == 1


def test_a_stall_before_the_first_message_spares_connections_with_live_calls() -> None:
    # The cut is by elimination: a session held open across the timeout is never cut, and
    # a client idle between calls may be (it reconnects on its next call).
    ids = [np.arange(3)] * 2
    with (
        flightq.Server(idle_timeout=IDLE) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
        flightq.connect(srv.location, timeout=TIMEOUT) as idle,
    ):
        c.create_partition("held", TEXT, tasks=["t"])
        c.put("held", ["a", "b"], {"input_ids": ids})
        held = c.claim("held", "t", 2, lease=float("inf"), as_="numpy")  # opens the session
        assert idle.health()["ok"] is True
        with HeadersOnly("127.0.0.1", srv.port) as raw:
            raw.open("DoPut")
            assert raw.closed.wait(TIMEOUT), "the stalled call's connection was never cut"
        # The session lived: its rows are still leased to it.
        with pytest.raises(flightq.ClaimTimeoutError):
            idle.claim("held", "t", 1, timeout=0.5, as_="numpy")
        assert c.ack(held) == 2
        assert idle.health()["ok"] is True


def test_a_flood_of_short_connections_cannot_get_a_live_sessions_connection_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The connections a handler ran a call on are remembered in a bounded table: a client
    # opening more short connections than it keeps pushed a held session's out of it,
    # and one stalled call then had that session cut by elimination (its leases ended).
    from flightq.server import idle as idle_module

    monkeypatch.setattr(idle_module, "_SEEN_KEPT", 4)  # the flood, in a few connections
    with (
        flightq.Server(idle_timeout=IDLE) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
    ):
        c.create_partition("held", TEXT, tasks=["t"])
        c.put("held", ["a", "b"], {"input_ids": [np.arange(3)] * 2})
        held = c.claim("held", "t", 2, lease=float("inf"), as_="numpy")  # opens the session
        for _ in range(idle_module._SEEN_KEPT + 4):
            with fl.connect(srv.location) as short:
                list(short.do_action(fl.Action("health", b"")))
        with HeadersOnly("127.0.0.1", srv.port) as raw:
            raw.open("DoPut")
            assert raw.closed.wait(TIMEOUT), "the stalled call's connection was never cut"
        assert srv.store.stats()["partitions"]["held"]["leased"] == {"t": 2}
        assert c.ack(held) == 2


def test_calls_refused_busy_are_not_taken_for_stalled_ones() -> None:
    # A refused call never reaches a handler: were it followed as one that waits for its
    # first message, the bystander's idle connection would be cut for it.
    mib = 2**20
    with (
        flightq.Server(max_calls=1, idle_timeout=IDLE, memory_budget=4 * mib) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
        flightq.connect(srv.location, timeout=TIMEOUT) as bystander,
    ):
        c.create_partition("p", TEXT, tasks=["t"])
        c.put("p", ["full"], {"input_ids": [np.zeros(3 * mib // 8, dtype=np.int64)]})
        assert bystander.health()["ok"] is True
        got: list[object] = []

        def put() -> None:  # waits on the server for room, not on its client: never cut
            try:
                big = {"input_ids": [np.zeros(2 * mib // 8, dtype=np.int64)]}
                c.put("p", ["big"], big, timeout=5 * IDLE)
            except Exception as e:
                got.append(e)

        waiter = threading.Thread(target=put)
        waiter.start()
        _until("the put holds the one slot", lambda: srv.limits.in_flight()[0] == 1)
        for _ in range(3):
            with pytest.raises(fl.FlightError, match="server busy"):
                plain_put(srv.location, put_command("p", rows=1), [text_batch(["x"])])
        waiter.join(TIMEOUT)
        assert [type(e) for e in got] == [flightq.ResourceExhaustedError]
        assert srv.counters.snapshot()["idle_cuts"] == 0
        assert bystander.health()["ok"] is True
        assert plain_put(srv.location, put_command("p", rows=1), [text_batch(["a"])]) == {"rows": 1}
