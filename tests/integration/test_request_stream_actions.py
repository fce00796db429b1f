"""Acks, nacks, clears and resets on the request stream.

A training loop's small actions travel as frames (op ``"act"``) on the client's held
DoExchange. Each is checked against its per-call twin (a client with
``stream_max_bytes = 0``): the same reply, the same state on the server, the same typed
error with the same message. Hostile frames are written with plain ``pyarrow.flight``;
after each refusal the same stream still answers. Real servers on loopback port 0.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, text_columns, text_keys
from helpers_stream import ask, error_of, open_stream, raw_frame

import flightq
import flightq.validation as validation
from flightq.digest import DIGEST_BYTES, HASH, pack_claims
from flightq.errors import (
    FlightqError,
    LeaseExpiredError,
    MediaDigestError,
    NotFoundError,
    ProtocolError,
)
from flightq.frames import STREAM_ACK_ROWS, STREAM_ACTIONS, STREAM_READS, pack_frame
from flightq.protocol import (
    Ack,
    AckReply,
    ClaimGrant,
    ClaimTicket,
    Clear,
    ClearReply,
    ErrorDetail,
    PutCommand,
)

pytestmark = pytest.mark.timeout(60)


def _progress(c: flightq.Client, partition: str) -> dict[str, Any]:
    st = c.inspect(partition)
    return {k: st[k] for k in ("rows", "delivered", "acked", "leased", "dead", "ready")}


def test_acks_nacks_clears_and_resets_take_the_stream_and_match_per_call(
    pair: tuple[flightq.Client, flightq.Client],
) -> None:
    streamed, per_call = pair
    keys = text_keys(4, 2)
    cols = text_columns(keys)
    for c, name in ((streamed, "s"), (per_call, "p")):
        c.create_partition(name, TEXT, tasks=["train"], group_size=2)
        c.put(name, keys, cols)
    replies: dict[str, list[Any]] = {"s": [], "p": []}
    for c, name in ((streamed, "s"), (per_call, "p")):
        first = c.claim(name, "train", 2, timeout=TIMEOUT, as_="numpy")
        served = c.requests.served
        steps = [
            lambda c=c, b=first: c.nack(b, [b.keys[0]]),  # one row back: it is ready again
            lambda c=c, b=first: c.ack(b),  # the other acknowledged
            lambda c=c, name=name: c.reset(name, "train", keys[2:4]),
            lambda c=c, name=name: c.clear(name, keys[6:]),
            lambda c=c, name=name: c.clear(name, keys[5:], missing_ok=True),
        ]
        for step in steps:
            replies[name].append(step())
        taken = len(steps) if c is streamed else 0
        assert c.requests.served == served + taken
        replies[name].append(_progress(c, name))
    assert replies["s"] == replies["p"]
    assert replies["s"][:5] == [1, 1, 0, 2, 1]


def test_reads_of_rows_and_progress_take_the_stream_and_match_per_call(
    pair: tuple[flightq.Client, flightq.Client],
) -> None:
    streamed, per_call = pair
    keys = text_keys(3, 2)
    streamed.create_partition("r", TEXT, tasks=["train"], group_size=2, max_failures=1)
    streamed.put("r", keys, text_columns(keys), tags=[{"i": i} for i in range(len(keys))])
    b = streamed.claim("r", "train", 2, timeout=TIMEOUT, as_="numpy")
    streamed.nack(b, failed=True)  # its rows go to the dead letters
    reads = [
        lambda c: c.list_keys("r", keys),
        lambda c: c.list_keys("r", keys[2:4]),
        lambda c: c.inspect("r"),
        lambda c: c.describe("r"),
        lambda c: c.dead_letters("r", "train"),
        lambda c: c.stats()["partitions"]["r"],
    ]
    for read in reads:
        served = streamed.requests.served
        got = read(streamed)
        assert streamed.requests.served == served + 1
        assert got == read(per_call)
    assert streamed.dead_letters("r", "train")["keys"] == b.keys
    errors = [lambda c: c.list_keys("r", ["nope"]), lambda c: c.inspect("gone")]
    for case in errors:
        served = streamed.requests.served
        on_stream = error_of(lambda case=case: case(streamed))
        assert streamed.requests.served == served + 1
        assert on_stream == error_of(lambda case=case: case(per_call))
        assert on_stream[0] is NotFoundError


def test_a_read_whose_reply_exceeds_a_frame_is_asked_again_per_call(
    client: flightq.Client,
) -> None:
    n = 600
    keys = [f"t{i}" for i in range(n)]
    client.create_partition("wide", TEXT, tasks=["train"])
    tags = [{"note": "x" * 8000} for _ in range(n)]  # 4.8 MB of tags: more than a frame
    client.put("wide", keys, text_columns(keys), tags=tags)
    served = client.requests.served
    listed = client.list_keys("wide", keys)
    assert client.requests.served == served  # answered "retry": asked per call
    assert list(listed) == keys and listed[keys[-1]]["tags"] == tags[-1]
    assert list(client.list_keys("wide")) == keys  # every row: per call at once
    assert client.requests.served == served
    served = client.requests.served
    assert list(client.list_keys("wide", keys[:3])) == keys[:3]  # small: on the stream
    assert client.requests.served == served + 1


def test_action_errors_on_the_stream_match_per_call_and_change_nothing(
    pair: tuple[flightq.Client, flightq.Client],
) -> None:
    streamed, per_call = pair
    keys = text_keys(2, 2)
    streamed.create_partition("e", TEXT, tasks=["train"])
    streamed.put("e", keys, text_columns(keys))
    claim = streamed.claim("e", "train", 2, timeout=TIMEOUT, as_="numpy")
    before = _progress(streamed, "e")
    cases = [
        lambda c: c.clear("e", [keys[0], "nope"]),  # one unknown key: nothing removed
        lambda c: c.clear("gone", [keys[0]], missing_ok=True),  # the partition is unknown
        lambda c: c.reset("e", "nope"),
        lambda c: c.ack(claim, ["not-a-row-of-it"]),
        lambda c: c.nack(claim, [keys[3]]),  # a row of the partition, not of the claim
        lambda c: c.clear("gone", None),
    ]
    for case in cases:
        served = streamed.requests.served
        on_stream = error_of(lambda case=case: case(streamed))
        assert streamed.requests.served == served + 1, on_stream
        assert on_stream == error_of(lambda case=case: case(per_call))
    assert error_of(lambda: cases[0](streamed))[0] is NotFoundError
    assert _progress(streamed, "e") == before
    assert streamed.ack(claim) == 2  # the stream served on


def test_an_ack_of_a_claim_over_stream_ack_rows_goes_per_call(client: flightq.Client) -> None:
    n = STREAM_ACK_ROWS + 8
    keys = [f"k{i}" for i in range(n)]
    client.create_partition("big", TEXT, tasks=["train"])
    client.put("big", keys, text_columns(keys))
    claim = client.claim("big", "train", n, timeout=TIMEOUT, as_="numpy")
    served = client.requests.served
    assert client.ack(claim) == n
    assert client.requests.served == served
    small = client.claim  # a claim of a few rows: its ack takes the stream
    client.put("big", ["x0", "x1"], text_columns(["x0", "x1"]))
    few = small("big", "train", 2, timeout=TIMEOUT, as_="numpy")
    served = client.requests.served
    assert client.ack(few) == 2
    assert client.requests.served == served + 1


def test_a_late_ack_on_the_stream_names_the_rows_it_lost(client: flightq.Client) -> None:
    keys = text_keys(1, 3)
    client.create_partition("late", TEXT, tasks=["train"])
    client.put("late", keys, text_columns(keys))
    first = client.claim("late", "train", 3, timeout=TIMEOUT, lease=0.3, as_="numpy")
    time.sleep(0.5)
    again = client.claim("late", "train", 3, timeout=TIMEOUT, as_="numpy")
    served = client.requests.served
    with pytest.raises(LeaseExpiredError, match="0 rows were acknowledged") as info:
        client.ack(first)
    assert client.requests.served == served + 1
    assert info.value.actual == 3
    assert client.ack(again) == 3


def test_hostile_act_frames_are_refused_and_the_stream_serves_on(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("h", TEXT, tasks=["train"])
    client.put("h", ["k", "j"], text_columns(["k", "j"]))
    clear = Clear(partition="h", keys=["j"]).to_wire()
    hostile: list[tuple[bytes, type[FlightqError], str]] = [
        (raw_frame({"op": "act", "type": "drop", "cmd": b""}), ProtocolError, "goes per call"),
        (raw_frame({"op": "act", "type": "snapshot", "cmd": b""}), ProtocolError, "per call"),
        (raw_frame({"op": "act", "cmd": clear}), ProtocolError, "action None"),
        (raw_frame({"op": "act", "type": 7, "cmd": clear}), ProtocolError, "action 7"),
        (raw_frame({"op": "act", "type": "clear", "cmd": "text"}), ProtocolError, "must be bytes"),
        (raw_frame({"op": "act", "type": "clear", "cmd": b"\x93"}), ProtocolError, "clear"),
        (
            raw_frame({"op": "act", "type": "clear", "cmd": msgpack.packb({"partition": 5})}),
            ProtocolError,
            "partition",
        ),
        (
            raw_frame({"op": "act", "type": "ack", "cmd": Ack(partition="h", claim="x").to_wire()}),
            NotFoundError,
            "claim",
        ),
    ]
    c, writer, reader = open_stream(server.location)
    try:
        for frame, cls, match in hostile:
            answer = ask(writer, reader, frame)
            assert "error" in answer.header, (frame, answer.header)
            err = ErrorDetail.parse(answer.header["error"]).error()
            assert isinstance(err, cls), (frame, err)
            assert match in str(err), (frame, str(err))
        ok = ask(writer, reader, pack_frame({"op": "act", "type": "clear", "cmd": clear}))
        assert ClearReply.parse(ok.header["ok"]).cleared == 1
    finally:
        writer.close()
        c.close()
    assert list(client.list_keys("h")) == ["k"]
    assert set(STREAM_ACTIONS) == {"ack", "nack", "clear", "reset", *STREAM_READS}
    assert set(STREAM_READS) == {"list_keys", "inspect", "stats", "describe", "dead_letters"}


def test_an_ack_reply_larger_than_a_frame_is_answered_retry_after_it_ran(
    server: flightq.Server, client: flightq.Client
) -> None:
    """An ack a client sends on the stream against the rule (a claim past STREAM_ACK_ROWS,
    whose lost keys fill more than a frame): it ran, the answer says to ask per call, and
    acking again per call names the lost rows."""
    n = 4200
    keys = [f"{i:06d}".ljust(1000, "k") for i in range(n)]  # 1000-byte keys: 4.2 MB lost
    client.create_partition("wide", TEXT, tasks=["train"])
    client.put("wide", keys, text_columns(keys))
    ticket = ClaimTicket(partition="wide", task="train", batch_size=n, timeout=TIMEOUT, lease=0.3)
    reader = client.transport.connection().do_get(fl.Ticket(ticket.to_wire()))
    table = reader.read_all()
    grant = ClaimGrant.parse(table.schema.metadata[b"flightq.claim"])
    time.sleep(0.5)
    again = client.claim("wide", "train", n, timeout=TIMEOUT, as_="numpy")
    c, writer, stream = open_stream(server.location)
    try:
        ack = Ack(partition="wide", claim=grant.claim).to_wire()
        answer = ask(writer, stream, pack_frame({"op": "act", "type": "ack", "cmd": ack}))
        assert answer.header.get("retry", 0) > 4 << 20, answer.header
    finally:
        writer.close()
        c.close()
    reply = AckReply.parse(
        next(iter(client.transport.connection().do_action(fl.Action("ack", ack)))).body
    )
    assert reply.acked == 0 and len(reply.lost) == n
    assert client.ack(again) == n


def test_claims_of_one_partition_share_one_validation_plan(client: flightq.Client) -> None:
    """Each claim's grant rides in its schema's metadata; the client's validation memo
    keeps one plan for all of them, not one per claim (which filled it and cost every
    claim a search and trim of 256 plans)."""
    client.create_partition("plans", TEXT, tasks=["train"])
    keys = text_keys(1, 1)
    client.put("plans", keys, text_columns(keys))
    client.ack(client.claim("plans", "train", 1, timeout=TIMEOUT, as_="numpy"))
    held = validation._HELD["plans"]
    for i in range(40):
        k = [f"more{i}"]
        client.put("plans", k, text_columns(k))
        client.ack(client.claim("plans", "train", 1, timeout=TIMEOUT, as_="numpy"))
    assert validation._HELD["plans"] == held


def test_the_validation_memo_stays_within_its_caps_and_counts_what_it_holds() -> None:
    schema = flightq.SchemaRegistry.default().get(TEXT)
    keys = text_keys(1, 1)
    batch = flightq.encode(schema, text_columns(keys), keys)
    meta = dict(batch.schema.metadata)
    for i in range(validation._MAX_PLANS + 40):
        other = batch.replace_schema_metadata({**meta, b"x-extra": str(i).encode() * 50})
        validation.validate(other, schema)
    plans = [p for bucket in validation._PLANS.values() for p in bucket]
    assert validation._HELD["plans"] == len(plans) <= validation._MAX_PLANS
    assert validation._HELD["bytes"] == sum(validation._meta_bytes(p.arrow) for p in plans)
    assert validation._HELD["bytes"] <= validation._MAX_PLAN_BYTES


def test_a_put_frame_whose_media_claim_lies_is_refused_whole(
    server: flightq.Server, client: flightq.Client
) -> None:
    """A put on the stream claims a digest for its image that the image does not hash
    to: MediaDigestError, nothing stored, and the stream serves on."""
    vlm = "rollout_vlm@1"
    client.create_partition("lie", vlm, tasks=["train"])
    img = np.random.default_rng(3).standard_normal((8, 12), dtype=np.float32)
    cols = {
        "input_ids": [np.arange(5, dtype=np.int64)],
        "pixel_values": [[img]],
        "image_grid_thw": [[np.array([[1, 2, 4]], dtype=np.int64)]],
    }
    batch = flightq.encode(flightq.SchemaRegistry.default().get(vlm), cols, ["v0"])
    cmd = PutCommand(partition="lie", rows=1, timeout=5.0).to_wire()
    lie = pack_claims(HASH, {"pixel_values": [b"\x07" * DIGEST_BYTES]})
    c, writer, reader = open_stream(server.location)
    try:
        frame = pack_frame({"op": "put", "cmd": cmd, "claims": [lie]}, batch.schema, [batch])
        answer = ask(writer, reader, frame)
        err = ErrorDetail.parse(answer.header["error"]).error()
        assert isinstance(err, MediaDigestError), err
        assert server.store.partition("lie").nbytes == 0
        ok = ask(writer, reader, pack_frame({"op": "put", "cmd": cmd}, batch.schema, [batch]))
        assert "ok" in ok.header
    finally:
        writer.close()
        c.close()
    assert list(client.list_keys("lie")) == ["v0"]
