"""Every message that travels besides record batches, defined once.

Tickets (DoGet), the put command (DoPut descriptor), each action's request and answer
(DoAction), the put acknowledgement and the error details are frozen types here, each
with ``to_wire()`` (the msgpack map's bytes) and ``parse()`` (bytes, or a map, to the
type). The client builds these types; the server parses them and dispatches actions
from :data:`ACTIONS`. ``docs/protocol.md`` documents the same fields, and a test holds
the two together.

``parse()`` refuses a bad message with a :class:`ProtocolError` naming the message and
the key: random bytes, truncated msgpack, a non-map, a missing key, an unknown key, a
value of the wrong type (a bool is never an integer, and only a bool is a bool), a
number out of range, a header claiming more items than follow. On the server, a message
whose bytes, or the Python objects they decode to, pass its ``max_request_bytes`` is a
:class:`ResourceExhaustedError`, refused before it is decoded (:mod:`flightq.msgcheck`).

Errors raised on the server travel in the Flight error's ``extra_info`` as an
:class:`ErrorDetail` (``{"type": ClassName, "message": ..., "field": ...}``), so the
client raises the same flightq class with the same message and attributes.

Examples
--------
>>> t = ClaimTicket(partition="rollouts", task="train", batch_size=16, timeout=30.0)
>>> parse_ticket(t.to_wire()) == t
True
>>> Clear.parse({"partition": "rollouts", "keys": None, "all": True})
Traceback (most recent call last):
...
flightq.errors.ProtocolError: clear: unknown key 'all'; expected partition, keys, put_id, groups
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import msgpack

from .errors import (
    ATTRIBUTES,
    ERROR_CLASSES,
    FlightqError,
    FlightqTimeoutError,
    ProtocolError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from .layout import META_CLAIM
from .msgcheck import decoded_bytes, quick_bound, request_bytes

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_BODY",
    "MAX_PUT_PARTS",
    "MAX_GET_PARTS",
    "MAX_SECONDS",
    "MAX_CLAIM_ROWS",
    "CLAIM_METADATA",
    "ClaimGrant",
    "Ack",
    "AckReply",
    "Nack",
    "CancelClaim",
    "CancelClaimReply",
    "NackReply",
    "DeadLetters",
    "DeadLettersReply",
    "MAX_ERROR_MESSAGE",
    "Message",
    "GetTicket",
    "ClaimTicket",
    "ScanTicket",
    "Ticket",
    "parse_ticket",
    "ShmRef",
    "PutCommand",
    "PutAck",
    "PutCreated",
    "SessionCommand",
    "RequestsCommand",
    "SessionReply",
    "SessionBeat",
    "MIN_SILENCE",
    "Health",
    "HealthReply",
    "CheckSchemas",
    "CheckSchemasReply",
    "RegisterSchema",
    "SchemaRef",
    "Declare",
    "DeclareReply",
    "Describe",
    "Declaration",
    "Clear",
    "ClearReply",
    "Reset",
    "ResetReply",
    "Drop",
    "DropReply",
    "AbortPut",
    "AbortPutReply",
    "Stats",
    "StatsReply",
    "ServerCounters",
    "PartitionStats",
    "Inspect",
    "ListKeys",
    "KeysReply",
    "Snapshot",
    "SnapshotReply",
    "ActionSpec",
    "ACTIONS",
    "ErrorDetail",
    "pack",
    "unpack",
    "to_flight_error",
    "from_flight_error",
    "cut_message",
]

PROTOCOL_VERSION = 2

#: Largest answer from its server a client parses (bytes). What a server takes is its
#: own cap, ``Server(max_request_bytes=...)`` (:mod:`flightq.msgcheck`).
MAX_BODY = 64 * 2**20
#: Most bytes of Python objects a message read without a caller's cap (a reply the client
#: reads) may decode to (:func:`flightq.msgcheck.decoded_bytes`).
MAX_DECODED = 2**30
#: Most ranges of a writer's memory one put through shared memory may name.
MAX_FILLS = 2**16
#: Most parallel DoPut streams one put may travel over.
MAX_PUT_PARTS = 16
#: Most parallel DoGet streams one get may be split over (``GetTicket.parts``).
MAX_GET_PARTS = 16
#: Largest finite seconds value a message may carry (one day); a claim may say ``inf``.
MAX_SECONDS = 86400.0
#: Shortest silence a consumer session may ask the server to end it after (seconds).
MIN_SILENCE = 0.5
#: Most rows one claim may ask for.
MAX_CLAIM_ROWS = 1 << 20
#: The key of a claim answer's schema metadata that carries its :class:`ClaimGrant`.
CLAIM_METADATA = META_CLAIM
#: Longest error message sent (UTF-8 bytes): the message travels twice in gRPC metadata
#: (about 8 KiB in all; percent-encoding triples non-ASCII), and under the limit its class
#: survives. A longer one is cut with ``... (N more bytes)``.
MAX_ERROR_MESSAGE = 1024

M = TypeVar("M", bound="Message")


def pack(obj: Mapping[str, Any]) -> bytes:
    """Serialise a control message (a map with string keys)."""
    return msgpack.packb(dict(obj), use_bin_type=True)


def unpack(data: bytes | memoryview | Any, what: str, limit: int | None = None) -> dict[str, Any]:
    """Parse a control message, refusing anything that is not a msgpack map.

    ``limit``: the receiving server's cap (``max_request_bytes``) on the message's bytes
    and on the Python objects they decode to, both checked before msgpack runs
    (:func:`flightq.msgcheck.request_bytes`); None (a client reading its server's
    answer): at most :data:`MAX_BODY` bytes.

    Raises
    ------
    ProtocolError
        On random bytes, truncated msgpack, an oversized body, a header claiming more
        items than follow, or a non-map.
    ResourceExhaustedError
        With ``limit``: the message, or what it decodes to, passes it.
    """
    if limit is not None:
        raw = request_bytes(data, what, limit)
    else:
        if hasattr(data, "to_pybytes"):
            raw = data.to_pybytes()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:  # bytes(n) of an int n would make n zero bytes; of a str, an untyped error
            raise ProtocolError(f"{what}: a msgpack body must be bytes, got {type(data).__name__}")
        if len(raw) > MAX_BODY:
            raise ProtocolError(f"{what}: body of {len(raw)} bytes exceeds {MAX_BODY}")
        # A reply a client reads: bounded by what it decodes to as well (60 MB of empty
        # maps would take 8 GB), at a cap no flightq server's reply comes near.
        if (
            quick_bound(raw, MAX_DECODED) is None
            and decoded_bytes(raw, what, MAX_DECODED) > MAX_DECODED
        ):
            raise ProtocolError(
                f"{what}: a body of {len(raw)} bytes that would decode to more than "
                f"{MAX_DECODED} bytes of Python objects; not a flightq server's reply"
            )
    n = len(raw)
    try:
        # Nothing in a body holds more items or bytes than the body has (each item takes
        # one byte at least): msgpack refuses any header claiming more, at once.
        obj = msgpack.unpackb(
            raw,
            raw=False,
            max_str_len=n,
            max_bin_len=n,
            max_ext_len=n,
            max_array_len=n,
            max_map_len=n // 2,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"{what}: not a valid msgpack map ({type(e).__name__}: {e})") from e
    except Exception as e:  # msgpack raises assorted errors on hostile input
        raise ProtocolError(f"{what}: not a valid msgpack map ({type(e).__name__})") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    return obj


# --------------------------------------------------------------------------- value checks

#: A check takes (value, key, message name) and returns the value, or raises ProtocolError.
Check = Callable[[Any, str, str], Any]


def _shown(v: Any, most: int = 64) -> str:
    """``repr(v)``, cut to about ``most`` characters: a refusal names what arrived without
    echoing (or keeping) megabytes of it."""
    if isinstance(v, (str, bytes, list, dict)) and len(v) > most:
        head = dict(itertools.islice(v.items(), 8)) if isinstance(v, dict) else v[:most]
        return f"{repr(head)[:most]}... (of length {len(v)})"
    r = repr(v)
    return r if len(r) <= most else f"{r[:most]}..."


def _type_error(v: Any, key: str, what: str) -> ProtocolError:
    return ProtocolError(f"{what}: {key!r} has type {type(v).__name__}")


def _str(max_len: int | None = None, nonempty: bool = False) -> Check:
    def check(v: Any, key: str, what: str) -> str:
        if not isinstance(v, str):
            raise _type_error(v, key, what)
        if nonempty and not v:
            raise ProtocolError(f"{what}: {key!r} must be a non-empty string")
        if max_len is not None and len(v) > max_len:
            raise ProtocolError(f"{what}: {key!r} must be a string of <= {max_len} chars")
        return v

    return check


def _int(lo: int | None = None, hi: int | None = None) -> Check:
    def check(v: Any, key: str, what: str) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _type_error(v, key, what)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ProtocolError(f"{what}: expected an integer {key!r} {bounds}, got {v}")
        return v

    return check


def _bytes(max_len: int) -> Check:
    def check(v: Any, key: str, what: str) -> bytes:
        if not isinstance(v, bytes):
            raise _type_error(v, key, what)
        if len(v) > max_len:
            raise ProtocolError(f"{what}: {key!r} must be at most {max_len} bytes")
        return v

    return check


def _seconds(inf: bool, positive: bool = False) -> Check:
    """Seconds: a number in [0, MAX_SECONDS] (above 0 when ``positive``), or (``inf``)
    infinity for no limit."""

    def check(v: Any, key: str, what: str) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise _type_error(v, key, what)
        if math.isnan(v):
            raise ProtocolError(f"{what}: {key!r} is NaN; give seconds (inf: no limit)")
        if v < 0 or (positive and v == 0):
            sign = "positive" if positive else "non-negative"
            raise ProtocolError(f"{what}: {key!r} must be a {sign} number, got {v}")
        if v > MAX_SECONDS and not (inf and math.isinf(v)):
            no_limit = " (inf: no limit)" if inf else ""
            raise ProtocolError(
                f"{what}: {key!r} must be at most {MAX_SECONDS:g} seconds{no_limit}, got {v:g}"
            )
        return float(v)

    return check


def _silence(v: Any, key: str, what: str) -> float:
    """A consumer session's silence: seconds in [MIN_SILENCE, MAX_SECONDS]."""
    got = _seconds(inf=False)(v, key, what)
    if got < MIN_SILENCE:
        raise ProtocolError(
            f"{what}: {key!r} must be at least {MIN_SILENCE:g} seconds, got {got:g}"
        )
    return got


