"""Arrow IPC bodies compressed by the sender are refused before Arrow inflates them.

Arrow's reader inflates a compressed body buffer to the size the buffer declares: a few
KiB of zstd can ask the reader for gigabytes. flightq compresses cells (field codecs,
checked), never IPC bodies, so wherever the server decodes IPC bytes itself (request
stream frames, a put through shared memory) it refuses compressed ones first. A per-call
DoPut is decoded by Flight before the server sees it: there ``flightq serve``'s cap on its
own data segment makes the inflating allocation fail, and the put is refused typed. Real
``flightq serve`` processes; their memory high-water mark and limits are read from /proc.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, cli_server, text_columns
from helpers_budget import data_limit, hwm_mib, put_bomb
from helpers_reliability import plain_error

import flightq
from flightq.errors import ProtocolError
from flightq.frames import parse_frame
from flightq.ipccheck import check_stream
from flightq.protocol import ErrorDetail, PutCommand, RequestsCommand

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the server's memory from /proc"
)

#: Zeros a bomb inflates to (400 MB), from about 12 KiB of zstd.
BOMB_VALUES = 50_000_000


def _compressed_text_batch(codec: str) -> tuple[bytes, bytes, bytes]:
    """A one-row text batch (keys ``x``) whose ``input_ids`` payload is a bomb: schema
    message, record batch message, and the whole stream, all with ``codec`` bodies."""
    batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"])
    i = batch.schema.get_field_index("input_ids")
    bomb = pa.array([np.zeros(BOMB_VALUES, np.int64).tobytes()], pa.large_binary())
    rb = batch.set_column(i, batch.schema.field(i), bomb.cast(batch.schema.field(i).type))
    opts = pa.ipc.IpcWriteOptions(compression=codec)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema, options=opts) as w:
        w.write_batch(rb)
    stream = sink.getvalue()
    schema_msg, batch_msg = list(pa.ipc.MessageReader.open_stream(stream))
    return (
        schema_msg.serialize().to_pybytes(),
        batch_msg.serialize().to_pybytes(),
        stream.to_pybytes(),
    )


def _frame(header: dict[str, Any], body: bytes) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return len(head).to_bytes(4, "little") + head + body


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_request_stream_frame_is_refused_before_it_is_inflated(codec: str) -> None:
    schema_b, batch_b, stream_b = _compressed_text_batch(codec)
    assert len(stream_b) < 4 * 2**20 < BOMB_VALUES * 8  # small on the wire, huge inflated
    put = PutCommand(partition="p", rows=1, timeout=1.0).to_wire()
    frames = [
        _frame(
            {
                "op": "put",
                "cmd": put,
                "body": "rb",
                "schema": len(schema_b),
                "batches": [len(batch_b)],
            },
            schema_b + batch_b,
        ),
        _frame({"op": "put", "cmd": put, "body": "ipc", "batches": [len(stream_b)]}, stream_b),
    ]
    with cli_server() as (location, proc):
        with flightq.connect(location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        before = hwm_mib(proc.pid)
        client = fl.connect(location)
        writer, reader = client.do_exchange(
            fl.FlightDescriptor.for_command(RequestsCommand().to_wire())
        )
        assert parse_frame(reader.read_chunk().app_metadata, "hello").header["ok"] == b""
        for frame in frames:
            writer.write_metadata(pa.py_buffer(frame))
            answer = parse_frame(reader.read_chunk().app_metadata, "answer")
            e = ErrorDetail.parse(answer.header["error"]).error()
            assert type(e) is ProtocolError and "compressed body" in str(e), e
        writer.done_writing()
        client.close()
        assert hwm_mib(proc.pid) - before < 100  # never inflated (400 MB if it were)
        with flightq.connect(location, timeout=TIMEOUT) as c:
            assert c.stats()["partitions"]["p"]["rows"] == 0
            c.put("p", ["a"], text_columns(["a"]))  # the server serves on
            assert c.get("p", ["a"], as_="numpy").keys == ["a"]


def test_the_check_reads_headers_only_and_passes_uncompressed_streams() -> None:
    batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    check_stream(sink.getvalue(), "test")  # nothing raised
    with pytest.raises(ProtocolError, match=r"test: the Arrow IPC stream does not parse"):
        check_stream(pa.py_buffer(b"\xff\xff\xff\xff\x10\x00\x00\x00garbage!"), "test")
    _, _, stream = _compressed_text_batch("zstd")
    with pytest.raises(ProtocolError, match=r"test: an Arrow IPC record batch has a compressed"):
        check_stream(pa.py_buffer(stream), "test")


def test_a_per_call_put_that_inflates_past_the_servers_cap_is_refused_typed() -> None:
    limits = ("--memory-budget", str(64 * 2**20), "--max-calls", "8", "--max-sessions", "8")
    with cli_server(*limits) as (location, proc):
        cap = data_limit(proc.pid)
        assert cap is not None  # flightq serve caps itself by default
        with flightq.connect(location, timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["t"])
        before = hwm_mib(proc.pid)
        kind, message = plain_error(put_bomb(location, "p", cap + 2**30))
        assert kind == "ResourceExhaustedError", message
        assert "put to 'p'" in message and "uncompressed record batches" in message
        assert hwm_mib(proc.pid) - before < 100  # the inflating allocation never took
        with flightq.connect(location, timeout=TIMEOUT) as c:
            assert c.stats()["partitions"]["p"]["rows"] == 0  # nothing half-stored
            c.put("p", ["a"], text_columns(["a"]))  # the server serves on
            assert c.get("p", ["a"], as_="numpy").keys == ["a"]


def test_the_memory_cap_is_the_one_asked_for_or_none() -> None:
    with cli_server("--memory-cap", str(48 * 2**30)) as (_, proc):
        assert data_limit(proc.pid) == 48 * 2**30
    with cli_server("--memory-cap", "0") as (_, proc):
        assert data_limit(proc.pid) is None
