"""What travels besides record batches: tickets, descriptors, actions, and errors.

Every ticket, descriptor command and action body is a msgpack map; :func:`unpack` refuses
anything else with a :class:`ProtocolError` naming what was wrong. Errors raised on the
server travel in the Flight error's ``extra_info`` as ``{"type": ClassName, "message":
...}`` so the client raises the same flightq class with the same message; see
``docs/protocol.md`` for the full list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import pyarrow.flight as fl

from .errors import (
    ERROR_CLASSES,
    FlightqError,
    FlightqTimeoutError,
    ProtocolError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ACTIONS",
    "MAX_BODY",
    "pack",
    "unpack",
    "require",
    "to_flight_error",
    "from_flight_error",
]

PROTOCOL_VERSION = 1

#: Action types and what they do (DoAction). Bodies and results are msgpack maps.
ACTIONS: dict[str, str] = {
    "declare": "declare a partition: {partition, schema (JSON), tasks, group_size}",
    "check_schemas": "compare schema fingerprints: {schemas: [JSON, ...]}",
    "register_schema": "add a schema to the server's registry: {schema (JSON)}",
    "describe": "a partition's declaration: {partition}",
    "clear": "remove rows: {partition, keys (null: all)}",
    "reset": "make rows claimable again for a task: {partition, task, keys (null: all)}",
    "drop": "remove a partition and its rows: {partition}",
    "abort_put": "fail a put sent in parts, none stored: {partition, stage, parts}",
    "stats": "what the server holds: {}",
    "inspect": "one partition in detail: {partition}",
    "health": "liveness and version: {}",
    "snapshot": "write partitions to the snapshot directory: {name, partition (null: all)}",
}

#: Largest ticket, descriptor or action body accepted (bytes).
MAX_BODY = 64 * 2**20


def pack(obj: Mapping[str, Any]) -> bytes:
    """Serialise a control message."""
    return msgpack.packb(dict(obj), use_bin_type=True)


def unpack(data: bytes | memoryview | Any, what: str) -> dict[str, Any]:
    """Parse a control message, refusing anything that is not a msgpack map.

    Raises
    ------
    ProtocolError
        On random bytes, truncated msgpack, an oversized body or a non-map.
    """
    raw = data.to_pybytes() if hasattr(data, "to_pybytes") else bytes(data)
    if len(raw) > MAX_BODY:
        raise ProtocolError(f"{what}: body of {len(raw)} bytes exceeds {MAX_BODY}")
    try:
        obj = msgpack.unpackb(
            raw,
            raw=False,
            max_str_len=MAX_BODY,
            max_bin_len=MAX_BODY,
            max_array_len=10_000_000,
            max_map_len=1_000_000,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"{what}: not a valid msgpack map ({type(e).__name__}: {e})") from e
    except Exception as e:  # msgpack raises assorted errors on hostile input
        raise ProtocolError(f"{what}: not a valid msgpack map ({type(e).__name__})") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    return obj


def require(msg: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    """``msg[key]``, checked for presence and type.

    Raises
    ------
    ProtocolError
        If the key is missing or of the wrong type.
    """
    if key not in msg:
        raise ProtocolError(f"{what}: missing {key!r}")
    v = msg[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types)):
        raise ProtocolError(f"{what}: {key!r} has type {type(v).__name__}")
    return v


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def to_flight_error(e: FlightqError) -> fl.FlightError:
    """The Flight error that carries ``e`` to the client."""
    info = pack({"type": type(e).__name__, "message": str(e)})
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, FlightqTimeoutError):
        return fl.FlightTimedOutError(msg, extra_info=info)
    if isinstance(e, UnauthenticatedError):
        return fl.FlightUnauthenticatedError(msg, extra_info=info)
    if isinstance(e, ResourceExhaustedError):
        return fl.FlightUnavailableError(msg, extra_info=info)
    return fl.FlightServerError(msg, extra_info=info)


def from_flight_error(e: BaseException, where: str = "") -> FlightqError:
    """The flightq error a Flight (or Arrow) exception stands for."""
    info = getattr(e, "extra_info", None)
    if info:
        try:
            d = unpack(info, "error")
            cls = ERROR_CLASSES.get(str(d.get("type")), FlightqError)
            return cls(str(d.get("message", "")))
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
