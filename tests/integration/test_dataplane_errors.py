"""The connect-time schema check, and server errors reaching callers typed and unchanged."""

from __future__ import annotations

import dataclasses
import socket
import threading

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, client_fixture, server_fixture, text_columns  # noqa: F401

import flightq

pytestmark = pytest.mark.timeout(60)


def _drifted_vlm() -> flightq.Schema:
    """rollout_vlm@1 with imgs_sizes declared int64: same name, same version."""
    v = flightq.SchemaRegistry.default().get(VLM)
    fields = [
        dataclasses.replace(f, dtype="int64") if f.name == "imgs_sizes" else f for f in v.fields
    ]
    return flightq.Schema(v.name, v.version, fields, v.doc)


# --------------------------------------------------------------------------- schema check


def test_connect_fails_on_an_int64_versus_int32_drift_naming_field_and_dtypes(server):
    drift = _drifted_vlm()
    assert drift.ref == VLM
    with pytest.raises(
        flightq.SchemaMismatchError,
        match=r"startup schema check against grpc://127\.0\.0\.1:\d+ failed: your schema "
        r"rollout_vlm@1 \(fingerprint \w+\) differs from the server's \(\w+\): "
        r"field 'imgs_sizes': dtype yours 'int64', the server's 'int32'",
    ) as exc:
        flightq.connect(server.location, [drift], timeout=TIMEOUT)
    assert isinstance(exc.value, ValueError)
    assert "input_ids" not in str(exc.value)  # only the fields that differ


def test_connect_passes_for_the_schemas_the_server_holds(server):
    shipped = flightq.SchemaRegistry.default()
    with flightq.connect(server.location, [TEXT, shipped.get(VLM)], timeout=TIMEOUT) as c:
        assert c.health()["ok"] is True


def test_a_batch_encoded_under_a_drifted_schema_is_refused_at_write(client):
    client.create_partition("vlm", VLM)
    drift = _drifted_vlm()
    rb = flightq.encode(drift, {"input_ids": [np.arange(3)]}, ["k0"])
    with pytest.raises(
        flightq.SchemaMismatchError,
        match=r"batch carries schema rollout_vlm@1 .*dtype expected 'int32', actual 'int64'",
    ):
        client.put_batch("vlm", rb)
    assert client.stats()["partitions"]["vlm"]["rows"] == 0


def test_connect_fails_on_a_schema_name_unknown_here(server):
    with pytest.raises(flightq.UnknownSchemaError, match=r"unknown schema 'rollout_nope'"):
        flightq.connect(server.location, ["rollout_nope@1"], timeout=TIMEOUT)


def test_connect_fails_on_a_schema_the_server_does_not_know_until_registered(server):
    custom = flightq.Schema(
        "custom", 1, [flightq.Field("input_ids", "int64", "token", (None,), required=True)]
    )
    with pytest.raises(
        flightq.UnknownSchemaError,
        match=r"startup schema check against .* failed: unknown schema 'custom'; registered: "
        r"rollout_text, rollout_vlm, rollout_vlm_bf16",
    ):
        flightq.connect(server.location, [custom], timeout=TIMEOUT)
    with flightq.connect(server.location, timeout=TIMEOUT) as c:
        c.register_schema(custom)
    with flightq.connect(server.location, [custom], timeout=TIMEOUT) as c:
        c.create_partition("custom", custom)
        assert c.put("custom", ["a"], {"input_ids": [np.arange(2)]}) == 1


def test_connect_to_nothing_listening_is_unavailable(server):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(flightq.UnavailableError, match=r"server unavailable") as exc:
        flightq.connect(f"grpc://127.0.0.1:{port}", timeout=5)
    assert isinstance(exc.value, ConnectionError)


# --------------------------------------------------------------------------- typed errors


def _server_message(fn, *args) -> str:
    """The message the server's store raises for the same request."""
    with pytest.raises(flightq.FlightqError) as exc:
        fn(*args)
    return str(exc.value)


@pytest.mark.parametrize(
    ("call", "cls"),
    [
        (lambda c: c.get("nope", ["k"]), flightq.NotFoundError),
        (lambda c: c.claim("nope", "train", 1, as_="numpy", timeout=1), flightq.NotFoundError),
        (lambda c: c.inspect("nope"), flightq.NotFoundError),
        (lambda c: c.clear("nope"), flightq.NotFoundError),
        (lambda c: c.drop("nope"), flightq.NotFoundError),
        (lambda c: c.put("nope", ["k"], {"input_ids": [np.arange(2)]}), flightq.NotFoundError),
    ],
)
def test_an_unknown_partition_reaches_the_caller_as_the_servers_error(server, client, call, cls):
    want = _server_message(server.store.partition, "nope")
    with pytest.raises(cls) as exc:
        call(client)
    assert type(exc.value) is cls
    assert str(exc.value) == want
    assert not isinstance(exc.value, (pa.ArrowException, fl.FlightError))


def test_server_errors_keep_their_class_and_message(server, client):
    client.create_partition("p", TEXT, tasks=["train"], group_size=2)
    with pytest.raises(flightq.ConflictError) as exc:
        client.create_partition("p", TEXT, tasks=["train"], group_size=4)
    want = _server_message(
        server.store.declare, "p", flightq.SchemaRegistry.default().get(TEXT), ["train"], 4
    )
    assert str(exc.value) == want
    assert "group_size 2" in want and "group_size 4" in want
    # Declaring again with the same arguments is idempotent.
    assert client.create_partition("p", TEXT, tasks=["train"], group_size=2) is False


