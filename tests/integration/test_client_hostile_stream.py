"""A client's request stream against a server that is not flightq's: answers sent twice,
answers that are no answer, answers to something else. Whatever comes, the client raises
a typed error, never takes one request's answer for another's, and closes a stream once
an answer on it was refused (answers are taken in turn: nothing after it is trusted).

The server here is plain ``pyarrow.flight`` on 127.0.0.1 (port 0): it accepts the request
stream, greets as flightq's server does, and answers each request frame as the test says.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from helpers_hostile import DECLARED, HEALTH, serving
from helpers_hostile import rows as _rows

import flightq
from flightq.errors import ConflictError, FlightqTimeoutError, NotFoundError, ProtocolError
from flightq.frames import Frame, pack_frame, parse_frame
from flightq.protocol import ErrorDetail, PutAck, PutCreated
from flightq.server.exchange import HELLO

pytestmark = pytest.mark.timeout(120)


#: What the liar answers a request with: the request's op, its parsed command and frame
#: in, the answers' headers (with the body's batches, if any) out.
Answer = Callable[[str, Any, Frame], list[tuple[dict[str, Any], list[pa.RecordBatch]]]]


def _acked(rows: int) -> dict[str, Any]:
    created = PutCreated(created=rows, groups=[0, rows]).to_wire()
    return {"ok": PutAck(rows=rows).to_wire(), "created": created}


def _keys(frame: Frame) -> list[str]:
    """A put's row keys."""
    return [k for b in frame.batches for k in b.column(0).to_pylist()]


def _honest(op: str, cmd: Any, frame: Frame) -> list[Any]:
    """What a flightq server would answer (rows of the keys asked for; puts stored)."""
    if op == "put":
        return [(_acked(cmd["rows"]), [])]
    if op == "read":
        return [({"ok": b""}, [_rows(cmd["keys"])])]
    if frame.header.get("type") == "describe":
        return [({"ok": msgpack.packb(DECLARED)}, [])]
    return [({"ok": msgpack.packb({"acked": 0})}, [])]


