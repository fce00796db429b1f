"""A sharded client where one shard is not flightq's server: its gets and claims are held
to what each shard was asked, as a single server's are (``test_client_hostile_server.py``):
no row another shard holds, none twice, no answer read past the rows asked for, and a
claim's rows given back when its answer is refused.

Both shards are plain ``pyarrow.flight`` servers on 127.0.0.1 (port 0): shard B answers
as flightq's server would, shard A as the test says. Neither takes the request stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from helpers_hostile import DECLARED, HEALTH, serving
from helpers_hostile import rows as _rows

import flightq
from flightq.errors import ClaimTimeoutError, ProtocolError, UnavailableError
from flightq.protocol import to_flight_error
from flightq.sharding.router import Router

pytestmark = pytest.mark.timeout(120)


def _stream(*batches: pa.RecordBatch) -> fl.FlightDataStream:
    return fl.RecordBatchStream(pa.Table.from_batches(list(batches)))


def _none_ready(ticket: dict[str, Any]) -> fl.FlightDataStream:
    raise to_flight_error(ClaimTimeoutError("no rows ready", partition="p"))


def _honest_get(ticket: dict[str, Any]) -> fl.FlightDataStream:
    if "batch_size" in ticket:
        return _none_ready(ticket)
    return _stream(_rows(ticket["keys"]))


class Shard(fl.FlightServerBase):
    """Health, describe, sessions, acks and nacks as flightq answers them; gets and claims
    (DoGet) as ``get`` says; the claims it was sent acks and nacks of kept in ``acks`` and
    ``nacks``."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.get: Callable[[dict[str, Any]], fl.FlightDataStream] = _honest_get
        self.nacks: list[str] = []
        self.acks: list[str] = []

    def do_action(self, context: Any, action: fl.Action) -> Iterator[bytes]:
        body = msgpack.unpackb(action.body.to_pybytes()) if action.body.size else {}
        if action.type == "health":
            return iter([msgpack.packb(HEALTH)])
        if action.type == "describe":
            return iter([msgpack.packb(DECLARED)])
        if action.type == "nack":
            self.nacks.append(body["claim"])
            return iter([msgpack.packb({"released": 0, "dead": 0})])
        if action.type == "ack":
            self.acks.append(body["claim"])
            return iter([msgpack.packb({"acked": 0})])
        raise fl.FlightServerError(f"no {action.type} here")

    def do_get(self, context: Any, ticket: fl.Ticket) -> fl.FlightDataStream:
        return self.get(msgpack.unpackb(ticket.ticket))

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        if msgpack.unpackb(descriptor.command).get("op") != "session":
            raise fl.FlightServerError("no request stream here")
        writer.write_metadata(pa.py_buffer(msgpack.packb({"session": "s1"})))
        with contextlib.suppress(fl.FlightError, pa.ArrowException, StopIteration):
            reader.read_chunk()  # until the client closes it


@pytest.fixture(name="shards", scope="module")
def shards_fixture() -> Iterator[list[Shard]]:
    shards = [Shard(), Shard()]
    with serving(*shards):
        yield shards


@pytest.fixture(name="sharded")
def sharded_fixture(shards: list[Shard]) -> Iterator[tuple[Any, list[list[str]]]]:
    """A sharded client of both shards (claims start at shard A), and keys of each."""
    locations = [f"grpc://127.0.0.1:{s.port}" for s in shards]
    router = Router(locations)
    keys: list[list[str]] = [[], []]
    for i in range(400):
        keys[router.shard_of(f"k{i}")].append(f"k{i}")
    c = flightq.connect_sharded(locations, timeout=5.0, poll=0.05)
    c._turn = iter(range(0, 10**6, 2))  # every claim starts at shard A
    yield c, keys
    c.close()
    for s in shards:
        s.get, s.nacks, s.acks = _honest_get, [], []


@pytest.mark.parametrize(
    "lie",
    ["other-shards-keys", "unknown-keys", "a-key-twice", "one-more", "one-less", "reversed"],
)
def test_a_shard_answering_a_get_with_rows_not_asked_of_it_is_refused(
    shards, sharded, lie: str
) -> None:
    c, keys = sharded
    a, b = keys[0][:3], keys[1][:2]

    def get(ticket: dict[str, Any]) -> fl.FlightDataStream:
        asked = ticket["keys"]
        sent = {
            "other-shards-keys": [b],
            "unknown-keys": [["evil0", "evil1", "evil2"]],
            "a-key-twice": [asked[:1], [asked[0], *asked[2:]]],  # as many rows as asked
            "one-more": [[*asked, "zz"]],
            "one-less": [asked[:-1]],
            "reversed": [asked[::-1]],
        }[lie]
        return _stream(*map(_rows, sent))

    assert c.get("p", a + b, as_="numpy").keys == a + b  # both shards honest
    shards[0].get = get
    with pytest.raises(ProtocolError, match="asked for"):
        c.get("p", a + b, as_="numpy")
    assert c.get("p", b, as_="numpy").keys == b  # the honest shard alone


