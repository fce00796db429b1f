"""Small requests that would make the server build far more than they carry are stopped
before it builds it: Arrow IPC dictionary deltas in bytes the server decodes itself (a
request-stream frame, a put through shared memory), a read on the request stream naming
rows many times over, a read through shared memory made of thousands of batches.

Real ``flightq serve`` processes under a 64 MiB budget, driven with plain
``pyarrow.flight``; their memory high-water mark is read from /proc.
"""

from __future__ import annotations

import sys
import time

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, cli_server
from helpers_budget import hwm_mib
from helpers_reliability import plain_error
from helpers_stream import ask, open_stream, raw_frame, refusal

import flightq
from flightq.encode import encode
from flightq.errors import ProtocolError
from flightq.ipccheck import check_stream
from flightq.protocol import PutCommand

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="reads the server's memory from /proc"
    ),
    pytest.mark.timeout(120),
]

BUDGET = ("--memory-budget", str(64 * 2**20))


def _delta_stream(deltas: int) -> tuple[pa.Buffer, int]:
    """An IPC stream of a one-row VLM batch holding a 2 MiB image, then ``deltas`` pairs
    of (a dictionary delta adding an empty entry, a one-row batch using it): a few hundred
    bytes a pair, each of which Arrow's reader turns into a copy of the whole dictionary.
    Returns the stream and its rows."""
    schema = flightq.SchemaRegistry.default().get(VLM)
    image = np.random.default_rng(0).random((446, 1176), dtype=np.float32)  # 2 MiB
    empty = np.ones((0, 1176), np.float32)
    template = encode(schema, {"input_ids": [np.arange(3)], "pixel_values": [[image]]}, ["t"])
    arrow = template.schema
    shape_type = arrow.field("pixel_values__shape").type

    def batch(entries: list[bytes], shapes: list[list[int]], use: int, key: str) -> pa.RecordBatch:
        d = pa.DictionaryArray.from_arrays(
            pa.array([use], pa.int32()), pa.array(entries, pa.large_binary())
        )
        pv = pa.LargeListArray.from_arrays(pa.array([0, 1], pa.int64()), d)
        return pa.RecordBatch.from_arrays(
            [
                pa.array([key]),
                pa.array([None], pa.binary()),
                template.column("input_ids"),
                template.column("input_ids__shape"),
                pv,
                pa.array([[shapes[use]]], shape_type),
            ],
            schema=arrow,
        )

    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True)
    with pa.ipc.new_stream(sink, arrow, options=opts) as w:
        w.write_batch(batch([image.tobytes()], [list(image.shape)], 0, "k0"))
        w.write_batch(
            batch([image.tobytes(), empty.tobytes()], [list(image.shape), [0, 1176]], 1, "k1")
        )
    messages = list(pa.ipc.MessageReader.open_stream(sink.getvalue()))
    kinds = ["schema", "dictionary", "record batch", "dictionary", "record batch"]
    assert [m.type for m in messages] == kinds
    schema_m, dict_m, first, delta, second = (m.serialize().to_pybytes() for m in messages)
    end = b"\xff\xff\xff\xff\x00\x00\x00\x00"
    return pa.py_buffer(schema_m + dict_m + first + (delta + second) * deltas + end), deltas + 1


def test_the_ipc_check_refuses_a_dictionary_delta_and_passes_whole_dictionaries() -> None:
    stream, _ = _delta_stream(1)
    with pytest.raises(ProtocolError, match=r"^test: an Arrow IPC dictionary batch is a delta"):
        check_stream(stream, "test")
    whole, _ = _delta_stream(0)
    check_stream(whole, "test")  # one dictionary batch, no delta: nothing raised


