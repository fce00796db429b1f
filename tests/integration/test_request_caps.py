"""Control messages past the server's cap (``max_request_bytes``, 16 MiB by default):
refused before they are decoded, typed, naming the call, the size, the cap and the fix;
nothing changes and the server serves on. A message whose headers claim more than
follows fails before msgpack allocates what they claim. A flightq client cuts its long
key lists into messages within the cap.

Every hostile message is crafted with plain ``pyarrow.flight``, as a client in another
language would send it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, cli_server
from helpers_budget import media_batch
from helpers_reliability import partition_state, plain_error, put_command, text_batch
from helpers_stream import ask, open_stream, refusal

import flightq
from flightq.digest import split_claims
from flightq.frames import pack_frame
from flightq.msgcheck import DEFAULT_MAX_REQUEST_BYTES, quick_bound
from flightq.protocol import Clear, GetTicket

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served() -> Iterator[tuple[flightq.Server, flightq.Client]]:
    """A server with the default cap: partitions 'p' (text, task train, rows k0 k1) and
    'v' (vlm), and a connected client."""
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location, [TEXT, VLM], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        c.create_partition("v", VLM)
        c.put_batch("p", text_batch(["k0", "k1"]))
        yield srv, c


def _serves_on(c: flightq.Client) -> None:
    """A put and a get succeed after the refusals, and the rows put before are whole."""
    assert c.put_batch("p", text_batch(["ok"])) == 1
    assert c.get("p", ["k0", "k1", "ok"], as_="numpy").keys == ["k0", "k1", "ok"]


def _refused(call: Callable[[], object]) -> tuple[str, str]:
    """The flightq class and message of the Flight error ``call()`` raises."""
    with pytest.raises(fl.FlightError) as e:
        call()
    return plain_error(e.value)


def _plain_put(loc: str, command: bytes, batch: pa.RecordBatch, meta: bytes | None) -> None:
    with fl.connect(loc) as plain:
        schema, _ = split_claims(batch.schema)
        writer, reader = plain.do_put(fl.FlightDescriptor.for_command(command), schema)
        with writer:
            batch = batch.replace_schema_metadata(schema.metadata)
            if meta is None:
                writer.write_batch(batch)
            else:
                writer.write_with_metadata(batch, pa.py_buffer(meta))
            writer.done_writing()
            reader.read()


def _stream_header(loc: str, body: bytes) -> tuple[str, str]:
    """Send ``body`` as the header of a request-stream frame; the class and message of
    the error the answer carries, once the same stream has answered a valid read."""
    c, writer, reader = open_stream(loc)
    try:
        kind, message = refusal(ask(writer, reader, len(body).to_bytes(4, "little") + body))
        ticket = GetTicket(partition="p", keys=["k0"]).to_wire()
        ok = ask(writer, reader, pack_frame({"op": "read", "cmd": ticket}))
        assert "ok" in ok.header, ok.header
    finally:
        writer.close()
        c.close()
    return kind.__name__, message


def _sent(loc: str, body: bytes, where: str) -> tuple[str, str]:
    """Send ``body`` where a client's msgpack reaches the server; the class and message
    of the error it is refused with."""
    if where == "request stream frame":
        return _stream_header(loc, body)
    if where == "put descriptor":
        return _refused(lambda: _plain_put(loc, body, text_batch(["n0"]), None))
    if where == "media claims":
        return _refused(
            lambda: _plain_put(loc, put_command("v").command, media_batch(["m0"]), body)
        )
    calls: dict[str, Callable[[fl.FlightClient], object]] = {
        "action": lambda p: list(p.do_action(fl.Action("clear", body))),
        "ticket": lambda p: p.do_get(fl.Ticket(body)).read_all(),
        "info descriptor": lambda p: p.get_flight_info(fl.FlightDescriptor.for_command(body)),
        "exchange command": lambda p: p.do_exchange(fl.FlightDescriptor.for_command(body))[
            1
        ].read_chunk(),
    }
    with fl.connect(loc) as plain:
        return _refused(lambda: calls[where](plain))


_WHAT = {
    "action": "clear",
    "ticket": "ticket",
    "put descriptor": "put descriptor",
    "info descriptor": "descriptor",
    "exchange command": "DoExchange command",
    "request stream frame": "request stream",
    "media claims": "put to 'v': media claims",
}


def test_a_clear_past_the_cap_is_refused_before_it_is_decoded_and_nothing_is_cleared(served):
    srv, c = served
    before = partition_state(srv.location, "p")
    # 17 000 keys of 1000 characters: 16.3 MiB, k0 (a stored row) first.
    body = msgpack.packb({"partition": "p", "keys": ["k0"] + ["x" * 1000] * 17_000})
    kind, message = _sent(srv.location, body, "action")
    assert kind == "ResourceExhaustedError"
    assert message == (
        "clear: a body of 16.3 MiB exceeds the server's cap of 16 MiB (max_request_bytes); "
        "name fewer keys per call, or start the server with a larger max_request_bytes"
    )
    with pytest.raises(flightq.ResourceExhaustedError, match=r"^clear: a body of 16\.3 MiB"):
        c.transport.action(Clear.parse(msgpack.unpackb(body)))
    assert partition_state(srv.location, "p") == before
    assert c.stats()["counters"]["refusals"]["ResourceExhaustedError"] == 2
    _serves_on(c)


#: 300 000 empty maps where a value goes: 293 KiB on the wire, 21 MiB of dicts decoded.
_EMPTIES = [{}] * 300_000
_BOMBS = {
    "action": {"partition": "p", "keys": _EMPTIES},
    "ticket": {"op": "get", "partition": "p", "keys": _EMPTIES},
    "put descriptor": {"op": "put", "partition": "p", "put_id": _EMPTIES},
    "info descriptor": {"partition": _EMPTIES},
    "exchange command": {"op": "requests", "x": _EMPTIES},
    "request stream frame": {"op": "read", "cmd": b"", "x": _EMPTIES},
    "media claims": {"hash": "blake3", "fields": {"pixel_values": _EMPTIES}},
}


@pytest.mark.parametrize("where", list(_BOMBS))
def test_a_small_body_that_would_decode_past_the_cap_is_refused_before_decoding(served, where):
    srv, c = served
    before = partition_state(srv.location, "p")
    body = msgpack.packb(_BOMBS[where], use_bin_type=True)
    assert len(body) < 300 * 1024
    kind, message = _sent(srv.location, body, where)
    assert kind == "ResourceExhaustedError", message
    assert message.startswith(f"{_WHAT[where]}: a body of 29") and message.endswith(
        "KiB would take more than the server's cap of 16 MiB (max_request_bytes); name fewer "
        "keys per call, or start the server with a larger max_request_bytes"
    ), message
    assert partition_state(srv.location, "p") == before
    _serves_on(c)


#: {"keys": [[[...]]]}: 5 006 bytes whose 1000 nested array headers claim 9 999 999 items
#: each: refused from the first header, before msgpack runs.
_NESTED = b"\x81\xa4keys" + (b"\xdd" + (9_999_999).to_bytes(4, "big")) * 1000


@pytest.mark.parametrize("where", ["action", "ticket", "put descriptor", "info descriptor"])
def test_headers_claiming_more_items_than_follow_are_refused_naming_the_claim(served, where):
    srv, c = served
    before = partition_state(srv.location, "p")
    kind, message = _sent(srv.location, _NESTED, where)
    assert kind == "ProtocolError"
    assert message.endswith(
        "not a valid msgpack map (its headers claim 9999999 more items at byte 11; "
        "4995 bytes follow)"
    ), message
    assert partition_state(srv.location, "p") == before
    _serves_on(c)


def test_flightq_serve_takes_its_cap_from_the_command_line():
    with cli_server("--max-request-bytes", str(2 * 2**20)) as (loc, _):
        body = msgpack.packb({"partition": "p", "keys": ["x" * 1000] * 3000})  # 2.9 MiB
        kind, message = _sent(loc, body, "action")
        assert kind == "ResourceExhaustedError"
        assert message.startswith(
            "clear: a body of 2.9 MiB exceeds the server's cap of 2 MiB (max_request_bytes)"
        ), message
        with flightq.connect(loc, [TEXT]) as c:  # its own calls fit: it cuts its key lists
            c.create_partition("p", TEXT)
            keys = [f"r{i:04d}_".ljust(1000, "k") for i in range(3000)]
            assert c.put_batch("p", text_batch(keys)) == len(keys)
            assert c.clear("p", keys) == len(keys)


def test_schema_json_nested_past_pythons_stack_or_longer_than_a_put_carries_is_refused_typed(
    served,
):
    srv, c = served
    with fl.connect(srv.location) as plain:

        def act(kind: str, body: dict[str, Any]) -> tuple[str, str]:
            return _refused(lambda: list(plain.do_action(fl.Action(kind, msgpack.packb(body)))))

        deep = "[" * 30_000  # within register_schema's 32 KiB
        for kind, body in [
            ("declare", {"partition": "q", "schema": deep}),
            ("check_schemas", {"schemas": [deep]}),
            ("register_schema", {"schema": deep}),
        ]:
            got, message = act(kind, body)
            assert got == "SchemaError", (kind, message)
            assert message.startswith("schema is not valid JSON: nested too deeply"), message
        long = " " * 70_000 + flightq.SchemaRegistry.default().get(TEXT).canonical_json
        for kind, body in [
            ("declare", {"partition": "q", "schema": long}),
            ("check_schemas", {"schemas": [long]}),
        ]:
            got, message = act(kind, body)
            assert got == "ResourceExhaustedError", (kind, message)
            assert message.startswith(
                f"{kind}: a schema of {len(long)} characters of JSON is longer than any a put "
                "can carry (65536 bytes of schema metadata)"
            ), message
    assert "q" not in c.partitions()
    _serves_on(c)


def test_clears_and_acks_of_more_keys_than_a_message_carries_go_in_parts(served):
    # 66 000 keys of 1000 characters: 66 MB of keys, past what one message may carry;
    # the client names them over several calls, each within the cap.
    _, c = served
    keys = [f"r{i:06d}_".ljust(1000, "k") for i in range(66_000)]
    assert c.put_batch("p", text_batch(keys)) == len(keys)
    listed = c.list_keys("p", keys[::-1])
    assert list(listed) == keys[::-1]
    batch = c.claim("p", "train", len(keys) + 2, as_="numpy")
    assert c.ack(batch, [*batch.keys, *batch.keys]) == len(keys) + 2  # named twice: once
    assert c.clear("p", keys) == len(keys)
    assert c.inspect("p")["rows"] == 2
    _serves_on(c)


#: Small bodies bounded without the header walk (few bytes that could be a header), whose
#: headers still claim more than follows: msgpack refuses them at decode, typed.
_SHORT = {
    "claim past the end": b"\x81\xa4keys\x9f\xa1k",
    "nested fixarrays": b"\x81\xa4keys" + b"\x9f" * 900,
    "array16 claim": b"\x81\xa4keys\xdc\x01\x00" + b"\xa1k" * 10,
}


@pytest.mark.parametrize("body", list(_SHORT.values()), ids=list(_SHORT))
@pytest.mark.parametrize("where", list(_WHAT))
def test_small_bodies_claiming_more_than_follows_are_refused_typed_without_the_walk(
    served, where, body
):
    assert quick_bound(body, DEFAULT_MAX_REQUEST_BYTES) is not None  # not walked
    srv, c = served
    before = partition_state(srv.location, "p")
    kind, message = _sent(srv.location, body, where)
    assert kind == "ProtocolError", message
    start = f"{_WHAT[where]}: not a valid msgpack map"
    if where == "media claims":
        start = "put to 'v': a record batch's media claims are malformed"
    assert message.startswith(start), message
    assert partition_state(srv.location, "p") == before
    _serves_on(c)