def test_a_shard_answering_a_get_without_end_is_refused_at_the_batch_past_its_keys(
    shards, sharded
) -> None:
    c, keys = sharded

    def endless(ticket: dict[str, Any]) -> fl.FlightDataStream:
        rb = _rows(ticket["keys"])
        return fl.GeneratorStream(rb.schema, (rb for _ in iter(int, 1)))

    shards[0].get = endless
    with pytest.raises(ProtocolError, match="more than the 2 rows asked for"):
        c.get("p", keys[0][:2] + keys[1][:2], as_="numpy")


@pytest.mark.parametrize(
    ("lie", "cause"),
    [
        ("more-than-asked", "more than the 2 rows asked for"),
        ("a-row-twice", r"2 rows \(1 distinct\)"),
        ("deliveries-short", "1 deliveries .* for 2 rows"),
        ("deliveries-negative", "least -5"),
        ("no-record-batch", "carries no rows"),
        ("no-grant", "no claim grant"),
    ],
)
def test_a_shard_answering_a_claim_out_of_its_bounds_is_refused_and_given_back(
    shards, sharded, lie: str, cause: str
) -> None:
    c, keys = sharded
    a = keys[0]

    def claim(ticket: dict[str, Any]) -> fl.FlightDataStream:
        if "batch_size" not in ticket:
            return _honest_get(ticket)
        n = ticket["batch_size"]
        if lie == "more-than-asked":
            return _stream(_rows(a[:12], "c1"))
        if lie == "a-row-twice":
            return _stream(_rows(a[:1], "c1"), _rows(a[:1], "c1"))
        if lie == "deliveries-short":
            return _stream(_rows(a[:n], "c1", [1]))
        if lie == "deliveries-negative":
            return _stream(_rows(a[:n], "c1", [-5, 1]))
        if lie == "no-record-batch":
            return fl.RecordBatchStream(pa.Table.from_batches([], _rows(["x"], "c1").schema))
        return _stream(_rows(a[:n]))

    shards[0].get = claim
    with pytest.raises(ProtocolError, match=cause):
        c.claim("p", "train", 2, as_="numpy", timeout=2.0)
    # Rows the shard said it leased go back at once (an answer without a grant took none).
    assert shards[0].nacks == ([] if lie in ("no-record-batch", "no-grant") else ["c1"])


def test_two_shards_giving_one_claim_the_same_row_are_refused_and_both_given_back(
    shards, sharded
) -> None:
    c, keys = sharded
    row = keys[0][0]

    def one_row(claim: str) -> Callable[[dict[str, Any]], fl.FlightDataStream]:
        # One row ready, once: a claim of two finds none, the first of one (halved) it.
        given: list[str] = []

        def get(t: dict[str, Any]) -> fl.FlightDataStream:
            if t["batch_size"] != 1 or given:
                return _none_ready(t)
            given.append(row)
            return _stream(_rows([row], claim))

        return get

    shards[0].get, shards[1].get = one_row("ca"), one_row("cb")
    with pytest.raises(ProtocolError, match="came in two answers of one claim"):
        c.claim("p", "train", 2, as_="numpy", timeout=2.0)
    assert (shards[0].nacks, shards[1].nacks) == (["ca"], ["cb"])


def test_a_shard_whose_claim_answer_breaks_after_its_grant_gives_back_and_others_serve(
    shards, sharded
) -> None:
    # A shard stopping mid-answer (its grant came, then the stream broke): its rows go
    # back at once and the claim is served by the other shard, with none of the first's.
    c, keys = sharded
    a, b = keys[0], keys[1]

    def broken(ticket: dict[str, Any]) -> fl.FlightDataStream:
        rb = _rows(a[: ticket["batch_size"]], "ca")

        def batches() -> Iterator[pa.RecordBatch]:
            yield rb
            raise to_flight_error(UnavailableError("the shard is stopping"))

        return fl.GeneratorStream(rb.schema, batches())

    shards[0].get = broken
    shards[1].get = lambda t: _stream(_rows(b[: t["batch_size"]], "cb"))
    batch = c.claim("p", "train", 2, as_="numpy", timeout=2.0)
    assert batch.keys == b[:2] and [p.id for p in batch.claim.parts] == ["cb"]
    assert shards[0].nacks == ["ca"] and shards[1].nacks == []
    c.ack(batch)  # the shard that served it alone
    assert (shards[0].acks, shards[1].acks) == ([], ["cb"])