def test_a_claim_timeout_travels_as_a_timeout_on_the_wire_too(server, client):
    client.create_partition("p", TEXT, tasks=["train"])
    ticket = {
        "op": "claim",
        "partition": "p",
        "task": "train",
        "batch_size": 1,
        "fields": None,
        "timeout": 0.1,
    }
    with fl.connect(server.location) as plain, pytest.raises(fl.FlightTimedOutError) as exc:
        plain.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
    info = msgpack.unpackb(exc.value.extra_info)
    assert info["type"] == "ClaimTimeoutError"
    assert info["message"].startswith("claim of 1 rows for task 'train' from partition 'p'")


@pytest.mark.torch
@pytest.mark.parametrize(
    ("ticket", "cause"),
    [
        (b"\xc1 not msgpack", r"ticket: not a valid msgpack map"),
        (msgpack.packb([1, 2]), r"ticket: expected a msgpack map, got list"),
        (msgpack.packb({"partition": "p"}), r"ticket: missing 'op'"),
        (msgpack.packb({"op": "frob", "partition": "p"}), r"unknown op 'frob'"),
        (msgpack.packb({"op": "get", "partition": "p", "keys": [1]}), r"keys must be strings"),
        (
            msgpack.packb({"op": "claim", "partition": "p", "task": "t", "batch_size": 1}),
            r"claim ticket: missing 'timeout'",
        ),
        (
            msgpack.packb(
                {"op": "claim", "partition": "p", "task": "t", "batch_size": 1, "timeout": "1s"}
            ),
            r"claim ticket: 'timeout' has type str",
        ),
        (
            msgpack.packb(
                {"op": "claim", "partition": "p", "task": "t", "batch_size": 1, "timeout": 1}
            ),
            r"NotFoundError: partition 'p' declares no task 't'",
        ),
    ],
)
def test_a_malformed_ticket_from_a_plain_client_names_the_cause_and_the_server_serves_on(
    server, client, ticket, cause
):
    client.create_partition("p", TEXT, tasks=["train"])
    with fl.connect(server.location) as plain:
        with pytest.raises(fl.FlightServerError, match=cause) as exc:
            plain.do_get(fl.Ticket(ticket)).read_all()
        assert msgpack.unpackb(exc.value.extra_info)["type"] in ("ProtocolError", "NotFoundError")
        # The server keeps serving, plain and flightq clients alike.
        assert plain.get_flight_info(fl.FlightDescriptor.for_path("p")).total_records == 0
    assert client.put("p", ["k"], {"input_ids": [np.arange(3)]}) == 1
    assert client.get("p", ["k"]).keys == ["k"]


def test_a_nan_claim_timeout_is_refused_not_waited_on(server, client):
    client.create_partition("p", TEXT, tasks=["train"])
    ticket = {"op": "claim", "partition": "p", "task": "train", "batch_size": 1}
    ticket["timeout"] = float("nan")
    with (
        fl.connect(server.location) as plain,
        pytest.raises(fl.FlightServerError, match=r"ProtocolError: claim ticket: 'timeout' is NaN"),
    ):
        plain.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()


@pytest.mark.torch
def test_a_claim_with_no_time_limit_waits_for_rows(client):
    client.create_partition("p", TEXT, tasks=["train"])
    timer = threading.Timer(0.2, client.put, ("p", ["k"], {"input_ids": [np.arange(3)]}))
    timer.start()
    try:
        assert client.claim("p", "train", 1, timeout=float("inf")).keys == ["k"]
    finally:
        timer.join(TIMEOUT)


@pytest.mark.parametrize(
    ("kind", "body", "cause"),
    [
        ("frob", {}, r"ProtocolError: unknown action 'frob'"),
        ("describe", {}, r"ProtocolError: describe: missing 'partition'"),
        ("clear", {"partition": 5}, r"ProtocolError: clear: 'partition' has type int"),
        ("declare", {"partition": "x", "schema": "{"}, r"SchemaError"),
    ],
)
def test_a_malformed_action_from_a_plain_client_names_the_cause(server, kind, body, cause):
    with fl.connect(server.location) as plain:
        with pytest.raises(fl.FlightServerError, match=cause):
            list(plain.do_action(fl.Action(kind, msgpack.packb(body))))
        health = list(plain.do_action(fl.Action("health", b"")))
        assert msgpack.unpackb(health[0].body.to_pybytes())["ok"] is True


def test_a_put_with_a_path_descriptor_or_a_foreign_batch_is_refused(server, client):
    client.create_partition("p", TEXT)
    foreign = pa.record_batch([pa.array([1, 2])], names=["a"])
    cases = [
        (fl.FlightDescriptor.for_path("p"), r"put descriptor: expected a command descriptor"),
        (
            fl.FlightDescriptor.for_command(msgpack.packb({"op": "put", "partition": "p"})),
            r"DecodeError: not a flightq record batch: no 'flightq.schema'",
        ),
    ]
    with fl.connect(server.location) as plain:
        for descriptor, cause in cases:
            writer, reader = plain.do_put(descriptor, foreign.schema)
            with pytest.raises(fl.FlightServerError, match=cause):
                writer.write_batch(foreign)
                writer.done_writing()
                reader.read()
                writer.close()
    assert client.stats()["partitions"]["p"]["rows"] == 0