def _bool(v: Any, key: str, what: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{what}: {key!r} must be true or false, got {type(v).__name__}")
    return v


def _strs(v: Any, key: str, what: str) -> list[str]:
    if not isinstance(v, list):
        raise _type_error(v, key, what)
    if set(map(type, v)) <= {str}:  # the common case in one pass; else find the item
        return v
    for i, x in enumerate(v):
        if not isinstance(x, str):
            raise ProtocolError(
                f"{what}: {key} must be strings, item {i} has type {type(x).__name__}"
            )
    return v


def _ints(v: Any, key: str, what: str) -> list[int]:
    if not isinstance(v, list):
        raise _type_error(v, key, what)
    if set(map(type, v)) <= {int}:  # the common case in one pass; else find the item
        return v
    for i, x in enumerate(v):
        if not isinstance(x, int) or isinstance(x, bool):
            raise ProtocolError(
                f"{what}: {key} must be integers, item {i} has type {type(x).__name__}"
            )
    return v


def _span(v: Any, key: str, what: str) -> list[int]:
    """``[first, end]``: a range of non-negative integers, ``first <= end``."""
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        or v[0] > v[1]
    ):
        raise ProtocolError(
            f"{what}: {key!r} must be [first, end], two integers with 0 <= first <= end; "
            f"got {_shown(v)}"
        )
    return v


