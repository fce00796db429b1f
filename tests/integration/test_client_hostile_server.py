"""A client against a server that is not flightq's (a bug, another program on the port, a
hostile peer): whatever it answers, the client raises a typed error naming what went
wrong, never hands out rows it did not ask for, and never reads an answer that goes on
past what it asked for to its end.

The server here is plain ``pyarrow.flight`` on 127.0.0.1 (port 0), answering each call as
the test says; it refuses the request stream, so every call goes per call.
"""

from __future__ import annotations

import contextlib
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
from flightq.errors import ProtocolError
from flightq.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(120)


class Liar(fl.FlightServerBase):
    """Answers health as flightq does, and every other call with what ``answer`` says
    (a callable per call kind: ``get(ticket)``, ``put(reader, writer)``,
    ``action(name, body)``, ``exchange(descriptor, reader, writer)``)."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.answer: dict[str, Callable[..., Any]] = {}

    def do_action(self, context: Any, action: fl.Action) -> Iterator[bytes]:
        body = msgpack.unpackb(action.body.to_pybytes()) if action.body.size else {}
        if action.type == "health":
            return self.answer.get("health", lambda n, b: iter([msgpack.packb(HEALTH)]))(
                action.type, body
            )
        if action.type == "describe":
            return iter([msgpack.packb(DECLARED)])
        return self.answer["action"](action.type, body)

    def do_get(self, context: Any, ticket: fl.Ticket) -> fl.FlightDataStream:
        return self.answer["get"](msgpack.unpackb(ticket.ticket))

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        self.answer["put"](reader, writer)

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        if msgpack.unpackb(descriptor.command).get("op") == "requests":
            raise fl.FlightServerError("no request stream here")
        self.answer["exchange"](descriptor, reader, writer)


@pytest.fixture(name="server", scope="module")
def server_fixture() -> Iterator[Liar]:
    # One server for the module, its answers set by each test: a server of its own per
    # test could take a port a closed one had, which gRPC's shared channels still know.
    server = Liar()
    with serving(server):
        yield server


@pytest.fixture(name="liar")
def liar_fixture(server: Liar) -> Iterator[Callable[..., flightq.Client]]:
    clients: list[flightq.Client] = []

    def make(**answer: Callable[..., Any]) -> flightq.Client:
        server.answer = answer
        c = flightq.connect(f"grpc://127.0.0.1:{server.port}", timeout=5.0)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.mark.parametrize(
    "sent",
    [["evil0", "evil1", "evil2"], ["a", "b", "c", "extra"], ["a", "b"], ["c", "b", "a"]],
    ids=["other-keys", "one-more", "one-less", "reversed"],
)
def test_a_get_answered_with_rows_not_asked_for_is_refused(liar, sent: list[str]) -> None:
    c = liar(get=lambda t: fl.RecordBatchStream(pa.Table.from_batches([_rows(sent)])))
    with pytest.raises(ProtocolError, match="asked for"):
        c.get("p", ["a", "b", "c"], as_="numpy")


def test_a_get_answered_by_an_endless_stream_is_refused_at_the_batch_past_the_keys(liar) -> None:
    def endless(t: Any) -> fl.FlightDataStream:
        rb = _rows(["a", "b", "c"])
        return fl.GeneratorStream(rb.schema, (rb for _ in iter(int, 1)))

    c = liar(get=endless)
    with pytest.raises(ProtocolError, match="more than the 3 rows asked for"):
        c.get("p", ["a", "b", "c"], as_="numpy")


def test_an_action_answered_with_more_than_one_result_is_refused(liar) -> None:
    def many(name: str, body: Any) -> Iterator[bytes]:
        yield msgpack.packb({"partitions": {}, "rows": 0, "bytes": 0})
        while True:  # a server that never stops: the client reads two, not all
            yield b"\0" * (1 << 20)

    c = liar(action=many)
    with pytest.raises(ProtocolError, match="more than one answer"):
        c.stats()


def test_a_session_stream_ended_without_an_id_is_a_protocol_error(liar) -> None:
    def ends(descriptor: Any, reader: Any, writer: Any) -> None:
        return  # no reply at all

    c = liar(exchange=ends)
    with pytest.raises(ProtocolError, match="without a session id"):
        c.session.id()  # what a claim opens first


def test_a_put_acknowledged_for_other_rows_than_sent_is_refused(liar) -> None:
    def acks(reader: Any, writer: Any) -> None:
        reader.read_all()
        writer.write(pa.py_buffer(msgpack.packb({"rows": 1002})))

    c = liar(put=acks)
    with pytest.raises(ProtocolError, match="acknowledged 1002 rows of the 2 sent"):
        c.put("p", ["a", "b"], {"input_ids": [np.arange(3), np.arange(2)]})


def test_a_list_keys_reply_whose_lists_disagree_is_refused(liar) -> None:
    def listed(name: str, body: Any) -> Iterator[bytes]:
        reply = {"keys": ["a", "b"], "tags": [{}], "fields": ["input_ids"], "present": [[0], [5]]}
        return iter([msgpack.packb(reply)])

    c = liar(action=listed)
    with pytest.raises(ProtocolError, match="list_keys"):
        c.list_keys("p")


@pytest.mark.parametrize(
    "listed",
    [["a", "zz"], ["a"], ["b", "a"], ["a", "b", "c"]],
    ids=["other", "short", "order", "more"],
)
def test_a_list_keys_reply_of_other_keys_is_refused(liar, listed: list[str]) -> None:
    def reply(name: str, body: Any) -> Iterator[bytes]:
        n = len(listed)
        r = {"keys": listed, "tags": [{}] * n, "fields": ["input_ids"], "present": [[0]] * n}
        return iter([msgpack.packb(r)])

    c = liar(action=reply)
    with pytest.raises(ProtocolError, match="not the 2 keys asked for"):
        c.list_keys("p", ["a", "b"])
    with pytest.raises(ProtocolError, match="not the 2 keys asked for"):
        c.list_keys("p", ["a", "b", "a"])  # a key named twice is listed once


def test_a_reply_of_megabytes_of_empty_maps_is_refused_before_it_is_decoded(server) -> None:
    n = 20_000_000  # 20 MB on the wire, about 3 GB of Python dicts once decoded
    bomb = (
        b"\x84\xa2ok\xc3\xa8protocol\x01\xaapartitions\x00\xa3shm\x81\xa1k\xdd"
        + n.to_bytes(4, "big")
        + b"\x80" * n
    )
    server.answer = {"health": lambda name, body: iter([bomb])}
    with pytest.raises(ProtocolError, match="would decode to more than"):
        flightq.connect(f"grpc://127.0.0.1:{server.port}", timeout=30.0)


def _held_session(descriptor: Any, reader: Any, writer: Any) -> None:
    """A session as a server without an idle watch opens one: its id, then nothing."""
    writer.write_metadata(pa.py_buffer(msgpack.packb({"session": "s1"})))
    with contextlib.suppress(fl.FlightError, pa.ArrowException, StopIteration):
        reader.read_chunk()  # until the client cancels or closes


def _granted(
    batches: list[list[str]], deliveries: list[int]
) -> Callable[[Any], fl.FlightDataStream]:
    """A claim's answer: record batches of these keys, under a grant of ``deliveries``."""

    def get(ticket: Any) -> fl.FlightDataStream:
        grant = msgpack.packb({"claim": "c1", "lease": 30.0, "deliveries": deliveries})
        rbs = [_rows(keys) for keys in batches]
        meta = {**rbs[0].schema.metadata, b"flightq.claim": grant}
        return fl.RecordBatchStream(
            pa.Table.from_batches([rb.replace_schema_metadata(meta) for rb in rbs])
        )

    return get


