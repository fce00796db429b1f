"""docs/protocol.md and flightq/protocol.py describe the same messages.

The test reads the doc's message tables (the put command's keys and the put creation
record's, the DoGet tickets, the DoAction bodies and results, a partition's stats ``P``,
the error detail, the error classes) and compares them with the protocol types: every
documented key exists with the same optionality, default, nullability and kind of type,
and every key of a type, every ticket op and every action is documented. It also holds
the action table (``protocol.ACTIONS``) and the server's handlers
(``server.actions.HANDLERS``) together, and checks that every message survives
``parse(to_wire(x))``. No server needed, except for ListActions.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import flightq
from flightq import protocol
from flightq.errors import ATTRIBUTES, ERROR_CLASSES, FlightqError, ProtocolError
from flightq.protocol import (
    ACTIONS,
    ClaimTicket,
    ErrorDetail,
    GetTicket,
    Message,
    PartitionStats,
    PutCommand,
    PutCreated,
    ScanTicket,
)
from flightq.server.actions import HANDLERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TICKETS: dict[str, type[Message]] = {"get": GetTicket, "claim": ClaimTicket, "scan": ScanTicket}


# --------------------------------------------------------------------------- reading the doc


def _sections(text: str) -> dict[str, str]:
    """The doc's ``## `` sections by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _tables(body: str) -> list[list[list[str]]]:
    """Every markdown table of a section: rows of cells, the header first, no rule line."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*body.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if not all(set(c) <= {"-", ":"} for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _table(doc: dict[str, str], section: str, header: list[str]) -> list[list[str]]:
    """The rows of the one table of ``section`` with this header."""
    found = [t[1:] for t in _tables(doc[section]) if t[0] == header]
    assert len(found) == 1, f"{section!r}: {len(found)} tables with header {header}"
    return found[0]


def _code(cell: str) -> str:
    """The cell's first code span."""
    m = re.search(r"`([^`]+)`", cell)
    assert m, f"no code span in {cell!r}"
    return m.group(1)


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` where no bracket, brace or string is open."""
    out, depth, start, quoted, i = [], 0, 0, False, 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "[{(":
            depth += 1
        elif not quoted and ch in "]})":
            depth -= 1
        elif not quoted and depth == 0 and text.startswith(sep, i):
            out.append(text[start:i])
            start = i + len(sep)
            i += len(sep)
            continue
        i += 1
    out.append(text[start:])
    return [s.strip() for s in out]


def _map_keys(spec: str) -> dict[str, str]:
    """``{"a": T, "b": U = d}`` as ``{"a": "T", "b": "U = d"}`` (top-level keys only)."""
    spec = spec.strip()
    assert spec.startswith("{") and spec.endswith("}"), f"not a map: {spec!r}"
    inner = spec[1:-1].strip()
    out: dict[str, str] = {}
    for item in _split_top(inner, ",") if inner else []:
        m = re.fullmatch(r'"(\w+)"\s*:\s*(.+)', item, flags=re.S)
        assert m, f"not a key: type entry: {item!r} in {spec!r}"
        out[m.group(1)] = m.group(2)
    return out


# --------------------------------------------------------------------------- comparing


def _fields(cls: type[Message]) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _kind_fits(doc: str, annotation: str) -> bool:
    """Whether a documented type (null stripped) is the kind of the field's annotation."""
    if doc.startswith('"'):
        return annotation == "str"
    if doc.startswith("["):
        return annotation.startswith("list[")
    if doc.startswith("{str:"):
        return annotation.startswith("dict[str,")
    if doc.startswith("{"):
        return annotation.startswith("dict[") or isinstance(_message_type(annotation), type)
    return {
        "str": "str",
        "int": "int",
        "float": "float",
        "bool": "bool",
        "bytes": "bytes",
        "any": "Any",
    }.get(doc) == annotation


def _message_type(annotation: str) -> type[Message] | None:
    t = getattr(protocol, annotation, None)
    return t if isinstance(t, type) and issubclass(t, Message) else None


def compare(cls: type[Message], documented: dict[str, str], where: str) -> list[str]:
    """The disagreements between a type's fields and its documented ``{key: type spec}``."""
    problems: list[str] = []
    fields = _fields(cls)
    for k in documented.keys() - fields.keys():
        problems.append(f"{where}: documented key {k!r} is not a field of {cls.__name__}")
    for k in fields.keys() - documented.keys():
        problems.append(f"{where}: {cls.__name__}.{k} is not documented")
    for k in documented.keys() & fields.keys():
        f, parts = fields[k], _split_top(documented[k], "=")
        doc_type, doc_default = parts[0], (parts[1] if len(parts) > 1 else None)
        annotation = str(f.type)
        alternatives = _split_top(doc_type, "|")
        nullable = "null" in alternatives
        base = " | ".join(a for a in alternatives if a != "null")
        if nullable != annotation.endswith("| None"):
            problems.append(f"{where}: {k!r} is {doc_type} here, {annotation} in the code")
        annotation = annotation.removesuffix(" | None")
        if not _kind_fits(base, annotation):
            problems.append(f"{where}: {k!r} is {doc_type} here, {annotation} in the code")
        default = _default(f)
        if k == "op":  # a constant: the documented literal is the op's value
            if not _same(json.loads(base), default):
                problems.append(f"{where}: 'op' is {base} here, {default!r} in the code")
        elif doc_default is None and default is not dataclasses.MISSING:
            problems.append(f"{where}: {k!r} has a default ({default!r}) the doc does not show")
        elif doc_default is not None and default is dataclasses.MISSING:
            problems.append(f"{where}: {k!r} is required, the doc gives it a default")
        elif doc_default is not None and not _same(json.loads(doc_default), default):
            problems.append(f"{where}: {k!r} defaults to {doc_default} here, {default!r}")
        # A nested message documented as a map: its keys too.
        inner_spec = base[1:-1] if base.startswith("[{") else base
        inner_ann = annotation[5:-1] if annotation.startswith("list[") else annotation
        inner = _message_type(inner_ann)
        if inner is not None and inner_spec.startswith('{"'):
            problems += compare(inner, _map_keys(inner_spec), f"{where}: {k!r}")
    return problems


def _key_table(rows: list[list[str]]) -> dict[str, str]:
    """A ``| key | type | meaning |`` table as ``{key: type spec}``."""
    return {_code(r[0]): _code(r[1]) for r in rows}


def contract_problems(text: str) -> list[str]:
    """Every disagreement between ``text`` (docs/protocol.md) and the protocol types."""
    doc = _sections(text)
    problems: list[str] = []

    put = _table(doc, "DoPut: writing rows", ["key", "type", "meaning"])
    problems += compare(PutCommand, _key_table(put), "put command")
    created = _table(doc, "DoPut: writing rows", ["key", "type", "what it says"])
    problems += compare(PutCreated, _key_table(created), "put creation record")

    tickets = _table(doc, "DoGet: reading rows", ["op", "ticket", "what comes back"])
    ops = {_code(r[0]): _map_keys(_code(r[1])) for r in tickets}
    for op in ops.keys() ^ TICKETS.keys():
        problems.append(f"ticket op {op!r} is in only one of the doc and the code")
    for op in ops.keys() & TICKETS.keys():
        problems += compare(TICKETS[op], ops[op], f"{op} ticket")

    section = "DoAction: control"
    p_rows = _key_table(_table(doc, section, ["key", "type", "meaning"]))
    problems += compare(PartitionStats, p_rows, "P")
    actions = {
        _code(r[0]): (_code(r[1]), _code(r[2]))
        for r in _table(doc, section, ["type", "body", "result"])
    }
    for name in actions.keys() ^ ACTIONS.keys():
        problems.append(f"action {name!r} is in only one of the doc and protocol.ACTIONS")
    for name in actions.keys() & ACTIONS.keys():
        body, result = actions[name]
        spec = ACTIONS[name]
        problems += compare(spec.request, _map_keys(body), f"{name} body")
        if result == "P":
            if spec.reply is not PartitionStats:
                problems.append(f"{name} result: P here, {spec.reply.__name__} in the code")
        else:
            problems += compare(spec.reply, _map_keys(result), f"{name} result")

    errors = "How errors travel"
    detail = _key_table(_table(doc, errors, ["key", "type", "meaning"]))
    problems += compare(ErrorDetail, detail, "error detail")
    problems += [f"error attribute {a!r} is not documented" for a in ATTRIBUTES if a not in detail]
    classes = {_code(r[0]): r[1] for r in _table(doc, errors, ["class", "also a", "meaning"])}
    for name in classes.keys() ^ ERROR_CLASSES.keys():
        problems.append(f"error class {name!r} is in only one of the doc and ERROR_CLASSES")
    for name in classes.keys() & ERROR_CLASSES.keys():
        bases = [b.__name__ for b in ERROR_CLASSES[name].__bases__ if b is not FlightqError]
        if re.findall(r"`(\w+)`", classes[name]) != bases:
            problems.append(f"error class {name!r}: also a {classes[name]} here, {bases} in code")
    return problems


# --------------------------------------------------------------------------- the contract


def test_the_protocol_doc_and_the_protocol_types_agree():
    assert contract_problems(DOC.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        # A key the doc lists that no type has.
        (
            "| `timeout` | `float = 0` |",
            "| `deadline` | `float = 0` |",
            "put command: documented key 'deadline' is not a field of PutCommand",
        ),
        ('"wait_for": [str] = [], ', "", "claim ticket: ClaimTicket.wait_for is not documented"),
        ('| `inspect` | `{"partition": str}` | `P` |\n', "", "action 'inspect' is in only one"),
        (
            '"put_id": str \\| null = null, "groups"',
            '"put_id": str \\| null, "groups"',
            "clear body: 'put_id' has a default (None) the doc does not show",
        ),
        (
            "| `waiting` | `{str: int} = {}` |",
            "| `waiting` | `{str: int}` |",
            "P: 'waiting' has a default ({}) the doc does not show",
        ),
        ('`"put" = "put"`', '`"get" = "get"`', "put command: 'op' is \"get\" here"),
        (
            '"nbytes": int, "pid"',
            '"size": int, "pid"',
            "put command: 'shm': ShmRef.nbytes is not documented",
        ),
        (
            "| `partition` | `str \\| null = null` | the partition the call",
            "| `partition` | `str = null` | the partition the call",
            "error detail: 'partition' is str here, str | None in the code",
        ),
        (
            "| `ResourceExhaustedError` | `RuntimeError` |",
            "| `ResourceExhaustedError` | `MemoryError` |",
            "error class 'ResourceExhaustedError'",
        ),
    ],
)
def test_the_contract_check_fails_on_a_drifted_doc(old, new, problem):
    text = DOC.read_text()
    assert text.count(old) == 1, old
    problems = contract_problems(text.replace(old, new))
    assert any(problem in p for p in problems), problems


def test_every_action_has_one_handler():
    assert HANDLERS.keys() == ACTIONS.keys()


# --------------------------------------------------------------------------- round trips

_REF = protocol.ShmRef(path="/dev/shm/flightq-1-abcdef01-0", gen=3, nbytes=4096)
_P = PartitionStats(
    schema="rollout_text@1",
    fingerprint="0123456789abcdef",
    tasks=["train", "ref"],
    group_size=4,
    rows=8,
    bytes=1024,
    delivered={"train": 4, "ref": 0},
    acked={"train": 2, "ref": 0},
    leased={"train": 2, "ref": 0},
    dead={"train": 1, "ref": 0},
    claims=1,
    waiting={"train": 1},
)
_DECLARATION = {
    "partition": "p",
    "schema": '{"name":"s"}',
    "schema_ref": "s@1",
    "fingerprint": "0123456789abcdef",
    "tasks": ["train"],
    "group_size": None,
    "max_rows": 100,
    "lease": 600.0,
    "max_failures": 3,
}

#: One example or more of every message, with values other than the defaults.
EXAMPLES: list[Message] = [
    GetTicket(partition="p", keys=["k0", "k0", "k1"], fields=["input_ids"], shm=True),
    GetTicket(partition="p", keys=[]),
    GetTicket(partition="p", keys=["k0"], hide_tag_values="big:"),
    ClaimTicket(partition="p", task="t", batch_size=1, timeout=0.0, hide_tag_values="big:"),
    ClaimTicket(partition="p", task="train", batch_size=16, timeout=float("inf"), wait_for=["x"]),
    ClaimTicket(partition="p", task="t", batch_size=1, timeout=0.5, fields=[], shm=True),
    ClaimTicket(
        partition="p", task="t", batch_size=2, timeout=1.0, lease=float("inf"), session="s1"
    ),
    ClaimTicket(partition="p", task="t", batch_size=1, timeout=1.0, call="c" * 64),
    protocol.ClaimGrant(claim="c1", lease=30.0, deliveries=[1, 2]),
    protocol.SessionCommand(),
    protocol.SessionCommand(silence=15.0),
    protocol.RequestsCommand(),
    protocol.SessionReply(session="s1"),
    protocol.SessionReply(session="s1", silence=0.5),
    protocol.SessionBeat(),
    protocol.Ack(partition="p", claim="c1", keys=["k0"]),
    protocol.Ack(partition="p", claim="c1"),
    protocol.AckReply(acked=2, lost=["k1"]),
    protocol.Nack(partition="p", claim="c1", keys=["k0"], failed=True),
    protocol.NackReply(released=1, dead=1),
    protocol.CancelClaim(partition="p", call="9f1c"),
    protocol.CancelClaimReply(cancelled=1),
    protocol.DeadLetters(partition="p", task="train", limit=10),
    protocol.DeadLettersReply(keys=["k0"], why=["failed"], deliveries=[3], total=1),
    ScanTicket(partition="p"),
    ScanTicket(partition="p", shm=True),
    _REF,
    protocol.ShmRef(
        path="/dev/shm/flightq-1-abcdef01-0",
        gen=3,
        nbytes=4096,
        pid=4242,
        fills=np.array([[64, 0x7F0000001000, 512]], dtype="<i8").tobytes(),
    ),
    protocol.Health(shm_probe="/dev/shm/flightq-1-abcdef01-0", shm_reader=[4242, 0x7F0000002000]),
    PutCommand(partition="p"),
    PutCommand(
        partition="p",
        overwrite=True,
        timeout=2.5,
        rows=10,
        put_id="id-1",
        stage="s",
        part=1,
        parts=2,
        shm=_REF,
    ),
    protocol.PutAck(rows=7),
    protocol.PutCreated(created=4, groups=[3, 5]),
    protocol.PutCreated(created=0, replay=True),
    protocol.Health(),
    protocol.Health(shm_probe="/dev/shm/flightq-probe"),
    protocol.HealthReply(ok=True, protocol=1, partitions=2, shm={"dir": "/dev/shm", "probe": None}),
    protocol.CheckSchemas(schemas=['{"name":"s"}']),
    protocol.SchemaRef(ref="s@1", fingerprint="0123456789abcdef"),
    protocol.CheckSchemasReply(schemas=[protocol.SchemaRef(ref="s@1", fingerprint="ab")]),
    protocol.RegisterSchema(schema='{"name":"s"}'),
    protocol.Declare(
        partition="p",
        schema="{}",
        tasks=["a", "b"],
        group_size=4,
        max_rows=8,
        lease=30.0,
        max_failures=5,
    ),
    protocol.Declare(partition="p", schema="{}"),
    protocol.DeclareReply(created=True, **_DECLARATION),
    protocol.Describe(partition="p"),
    protocol.Declaration(**_DECLARATION),
    protocol.Clear(partition="p", keys=["k0"]),
    protocol.Clear(partition="p"),
    protocol.Clear(partition="p", keys=["k0", "k1"], put_id="x", groups=[3, 5]),
    protocol.ClearReply(cleared=3),
    protocol.Reset(partition="p", task="train", keys=None),
    protocol.ResetReply(reset=2),
    protocol.Drop(partition="p"),
    protocol.DropReply(dropped=True),
    protocol.AbortPut(partition="p", stage="s", parts=3),
    protocol.AbortPutReply(aborted=True),
    protocol.Stats(),
    protocol.StatsReply(partitions={"p": _P}, rows=8, bytes=1024, waiting_claims=1),
    protocol.ServerCounters(
        puts=0,
        rows_put=0,
        bytes_received=0,
        gets=0,
        claims=0,
        scans=0,
        rows_sent=0,
        bytes_sent=0,
        actions=0,
        refusals={},
    ),
    protocol.StatsReply(
        partitions={},
        rows=0,
        bytes=0,
        counters=protocol.ServerCounters(
            puts=1,
            rows_put=8,
            bytes_received=4096,
            gets=2,
            claims=1,
            scans=0,
            rows_sent=16,
            bytes_sent=8192,
            actions=5,
            refusals={"NotFoundError": 1},
        ),
    ),
    _P,
    dataclasses.replace(_P, fields={"input_ids": 8}, ready={"train": 4}),
    protocol.Inspect(partition="p"),
    protocol.ListKeys(partition="p"),
    protocol.ListKeys(partition="p", keys=["k0"]),
    protocol.ListKeys(partition="p", hide_tag_values="big:"),
    protocol.KeysReply(
        keys=["k0", "k1"], tags=[{"v": 1}, {}], fields=["input_ids"], present=[[0], []]
    ),
    protocol.Snapshot(name="step-7", partition="p"),
    protocol.Snapshot(name="step-7"),
    protocol.SnapshotReply(path="/snap/step-7", partitions={"p": 8}),
    ErrorDetail(type="ProtocolError", message="m"),
    ErrorDetail(
        type="ShapeError",
        message="m",
        field="input_ids",
        key="g7_3",
        expected=[4, 3],
        actual=[4, 2],
        partition="p",
    ),
    ErrorDetail(type="ResourceExhaustedError", message="m", retry="full"),
]


def test_the_examples_cover_every_message_type():
    exported = [getattr(protocol, n) for n in protocol.__all__]
    types = {t for t in exported if isinstance(t, type) and issubclass(t, Message)} - {Message}
    assert types == {type(x) for x in EXAMPLES}


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
def test_every_message_survives_its_wire_form(message):
    wire = message.to_wire()
    assert type(message).parse(wire) == message
    # The map that travels is plain msgpack: any client reads it, and it parses back.
    assert type(message).parse(msgpack.unpackb(wire, raw=False)) == message
    if isinstance(message, (GetTicket, ClaimTicket, ScanTicket)):
        assert protocol.parse_ticket(wire) == message


def test_an_error_detail_brings_back_the_same_error():
    e = flightq.ShapeError("bad", field="f", key="k", expected=[2], actual=[3], partition="p")
    back = ErrorDetail.parse(ErrorDetail.of(e).to_wire()).error()
    assert type(back) is flightq.ShapeError and str(back) == "bad"
    assert back.attributes() == e.attributes()


def test_whether_a_refusal_may_pass_later_travels_typed_not_read_from_its_message():
    def back(e: flightq.FlightqError) -> flightq.FlightqError:
        return ErrorDetail.parse(ErrorDetail.of(e).to_wire()).error()

    busy = back(flightq.ResourceExhaustedError("any words", retry="busy"))
    assert busy.retry == "busy" and busy.busy and busy.room_may_come
    full = back(flightq.ResourceExhaustedError("any words", retry="full"))
    assert full.retry == "full" and full.room_may_come and not full.busy
    # The words of a message decide nothing.
    worded = back(flightq.ResourceExhaustedError("server busy; no rows were cleared within 1s"))
    assert worded.retry is None and not worded.room_may_come and not worded.busy
    assert "retry" not in msgpack.unpackb(ErrorDetail.of(worded).to_wire())  # omitted
    with pytest.raises(ProtocolError, match="retry"):
        ErrorDetail.parse({"type": "ResourceExhaustedError", "message": "m", "retry": "x" * 17})
    # Pickled (Ray, multiprocessing) with it.
    assert pickle.loads(pickle.dumps(full)).retry == "full"


@pytest.mark.parametrize(
    ("message", "body", "key"),
    [
        (protocol.ClaimGrant, {"claim": "c", "lease": 1.0, "deliveries": ["1", "2"]}, "deliveries"),
        (protocol.Health, {"shm_reader": ["123", "456"]}, "shm_reader"),
    ],
)
def test_a_list_of_integers_refuses_strings_naming_the_first(message, body, key):
    with pytest.raises(ProtocolError, match=rf"{key} must be integers, item 0 has type str"):
        message.parse(body)
    good = {**body, key: [1, 2]}
    assert getattr(message.parse(good), key) == [1, 2]
