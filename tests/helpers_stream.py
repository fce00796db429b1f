"""Helpers of the request-stream tests: a streamed and a per-call client, and plain
``pyarrow.flight`` access to the stream (hand-written frames, as a client in another
language would write them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT

import flightq
from flightq.errors import FlightqError
from flightq.frames import parse_frame
from flightq.protocol import ErrorDetail, RequestsCommand


@pytest.fixture(name="pair")
def pair_fixture(server: flightq.Server) -> Iterator[tuple[flightq.Client, flightq.Client]]:
    """Two clients of ``server``: one using the request stream, one per call only."""
    with (
        flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as streamed,
        flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as per_call,
    ):
        per_call.stream_max_bytes = 0
        yield streamed, per_call


def error_of(fn: Any) -> tuple[type[BaseException], str]:
    """The class and message of the flightq error ``fn()`` raises."""
    with pytest.raises(FlightqError) as info:
        fn()
    return type(info.value), str(info.value)


def open_stream(location: str) -> tuple[Any, Any, Any]:
    """A plain Flight client's request stream, its greeting read: (client, writer, reader)."""
    c = fl.connect(location)
    desc = fl.FlightDescriptor.for_command(RequestsCommand().to_wire())
    writer, reader = c.do_exchange(desc)
    hello = parse_frame(reader.read_chunk().app_metadata, "hello")
    assert hello.header["ok"] == b""
    return c, writer, reader


def ask(writer: Any, reader: Any, frame: bytes | pa.Buffer) -> Any:
    """Send one frame and parse the answer's."""
    writer.write_metadata(pa.py_buffer(frame) if isinstance(frame, bytes) else frame)
    return parse_frame(reader.read_chunk().app_metadata, "answer")


def refusal(answer: Any) -> tuple[type[FlightqError], str]:
    """The class and message of the error an answer's frame carries."""
    assert "error" in answer.header, answer.header
    e = ErrorDetail.parse(answer.header["error"]).error()
    return type(e), str(e)


def raw_frame(h: dict[str, Any], body: bytes = b"") -> bytes:
    """A frame written by hand: ``h`` packed as its header, then ``body`` as it is."""
    head = msgpack.packb(h, use_bin_type=True)
    return len(head).to_bytes(4, "little") + head + body
