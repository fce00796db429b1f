"""No request slows another: replays found without a cell walk, large puts committed at
once, calls and sessions bounded with a typed refusal (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from helpers_reliability import plain_error, plain_put, put_command, text_batch

import flightq
from flightq.chunks import encode_chunks
from flightq.protocol import SessionCommand

TEXT = "rollout_text@1"
#: Seconds any wait in these tests may take before the test fails (never a speed check).
TIMEOUT = 30.0


def _health_until_ok(location: str) -> dict[str, object]:
    """Health, retried while the server says it is busy; fails after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    with flightq.connect(location, timeout=TIMEOUT) as c:
        while True:
            try:
                return c.health()
            except flightq.ResourceExhaustedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_an_identical_replay_is_acknowledged_and_differing_content_conflicts() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        batch = text_batch(["a0", "a1", "a2"])
        assert plain_put(srv.location, put_command("p", rows=3), [batch]) == {"rows": 3}
        before = c.inspect("p")
        # The same record batch again, from a plain client: acknowledged, nothing stored.
        assert plain_put(srv.location, put_command("p", rows=3), [batch]) == {"rows": 3}
        assert c.inspect("p") == before
        # A column written back meanwhile does not change that, and its retry is one too.
        lp = [np.full(4 + i % 3, -0.5, np.float32) for i in range(3)]
        assert c.put("p", ["a0", "a1", "a2"], {"prev_logprobs": lp}) == 3
        assert c.put("p", ["a0", "a1", "a2"], {"prev_logprobs": lp}) == 3
        assert plain_put(srv.location, put_command("p", rows=3), [batch]) == {"rows": 3}
        # Same keys, other content: a conflict, nothing changed.
        with pytest.raises(flightq.ConflictError, match=r"row key 'a0' already has column"):
            c.put_batch("p", text_batch(["a0", "a1", "a2"], seed=7))
        # Once a cell of the stored batch is rewritten, the old batch is no retry.
        lengths = {"input_lengths": np.array([5], np.int32)}
        assert c.put("p", ["a1"], lengths, overwrite=True) == 1
        with pytest.raises(flightq.ConflictError, match=r"row key 'a0' already has column"):
            c.put_batch("p", batch)
        # A put id is acknowledged again even after its rows were cleared.
        assert c.put_batch("p", text_batch(["b0"]), put_id="g1") == 1
        assert c.clear("p", ["b0"]) == 1
        assert c.put_batch("p", text_batch(["b0"]), put_id="g1") == 1
        assert c.stats()["partitions"]["p"]["rows"] == 3
        got = c.claim("p", "t", 3, timeout=TIMEOUT, as_="numpy")
        assert sorted(got.keys) == ["a0", "a1", "a2"]


def test_a_retry_of_a_cleared_row_is_no_replay_and_stores_again_whole() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        batch = text_batch(["a0", "a1"])
        assert c.put_batch("p", batch) == 2
        assert c.clear("p", ["a0", "a1"]) == 2
        assert c.put_batch("p", batch) == 2  # new rows again, not a replay
        assert c.stats()["partitions"]["p"]["rows"] == 2
        assert c.claim("p", "t", 2, timeout=TIMEOUT, as_="numpy").keys == ["a0", "a1"]


def test_a_large_put_appears_all_at_once_to_readers() -> None:
    n = 100_000
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        keys = [f"k{i}" for i in range(n)]
        batch = text_batch(keys)
        seen: set[int] = set()
        done = threading.Event()

        def read() -> None:
            with flightq.connect(srv.location, timeout=TIMEOUT) as r:
                while not done.is_set():
                    seen.add(r.stats()["partitions"]["p"]["rows"])

        reader = threading.Thread(target=read)
        reader.start()
        try:
            assert c.put_batch("p", batch, timeout=TIMEOUT) == n
        finally:
            done.set()
            reader.join(TIMEOUT)
        assert seen <= {0, n}
        assert c.stats()["partitions"]["p"]["rows"] == n
        got = c.get("p", [keys[0], keys[-1]], as_="numpy")
        assert got.keys == [keys[0], keys[-1]]


def _stalled_puts(location: str, n: int) -> list[tuple[fl.FlightClient, object]]:
    """``n`` DoPut streams that send their schema and then nothing."""
    schema = text_batch(["x"]).schema
    out = []
    for _ in range(n):
        client = fl.connect(location)
        writer, _ = client.do_put(put_command("p", rows=1), schema)
        out.append((client, writer))
    return out