def _map(v: Any, key: str, what: str) -> dict[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _type_error(v, key, what)
    return v


def _counts(v: Any, key: str, what: str) -> dict[str, int]:
    """A map of names to non-negative integers (rows per task, per field)."""
    d = _map(v, key, what)
    for k, n in d.items():
        _int(0)(n, f"{key}[{_shown(k)}]", what)
    return d


def _any(v: Any, key: str, what: str) -> Any:
    return v


def _const(value: str) -> Check:
    def check(v: Any, key: str, what: str) -> str:
        if v != value:
            raise ProtocolError(f"{what}: {key!r} must be {value!r}, got {_shown(v)}")
        return value

    return check


def _optional(inner: Check) -> Check:
    def check(v: Any, key: str, what: str) -> Any:
        return None if v is None else inner(v, key, what)

    return check


def _message(cls: type[Message]) -> Check:
    def check(v: Any, key: str, what: str) -> Any:
        return cls.parse(_map(v, key, what), f"{what}: {key!r}")

    return check


def _map_of(cls: type[Message]) -> Check:
    def check(v: Any, key: str, what: str) -> dict[str, Any]:
        d = _map(v, key, what)
        return {
            k: cls.parse(_map(x, f"{key}[{k!r}]", what), f"{what}: {key}[{k!r}]")
            for k, x in d.items()
        }

    return check


def _list_of(cls: type[Message]) -> Check:
    def check(v: Any, key: str, what: str) -> list[Any]:
        if not isinstance(v, list):
            raise _type_error(v, key, what)
        return [
            cls.parse(_map(x, f"{key}[{i}]", what), f"{what}: {key}[{i}]") for i, x in enumerate(v)
        ]

    return check


_REQUIRED = dataclasses.MISSING
_NO_OMIT = object()


def _field(check: Check, default: Any = _REQUIRED, *, omit: Any = _NO_OMIT) -> Any:
    """A message field: its check, its default (absent: required) and the value left off
    the wire (``omit``: the key is not sent when the field holds it)."""
    meta = {"check": check, "omit": omit}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# --------------------------------------------------------------------------- messages


class Message:
    """A control message: a frozen dataclass whose fields are the map's keys."""

    __slots__ = ()
    #: How errors name the message (``"claim ticket"``, ``"clear"``).
    WHAT: ClassVar[str] = "message"

    def to_dict(self) -> dict[str, Any]:
        """The message as the map that travels (nested messages as maps too)."""
        out: dict[str, Any] = {}
        for name, omit in _omits(type(self)):
            v = getattr(self, name)
            if omit is not _NO_OMIT and v == omit:
                continue
            out[name] = _plain(v)
        return out

    def to_wire(self) -> bytes:
        """The msgpack bytes of :meth:`to_dict`."""
        return pack(self.to_dict())

    @classmethod
    def wire_keys(cls) -> list[str]:
        """The map's keys, in order."""
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def parse(cls: type[M], data: Any, what: str | None = None, limit: int | None = None) -> M:
        """The message in ``data`` (msgpack bytes, a Flight buffer, or a map); ``limit``:
        the receiving server's cap on its bytes (:func:`unpack`).

        Raises
        ------
        ProtocolError
            Naming the message and the key at fault.
        ResourceExhaustedError
            The bytes, or what they decode to, pass ``limit``.
        """
        what = cls.WHAT if what is None else what
        d = data if isinstance(data, Mapping) else unpack(data, what, limit)
        fields, names = _fields(cls)
        unknown = [k for k in d if k not in names]
        if unknown:
            s = "s" if len(unknown) > 1 else ""
            listed = ", ".join(_shown(k) for k in unknown[:8])
            raise ProtocolError(
                f"{what}: unknown key{s} {listed}; expected {', '.join(cls.wire_keys())}"
            )
        kwargs: dict[str, Any] = {}
        for f in fields:
            if f.name in d:
                kwargs[f.name] = f.metadata["check"](d[f.name], f.name, what)
            elif f.default is _REQUIRED and f.default_factory is _REQUIRED:
                raise ProtocolError(f"{what}: missing {f.name!r}")
        return cls(**kwargs)


#: Per message class, its fields and their names; and each field's name with the value it
#: is left out at (``_NO_OMIT``: never). A class's fields never change: read once each.
_FIELDS: dict[type, tuple[tuple[dataclasses.Field[Any], ...], frozenset[str]]] = {}
_OMITS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], ...], frozenset[str]]:
    hit = _FIELDS.get(cls)
    if hit is None:
        fields = dataclasses.fields(cls)
        hit = _FIELDS[cls] = (fields, frozenset(f.name for f in fields))
    return hit


def _omits(cls: type) -> tuple[tuple[str, Any], ...]:
    hit = _OMITS.get(cls)
    if hit is None:
        fields = dataclasses.fields(cls)
        hit = _OMITS[cls] = tuple((f.name, f.metadata["omit"]) for f in fields)
    return hit


