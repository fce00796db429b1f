"""flightq.Writer: a generator's puts in the background, against a real server.

Many puts land, in order, each once; a full queue blocks and then raises a typed error;
an error in the background surfaces on the next put, on flush and on close, and nothing
queued after it is stored; a put id repeated (a retry) stores nothing again. A full
server and an outage are waited out; what the writer gives up on is listed, never lost;
close keeps one deadline and names the put whose fate it cannot know.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, text_columns, text_keys
from helpers_proxy import Relay

import flightq

pytestmark = pytest.mark.timeout(120)


def _rows(n: int, prefix: str) -> tuple[list[str], dict[str, object]]:
    keys = text_keys(1, n, prefix)
    return keys, text_columns(keys)


def test_many_puts_land_once_each_and_close_flushes() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        w = flightq.Writer(srv.location, "r", max_pending=4)
        ids = [w.put(*_rows(2, f"p{i}_")) for i in range(200)]
        w.close()  # flushes
        assert len(set(ids)) == 200 and (w.puts, w.rows, w.dropped) == (200, 400, 0)
        assert c.inspect("r")["rows"] == 400
        with pytest.raises(ValueError, match="closed"):
            w.put(*_rows(1, "late"))


def test_a_full_queue_blocks_then_raises_a_typed_error() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"], max_rows=2)
        with flightq.Writer(c, "r", max_pending=1) as w:
            w.put(*_rows(2, "a"))  # fills the partition
            w.put(*_rows(2, "b"))  # sent: the server waits for room
            time.sleep(0.3)
            w.put(*_rows(2, "c"))  # queued: the queue is full now
            start = time.monotonic()
            with pytest.raises(flightq.WriterFullError, match="max_pending=1") as e:
                w.put(*_rows(2, "d"), timeout=0.3)
            assert time.monotonic() - start >= 0.3 and isinstance(e.value, TimeoutError)
            # A trainer makes room (clears what it consumed): the writer moves on.
            done = threading.Event()

            def trainer() -> None:
                while not done.is_set():
                    c.clear("r")
                    time.sleep(0.05)

            t = threading.Thread(target=trainer)
            t.start()
            try:
                w.put(*_rows(2, "e"), timeout=TIMEOUT)
                w.flush()
            finally:
                done.set()
                t.join()
        assert w.puts == 4 and w.dropped == 0


def test_an_error_in_the_background_surfaces_on_put_flush_and_close() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        w = flightq.Writer(c, "r", max_pending=8)
        w.put(*_rows(2, "ok"))
        w.put(["bad_g0"], {"input_ids": [np.arange(3, dtype=np.float32)]})
        w.put(*_rows(2, "after"))  # may be queued or refused: never stored
        with pytest.raises(flightq.DTypeError, match="input_ids"):
            w.flush()
        with pytest.raises(flightq.DTypeError, match="input_ids"):
            w.put(*_rows(2, "later"))
        with pytest.raises(flightq.DTypeError, match="input_ids"):
            w.close()
        assert sorted(c.list_keys("r")) == ["ok0_g0", "ok0_g1"]
        # The refused put first, then what was queued behind it; none of them may be stored.
        assert w.puts == 1 and w.dropped_puts[0].keys == ["bad_g0"] and w.unsure_puts == []
        assert [p.keys[0] for p in w.dropped_puts[1:]] in ([], ["after0_g0"])


def test_a_repeated_put_id_stores_nothing_again() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        keys, cols = _rows(2, "p")
        with flightq.Writer(c, "r") as w:
            put_id = w.put(keys, cols)
        # What a retry of that put sends: the same id; acknowledged, nothing stored twice.
        assert c.put("r", keys, cols, put_id=put_id) == 2
        assert c.inspect("r")["rows"] == 2


def _tokens(keys: list[str], n: int = 32_000) -> dict[str, object]:
    return {"input_ids": [np.arange(n, dtype=np.int64)] * len(keys)}  # 256 kB a row


def test_a_full_memory_budget_is_waited_out_not_fatal() -> None:
    # The server waits 0.8 s (of the writer's 1 s timeout) for room and refuses; the
    # trainer clears only after 2.5 s: every put is stored, once, nothing dropped.
    with (
        flightq.Server(memory_budget=4 << 20) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
    ):
        c.create_partition("r", TEXT, tasks=["train"])
        cleared, done = [0], threading.Event()

        def trainer() -> None:
            time.sleep(2.5)  # a weight sync: nothing consumed meanwhile
            while not done.is_set():
                cleared[0] += c.clear("r")
                time.sleep(0.05)

        t = threading.Thread(target=trainer)
        t.start()
        try:
            w = flightq.Writer(srv.location, "r", max_pending=2, connect_kwargs={"timeout": 1})
            for g in range(10):
                w.put(text_keys(1, 4, f"p{g}_"), _tokens(text_keys(1, 4, f"p{g}_")))
            w.close(timeout=TIMEOUT)
        finally:
            done.set()
            t.join()
        assert (w.puts, w.rows, w.dropped_puts, w.unsure_puts) == (10, 40, [], [])
        assert cleared[0] + c.inspect("r")["rows"] == 40


def test_a_put_past_its_patience_is_dropped_listed_and_can_be_sent_again() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"], max_rows=2)
        w = flightq.Writer(
            srv.location, "r", max_pending=4, retry_for=1.5, connect_kwargs={"timeout": 1}
        )
        for g in range(3):
            w.put(*_rows(2, f"p{g}_"))  # the first fills the partition; nobody clears
        with pytest.raises(flightq.ResourceExhaustedError, match="no rows were cleared"):
            w.flush(timeout=TIMEOUT)
        # Refused for room, never stored: listed as dropped, in order, with their put ids.
        assert w.puts == 1 and w.unsure_puts == []
        assert [p.keys for p in w.dropped_puts] == [["p1_0_g0", "p1_0_g1"], ["p2_0_g0", "p2_0_g1"]]
        c.clear("r")
        assert [p.send(c) for p in w.dropped_puts[:1]] == [2]
        assert sorted(c.list_keys("r")) == ["p1_0_g0", "p1_0_g1"]
        with pytest.raises(flightq.ResourceExhaustedError):
            w.close()


def test_a_put_past_a_limit_that_time_cannot_lift_stops_the_writer_at_once() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"], max_rows=2)
        w = flightq.Writer(c, "r")
        w.put(*_rows(3, "big"))
        start = time.monotonic()
        with pytest.raises(flightq.ResourceExhaustedError, match="split it"):
            w.flush(timeout=TIMEOUT)
        assert time.monotonic() - start < TIMEOUT / 2  # not retried for minutes
        assert [p.keys for p in w.dropped_puts] == [["big0_g0", "big0_g1", "big0_g2"]]


def test_an_outage_is_waited_out_and_every_put_stored_once() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"])
        port = int(srv.location.rsplit(":", 1)[1])
        relay = Relay(port)
        listen = int(relay.location.rsplit(":", 1)[1])
        w = flightq.Writer(relay.location, "r", connect_kwargs={"timeout": 2})
        try:
            w.put(*_rows(2, "before"))
            w.flush(timeout=TIMEOUT)
            relay.close()  # the server is gone for 2 s (refused, as while it restarts)
            for g in range(4):
                w.put(*_rows(2, f"during{g}_"))
                time.sleep(0.5)
            relay = Relay(port, listen)
            w.flush(timeout=TIMEOUT)
        finally:
            w.close(timeout=TIMEOUT)
            relay.close()
        assert (w.puts, w.rows, w.dropped_puts, w.unsure_puts) == (5, 10, [], [])
        assert c.inspect("r")["rows"] == 10


@pytest.mark.parametrize("owned", [True, False], ids=["own-connection", "given-client"])
def test_close_keeps_one_deadline_and_lists_the_put_in_flight_as_unsure(owned: bool) -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("r", TEXT, tasks=["train"], max_rows=2)
        given = flightq.connect(srv.location, timeout=10)
        target = srv.location if owned else given
        w = flightq.Writer(target, "r", connect_kwargs={"timeout": 10})
        w.put(*_rows(2, "a"))  # fills the partition
        w.flush(timeout=TIMEOUT)
        for g in range(3):
            w.put(*_rows(2, f"p{g}_"))  # the first waits on the server for room
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(flightq.FlightqTimeoutError, match="may have been stored") as e:
            w.close(timeout=2)
        took = time.monotonic() - start
        assert 2 <= took < 3.5, took  # one deadline, not the flush's and the join's
        (flying,) = w.unsure_puts
        assert flying.keys == ["p0_0_g0", "p0_0_g1"] and flying.put_id in str(e.value)
        assert [p.keys[0] for p in w.dropped_puts] == ["p1_0_g0", "p2_0_g0"]
        c.clear("r")  # room: the put in flight may land now
        if not owned:  # its call went on: its answer counts it acknowledged
            deadline = time.monotonic() + TIMEOUT
            while w.unsure_puts and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (w.puts, w.unsure_puts) == (2, [])
        # Everything not acknowledged, sent again by put id: each row stored once.
        for p in [*w.unsure_puts, *w.dropped_puts]:
            c.clear("r")
            assert p.send(c) == 2
        given.close()
        assert c.inspect("r")["rows"] == 2


def test_a_put_retried_thousands_of_times_still_ends_listed(monkeypatch) -> None:
    # The backoff's 0.1 * 2**tries overflowed a float past 1024 tries (an hour of 2 s
    # waits; here in seconds, the waits made tiny): the thread died, the put was in
    # neither list, and flush() without a timeout hung.
    import flightq.writer as writer

    monkeypatch.setattr(writer, "MAX_BACKOFF", 1e-4)
    srv = flightq.Server().start()
    with flightq.connect(srv.location, [TEXT], timeout=2.0) as c:
        c.create_partition("p", TEXT)
        srv.stop()  # gone for good: every try fails at once
        w = writer.Writer(c, "p", retry_for=8.0)
        keys, cols = _rows(1, "a")
        w.put(keys, cols)
        with pytest.raises(flightq.UnavailableError):
            w.flush(timeout=TIMEOUT)
        assert [p.keys for p in w.unsure_puts] == [keys] and not w.dropped_puts
        assert not w._thread.is_alive()