def test_over_max_calls_a_call_is_refused_typed_and_the_server_serves_after() -> None:
    with flightq.Server(max_calls=2) as srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        stalled = _stalled_puts(srv.location, 2)
        try:
            deadline = time.monotonic() + TIMEOUT
            while srv.limits.in_flight()[0] < 2:  # both streams reached the server
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with flightq.connect(srv.location, timeout=TIMEOUT) as c:
                # Actions have slots of their own: the stalled streams do not starve them.
                assert c.stats()["partitions"]["p"]["rows"] == 0
                with pytest.raises(
                    flightq.ResourceExhaustedError, match=r"server busy: 2 calls in flight"
                ) as busy:
                    c.get("p", ["a"] * 17, as_="numpy")  # a data call (DoGet): refused
                assert busy.value.retry == "busy" and busy.value.busy and busy.value.room_may_come
            with pytest.raises(fl.FlightError) as info:
                plain_put(srv.location, put_command("p", rows=1), [text_batch(["x"])])
            kind, message = plain_error(info.value)
            assert kind == "ResourceExhaustedError" and "max_calls=2" in message
            # A plain Flight client reads why it may retry from the detail, not the text.
            assert msgpack.unpackb(info.value.extra_info)["retry"] == "busy"
        finally:
            for client, writer in stalled:
                with contextlib.suppress(fl.FlightError):  # refused: 0 of the rows announced
                    writer.close()  # type: ignore[attr-defined]
                client.close()
        assert _health_until_ok(srv.location)["ok"] is True
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            assert c.stats()["partitions"]["p"]["rows"] == 0  # the stalled puts stored nothing
            assert c.put_batch("p", text_batch(["a0"])) == 1


@contextlib.contextmanager
def _one_slot_held(srv: flightq.Server) -> Iterator[None]:
    """While it lasts, a stalled plain DoPut holds one of the server's data-call slots."""
    stalled = _stalled_puts(srv.location, 1)
    try:
        deadline = time.monotonic() + TIMEOUT
        while srv.limits.in_flight()[0] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield
    finally:
        for client, writer in stalled:
            with contextlib.suppress(fl.FlightError):
                writer.close()  # type: ignore[attr-defined]
            client.close()


def _busy_refusals(c: flightq.Client) -> int:
    return int(c.stats()["counters"]["refusals"].get("ResourceExhaustedError", 0))


#: Eight rows of 2 MiB each.
_KEYS = [f"k{i}" for i in range(8)]
_IDS = [np.full(1 << 18, i, dtype=np.int64) for i in range(8)]


def test_a_parallel_get_whose_streams_find_the_server_busy_runs_as_one_stream() -> None:
    # One slot of two held by a stalled put: a get over 4 streams has most of them refused
    # "server busy"; the client reads it again as one stream, and its next gets go as one
    # stream for a while (CROWDED_SECONDS) instead of being refused again.
    with (
        flightq.Server(max_calls=2) as srv,
        flightq.connect(
            srv.location, [TEXT], timeout=TIMEOUT, get_streams=4, min_stream_bytes=2**20
        ) as c,
    ):
        c.create_partition("p", TEXT, tasks=["t"])
        c.put("p", _KEYS, {"input_ids": _IDS})
        c.get("p", _KEYS, as_="numpy")  # the row sizes learned: the next get splits
        with _one_slot_held(srv):
            before = _busy_refusals(c)
            b = c.get("p", _KEYS, as_="numpy")
            assert b.received is not None and b.received.route == "socket"
            assert all(np.array_equal(x, y) for x, y in zip(b["input_ids"], _IDS, strict=True))
            assert _busy_refusals(c) > before  # the streams were refused, the get was not
            again = _busy_refusals(c)
            assert c.get("p", _KEYS, as_="numpy").received.route == "socket"
            assert _busy_refusals(c) == again  # one stream at once: nothing refused


@pytest.mark.parametrize("how", ["put", "put_batch"])
def test_a_parallel_put_whose_streams_find_the_server_busy_is_sent_again_as_one_stream(
    how: str,
) -> None:
    # As above for a put over 4 DoPut streams (4 MiB batches): the refused parts are
    # aborted, nothing is stored twice, and the put goes again as one stream (put_batch
    # raised the streams' refusal instead, without its `retry`: a sharded put, which
    # puts record batches on each shard, and a Writer over it gave up).
    with (
        flightq.Server(max_calls=2) as srv,
        flightq.connect(
            srv.location,
            [TEXT],
            timeout=TIMEOUT,
            put_streams=4,
            min_stream_bytes=2**20,
            max_batch_bytes=4 * 2**20,
        ) as c,
    ):
        c.create_partition("p", TEXT, tasks=["t"])
        assert c.put("p", _KEYS[:4], {"input_ids": _IDS[:4]}).route == "streams=2"
        with _one_slot_held(srv):
            before = _busy_refusals(c)
            if how == "put":
                got = c.put("p", _KEYS, {"input_ids": _IDS}, overwrite=True)
            else:
                schema = flightq.SchemaRegistry.default().get(TEXT)
                batches = encode_chunks(schema, {"input_ids": _IDS}, _KEYS, max_bytes=4 * 2**20)
                got = c.put_batch("p", batches, overwrite=True)
            assert got == 8 and got.route == "socket"
            assert _busy_refusals(c) > before
            assert c.stats()["partitions"]["p"]["rows"] == 8
            b = c.get("p", _KEYS, as_="numpy")
            assert all(np.array_equal(x, y) for x, y in zip(b["input_ids"], _IDS, strict=True))