def _plain(v: Any) -> Any:
    if isinstance(v, Message):
        return v.to_dict()
    if isinstance(v, list):
        # A get's ticket lists every key: strings pass through without a call each.
        return [x if type(x) is str else _plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


_FROZEN = {"frozen": True, "slots": True}


# ---- DoGet tickets


@dataclasses.dataclass(**_FROZEN)
class GetTicket(Message):
    """Rows by key, in the order asked (a key may repeat), with ``fields`` (None: all).

    A get split over parallel streams sends every stream the same ticket but for its
    ``part`` of ``parts``: the server cuts the rows of all ``keys`` into ``parts`` runs of
    consecutive rows, alike for each stream, where rows stop sharing media (a prompt
    group's image travels on one stream), and answers run ``part``
    (:class:`flightq.server.assemble.PartCuts`)."""

    WHAT: ClassVar[str] = "get ticket"
    partition: str = _field(_str())
    keys: list[str] = _field(_strs)
    fields: list[str] | None = _field(_optional(_strs), None)
    #: Answer through shared memory (:mod:`flightq.shm`).
    shm: bool = _field(_bool, False, omit=False)
    op: str = _field(_const("get"), "get")
    part: int | None = _field(_optional(_int(0, MAX_GET_PARTS - 1)), None, omit=None)
    parts: int | None = _field(_optional(_int(2, MAX_GET_PARTS)), None, omit=None)
    #: Tags whose key starts with this prefix come back with their value left out (null),
    #: as :class:`ListKeys` can: large values a reader of other fields does not need.
    hide_tag_values: str | None = _field(_optional(_str(256, nonempty=True)), None, omit=None)

    def check_parts(self) -> None:
        """Raise :class:`ProtocolError` unless ``part`` and ``parts`` are both absent, or
        ``0 <= part < parts``."""
        if (self.part is None) != (self.parts is None) or (
            self.part is not None and self.parts is not None and self.part >= self.parts
        ):
            raise ProtocolError(
                f"get ticket: 'part' and 'parts' go together, with 0 <= part < parts <= "
                f"{MAX_GET_PARTS}; got part {self.part}, parts {self.parts}"
            )


@dataclasses.dataclass(**_FROZEN)
class ClaimTicket(Message):
    """The next ``batch_size`` ready rows for ``task``, waiting up to ``timeout`` seconds,
    leased for ``lease`` seconds (the partition's when None) or until ``session`` ends;
    ``call``, the caller's name for it, lets ``cancel_claim`` stop it while it waits."""

    WHAT: ClassVar[str] = "claim ticket"
    partition: str = _field(_str())
    task: str = _field(_str())
    batch_size: int = _field(_int(1, MAX_CLAIM_ROWS))
    timeout: float = _field(_seconds(inf=True))
    fields: list[str] | None = _field(_optional(_strs), None)
    wait_for: list[str] = _field(_strs, [])
    shm: bool = _field(_bool, False, omit=False)
    lease: float | None = _field(_optional(_seconds(inf=True, positive=True)), None, omit=None)
    session: str | None = _field(_optional(_str(64)), None, omit=None)
    call: str | None = _field(_optional(_str(64, nonempty=True)), None, omit=None)
    #: As :class:`GetTicket`'s: tags under this prefix come back with a null value.
    hide_tag_values: str | None = _field(_optional(_str(256, nonempty=True)), None, omit=None)
    op: str = _field(_const("claim"), "claim")


@dataclasses.dataclass(**_FROZEN)
class ClaimGrant(Message):
    """What a claim's answer says of its lease, in the answer schema's metadata
    (:data:`CLAIM_METADATA`): the claim's id (for ``ack``/``nack``), the lease's seconds,
    and per row, in the answer's order, how many times it has been delivered."""

    WHAT: ClassVar[str] = "claim grant"
    claim: str = _field(_str(64))
    lease: float = _field(_seconds(inf=True, positive=True))
    deliveries: list[int] = _field(_ints)


@dataclasses.dataclass(**_FROZEN)
class ScanTicket(Message):
    """Every row not yet cleared (the ticket of ``GetFlightInfo``'s endpoints)."""

    WHAT: ClassVar[str] = "scan ticket"
    partition: str = _field(_str())
    shm: bool = _field(_bool, False, omit=False)
    op: str = _field(_const("scan"), "scan")


Ticket = GetTicket | ClaimTicket | ScanTicket
_TICKETS: dict[str, type[Message]] = {"get": GetTicket, "claim": ClaimTicket, "scan": ScanTicket}


def parse_ticket(data: Any, limit: int | None = None) -> Ticket:
    """A DoGet ticket, by its ``op``; ``limit``: the server's cap (:func:`unpack`).

    Raises
    ------
    ProtocolError
        On a malformed ticket or an unknown ``op``.
    ResourceExhaustedError
        The ticket, or what it decodes to, passes ``limit``.
    """
    d = unpack(data, "ticket", limit)
    if "op" not in d:
        raise ProtocolError("ticket: missing 'op'")
    cls = _TICKETS.get(d["op"]) if isinstance(d["op"], str) else None
    if cls is None:
        raise ProtocolError(f"ticket: unknown op {d['op']!r}; expected get, claim or scan")
    return cls.parse(d)  # type: ignore[return-value]


# ---- DoPut


@dataclasses.dataclass(**_FROZEN)
class ShmRef(Message):
    """A shared-memory segment: its file, the generation written and the bytes used."""

    WHAT: ClassVar[str] = "shared-memory reference"
    path: str = _field(_str(4096))
    gen: int = _field(_int(0))
    nbytes: int = _field(_int(0))
    #: Direct reads (:mod:`flightq.shm.direct`): the writer's pid, and the ranges of its
    #: memory that fill the segment, as little-endian int64 (offset, address, length).
    pid: int | None = _field(_optional(_int(1, 2**22)), None, omit=None)
    fills: bytes | None = _field(_optional(_bytes(24 * MAX_FILLS)), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class PutCommand(Message):
    """The DoPut descriptor's command: where the stream's record batches go, and how."""

    WHAT: ClassVar[str] = "put descriptor"
    partition: str = _field(_str())
    overwrite: bool = _field(_bool, False)
    #: Seconds the server may wait for space under a memory budget.
    timeout: float = _field(_seconds(inf=False), 0.0)
    #: Rows the stream carries; a stream that ends with another count stores nothing.
    rows: int | None = _field(_optional(_int(0)), None, omit=None)
    #: Names the put, so a retry of it is acknowledged again without storing anything.
    put_id: str | None = _field(_optional(_str(256)), None, omit=None)
    #: A put in parts: every part carries the same ``stage``, its ``part`` and ``parts``.
    stage: str | None = _field(_optional(_str(64)), None, omit=None)
    part: int | None = _field(_optional(_int(0, MAX_PUT_PARTS - 1)), None, omit=None)
    parts: int | None = _field(_optional(_int(1, MAX_PUT_PARTS)), None, omit=None)
    #: The batches travel in this segment, not on the stream.
    shm: ShmRef | None = _field(_optional(_message(ShmRef)), None, omit=None)
    op: str = _field(_const("put"), "put")


@dataclasses.dataclass(**_FROZEN)
class SessionCommand(Message):
    """The DoExchange descriptor's command that opens a consumer session."""

    WHAT: ClassVar[str] = "session command"
    #: Seconds without a :class:`SessionBeat` after which the server ends the session
    #: as if its client had gone (a dead host, a cut link); None: the session ends only
    #: when its stream does. The server agrees in :class:`SessionReply`.
    silence: float | None = _field(_optional(_silence), None, omit=None)
    op: str = _field(_const("session"), "session")


@dataclasses.dataclass(**_FROZEN)
class SessionBeat(Message):
    """What a consumer session's client sends (as app metadata, no record batch) to say
    it is alive, when the server agreed to a silence."""

    WHAT: ClassVar[str] = "session beat"
    op: str = _field(_const("beat"), "beat")


@dataclasses.dataclass(**_FROZEN)
class RequestsCommand(Message):
    """The DoExchange descriptor's command that opens a request stream: small puts, gets
    and claims as frames (:mod:`flightq.frames`), each answered in turn."""

    WHAT: ClassVar[str] = "request stream command"
    op: str = _field(_const("requests"), "requests")


@dataclasses.dataclass(**_FROZEN)
class SessionReply(Message):
    """The session's first message (its app metadata): the id claims name it by."""

    WHAT: ClassVar[str] = "session reply"
    session: str = _field(_str(64))
    #: The silence the server ends the session after (the one asked for); None: it
    #: watches no beats (it has no idle watch running), and the client sends none.
    silence: float | None = _field(_optional(_silence), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class PutAck(Message):
    """The acknowledgement a put's DoPut stream carries once the rows are stored."""

    WHAT: ClassVar[str] = "put acknowledgement"
    rows: int = _field(_int(0))


@dataclasses.dataclass(**_FROZEN)
class PutCreated(Message):
    """What a put created, sent after its :class:`PutAck` (a second DoPut metadata
    message; ``"created"`` beside ``"ok"`` in a request stream's answer).

    A client that undoes the put (a sharded put rolling back a part) clears only these
    rows: a put acknowledged again as a replay created none, one that added columns to
    existing rows created none of those. A separate message, so that a client that reads
    only the acknowledgement (an older one) is not refused by a key it does not know; a
    server that sends none (an older one) leaves the client not knowing.
    """

    WHAT: ClassVar[str] = "put creation record"
    #: Rows the put created (0: a replay, or columns added to existing rows only).
    created: int = _field(_int(0))
    #: Acknowledged again as a retry of an earlier put (by put id or by content).
    replay: bool = _field(_bool, False, omit=False)
    #: ``[first, end]``: the creation numbers (a grouped partition's group numbers, else
    #: one per row) the server gave the rows it created; a ``clear`` naming them removes
    #: those rows and no other. None when it created none.
    groups: list[int] | None = _field(_optional(_span), None, omit=None)


# ---- DoAction: requests and answers


@dataclasses.dataclass(**_FROZEN)
class Health(Message):
    """Liveness; ``shm_probe`` names a file the client wrote, to prove a shared directory."""

    WHAT: ClassVar[str] = "health"
    shm_probe: str | None = _field(_optional(_str(4096)), None, omit=None)
    #: ``[pid, address]``: where the client keeps the probe's token, for the server to
    #: read back before it offers direct reads (:mod:`flightq.shm.direct`).
    shm_reader: list[int] | None = _field(_optional(_ints), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class HealthReply(Message):
    WHAT: ClassVar[str] = "health result"
    ok: bool = _field(_bool)
    protocol: int = _field(_int(0))
    partitions: int = _field(_int(0))
    #: ``{"dir": ..., "probe": hex or None}``; None: shared memory disabled.
    shm: dict[str, Any] | None = _field(_optional(_map), None)
    #: Longest tags a put may give one row, in msgpack bytes (None: not said, 65 536).
    max_tags_bytes: int | None = _field(_optional(_int(0)), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class CheckSchemas(Message):
    WHAT: ClassVar[str] = "check_schemas"
    #: Canonical JSON of each schema.
    schemas: list[str] = _field(_strs)


@dataclasses.dataclass(**_FROZEN)
class SchemaRef(Message):
    WHAT: ClassVar[str] = "schema reference"
    ref: str = _field(_str())
    fingerprint: str = _field(_str())


@dataclasses.dataclass(**_FROZEN)
class CheckSchemasReply(Message):
    WHAT: ClassVar[str] = "check_schemas result"
    schemas: list[SchemaRef] = _field(_list_of(SchemaRef))


@dataclasses.dataclass(**_FROZEN)
class RegisterSchema(Message):
    WHAT: ClassVar[str] = "register_schema"
    schema: str = _field(_str())


@dataclasses.dataclass(**_FROZEN)
class Declare(Message):
    WHAT: ClassVar[str] = "declare"
    partition: str = _field(_str())
    schema: str = _field(_str())
    tasks: list[str] | None = _field(_optional(_strs), None)
    group_size: int | None = _field(_optional(_int()), None)
    max_rows: int | None = _field(_optional(_int()), None)
    #: Seconds a claim's rows stay leased without an ack; None: 600.
    lease: float | None = _field(_optional(_seconds(inf=True, positive=True)), None)
    #: Failed deliveries after which a row goes to the dead letters; None: 3.
    max_failures: int | None = _field(_optional(_int(1, 1000)), None)


@dataclasses.dataclass(**_FROZEN)
class Declaration(Message):
    """A partition's declaration (the ``describe`` answer)."""

    WHAT: ClassVar[str] = "describe result"
    partition: str = _field(_str())
    schema: str = _field(_str())
    schema_ref: str = _field(_str())
    fingerprint: str = _field(_str())
    tasks: list[str] = _field(_strs)
    group_size: int | None = _field(_optional(_int()))
    max_rows: int | None = _field(_optional(_int()))
    lease: float = _field(_seconds(inf=True, positive=True))
    max_failures: int = _field(_int(1))


@dataclasses.dataclass(**_FROZEN)
class DeclareReply(Declaration):
    """The declaration, and whether this call created the partition."""

    WHAT: ClassVar[str] = "declare result"
    created: bool = _field(_bool)


@dataclasses.dataclass(**_FROZEN)
class Describe(Message):
    WHAT: ClassVar[str] = "describe"
    partition: str = _field(_str())


@dataclasses.dataclass(**_FROZEN)
class Clear(Message):
    WHAT: ClassVar[str] = "clear"
    partition: str = _field(_str())
    #: None: every row.
    keys: list[str] | None = _field(_optional(_strs), None)
    #: A put id the partition forgets with the rows, so that a retry of that put is
    #: stored again (a sharded put rolling back its part); None: none.
    put_id: str | None = _field(_optional(_str(256)), None, omit=None)
    #: ``[first, end]``: remove only rows whose creation number lies in ``[first, end)``
    #: (those one put created: its :class:`PutCreated`'s ``groups``), skipping keys not
    #: held; None: every row named.
    groups: list[int] | None = _field(_optional(_span), None, omit=None)
    #: Skip keys not held instead of refusing the clear (a key another process cleared
    #: meanwhile): the keys held go, the rest are left out of ``cleared``.
    missing_ok: bool = _field(_bool, False, omit=False)


@dataclasses.dataclass(**_FROZEN)
class ClearReply(Message):
    WHAT: ClassVar[str] = "clear result"
    cleared: int = _field(_int(0))


@dataclasses.dataclass(**_FROZEN)
class Reset(Message):
    WHAT: ClassVar[str] = "reset"
    partition: str = _field(_str())
    task: str = _field(_str())
    keys: list[str] | None = _field(_optional(_strs), None)


@dataclasses.dataclass(**_FROZEN)
class ResetReply(Message):
    WHAT: ClassVar[str] = "reset result"
    reset: int = _field(_int(0))


@dataclasses.dataclass(**_FROZEN)
class Ack(Message):
    """The consumer is done with rows of a claim (all of them when ``keys`` is None)."""

    WHAT: ClassVar[str] = "ack"
    partition: str = _field(_str())
    claim: str = _field(_str(64))
    keys: list[str] | None = _field(_optional(_strs), None)


@dataclasses.dataclass(**_FROZEN)
class AckReply(Message):
    WHAT: ClassVar[str] = "ack result"
    acked: int = _field(_int(0))
    #: Rows the claim had lost: its lease ended and another claim took them, or they
    #: went to the dead letters.
    lost: list[str] = _field(_strs, [])


@dataclasses.dataclass(**_FROZEN)
class Nack(Message):
    """Give rows of a claim back (all it holds when ``keys`` is None); ``failed`` counts a
    failed delivery of each."""

    WHAT: ClassVar[str] = "nack"
    partition: str = _field(_str())
    claim: str = _field(_str(64))
    keys: list[str] | None = _field(_optional(_strs), None)
    failed: bool = _field(_bool, False)


@dataclasses.dataclass(**_FROZEN)
class NackReply(Message):
    WHAT: ClassVar[str] = "nack result"
    released: int = _field(_int(0))
    dead: int = _field(_int(0), 0)


@dataclasses.dataclass(**_FROZEN)
class CancelClaim(Message):
    """Stop the claims that named themselves ``call`` (their ticket's ``call``) while they
    wait, those under consumer session ``session`` only where given: each takes no rows
    and fails ``ClaimCancelledError``. A claim not waiting yet is refused when it comes;
    one that took its rows already goes on (nack them)."""

    WHAT: ClassVar[str] = "cancel_claim"
    partition: str = _field(_str())
    call: str = _field(_str(64, nonempty=True))
    session: str | None = _field(_optional(_str(64)), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class CancelClaimReply(Message):
    WHAT: ClassVar[str] = "cancel_claim result"
    cancelled: int = _field(_int(0))


@dataclasses.dataclass(**_FROZEN)
class DeadLetters(Message):
    """The rows of a task given up on (failed deliveries reached ``max_failures``)."""

    WHAT: ClassVar[str] = "dead_letters"
    partition: str = _field(_str())
    task: str = _field(_str())
    limit: int = _field(_int(1, 100_000), 1000)


@dataclasses.dataclass(**_FROZEN)
class DeadLettersReply(Message):
    WHAT: ClassVar[str] = "dead_letters result"
    keys: list[str] = _field(_strs)
    #: Per key: ``"expired"`` (its lease ran out), ``"gone"`` (its consumer's session
    #: ended) or ``"failed"`` (a ``nack`` with ``failed``), the last failure's.
    why: list[str] = _field(_strs)
    deliveries: list[int] = _field(_ints)
    #: Dead rows in all (``keys`` holds the first ``limit``).
    total: int = _field(_int(0))


@dataclasses.dataclass(**_FROZEN)
class Drop(Message):
    WHAT: ClassVar[str] = "drop"
    partition: str = _field(_str())


@dataclasses.dataclass(**_FROZEN)
class DropReply(Message):
    WHAT: ClassVar[str] = "drop result"
    dropped: bool = _field(_bool)


@dataclasses.dataclass(**_FROZEN)
class AbortPut(Message):
    """Fail a put sent in parts: none of it is stored, its waiting parts stop waiting."""

    WHAT: ClassVar[str] = "abort_put"
    partition: str = _field(_str())
    stage: str = _field(_str(64))
    parts: int = _field(_int(1, MAX_PUT_PARTS))


@dataclasses.dataclass(**_FROZEN)
class AbortPutReply(Message):
    WHAT: ClassVar[str] = "abort_put result"
    aborted: bool = _field(_bool)


@dataclasses.dataclass(**_FROZEN)
class Stats(Message):
    WHAT: ClassVar[str] = "stats"


@dataclasses.dataclass(**_FROZEN)
class PartitionStats(Message):
    """One partition in ``stats`` (and, with ``fields`` and ``ready``, in ``inspect``)."""

    WHAT: ClassVar[str] = "partition stats"
    schema: str = _field(_str())
    fingerprint: str = _field(_str())
    tasks: list[str] = _field(_strs)
    group_size: int | None = _field(_optional(_int()))
    rows: int = _field(_int(0))
    #: Payload bytes as received (compressed where a codec applies).
    bytes: int = _field(_int(0))
    #: Rows delivered and not given back (leased or acknowledged), per task.
    delivered: dict[str, int] = _field(_counts)
    #: Rows acknowledged, per task.
    acked: dict[str, int] = _field(_counts, {})
    #: Rows under a claim's lease right now, per task.
    leased: dict[str, int] = _field(_counts, {})
    #: Rows in the dead letters, per task.
    dead: dict[str, int] = _field(_counts, {})
    #: Claims holding rows right now.
    claims: int = _field(_int(0), 0)
    #: Claims waiting for rows right now, per task.
    waiting: dict[str, int] = _field(_counts, {})
    #: Puts waiting for room (memory budget, row limit) right now.
    waiting_puts: int = _field(_int(0), 0)
    #: Parts of puts in parts that arrived and wait for the put's other parts right now.
    staged_parts: int = _field(_int(0), 0)
    #: Bytes the memory budget counts for the partition's stored rows (payload and the
    #: rest; flightq.server.budget).
    held: int = _field(_int(0), 0)
    #: ``inspect`` only: rows having each field.
    fields: dict[str, int] | None = _field(_optional(_counts), None, omit=None)
    #: ``inspect`` only: rows ready per task with the schema's required fields.
    ready: dict[str, int] | None = _field(_optional(_counts), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class ServerCounters(Message):
    """What a server has done since it started (``stats``; flightq.server.metrics)."""

    WHAT: ClassVar[str] = "server counters"
    puts: int = _field(_int(0))
    rows_put: int = _field(_int(0))
    bytes_received: int = _field(_int(0))
    gets: int = _field(_int(0))
    claims: int = _field(_int(0))
    scans: int = _field(_int(0))
    rows_sent: int = _field(_int(0))
    bytes_sent: int = _field(_int(0))
    actions: int = _field(_int(0))
    #: Per error class, the calls refused with it.
    refusals: dict[str, int] = _field(_counts)
    #: Connections cut because a stream on them waited on its client for idle_timeout.
    idle_cuts: int = _field(_int(0), 0)
    #: Media payload bytes hashed to resolve puts (references, look-alike payloads).
    media_hashed_bytes: int = _field(_int(0), 0)
    #: Put payload bytes read straight out of writers' memory (shared memory, direct).
    shm_direct_bytes: int = _field(_int(0), 0)
    #: Reads asked for through shared memory and answered over the socket instead: the
    #: answer had no room to wait for its reader (memory budget, or 4 GiB unread).
    shm_answers_declined: int = _field(_int(0), 0)
    #: Beats heard on consumer sessions, and those read late because they came faster
    #: than one per MIN_BEAT_GAP seconds on their session.
    beats: int = _field(_int(0), 0)
    beats_slowed: int = _field(_int(0), 0)
    #: Calls that ended with an error because their client had gone (a waiting claim
    #: whose consumer died or cancelled it): counted here, not among the refusals.
    cancelled: int = _field(_int(0), 0)


@dataclasses.dataclass(**_FROZEN)
class StatsReply(Message):
    WHAT: ClassVar[str] = "stats result"
    partitions: dict[str, PartitionStats] = _field(_map_of(PartitionStats))
    rows: int = _field(_int(0))
    bytes: int = _field(_int(0))
    #: Claims waiting for rows right now, over every partition.
    waiting_claims: int = _field(_int(0), 0)
    #: Bytes the memory budget counts now: every partition's ``held`` and the pieces of
    #: puts on their way in.
    held: int = _field(_int(0), 0)
    #: The server's counters; null from a server that keeps none.
    counters: ServerCounters | None = _field(_optional(_message(ServerCounters)), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class Inspect(Message):
    WHAT: ClassVar[str] = "inspect"
    partition: str = _field(_str())


def _rows_fields(v: Any, key: str, what: str) -> list[list[int]]:
    """Per row, the indices of the fields it has (into the reply's ``fields``)."""
    if not isinstance(v, list):
        raise _type_error(v, key, what)
    for i, row in enumerate(v):
        if not isinstance(row, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row
        ):
            raise ProtocolError(f"{what}: {key}[{i}] must be a list of field indices")
    return v


def _tag_maps(v: Any, key: str, what: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise _type_error(v, key, what)
    return [_map(x, f"{key}[{i}]", what) for i, x in enumerate(v)]


@dataclasses.dataclass(**_FROZEN)
class ListKeys(Message):
    """Rows' keys, tags and the fields each has, without their data."""

    WHAT: ClassVar[str] = "list_keys"
    partition: str = _field(_str())
    #: None: every row, in insertion order.
    keys: list[str] | None = _field(_optional(_strs), None)
    #: Tags whose key starts with this prefix come back with their value left out (null):
    #: their names alone (large values a listing does not need).
    hide_tag_values: str | None = _field(_optional(_str(256, nonempty=True)), None, omit=None)


@dataclasses.dataclass(**_FROZEN)
class KeysReply(Message):
    WHAT: ClassVar[str] = "list_keys result"
    keys: list[str] = _field(_strs)
    tags: list[dict[str, Any]] = _field(_tag_maps)
    #: The fields any of the rows has, in schema order.
    fields: list[str] = _field(_strs)
    #: Per row, the indices into ``fields`` of the fields it has.
    present: list[list[int]] = _field(_rows_fields)


@dataclasses.dataclass(**_FROZEN)
class Snapshot(Message):
    WHAT: ClassVar[str] = "snapshot"
    #: A plain name (no path) under the server's snapshot directory.
    name: str = _field(_str())
    #: None: every partition.
    partition: str | None = _field(_optional(_str()), None)


@dataclasses.dataclass(**_FROZEN)
class SnapshotReply(Message):
    WHAT: ClassVar[str] = "snapshot result"
    path: str = _field(_str())
    partitions: dict[str, int] = _field(_counts)


@dataclasses.dataclass(frozen=True)
class ActionSpec:
    """One DoAction type: what it does, its request and its answer."""

    doc: str
    request: type[Message]
    reply: type[Message]


#: Every action type (DoAction), as ``ListActions`` lists them.
ACTIONS: dict[str, ActionSpec] = {
    "declare": ActionSpec("declare a partition before any producer writes", Declare, DeclareReply),
    "check_schemas": ActionSpec(
        "compare schema fingerprints with the server's", CheckSchemas, CheckSchemasReply
    ),
    "register_schema": ActionSpec(
        "add a schema to the server's registry", RegisterSchema, SchemaRef
    ),
    "describe": ActionSpec("a partition's declaration", Describe, Declaration),
    "clear": ActionSpec("remove rows (keys null: all)", Clear, ClearReply),
    "reset": ActionSpec("make rows claimable again for a task (keys null: all)", Reset, ResetReply),
    "ack": ActionSpec("the consumer is done with rows of a claim", Ack, AckReply),
    "nack": ActionSpec("give rows of a claim back to be claimed again", Nack, NackReply),
    "cancel_claim": ActionSpec(
        "stop a waiting claim by the name its caller gave it", CancelClaim, CancelClaimReply
    ),
    "dead_letters": ActionSpec("the rows of a task given up on", DeadLetters, DeadLettersReply),
    "drop": ActionSpec("remove a partition and its rows", Drop, DropReply),
    "abort_put": ActionSpec("fail a put sent in parts, none stored", AbortPut, AbortPutReply),
    "stats": ActionSpec("rows, bytes and per-task progress of every partition", Stats, StatsReply),
    "inspect": ActionSpec("one partition in detail", Inspect, PartitionStats),
    "list_keys": ActionSpec("rows' keys, tags and fields, without data", ListKeys, KeysReply),
    "health": ActionSpec("liveness and protocol version", Health, HealthReply),
    "snapshot": ActionSpec("write partitions to the snapshot directory", Snapshot, SnapshotReply),
}


# --------------------------------------------------------------------------- errors


@dataclasses.dataclass(**_FROZEN)
class ErrorDetail(Message):
    """A flightq error as it travels in a Flight error's ``extra_info``."""

    WHAT: ClassVar[str] = "error"
    type: str = _field(_str())
    message: str = _field(_str())
    field: str | None = _field(_optional(_str()), None, omit=None)
    key: str | None = _field(_optional(_str()), None, omit=None)
    expected: Any = _field(_any, None, omit=None)
    actual: Any = _field(_any, None, omit=None)
    partition: str | None = _field(_optional(_str()), None, omit=None)
    retry: str | None = _field(_optional(_str(16)), None, omit=None)

    @classmethod
    def of(cls, e: FlightqError) -> ErrorDetail:
        """The detail of ``e``: its class name, message and structured attributes, each
        cut to a size that fits gRPC's metadata (see :func:`cut_message`)."""
        attrs = {a: _cut_value(v) for a, v in e.attributes().items() if _travels(v)}
        return cls(type=type(e).__name__, message=cut_message(str(e)), **attrs)

    def error(self) -> FlightqError:
        """The flightq error this detail stands for (an unknown type: FlightqError)."""
        cls = ERROR_CLASSES.get(self.type, FlightqError)
        attrs = {a: getattr(self, a) for a in ATTRIBUTES}
        return cls(self.message, **attrs)


def cut_message(text: str, limit: int = MAX_ERROR_MESSAGE) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes (at a character boundary), saying how much
    was left off: ``"... (N more bytes)"``.

    Examples
    --------
    >>> cut_message("x" * 5000, 20)
    'xxxxxxxxxxxxxxxxxxxx... (4980 more bytes)'
    """
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    head = raw[:limit].decode("utf-8", "ignore")
    return f"{head}... ({len(raw) - len(head.encode('utf-8', 'surrogatepass'))} more bytes)"


def _cut_value(v: Any) -> Any:
    """An attribute's value, small: strings cut, lists cut to their first items."""
    if isinstance(v, str):
        return cut_message(v, _MAX_ATTRIBUTE)
    if isinstance(v, (list, tuple)):
        items = [_cut_value(x) for x in v[:_MAX_ATTRIBUTE_ITEMS]]
        if len(v) > _MAX_ATTRIBUTE_ITEMS:
            items.append(f"... ({len(v) - _MAX_ATTRIBUTE_ITEMS} more)")
        return items
    return v


#: Longest string attribute (UTF-8 bytes) and most list items an error detail carries.
_MAX_ATTRIBUTE = 128
_MAX_ATTRIBUTE_ITEMS = 8


def _travels(v: Any) -> bool:
    """Whether an attribute's value is plain data msgpack carries as it is."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_travels(x) for x in v)
    return False


assert set(ATTRIBUTES) <= set(ErrorDetail.wire_keys())


def to_flight_error(e: FlightqError) -> Exception:
    """The Flight error that carries ``e`` to the client."""
    import pyarrow.flight as fl

    # Both the message and the detail travel in gRPC metadata (about 8 KiB in all): cut
    # long ones, since over the limit the error arrives without its class.
    detail = ErrorDetail.of(e)
    info = detail.to_wire()
    msg = f"{type(e).__name__}: {detail.message}"
    if isinstance(e, FlightqTimeoutError):
        return fl.FlightTimedOutError(msg, extra_info=info)
    if isinstance(e, UnauthenticatedError):
        return fl.FlightUnauthenticatedError(msg, extra_info=info)
    if isinstance(e, ResourceExhaustedError):
        return fl.FlightUnavailableError(msg, extra_info=info)
    return fl.FlightServerError(msg, extra_info=info)


def from_flight_error(e: BaseException, where: str = "") -> FlightqError:
    """The flightq error a Flight (or Arrow) exception stands for."""
    import pyarrow.flight as fl

    info = getattr(e, "extra_info", None)
    if info:
        try:
            return ErrorDetail.parse(info).error()
        except ProtocolError:
            pass
    text = str(e).split("\n")[0] or type(e).__name__
    prefix = f"{where}: " if where else ""
    if isinstance(e, fl.FlightTimedOutError):
        return FlightqTimeoutError(f"{prefix}timed out: {text}")
    if isinstance(e, fl.FlightUnauthenticatedError):
        return UnauthenticatedError(f"{prefix}{text}")
    if isinstance(e, fl.FlightUnavailableError):
        return UnavailableError(f"{prefix}server unavailable: {text}")
    if isinstance(e, fl.FlightCancelledError):
        return FlightqError(f"{prefix}cancelled: {text}")
    return FlightqError(f"{prefix}{type(e).__name__}: {text}")
