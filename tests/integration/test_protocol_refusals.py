"""A malformed message from a plain Flight client is refused by name, and changes nothing.

Plain ``pyarrow.flight`` against ``flightq.Server()`` on loopback, messages built with
msgpack by hand as a client in another language would: a bool that is not a bool, an
unknown key (in a ticket, an action body, a put command), an integer where a bool is
expected, a negative timeout, too many parts. Each is a ``ProtocolError`` naming the
message and the key; nothing is stored, claimed or cleared; the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pyarrow.flight as fl
import pytest
from helpers_reliability import partition_state, plain_error, plain_put, put_command, text_batch

import flightq
from flightq.protocol import ACTIONS

pytestmark = pytest.mark.timeout(60)

TEXT = "rollout_text@1"


def _action(location: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    with fl.connect(location) as c:
        (res,) = list(c.do_action(fl.Action(kind, msgpack.packb(body))))
    return msgpack.unpackb(res.body.to_pybytes())


@pytest.fixture(name="location")
def location_fixture() -> Iterator[str]:
    """A server with partition 'p' (text, task 'train') holding rows k0 and k1."""
    with flightq.Server() as srv:
        schema = flightq.SchemaRegistry.default().get(TEXT).canonical_json
        _action(srv.location, "declare", {"partition": "p", "schema": schema, "tasks": ["train"]})
        assert plain_put(srv.location, put_command("p"), [text_batch(["k0", "k1"])]) == {"rows": 2}
        yield srv.location


def _claim(**extra: Any) -> bytes:
    ticket = {"op": "claim", "partition": "p", "task": "train", "batch_size": 2, "timeout": 5.0}
    return msgpack.packb({**ticket, **extra})


def _put(location: str, **extra: Any) -> None:
    plain_put(location, put_command("p", **extra), [text_batch(["n0", "n1"])])


def _get(location: str, ticket: bytes) -> None:
    with fl.connect(location) as c:
        c.do_get(fl.Ticket(ticket)).read_all()


def _do(location: str, kind: str, body: dict[str, Any]) -> None:
    _action(location, kind, body)


CASES = [
    (
        "overwrite-not-a-bool",
        lambda loc: _put(loc, overwrite="no"),
        r"put descriptor: 'overwrite' must be true or false, got str",
    ),
    (
        "unknown-key-in-a-put-command",
        lambda loc: _put(loc, overwite=True),
        r"put descriptor: unknown key 'overwite'; expected partition, overwrite, timeout, ",
    ),
    (
        "too-many-parts",
        lambda loc: _put(loc, stage="s", part=0, parts=99),
        r"put descriptor: expected an integer 'parts' in \[1, 16\], got 99",
    ),
    (
        "unknown-key-in-a-ticket",
        lambda loc: _get(
            loc, msgpack.packb({"op": "get", "partition": "p", "keys": ["k0"], "x": 1})
        ),
        r"get ticket: unknown key 'x'; expected partition, keys, fields, shm, op",
    ),
    (
        "batch-size-a-bool",
        lambda loc: _get(loc, _claim(batch_size=True)),
        r"claim ticket: 'batch_size' has type bool",
    ),
    (
        "negative-claim-timeout",
        lambda loc: _get(loc, _claim(timeout=-1.0)),
        r"claim ticket: 'timeout' must be a non-negative number, got -1\.0",
    ),
    (
        "unknown-key-in-an-action-body",
        lambda loc: _do(loc, "clear", {"partition": "p", "keys": None, "all": True}),
        r"clear: unknown key 'all'; expected partition, keys",
    ),
    (
        "clear-groups-not-a-range",
        lambda loc: _do(loc, "clear", {"partition": "p", "keys": ["k0"], "groups": [5, 3]}),
        r"clear: 'groups' must be \[first, end\], two integers with 0 <= first <= end; "
        r"got \[5, 3\]",
    ),
    (
        "unknown-key-in-a-reset",
        lambda loc: _do(loc, "reset", {"partition": "p", "task": "train", "key": ["k0"]}),
        r"reset: unknown key 'key'; expected partition, task, keys",
    ),
]


@pytest.mark.parametrize(("call", "cause"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_message_is_refused_by_key_and_changes_nothing(location, call, cause):
    before = partition_state(location, "p")
    with pytest.raises(fl.FlightServerError, match=f"ProtocolError: {cause}") as exc:
        call(location)
    kind, message = plain_error(exc.value)
    assert kind == "ProtocolError" and message.split(": ", 1)[0] in cause
    assert partition_state(location, "p") == before
    # The server serves on: a claim gets both rows (none was claimed or cleared above),
    # a put lands.
    with fl.connect(location) as c:
        got = c.do_get(fl.Ticket(_claim())).read_all()
    assert got.column("__key__").to_pylist() == ["k0", "k1"]
    assert plain_put(location, put_command("p"), [text_batch(["ok"])]) == {"rows": 1}


def test_an_empty_action_body_reads_as_an_empty_map(location):
    with fl.connect(location) as c:
        (res,) = list(c.do_action(fl.Action("stats", b"")))
    stats = msgpack.unpackb(res.body.to_pybytes())
    assert stats["rows"] == 2 and stats["partitions"]["p"]["delivered"] == {"train": 0}


def test_a_put_of_a_bool_overwrite_still_rewrites(location):
    # overwrite=true is the one spelling of "rewrite": the same rows again land.
    assert plain_put(location, put_command("p", overwrite=True), [text_batch(["k0"], 1)]) == {
        "rows": 1
    }


def test_list_actions_lists_every_action_with_its_doc():
    with flightq.Server() as srv, fl.connect(srv.location) as plain:
        listed = {a.type: a.description for a in plain.list_actions()}
    assert listed == {name: spec.doc for name, spec in ACTIONS.items()}