def _open_session(location: str) -> tuple[fl.FlightClient, object, object]:
    client = fl.connect(location)
    desc = fl.FlightDescriptor.for_command(SessionCommand().to_wire())
    writer, reader = client.do_exchange(desc)
    reader.read_chunk()  # the session id: the session is open
    return client, writer, reader


def _data_slots_free(srv: flightq.Server) -> None:
    """Wait until no data call holds a slot: gRPC ends a call on the server a moment
    after its client has the answer."""
    deadline = time.monotonic() + TIMEOUT
    while srv.limits.in_flight()[0]:
        assert time.monotonic() < deadline, "a data call's slot never freed"
        time.sleep(0.02)


def test_claims_waiting_for_rows_never_take_the_slots_puts_and_gets_need() -> None:
    # A claim that waits gives up its data call's slot for one among the claims waiting:
    # a client's (or many consumers') waiting claims cannot refuse the generators' puts.
    from flightq.protocol import ClaimTicket

    def waiting_claim(location: str, errors: list[BaseException]) -> None:
        ticket = ClaimTicket(partition="p", task="t", batch_size=1, timeout=TIMEOUT)
        try:
            with fl.connect(location) as plain:
                plain.do_get(fl.Ticket(ticket.to_wire())).read_all()
        except BaseException as e:  # a refusal, or the end of the test
            errors.append(e)

    with (
        flightq.Server(max_calls=2) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["t"])
        c.stream_max_bytes = 0  # every call per call: each takes a data call's slot
        errors: list[BaseException] = []
        claims = [
            threading.Thread(target=waiting_claim, args=(srv.location, errors)) for _ in range(2)
        ]
        for th in claims:
            th.start()
        deadline = time.monotonic() + TIMEOUT
        while srv.limits.waiting() < 2:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.02)
        assert srv.limits.in_flight()[0] == 0  # both wait, neither holds a data slot
        # A third claim that must wait is refused busy; a put and a get go through.
        with pytest.raises(
            flightq.ResourceExhaustedError, match=r"server busy: 2 claims waiting for rows"
        ):
            c.claim("p", "t", 1, timeout=TIMEOUT, as_="numpy")
        third = ClaimTicket(partition="p", task="t", batch_size=1, timeout=TIMEOUT)
        with fl.connect(srv.location) as plain, pytest.raises(fl.FlightError) as info:
            plain.do_get(fl.Ticket(third.to_wire())).read_all()  # a plain client: the same
        kind, message = plain_error(info.value)
        assert kind == "ResourceExhaustedError" and "2 claims waiting for rows" in message
        assert c.inspect("p")["rows"] == 0 and srv.limits.waiting() == 2  # nothing taken
        _data_slots_free(srv)  # the refused calls' slots free once they end
        for i in range(3):
            assert c.put("p", [f"r{i}"], {"input_ids": [np.arange(3)]}).route == "socket"
        for th in claims:
            th.join(TIMEOUT)
        assert not errors and srv.limits.waiting() == 0  # both took a row, then ended
        _data_slots_free(srv)
        assert c.get("p", ["r0", "r1", "r2"], as_="numpy").keys == ["r0", "r1", "r2"]
        assert c.claim("p", "t", 1, timeout=TIMEOUT, as_="numpy").keys == ["r2"]


def test_sessions_are_capped_apart_from_calls() -> None:
    with flightq.Server(max_sessions=1, max_calls=4) as srv:
        first = _open_session(srv.location)
        try:
            with pytest.raises(fl.FlightError) as info:
                _open_session(srv.location)
            kind, message = plain_error(info.value)
            assert kind == "ResourceExhaustedError"
            assert "server busy: 1 sessions in flight" in message and "max_sessions=1" in message
            # Data calls have their own slots: a session never starves them.
            with flightq.connect(srv.location, timeout=TIMEOUT) as c:
                assert c.health()["ok"] is True
        finally:
            first[2].cancel()  # type: ignore[attr-defined]
            first[0].close()
        deadline = time.monotonic() + TIMEOUT
        while True:  # the first session's slot frees once its handler sees it end
            try:
                again = _open_session(srv.location)
                break
            except fl.FlightError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        again[2].cancel()  # type: ignore[attr-defined]
        again[0].close()


