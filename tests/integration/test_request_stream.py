"""The request stream: small puts, gets and claims as frames on one held DoExchange.

Real servers on loopback port 0 and real clients. Each operation is checked against its
per-call twin (a client with ``stream_max_bytes = 0``): the same rows, the same typed
error with the same message. Hostile frames are written with plain ``pyarrow.flight``, as
a client in another language would write them; after each refusal the same stream still
answers a valid request. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, raw, text_columns, text_keys
from helpers_stream import ask, error_of, open_stream, raw_frame, refusal

import flightq
from flightq.errors import (
    ClaimTimeoutError,
    ConflictError,
    FlightqError,
    NotFoundError,
    ProtocolError,
    ResourceExhaustedError,
    SchemaMismatchError,
)
from flightq.frames import MAX_FRAME_BYTES, pack_frame, parse_frame
from flightq.protocol import ClaimTicket, GetTicket, PutCommand, RequestsCommand
from flightq.server.budget import underlying_bytes

pytestmark = pytest.mark.timeout(60)


def _numpy(batch: flightq.Batch) -> dict[str, list[Any]]:
    return {f: [None if x is None else raw(x) for x in batch[f]] for f in batch.fields}


def test_put_get_claim_match_per_call(
    server: flightq.Server, pair: tuple[flightq.Client, flightq.Client]
) -> None:
    streamed, per_call = pair
    streamed.create_partition("a", TEXT, tasks=["train"])
    streamed.create_partition("b", TEXT, tasks=["train"])
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    tags = [{"i": i} for i in range(len(keys))]
    served = streamed.requests.served
    assert streamed.put("a", keys, cols, tags=tags) == len(keys)
    assert streamed.requests.served == served + 1  # the put took the stream
    assert per_call.put("b", keys, cols, tags=tags) == len(keys)
    assert per_call.requests.served == 0
    # A partition's first get of a few rows tries the stream (its size unknown), as do
    # the later ones its size predicts small.
    served = streamed.requests.served
    first = streamed.get("a", keys[::-1], as_="numpy")
    again = streamed.get("a", keys[::-1], as_="numpy")
    assert streamed.requests.served == served + 2
    want = per_call.get("b", keys[::-1], as_="numpy")
    assert _numpy(first) == _numpy(again) == _numpy(want)
    assert again.keys == want.keys and again.tags == want.tags
    assert again.received is not None and again.received.route == "socket"
    fields = streamed.get("a", keys[:3], ["input_ids"], as_="numpy")
    assert _numpy(fields) == _numpy(per_call.get("b", keys[:3], ["input_ids"], as_="numpy"))
    # A claim on the stream leases like one per call: acked rows are not claimed again.
    served = streamed.requests.served
    got = streamed.claim("a", "train", 4, as_="numpy", timeout=TIMEOUT)
    assert streamed.requests.served == served + 1
    ref = per_call.claim("b", "train", 4, as_="numpy", timeout=TIMEOUT)
    assert got.keys == ref.keys and _numpy(got) == _numpy(ref)
    assert got.claim is not None and got.claim.deliveries == ref.claim.deliveries  # type: ignore[union-attr]
    streamed.ack(got)
    rest = streamed.claim("a", "train", 4, as_="numpy", timeout=TIMEOUT)
    assert set(rest.keys) == set(keys) - set(got.keys)
    streamed.nack(rest)
    assert streamed.claim("a", "train", 4, timeout=TIMEOUT, as_="numpy").keys == rest.keys


def test_errors_match_per_call(pair: tuple[flightq.Client, flightq.Client]) -> None:
    streamed, per_call = pair
    keys = text_keys(1, 2)
    cols, other_cols = text_columns(keys), text_columns(keys, seed=9)
    for c in (streamed, per_call):
        c.create_partition("e", TEXT, tasks=["train"])
    streamed.put("e", keys, cols)
    streamed.get("e", keys, as_="numpy")  # the partition's size known: reads take the stream
    cases = [
        lambda c: c.get("e", ["nope"], as_="numpy"),
        lambda c: c.put("e", keys, other_cols),  # other values there: overwrite needed
        lambda c: c.claim("e", "nope", 1, timeout=1.0, as_="numpy"),
    ]
    for case in cases:
        served = streamed.requests.served
        on_stream = error_of(lambda case=case: case(streamed))
        assert streamed.requests.served == served + 1, on_stream
        assert on_stream == error_of(lambda case=case: case(per_call))
    assert error_of(lambda: streamed.get("e", ["nope"], as_="numpy"))[0] is NotFoundError
    assert error_of(lambda: streamed.put("e", keys, other_cols))[0] is ConflictError
    # A batch encoded for another schema: refused by the server's validation.
    other = flightq.SchemaRegistry.default().get("rollout_vlm@1")
    batch = flightq.encode(other, {"input_ids": [np.arange(3)]}, ["x"])
    served = streamed.requests.served
    refused = error_of(lambda: streamed.put_batch("e", batch))
    assert streamed.requests.served == served + 1
    assert refused == error_of(lambda: per_call.put_batch("e", batch))
    assert refused[0] is SchemaMismatchError
    # The stream kept serving through every refusal.
    assert streamed.get("e", keys, as_="numpy").keys == keys


def test_blocking_claim_on_the_stream_times_out_typed(
    pair: tuple[flightq.Client, flightq.Client],
) -> None:
    streamed, _ = pair
    streamed.create_partition("w", TEXT, tasks=["train"])
    keys = text_keys(1, 2)
    streamed.put("w", keys, text_columns(keys))
    streamed.get("w", keys, as_="numpy")
    streamed.ack(streamed.claim("w", "train", 2, timeout=TIMEOUT, as_="numpy"))
    served = streamed.requests.served
    with pytest.raises(ClaimTimeoutError):
        streamed.claim("w", "train", 1, timeout=0.3, as_="numpy")
    assert streamed.requests.served == served + 1
    # Another thread's call meanwhile goes per call instead of waiting for the stream.
    done: list[Any] = []
    waiter = threading.Thread(
        target=lambda: done.append(
            error_of(lambda: streamed.claim("w", "train", 1, timeout=2.0, as_="numpy"))
        )
    )
    waiter.start()
    time.sleep(0.3)
    assert streamed.get("w", keys, as_="numpy").keys == keys  # not blocked by the claim
    waiter.join(TIMEOUT)
    assert done and done[0][0] is ClaimTimeoutError


def test_a_claim_waiting_on_the_stream_whose_client_went_away_is_counted_cancelled(
    server: flightq.Server, client: flightq.Client
) -> None:
    # Not a refusal: a preempted trainer must not raise the refusal counters alerts watch.
    client.create_partition("gone", TEXT, tasks=["train"])
    before = client.stats()["counters"]
    claim = ClaimTicket(partition="gone", task="train", batch_size=1, timeout=60.0)
    c, writer, reader = open_stream(server.location)
    writer.write_metadata(pack_frame({"op": "read", "cmd": claim.to_wire(), "n": 1}))
    time.sleep(0.5)  # the claim waits for rows
    reader.cancel()
    c.close()
    deadline = time.monotonic() + TIMEOUT
    while client.stats()["counters"]["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the abandoned claim was never counted"
        time.sleep(0.05)
    after = client.stats()["counters"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["refusals"].get("FlightqTimeoutError", 0) == before["refusals"].get(
        "FlightqTimeoutError", 0
    )
    client.put("gone", ["k"], text_columns(["k"]))
    assert client.claim("gone", "train", 1, timeout=TIMEOUT, as_="numpy").keys == ["k"]


def test_threads_share_one_client(pair: tuple[flightq.Client, flightq.Client]) -> None:
    streamed, _ = pair
    streamed.create_partition("t", TEXT, tasks=["train"])
    failures: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(15):
                keys = [f"t{i}_{j}_{k}" for k in range(2)]
                cols = text_columns(keys, seed=100 * i + j)
                streamed.put("t", keys, cols)
                got = streamed.get("t", keys, as_="numpy")
                assert got.keys == keys
                assert [raw(x) for x in got["input_ids"]] == [raw(x) for x in cols["input_ids"]]
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not failures, failures
    assert streamed.requests.served > 0
    assert len(streamed.list_keys("t")) == 4 * 15 * 2


def test_large_puts_and_reads_go_per_call(pair: tuple[flightq.Client, flightq.Client]) -> None:
    streamed, _ = pair
    streamed.create_partition("big", TEXT, tasks=["train"])
    keys = ["big0", "big1"]
    cols = {"input_ids": [np.arange(200_000, dtype=np.int64)] * 2}  # 3.2 MB
    served = streamed.requests.served
    assert streamed.put("big", keys, cols) == 2
    # Its size unknown, the first get tries the stream: the server answers that it is
    # larger than the client takes there, and it goes per call. Known large now: per call.
    assert streamed.get("big", keys, as_="numpy").keys == keys
    assert streamed.get("big", keys, as_="numpy").keys == keys
    assert streamed.requests.served == served
    # Nor does a first get of more rows than a guess is worth try it.
    many = [f"m{i}" for i in range(17)]
    streamed.create_partition("many", TEXT, tasks=["train"])
    streamed.put("many", many, text_columns(many))
    served = streamed.requests.served
    assert streamed.get("many", many, as_="numpy").keys == many
    assert streamed.requests.served == served


def test_a_first_get_takes_the_stream_while_data_calls_fill_max_calls() -> None:
    # Stalled puts hold every data-call slot: a new client's one-row put and get still
    # go through, on its request stream, which is counted apart from the data calls.
    with flightq.Server(max_calls=4) as srv:
        with flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["train"])
        schema = flightq.encode(
            flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"]
        ).schema
        plain = [fl.connect(srv.location) for _ in range(4)]
        stalled = [
            p.do_put(fl.FlightDescriptor.for_command(PutCommand("p", rows=1).to_wire()), schema)
            for p in plain
        ]
        try:
            deadline = time.monotonic() + TIMEOUT
            while srv.limits.in_flight()[0] < 4:
                assert time.monotonic() < deadline, "the stalled puts never reached the server"
                time.sleep(0.02)
            with flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as late:
                assert late.put("p", ["a"], text_columns(["a"])) == 1
                got = late.get("p", ["a"], as_="numpy")
                assert got.keys == ["a"] and got.received is not None
                # The partition's description (for the put), the put and the get: all on
                # the stream.
                assert late.requests.served == 3
                late.stream_max_bytes = 0  # per call from here on: a data call, refused
                with pytest.raises(ResourceExhaustedError, match="server busy: 4 calls"):
                    late.get("p", ["a"], as_="numpy")
        finally:
            for w, _ in stalled:
                with contextlib.suppress(fl.FlightError):  # refused: 0 of the rows announced
                    w.close()
            for p in plain:
                p.close()


def test_a_stopping_server_is_not_held_by_an_idle_stream() -> None:
    srv = flightq.Server().start()
    c = flightq.connect(srv.location, [TEXT], timeout=TIMEOUT)
    try:
        c.create_partition("s", TEXT, tasks=["train"])
        c.put("s", ["k"], text_columns(["k"]))
        assert c.requests.is_open
        assert srv.stop(deadline=10.0)  # the idle stream closes within about a second
    finally:
        c.close()


def test_a_stopping_server_cuts_a_plain_clients_stream_that_waits_for_its_next_request() -> None:
    # A plain client need not close its stream: the wait for its next request is cut once
    # the server stops (never before), and what the server held goes with it.
    srv = flightq.Server().start()
    plain, _writer, _reader = open_stream(srv.location)
    try:
        time.sleep(0.5)
        assert srv.counters.snapshot()["idle_cuts"] == 0  # waiting by design: never cut
        started = time.monotonic()
        assert srv.stop(deadline=4.0)
        assert time.monotonic() - started < 4.0
        assert srv.counters.snapshot()["idle_cuts"] == 1
        assert srv.shm_pool is None  # let go with the rest
    finally:
        plain.close()


def test_idle_stream_closes_and_reopens(pair: tuple[flightq.Client, flightq.Client]) -> None:
    streamed, _ = pair
    streamed.create_partition("i", TEXT, tasks=["train"])
    streamed.put("i", ["k0"], text_columns(["k0"]))
    assert streamed.requests.is_open
    deadline = time.monotonic() + 5.0
    while streamed.requests.is_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not streamed.requests.is_open
    # Its watchdog thread ends with it: an idle client holds no thread for it.
    while any(t.name == "flightq-requests" for t in threading.enumerate()):
        assert time.monotonic() < deadline + 1.0
        time.sleep(0.05)
    served = streamed.requests.served
    streamed.put("i", ["k1"], text_columns(["k1"]))
    assert streamed.requests.served == served + 1


def test_refused_stream_falls_back_per_call() -> None:
    # One request stream at most: the second client's is refused, its calls go per call.
    with (
        flightq.Server(max_sessions=1) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as a,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as b,
    ):
        a.create_partition("f", TEXT, tasks=["train"])
        a.put("f", ["a0"], text_columns(["a0"]))
        assert a.requests.served == 1 and srv.limits.streams() == 1
        keys = ["b0", "b1"]
        cols = text_columns(keys, seed=3)
        assert b.put("f", keys, cols) == 2
        b.get("f", keys, as_="numpy")
        got = b.get("f", keys, as_="numpy")
        assert [raw(x) for x in got["input_ids"]] == [raw(x) for x in cols["input_ids"]]
        assert b.requests.served == 0
        # The consumer session has its own count: a's stream does not take its slot.
        a.get("f", keys, as_="numpy")
        assert a.claim("f", "train", 1, timeout=TIMEOUT, as_="numpy").keys


# --------------------------------------------------------------------------- hostile


def test_a_read_larger_than_the_clients_bound_is_answered_retry(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("m", TEXT, tasks=["train"])
    client.put("m", ["k"], text_columns(["k"]))
    ticket = GetTicket(partition="m", keys=["k"]).to_wire()
    c, writer, reader = open_stream(server.location)
    try:
        small = ask(writer, reader, pack_frame({"op": "read", "cmd": ticket, "max": 1}))
        assert small.header["retry"] > 1 and not small.batches
        whole = ask(writer, reader, pack_frame({"op": "read", "cmd": ticket, "max": 1 << 20}))
        assert "ok" in whole.header and whole.batches[0].num_rows == 1
    finally:
        writer.close()
        c.close()


def test_hostile_frames_are_refused_and_the_stream_serves_on(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("h", TEXT, tasks=["train"])
    client.put("h", ["k"], text_columns(["k"]))
    get = pack_frame({"op": "read", "cmd": GetTicket(partition="h", keys=["k"]).to_wire()})
    batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"])
    put_cmd = PutCommand(partition="h", rows=1, timeout=1.0).to_wire()
    rb_bytes = batch.serialize().to_pybytes()
    schema_bytes = batch.schema.serialize().to_pybytes()

    def rb_put(**extra: Any) -> bytes:
        """The put of ``batch`` as an "rb" frame, with ``extra`` header keys."""
        head = {"op": "put", "cmd": put_cmd, "body": "rb", "schema": len(schema_bytes)}
        return raw_frame({**head, "batches": [len(rb_bytes)], **extra}, schema_bytes + rb_bytes)

    hostile: list[tuple[bytes, type[FlightqError], str]] = [
        (b"\x01\x00", ProtocolError, "too short"),
        (b"\xff\xff\xff\x7fjunk", ProtocolError, "announces a header"),
        (raw_frame({"op": "read"})[:6], ProtocolError, "announces a header"),
        (b"\x04\x00\x00\x00\xc1\xc1\xc1\xc1", ProtocolError, "msgpack"),
        (raw_frame({"op": "frob", "cmd": b""}), ProtocolError, "unknown op"),
        (raw_frame({"op": "read", "cmd": "text"}), ProtocolError, "'cmd' must be bytes"),
        (raw_frame({"op": "read", "cmd": b"\x93"}), ProtocolError, "ticket"),
        (
            raw_frame(
                {"op": "read", "cmd": GetTicket(partition="h", keys=["k"]).to_wire(), "max": "1"}
            ),
            ProtocolError,
            "'max' must be an int",
        ),
        (raw_frame({"op": "get", "cmd": b""}, b"tail"), ProtocolError, "carries no body"),
        # Lying sizes: more body announced than sent, and less.
        (
            raw_frame(
                {
                    "op": "put",
                    "cmd": put_cmd,
                    "body": "rb",
                    "schema": len(schema_bytes),
                    "batches": [len(rb_bytes) + 10],
                },
                schema_bytes + rb_bytes,
            ),
            ProtocolError,
            "body bytes",
        ),
        (
            raw_frame(
                {
                    "op": "put",
                    "cmd": put_cmd,
                    "body": "rb",
                    "schema": len(schema_bytes),
                    "batches": [-1],
                },
                schema_bytes + rb_bytes,
            ),
            ProtocolError,
            "lists of byte counts",
        ),
        # Media claims that do not list bytes or null, one per record batch.
        (
            rb_put(claims=[None, None]),
            ProtocolError,
            "'claims' must list bytes or null for each of its 1 record batches, got list of 2",
        ),
        (rb_put(claims=["text"]), ProtocolError, "'claims' must list"),
        # Garbage where the IPC bytes should be, lengths right.
        (
            raw_frame(
                {
                    "op": "put",
                    "cmd": put_cmd,
                    "body": "rb",
                    "schema": len(schema_bytes),
                    "batches": [64],
                },
                schema_bytes + b"\x00" * 64,
            ),
            ProtocolError,
            "do not parse",
        ),
        (
            raw_frame({"op": "put", "cmd": put_cmd, "body": "ipc", "batches": [32]}, b"\x07" * 32),
            ProtocolError,
            "the Arrow IPC stream does not parse",
        ),
        # A frame over the stream's limit.
        (
            raw_frame({"op": "put", "cmd": put_cmd}, b"\x00" * (MAX_FRAME_BYTES + 1)),
            ResourceExhaustedError,
            "exceeds the request stream's limit",
        ),
        # A put through shared memory belongs per call.
        (
            raw_frame(
                {
                    "op": "put",
                    "cmd": msgpack.packb(
                        {"partition": "h", "shm": {"path": "/dev/shm/x", "size": 1}}
                    ),
                }
            ),
            ProtocolError,
            "",
        ),
    ]
    c, writer, reader = open_stream(server.location)
    try:
        for frame, kind, match in hostile:
            got = refusal(ask(writer, reader, frame))
            assert got[0] is kind and match in got[1], (frame[:40], got)
            ok = ask(writer, reader, get)  # the stream still serves
            assert "ok" in ok.header and [b.num_rows for b in ok.batches] == [1]
        # A record batch instead of a frame: refused, and the stream serves on.
        writer.begin(batch.schema)
        writer.write_batch(batch)
        got = refusal(parse_frame(reader.read_chunk().app_metadata, "answer"))
        assert got[0] is ProtocolError and "metadata-only" in got[1]
        assert "ok" in ask(writer, reader, get).header
        # A valid put on the stream is stored, all or nothing, as per call.
        ok = ask(writer, reader, pack_frame({"op": "put", "cmd": put_cmd}, batch.schema, [batch]))
        assert ok.header["ok"] and set(client.list_keys("h")) == {"k", "x"}
        writer.done_writing()
    finally:
        c.close()
    assert set(client.list_keys("h")) == {"k", "x"}  # nothing of the refused puts stored


def test_every_answer_echoes_its_requests_number_and_a_bad_number_is_refused(
    server: flightq.Server, client: flightq.Client
) -> None:
    # The client takes answers in turn; the number lets it tell an answer sent twice (or
    # one lost) from the answer to its request.
    client.create_partition("num", TEXT, tasks=["train"])
    client.put("num", ["k"], text_columns(["k"]))
    batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"])
    put_cmd = PutCommand(partition="num", rows=1, timeout=1.0).to_wire()
    get = GetTicket(partition="num", keys=["k"]).to_wire()
    c = fl.connect(server.location)
    writer, reader = c.do_exchange(fl.FlightDescriptor.for_command(RequestsCommand().to_wire()))
    try:
        hello = parse_frame(reader.read_chunk().app_metadata, "hello")
        assert hello.header["numbered"] is True
        answers = [
            ask(writer, reader, pack_frame({"op": "read", "cmd": get, "n": 7})),
            ask(
                writer,
                reader,
                pack_frame({"op": "put", "cmd": put_cmd, "n": 8}, batch.schema, [batch]),
            ),
            ask(writer, reader, pack_frame({"op": "act", "type": "stats", "cmd": b"\x80", "n": 9})),
            ask(writer, reader, pack_frame({"op": "read", "cmd": get, "max": 1, "n": 10})),
            ask(
                writer,
                reader,
                pack_frame(
                    {
                        "op": "read",
                        "cmd": GetTicket(partition="num", keys=["nope"]).to_wire(),
                        "n": 2**63 - 1,
                    }
                ),
            ),
        ]
        assert [a.header["n"] for a in answers] == [7, 8, 9, 10, 2**63 - 1]
        assert [next(k for k in ("ok", "retry", "error") if k in a.header) for a in answers] == [
            "ok",
            "ok",
            "ok",
            "retry",
            "error",
        ]
        # Without a number (an older client), none is echoed.
        assert "n" not in ask(writer, reader, pack_frame({"op": "read", "cmd": get})).header
        for bad in [-1, 2**63, "7", True, 1.5, [7], None]:
            got = ask(writer, reader, raw_frame({"op": "read", "cmd": get, "n": bad}))
            assert "n" not in got.header
            kind, message = refusal(got)
            assert kind is ProtocolError and "'n' must be an int in [0, 2**63)" in message, bad
        assert (
            ask(writer, reader, pack_frame({"op": "read", "cmd": get, "n": 11})).header["n"] == 11
        )
        writer.done_writing()
    finally:
        c.close()


def test_a_read_the_stream_answers_retry_counts_nothing_sent(
    server: flightq.Server, client: flightq.Client
) -> None:
    # The counters say what was sent: a read answered `retry` (it goes per call, where it
    # is counted) sends no rows; one answered counts once, as per call.
    client.create_partition("cnt", TEXT, tasks=["train"])
    keys = text_keys(1, 3)
    client.put("cnt", keys, text_columns(keys))
    get = GetTicket(partition="cnt", keys=keys).to_wire()
    c, writer, reader = open_stream(server.location)
    try:
        before = client.stats()["counters"]
        for _ in range(20):
            got = ask(writer, reader, pack_frame({"op": "read", "cmd": get, "max": 1}))
            assert "retry" in got.header
        after = client.stats()["counters"]
        assert (after["gets"], after["rows_sent"]) == (before["gets"], before["rows_sent"])
        assert "ok" in ask(writer, reader, pack_frame({"op": "read", "cmd": get})).header
        sent = client.stats()["counters"]
        assert (sent["gets"], sent["rows_sent"]) == (after["gets"] + 1, after["rows_sent"] + 3)
        writer.done_writing()
    finally:
        c.close()


def test_hostile_put_cannot_overfill_the_budget() -> None:
    with (
        flightq.Server(memory_budget=200_000) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as client,
    ):
        client.create_partition("b", TEXT, tasks=["train"])
        keys = [f"r{i}" for i in range(4)]
        cols = {"input_ids": [np.arange(20_000, dtype=np.int64)] * 4}  # 640 KB
        batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), cols, keys)
        cmd = PutCommand(partition="b", rows=4, timeout=0.2).to_wire()
        c, writer, reader = open_stream(srv.location)
        try:
            got = refusal(
                ask(writer, reader, pack_frame({"op": "put", "cmd": cmd}, batch.schema, [batch]))
            )
            assert got[0] is ResourceExhaustedError, got
        finally:
            c.close()
        assert client.stats()["partitions"]["b"]["rows"] == 0


def test_stored_rows_keep_nothing_else_of_their_frame_alive() -> None:
    # A frame padded to 1 MiB (an unknown header key) stores a one-row batch read from a
    # copy of its own bytes: the pad is not held, and what is held is counted.
    budget = 8 << 20
    with (
        flightq.Server(memory_budget=budget) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as client,
    ):
        client.create_partition("pad", TEXT, tasks=["train"])
        c, writer, reader = open_stream(srv.location)
        try:
            for i in range(16):  # 16 MiB of frames through an 8 MiB budget
                batch = flightq.encode(
                    flightq.SchemaRegistry.default().get(TEXT), text_columns([f"r{i}"]), [f"r{i}"]
                )
                cmd = PutCommand(partition="pad", rows=1, timeout=0.2).to_wire()
                frame = pack_frame(
                    {"op": "put", "cmd": cmd, "pad": b"\0" * (1 << 20)}, batch.schema, [batch]
                )
                assert "ok" in ask(writer, reader, frame).header
        finally:
            c.close()
        part = srv.store.partition("pad")
        batches = {id(pc.batch): pc.batch for r in part.rows.values() for pc, _ in r.cells.values()}
        kept = underlying_bytes(list(batches.values()))
        assert len(part.rows) == 16 and kept < 16 * 64 << 10  # no pad among them
        assert kept <= client.stats()["partitions"]["pad"]["held"]


def test_a_checked_frame_names_the_copy_each_batch_was_read_from() -> None:
    # The server counts what a stream put's batch holds beyond its buffers from the size of
    # the copy it was read from: that size must be all the memory under the batch.
    reg = flightq.SchemaRegistry.default().get(TEXT)
    keys = [[f"r{i}-{j}" for j in range(n)] for i, n in enumerate((1, 7, 3))]
    batches = [flightq.encode(reg, text_columns(k), k) for k in keys]
    frame = pack_frame({"op": "put", "pad": b"\0" * 4096}, batches[0].schema, batches)
    checked = parse_frame(frame, "test", check=True)
    assert checked.blocks is not None and len(checked.blocks) == 3
    for b, n in zip(checked.batches, checked.blocks, strict=True):
        assert underlying_bytes([b]) == n > b.get_total_buffer_size()
    assert parse_frame(frame, "test").blocks is None  # shares the frame


def test_mutated_put_frames_are_refused_or_stored_whole(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("m", TEXT, tasks=["train"])
    batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"])
    valid = pack_frame(
        {"op": "put", "cmd": PutCommand(partition="m", rows=1, timeout=1.0).to_wire()},
        batch.schema,
        [batch],
    ).to_pybytes()
    get = pack_frame({"op": "read", "cmd": GetTicket(partition="m", keys=["x"]).to_wire()})
    rng = np.random.default_rng(7)
    c, writer, reader = open_stream(server.location)
    outcomes: dict[str, int] = {}
    try:
        for _ in range(150):
            frame = bytearray(valid)
            for i in rng.integers(4, len(frame), size=int(rng.integers(1, 8))):
                frame[int(i)] = int(rng.integers(0, 256))
            got = ask(writer, reader, bytes(frame))
            kind = "ok" if "ok" in got.header else refusal(got)[0].__name__
            outcomes[kind] = outcomes.get(kind, 0) + 1
            # Whatever was stored is a whole, valid row; the stream serves on.
            answer = ask(writer, reader, get)
            if "ok" in answer.header:
                assert [b.num_rows for b in answer.batches] == [1]
                client.clear("m")
        writer.done_writing()
    finally:
        c.close()
    assert sum(v for k, v in outcomes.items() if k != "ok") > 0, outcomes


def test_small_media_reads_take_the_stream_and_match_per_call(
    server: flightq.Server,
) -> None:
    # A put of new media claims nothing of it and takes the stream; one referencing media
    # sent before takes it too, its claims in the frame's header. A read of media takes
    # the stream, its dictionary columns as one Arrow IPC stream body.
    vlm = "rollout_vlm@1"
    rng = np.random.default_rng(5)
    img = rng.standard_normal((16, 24), dtype=np.float32)
    keys = ["v0", "v1", "v2"]
    cols = {
        "input_ids": [np.arange(4 + i, dtype=np.int64) for i in range(3)],
        "pixel_values": [[img]] * 3,  # one image shared by the group: sent once
        "image_grid_thw": [[np.array([[1, 4, 6]], dtype=np.int64)]] * 3,
    }
    with (
        flightq.connect(server.location, [vlm], timeout=TIMEOUT) as streamed,
        flightq.connect(server.location, [vlm], timeout=TIMEOUT) as per_call,
    ):
        per_call.stream_max_bytes = 0
        for c, name in ((streamed, "sa"), (per_call, "sb")):
            c.create_partition(name, vlm, tasks=["train"])
        served = streamed.requests.served
        streamed.put("sa", keys[:1], {k: v[:1] for k, v in cols.items()})
        assert streamed.requests.served == served + 1
        # A reference to the image: on the stream too, its claim in the frame's header.
        streamed.put("sa", keys[1:], {k: v[1:] for k, v in cols.items()})
        assert streamed.requests.served == served + 2
        per_call.put("sb", keys, cols)
        streamed.get("sa", keys, as_="numpy")
        served = streamed.requests.served
        got = streamed.get("sa", keys[::-1], as_="numpy")
        assert streamed.requests.served == served + 1
        want = per_call.get("sb", keys[::-1], as_="numpy")
        assert got.keys == want.keys
        for f in want.fields:
            if want.schema[f].role == "media":
                assert [[raw(x) for x in row] for row in got[f]] == [
                    [raw(x) for x in row] for row in want[f]
                ]
            else:
                assert [raw(x) for x in got[f]] == [raw(x) for x in want[f]]
        assert server.store.partition("sa").nbytes == server.store.partition("sb").nbytes


def test_one_row_round_trips_match_per_call(pair: tuple[flightq.Client, flightq.Client]) -> None:
    """W4: a row put then got, again and again. An answer served as a slice of the stored
    batch (all its fields asked) carries the row's current tags, merged by a later put,
    and a write-back's column; a subset of fields is served column by column."""
    streamed, per_call = pair
    step = flightq.workloads.w4()
    for name in ("a", "b"):
        streamed.create_partition(name, TEXT, tasks=["train"], group_size=1)
    for client, name in ((streamed, "a"), (per_call, "b")):
        for i in range(3):
            client.put(name, step.keys, step.columns, tags=[{"round": i}], overwrite=i > 0)
        client.get(name, step.keys, as_="numpy")  # a partition's first get goes per call
    served = streamed.requests.served
    got = streamed.get("a", step.keys, as_="numpy")
    assert streamed.requests.served == served + 1
    want = per_call.get("b", step.keys, as_="numpy")
    assert _numpy(got) == _numpy(want) and got.tags == want.tags == [{"round": 2}]
    for client, name in ((streamed, "a"), (per_call, "b")):
        client.put(name, step.keys, {}, tags=[{"extra": 1}])  # tags alone: cells stay
    got, want = streamed.get("a", step.keys, as_="numpy"), per_call.get("b", step.keys, as_="numpy")
    assert _numpy(got) == _numpy(want)
    assert got.tags == want.tags == [{"round": 2, "extra": 1}]
    merged = {"input_ids": [np.arange(128, dtype=np.int64)]}
    for client, name in ((streamed, "a"), (per_call, "b")):
        client.put(name, step.keys, merged, overwrite=True)  # a write-back: cells in two
    got, want = streamed.get("a", step.keys, as_="numpy"), per_call.get("b", step.keys, as_="numpy")
    assert _numpy(got) == _numpy(want) and got.tags == [{"round": 2, "extra": 1}]
    assert got["input_ids"][0].tolist() == list(range(128))
    subset = ["total_reward", "input_ids"]
    few = streamed.get("a", step.keys, subset, as_="numpy")
    assert _numpy(few) == _numpy(per_call.get("b", step.keys, subset, as_="numpy"))