def test_a_request_stream_put_of_dictionary_deltas_is_refused_before_arrow_copies_them() -> None:
    # 2 000 deltas in a 3.9 MiB frame: before the check, Arrow's reader took the server
    # from 86 MiB to 4.3 GB (a copy of the 2 MiB dictionary per delta) before any check.
    stream, rows = _delta_stream(2000)
    assert stream.size < 4 * 2**20
    put = PutCommand(partition="v", rows=rows, timeout=1.0).to_wire()
    frame = raw_frame({"op": "put", "cmd": put, "body": "ipc", "batches": [stream.size]})
    with cli_server(*BUDGET) as (location, proc):
        with flightq.connect(location, [VLM], timeout=TIMEOUT) as c:
            c.create_partition("v", VLM, tasks=["t"])
        before = hwm_mib(proc.pid)
        client, writer, reader = open_stream(location)
        try:
            kind, message = refusal(ask(writer, reader, frame + stream.to_pybytes()))
        finally:
            writer.done_writing()
            client.close()
        assert kind is ProtocolError, message
        assert message.startswith("request stream: an Arrow IPC dictionary batch is a delta")
        assert hwm_mib(proc.pid) - before < 64
        with flightq.connect(location, [VLM], timeout=TIMEOUT) as c:
            assert c.stats()["partitions"]["v"]["rows"] == 0  # nothing stored
            image = np.ones((4, 1176), np.float32)
            c.put("v", ["ok"], {"input_ids": [np.arange(3)], "pixel_values": [[image]]})
            assert c.get("v", ["ok"], as_="numpy").keys == ["ok"]  # serves on


def _eight_rows(location: str) -> None:
    """Partition 'r': 8 rows of about 496 KB, each from a put of its own."""
    with flightq.connect(location, [TEXT], timeout=TIMEOUT) as c:
        c.stream_max_bytes = 0  # per call
        c.create_partition("r", TEXT, tasks=["t"])
        for i in range(8):
            c.put("r", [str(i)], {"input_ids": [np.arange(62_000, dtype=np.int64)]})


def test_a_stream_read_naming_rows_many_times_stops_once_past_the_frame_limit() -> None:
    # 12.8 KB of ticket asking for 3.2 GB: the server built (and copied) the whole answer
    # before finding it past the 4 MiB frame (86 MiB to 3.5 GB). It stops at the limit.
    with cli_server(*BUDGET) as (location, proc):
        _eight_rows(location)
        before = hwm_mib(proc.pid)
        keys = [str(i) for i in range(8)] * 800
        ticket = msgpack.packb({"op": "get", "partition": "r", "keys": keys}, use_bin_type=True)
        client, writer, reader = open_stream(location)
        try:
            started = time.monotonic()
            answer = ask(writer, reader, raw_frame({"op": "read", "cmd": ticket}))
            took = time.monotonic() - started
            # The same stream still answers a read that fits.
            small = msgpack.packb({"op": "get", "partition": "r", "keys": ["3"]}, use_bin_type=True)
            fits = ask(writer, reader, raw_frame({"op": "read", "cmd": small}))
        finally:
            writer.done_writing()
            client.close()
        assert 4 * 2**20 - 2**16 < answer.header["retry"] < 16 * 2**20, answer.header
        assert not answer.batches
        assert hwm_mib(proc.pid) - before < 64
        assert took < 30  # generous: a loaded machine; it took under 0.1 s
        assert "ok" in fits.header and fits.batches[0].num_rows == 1


def test_a_shared_memory_read_of_thousands_of_batches_goes_over_the_socket_as_made() -> None:
    # 8 rows named 30 000 times: one batch each, 240 000 batches. Listed whole before the
    # server chose shared memory or the socket, they took 1.5 GB and 15 s before the first
    # byte; past MAX_SHM_ANSWER_BATCHES the answer streams over the socket as it is made.
    from flightq.server.flight import MAX_SHM_ANSWER_BATCHES

    with cli_server(*BUDGET) as (location, proc):
        _eight_rows(location)
        before = hwm_mib(proc.pid)
        keys = [str(i) for i in range(8)] * 30_000
        assert len(keys) > MAX_SHM_ANSWER_BATCHES
        ticket = {"op": "get", "partition": "r", "shm": True, "keys": keys}
        plain = fl.connect(location)
        try:
            stream = plain.do_get(fl.Ticket(msgpack.packb(ticket, use_bin_type=True)))
            first = [stream.read_chunk().data for _ in range(3)]
            stream.cancel()
        finally:
            plain.close()
        assert [b.column("__key__").to_pylist() for b in first] == [["0"], ["1"], ["2"]]
        assert all(
            np.array_equal(
                np.frombuffer(b.column("input_ids")[0].as_buffer(), np.int64), np.arange(62_000)
            )
            for b in first
        )
        assert hwm_mib(proc.pid) - before < 128
        with flightq.connect(location, [TEXT], timeout=TIMEOUT) as c:
            assert c.stats()["counters"]["shm_answers_declined"] == 1
            assert c.get("r", ["5"], as_="numpy")["input_ids"][0].size == 62_000  # serves on