@pytest.mark.parametrize(
    ("keys", "deliveries", "cause"),
    [
        ([[f"k{i}" for i in range(12)]], [1] * 12, "more than the 4 rows asked for"),
        ([["k0"], ["k0"]], [1, 1], r"2 rows \(1 distinct\)"),
        ([["k0", "k1"]], [1], "1 deliveries .* for 2 rows"),
        ([["k0", "k1"]], [-5, 1], "least -5"),
    ],
    ids=["more-than-asked", "a-row-twice", "deliveries-short", "deliveries-negative"],
)
def test_a_claim_answered_out_of_its_bounds_is_refused_and_given_back(
    liar, keys: list[list[str]], deliveries: list[int], cause: str
) -> None:
    gave_back: list[Any] = []

    def action(name: str, body: Any) -> Iterator[bytes]:
        gave_back.append((name, body))
        return iter([msgpack.packb({"released": 0})])

    c = liar(get=_granted(keys, deliveries), exchange=_held_session, action=action)
    with pytest.raises(ProtocolError, match=cause):
        c.claim("p", "train", 4, as_="numpy", timeout=1.0)
    assert [name for name, _ in gave_back] == ["nack"]  # the rows go back


def test_a_refused_request_stream_is_closed_at_once(liar, capfd) -> None:
    # The liar refuses the request stream: the client's call goes per call, and the
    # stream it opened is closed then, not found unclosed by the collector later (which
    # Arrow reports on stderr as "Close() failed").
    import gc

    c = liar(
        action=lambda name, body: iter([msgpack.packb({"partitions": {}, "rows": 0, "bytes": 0})])
    )
    assert c.stats()["rows"] == 0
    c.close()
    del c
    gc.collect()
    assert "Close() failed" not in capfd.readouterr().err


@pytest.mark.parametrize("protocol", [PROTOCOL_VERSION + 1, 999, 0], ids=["next", "999", "zero"])
def test_a_server_of_another_protocol_version_is_refused_at_connect(server, protocol: int) -> None:
    server.answer = {
        "health": lambda name, body: iter([msgpack.packb({**HEALTH, "protocol": protocol})])
    }
    with pytest.raises(
        ProtocolError, match=f"speaks flightq protocol {protocol}; this client speaks"
    ):
        flightq.connect(f"grpc://127.0.0.1:{server.port}", timeout=5.0)
    with pytest.raises(
        ProtocolError, match=f"speaks flightq protocol {protocol}; this client speaks"
    ):
        flightq.connect_sharded([f"grpc://127.0.0.1:{server.port}"], timeout=5.0)