def test_a_stream_the_server_dropped_by_restarting_gives_way_to_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fixtures_dataplane import cli_server

    from flightq.client import requests

    monkeypatch.setattr(requests, "IDLE_CLOSE_S", 600.0)  # held across the restart
    with cli_server() as (location, proc):
        c = flightq.connect(location, [TEXT], timeout=TIMEOUT)
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", ["k0"], text_columns(["k0"]))
        assert c.requests.is_open
        proc.kill()
        proc.wait(timeout=TIMEOUT)
    port = location.rsplit(":", 1)[1]
    try:
        with cli_server("--port", port) as (again, _):
            assert again == location
            c.create_partition("r", TEXT, tasks=["train"])
            # The held stream is dead: the put goes per call, the next reopens the stream.
            assert c.put("r", ["k1"], text_columns(["k1"])) == 1
            assert c.get("r", ["k1"], as_="numpy").keys == ["k1"]
            served = c.requests.served
            assert c.put("r", ["k2"], text_columns(["k2"])) == 1
            assert c.requests.served == served + 1  # on a new stream
            c.close()  # before the server stops: it would wait on the held stream
    finally:
        c.close()


def test_a_stream_a_stopped_server_ended_gives_way_to_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flightq.client import requests

    monkeypatch.setattr(requests, "IDLE_CLOSE_S", 600.0)  # held across the restart
    srv = flightq.Server().start()
    location = srv.location
    c = flightq.connect(location, [TEXT], timeout=TIMEOUT)
    try:
        c.create_partition("r", TEXT, tasks=["train"])
        c.put("r", ["k0"], text_columns(["k0"]))
        assert c.requests.is_open
        srv.stop(deadline=1.0)  # ends the held stream
        try:
            again = flightq.Server(location)
        except Exception:  # pragma: no cover - the port was taken meanwhile
            pytest.skip("the port was taken by another process before the restart")
        with again:
            c.create_partition("r", TEXT, tasks=["train"])
            assert c.put("r", ["k1"], text_columns(["k1"])) == 1
            assert c.get("r", ["k1"], as_="numpy").keys == ["k1"]
    finally:
        c.close()