def test_call_limits_must_be_positive() -> None:
    with pytest.raises(flightq.ProtocolError, match=r"max_calls must be an int >= 1"):
        flightq.Server(max_calls=0)


def test_each_call_gives_its_slot_back_when_it_ends() -> None:
    with flightq.Server(max_calls=1) as srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
            for i in range(5):
                assert c.put_batch("p", text_batch([f"a{i}"])) == 1
                assert c.get("p", [f"a{i}"], as_="numpy").keys == [f"a{i}"]
            assert len(c.claim("p", "t", 5, timeout=TIMEOUT, as_="numpy").keys) == 5
        deadline = time.monotonic() + TIMEOUT
        while srv.limits.in_flight() != (0, 0):  # a session ends once its handler sees it
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_inspect_counts_a_snapshot_while_write_backs_add_cells() -> None:
    """inspect counts fields and ready rows outside the store's lock, from a snapshot: a
    write-back adding a field to rows meanwhile never breaks it, and each count lies
    between the partition's state before and after."""
    n = 4000
    keys = [f"r{i}" for i in range(n)]
    ids = [np.arange(3, dtype=np.int64)] * n
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location, [TEXT], timeout=30) as c,
        flightq.connect(srv.location, [TEXT], timeout=30) as writer,
    ):
        c.create_partition("w", TEXT, tasks=["t"])
        c.put("w", keys, {"input_ids": ids, "input_lengths": np.full(n, 3, np.int32)})
        errors: list[BaseException] = []

        def write_back() -> None:
            try:
                for i in range(0, n, 100):  # prev_logprobs lands on 100 rows at a time
                    lp = [np.zeros(3, dtype=np.float32)] * 100
                    writer.put("w", keys[i : i + 100], {"prev_logprobs": lp})
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=write_back, daemon=True)
        t.start()
        seen = []
        while t.is_alive() or not seen:
            d = c.inspect("w")
            assert d["fields"]["input_ids"] == n and d["ready"] == {"t": n}
            seen.append(d["fields"].get("prev_logprobs", 0))
        t.join(30)
        assert not errors, errors
        assert seen == sorted(seen) and all(0 <= x <= n for x in seen)
        assert c.inspect("w")["fields"]["prev_logprobs"] == n


def test_a_snapshot_builds_its_copies_of_rows_and_progress_after_the_lock_is_let_go(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copying every row and each task's ready rows under the store's lock held every other
    # call for about a second per 200 000 rows of 8 tasks: any client may ask for a
    # snapshot. Under the lock now only the tables are copied; the rest after.
    from flightq.server import store as store_module

    free: list[bool] = []
    real = store_module._copy_progress

    def watched(*args: object) -> object:
        lock = srv.store._lock
        took = lock.acquire(blocking=False)
        if took:
            lock.release()
        free.append(took)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "_copy_progress", watched)
    keys = [f"r{i}" for i in range(64)]
    with (
        flightq.Server(snapshot_dir=str(tmp_path)) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["a", "b"])
        c.put("p", keys, {"input_ids": [np.arange(3, dtype=np.int64)] * 64})
        got = c.claim("p", "a", 16, timeout=TIMEOUT, as_="numpy")
        c.ack(got)
        c.snapshot("s1")
        assert free == [True]
    with (
        flightq.Server(restore=str(tmp_path / "s1")) as again,
        flightq.connect(again.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        done = c.inspect("p")
        assert done["rows"] == 64 and done["acked"] == {"a": 16, "b": 0}
        assert sorted(c.list_keys("p")) == sorted(keys)


def test_describing_or_scanning_a_large_partition_gathers_its_fields_outside_the_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GetFlightInfo, ListFlights and a scan gathered the fields of every row under the
    # store's lock, in one call: on a 600 000-row partition each held every other call
    # for 60 ms (another client's 1-row put and get, p99 3 ms before, 146 ms).
    from flightq.server import store as store_module

    free: list[bool] = []
    real = store_module._CELLS

    def watched(row: object) -> object:
        lock = srv.store._lock
        took = lock.acquire(blocking=False)
        if took:
            lock.release()
        free.append(took)
        return real(row)

    monkeypatch.setattr(store_module, "_CELLS", watched)
    n = 3000  # rows lacking some declared field: every row's fields are looked at
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT)
        c.put("p", [f"r{i}" for i in range(n)], {"input_ids": [np.arange(2)] * n})
        plain = fl.connect(srv.location)
        info = plain.get_flight_info(fl.FlightDescriptor.for_path("p"))
        assert info.total_records == n
        assert "input_ids" in info.schema.names and "input_lengths" not in info.schema.names
        assert len(free) == n and all(free)
        assert [i.total_records for i in plain.list_flights()] == [n]
        table = plain.do_get(info.endpoints[0].ticket).read_all()
        assert table.num_rows == n and len(free) == 3 * n and all(free)
        plain.close()