def test_a_shared_memory_read_copying_an_image_per_batch_stops_listing_at_the_answer_room() -> None:
    # Row 'b' carries its own image and one put before it (two puts' dictionaries): each
    # answer batch of it copies both into one. Named 2 000 times, the listing held 2 000
    # copies (95 MiB to 2.2 GB under a 64 MiB budget) before anything was sent; it stops
    # once the copies pass a quarter of the budget, and the rest streams as it is made.
    rng = np.random.default_rng(1)
    x, y = (rng.random((111, 1176), dtype=np.float32) for _ in range(2))  # 0.5 MiB each
    with cli_server(*BUDGET) as (location, proc):
        with flightq.connect(location, [VLM], timeout=TIMEOUT) as c:
            c.stream_max_bytes = 0  # per call
            c.create_partition("v", VLM, tasks=["t"])
            c.put("v", ["a"], {"input_ids": [np.arange(3)], "pixel_values": [[x]]})
            c.put("v", ["b"], {"input_ids": [np.arange(3)], "pixel_values": [[y, x]]})
        before = hwm_mib(proc.pid)
        ticket = {"op": "get", "partition": "v", "shm": True, "keys": ["b"] * 2000}
        plain = fl.connect(location)
        try:
            stream = plain.do_get(fl.Ticket(msgpack.packb(ticket, use_bin_type=True)))
            first = stream.read_chunk().data
            stream.cancel()
        finally:
            plain.close()
        assert first.column("__key__").to_pylist()[0] == "b"  # rows, not a segment's name
        assert hwm_mib(proc.pid) - before < 128
        with flightq.connect(location, [VLM], timeout=TIMEOUT, shm=True) as c:
            assert c.stats()["counters"]["shm_answers_declined"] == 1
            got = c.get("v", ["b"] * 3, as_="numpy")["pixel_values"]  # serves on
            assert all(np.array_equal(r[0], y) and np.array_equal(r[1], x) for r in got)


def test_a_stream_read_of_many_tiny_rows_whose_framing_passes_the_frame_goes_per_call() -> None:
    # One small row named 12 000 times, a batch each: their bytes fit the 4 MiB frame,
    # their batches' IPC framing did not (a 5.5 MB frame, which the client refused as too
    # large). Answered retry, the get goes per call and returns every row.
    with (
        cli_server(*BUDGET) as (location, _),
        flightq.connect(location, [TEXT], timeout=TIMEOUT) as c,
    ):
        c.create_partition("r", TEXT, tasks=["t"])
        c.put("r", ["0"], {"input_ids": [np.arange(3, dtype=np.int64)]})
        c.get("r", ["0"])  # the row's size learned: the next get tries the stream
        got = c.get("r", ["0"] * 12_000, as_="numpy")  # a batch per row
        assert got.keys == ["0"] * 12_000
        assert got["input_ids"][-1].tolist() == [0, 1, 2]


def test_a_list_keys_naming_a_row_many_times_is_refused_before_its_reply_is_built() -> None:
    # One row of 60 KB of tags named 2 000 times in a 4 KB body: each entry copied the
    # row's tags (93 MiB to 437 MiB); 36 000 times made a reply past 2 GiB, one gRPC
    # message, and gRPC aborted the server. Refused once it would take more than listing
    # the partition's rows once, and 16 MiB.
    with cli_server(*BUDGET) as (location, proc):
        with flightq.connect(location, [TEXT], timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
            c.put("p", ["k"], {"input_ids": [np.arange(4)]}, tags=[{"t": "x" * 60_000}])
        before = hwm_mib(proc.pid)
        body = msgpack.packb({"partition": "p", "keys": ["k"] * 36_000}, use_bin_type=True)
        with fl.connect(location) as plain:
            with pytest.raises(fl.FlightError) as e:
                list(plain.do_action(fl.Action("list_keys", body)))
            kind, message = plain_error(e.value)
            assert kind == "ResourceExhaustedError", message
            assert message.startswith("list_keys of 'p': the 36000 keys named"), message
            once = msgpack.packb({"partition": "p", "keys": ["k", "k"]}, use_bin_type=True)
            reply = next(iter(plain.do_action(fl.Action("list_keys", once))))
            twice = msgpack.unpackb(reply.body.to_pybytes())
        assert twice["keys"] == ["k", "k"]  # a key named twice in a small listing: as asked
        assert proc.poll() is None and hwm_mib(proc.pid) - before < 64
        with flightq.connect(location, [TEXT], timeout=TIMEOUT) as c:
            assert list(c.list_keys("p")) == ["k"]  # serves on