class StreamLiar(fl.FlightServerBase):
    """Answers health and describe as flightq does, opens a consumer session that never
    ends a lease, and answers each request on the request stream with what ``answer``
    says, echoing its number where ``numbered`` (as flightq's server says it does in its
    hello)."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.answer: Answer = _honest
        self.numbered = True
        self.streams = 0  # request streams opened

    def do_action(self, context: Any, action: fl.Action) -> Iterator[bytes]:
        if action.type == "health":
            return iter([msgpack.packb(HEALTH)])
        if action.type == "describe":
            return iter([msgpack.packb(DECLARED)])
        if action.type == "nack":
            return iter([msgpack.packb({"released": 0, "dead": 0})])
        raise fl.FlightServerError(f"no {action.type} here")

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        if msgpack.unpackb(descriptor.command).get("op") == "session":
            writer.write_metadata(pa.py_buffer(msgpack.packb({"session": "s1"})))
            with contextlib.suppress(StopIteration, pa.ArrowException):
                while True:  # its beats, until the client ends it
                    reader.read_chunk()
            return
        self.streams += 1
        numbered = self.numbered
        hello = dict(HELLO) if numbered else {k: v for k, v in HELLO.items() if k != "numbered"}
        writer.write_metadata(pack_frame(hello))
        while True:
            try:
                chunk = reader.read_chunk()
            except (StopIteration, pa.ArrowException):
                return
            frame = parse_frame(chunk.app_metadata, "liar")
            header = frame.header
            cmd = msgpack.unpackb(header["cmd"])
            for head, batches in self.answer(header["op"], cmd, frame):
                if numbered and "n" in header and "n" not in head:
                    head = {**head, "n": header["n"]}
                if "n" in head and head["n"] is None:  # an answer naming no request
                    head = {k: v for k, v in head.items() if k != "n"}
                schema = batches[0].schema if batches else None
                writer.write_metadata(pack_frame(head, schema, batches))


@pytest.fixture(name="server", scope="module")
def server_fixture() -> Iterator[StreamLiar]:
    server = StreamLiar()
    with serving(server):
        yield server


@pytest.fixture(name="liar")
def liar_fixture(server: StreamLiar) -> Iterator[Callable[..., flightq.Client]]:
    clients: list[flightq.Client] = []

    def make(answer: Answer, numbered: bool = True) -> flightq.Client:
        server.answer, server.numbered = answer, numbered
        c = flightq.connect(f"grpc://127.0.0.1:{server.port}", timeout=5.0)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()
    server.answer, server.numbered = _honest, True


def _put(c: flightq.Client, keys: list[str]) -> int:
    return c.put("p", keys, {"input_ids": [np.arange(3) for _ in keys]}).rows


def _twice(first: str) -> Answer:
    """Answers the first request of kind ``first`` twice, every other once."""
    seen: list[str] = []

    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        once = _honest(op, cmd, frame)
        seen.append(op)
        return once * 2 if seen.count(first) == 1 and op == first else once

    return answer


def test_a_get_answered_twice_never_hands_out_its_rows_for_the_next_get(liar, server) -> None:
    c = liar(_twice("read"))
    assert c.get("p", ["a", "b"], as_="numpy").keys == ["a", "b"]
    opened = server.streams
    with pytest.raises(ProtocolError, match="answered request 1 where request 2 was asked"):
        c.get("p", ["c", "d"], as_="numpy")
    # The stream was closed; the next get opens another and gets its own rows.
    assert c.get("p", ["e", "f"], as_="numpy").keys == ["e", "f"]
    assert server.streams == opened + 1


def test_a_put_answered_twice_does_not_acknowledge_the_next_put(liar) -> None:
    # The second put is refused by the server; without numbers it would read the first
    # put's second acknowledgement (the same row count) and return as stored.
    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        keys = _keys(frame)
        if keys == ["k3", "k4"]:
            err = ConflictError("k3 exists with other content", partition="p", key="k3")
            return [({"error": ErrorDetail.of(err).to_wire()}, [])]
        once = _honest(op, cmd, frame)
        return once * 2 if keys == ["k1", "k2"] else once

    c = liar(answer)
    assert _put(c, ["k1", "k2"]) == 2
    with pytest.raises(ProtocolError, match="answered request"):
        _put(c, ["k3", "k4"])
    with pytest.raises(ConflictError, match="k3 exists"):
        _put(c, ["k3", "k4"])  # its own answer this time, on a fresh stream
    assert _put(c, ["k5", "k6"]) == 2


@pytest.mark.parametrize("numbered", [True, False], ids=["numbered", "in-order-only"])
def test_a_refused_answer_closes_the_stream(liar, server, numbered: bool) -> None:
    # A get answered with another key's rows, then a put answered twice over: a server
    # that does not number its answers still cannot shift the next answers onto later
    # requests, since the stream is closed once an answer is refused.
    lies = {"n": 0}

    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        if op == "read" and cmd["keys"] == ["a"] and not lies["n"]:
            lies["n"] += 1
            return [({"ok": b""}, [_rows(["evil"])]), ({"ok": b""}, [_rows(["a"])])]
        return _honest(op, cmd, frame)

    c = liar(answer, numbered=numbered)
    c.describe("p")  # the stream is open
    opened = server.streams
    with pytest.raises(ProtocolError, match="not the keys asked for"):
        c.get("p", ["a"], as_="numpy")
    assert c.get("p", ["b"], as_="numpy").keys == ["b"]
    assert server.streams == opened + 1


#: Values that are no msgpack bytes, by name.
NOT_BYTES = {
    "str": "a string",
    "int-1.5e9": 1_500_000_000,
    "negative": -1,
    "huge-int": 10**19,
    "none": None,
    "float": 1.5,
    "list": [1, 2],
}


@pytest.mark.parametrize(
    ("where", "value"),
    [
        pytest.param(where, value, id=f"{where}-{name}")
        for where in ("put-ok", "put-created", "stats-ok", "error")
        for name, value in NOT_BYTES.items()
        # A put's "created" may be None: an older server sends none.
        if not (where == "put-created" and value is None)
    ],
)
def test_an_answer_field_that_is_no_bytes_is_refused_typed(liar, server, where, value) -> None:
    # msgpack fields the client parses as messages: bytes(n) of an int would have made n
    # zero bytes, a string an untyped TypeError.

    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        if op == "put" and where.startswith("put"):
            head = _acked(cmd["rows"])
            head["ok" if where == "put-ok" else "created"] = value
            return [(head, [])]
        if op == "act" and frame.header.get("type") == "stats" and where == "stats-ok":
            return [({"ok": value}, [])]
        if op == "put" and where == "error":
            return [({"error": value}, [])]
        return _honest(op, cmd, frame)

    c = liar(answer)
    c.describe("p")  # the stream is open
    opened = server.streams
    with pytest.raises(ProtocolError, match="must be bytes"):
        if where == "stats-ok":
            c.stats()
        else:
            _put(c, ["k1"])
    # The stream that carried it is closed: the next request opens another.
    assert c.describe("p")["partition"] == "p"
    assert server.streams == opened + 1


@pytest.mark.parametrize(
    ("head", "raised", "match"),
    [
        ({"done": True}, ProtocolError, "neither 'ok', 'error' nor 'retry'"),
        # A numbered server answers an error without a number only where it could not
        # read the frame: the error stands, and nothing after it on that stream is taken.
        (
            {
                "error": ErrorDetail.of(NotFoundError("unknown key 'a'", key="a")).to_wire(),
                "n": None,  # sent without a number
            },
            NotFoundError,
            "unknown key 'a'",
        ),
    ],
    ids=["no-ok-error-or-retry", "an-error-naming-no-request"],
)
def test_an_answer_that_is_none_or_names_no_request_closes_the_stream(
    liar, server, head: dict[str, Any], raised: type[Exception], match: str
) -> None:
    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        return [(head, [])] if op == "read" else _honest(op, cmd, frame)

    c = liar(answer)
    c.describe("p")  # the stream is open
    opened = server.streams
    with pytest.raises(raised, match=match):
        c.get("p", ["a"], as_="numpy")
    assert c.describe("p")["partition"] == "p"
    assert server.streams == opened + 1


def test_a_claim_answered_on_the_stream_without_rows_is_a_protocol_error(liar) -> None:
    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        if op == "read" and "batch_size" in cmd:
            return [({"ok": b""}, [])]
        return _honest(op, cmd, frame)

    c = liar(answer)
    # The client learns the partition's row size from a get first (a claim takes the
    # stream only once the answer is predicted small).
    assert c.get("p", ["a", "b"], as_="numpy").keys == ["a", "b"]
    with pytest.raises(ProtocolError, match="carries no rows, so no grant"):
        c.claim("p", "train", 2, as_="numpy", timeout=2.0)


def test_a_request_never_answered_times_out_as_its_per_call_twin(liar) -> None:
    # The stream is cancelled half a second past the call's timeout (5 s before), the
    # call raising FlightqTimeoutError; the next request opens another stream.
    release = threading.Event()

    def answer(op: str, cmd: Any, frame: Frame) -> list[Any]:
        if op == "read" and cmd["keys"] == ["stall"]:
            release.wait(30)
            return []
        return _honest(op, cmd, frame)

    c = liar(answer)
    c.describe("p")  # the stream is open
    try:
        started = time.monotonic()
        with pytest.raises(FlightqTimeoutError, match="no answer on the request stream"):
            c.get("p", ["stall"], as_="numpy", timeout=1.0)
        took = time.monotonic() - started
        assert 1.0 <= took < 4.0, took  # 6 s and more with the margin of 5 s
        assert c.get("p", ["b"], as_="numpy").keys == ["b"]
    finally:
        release.set()
