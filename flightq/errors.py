"""The flightq error tree.

Every error flightq raises derives from :class:`FlightqError` and also from the built-in
exception it resembles, so callers may catch either. Errors raised on a server reach the
client as the same class with the same message and the same attributes (see
:mod:`flightq.protocol`).

Where they apply, errors carry structured attributes beside the message, so a caller can
act on the fault without parsing text (drop the offending row, cast the column):

>>> from flightq.errors import DTypeError
>>> e = DTypeError("column 'x': expected int32", field="x", key="g0_1",
...                expected="int32", actual="int64")
>>> (e.field, e.key, e.expected, e.actual)
('x', 'g0_1', 'int32', 'int64')
>>> str(e)
"column 'x': expected int32"

An attribute that does not apply is ``None``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ATTRIBUTES",
    "RETRY_BUSY",
    "RETRY_FULL",
    "FlightqError",
    "SchemaError",
    "SchemaMismatchError",
    "EvolutionError",
    "UnknownSchemaError",
    "EncodeError",
    "DecodeError",
    "DTypeError",
    "ShapeError",
    "UndeclaredFieldError",
    "MissingFieldError",
    "ProtocolError",
    "NotFoundError",
    "MediaUnknownError",
    "MediaDigestError",
    "ConflictError",
    "LeaseExpiredError",
    "ClaimTimeoutError",
    "ClaimCancelledError",
    "WriterFullError",
    "FlightqTimeoutError",
    "UnavailableError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "DeviceError",
    "ERROR_CLASSES",
]


#: The structured attributes an error may carry (``None`` where one does not apply).
ATTRIBUTES = ("field", "key", "expected", "actual", "partition", "retry")

#: Values of :attr:`FlightqError.retry`: why the same call may pass later, unchanged.
RETRY_BUSY = "busy"  # other calls in flight hold the server's call slots or reply room
RETRY_FULL = "full"  # the memory budget or a row limit is reached: a consumer's clear frees room


class FlightqError(Exception):
    """Root of every error flightq raises.

    Parameters
    ----------
    message:
        What was expected, what arrived, where, and the fix when known.
    field:
        The column (schema field) at fault.
    key:
        The row key at fault (the first one, where several are).
    expected, actual:
        What the schema or the call wanted and what arrived (a dtype tag, a shape as a
        list, a count), as plain values that travel over the wire.
    partition:
        The partition the call was about.
    retry:
        Where the refusal lasts a while only and the same call may pass later, why:
        ``"busy"`` (other calls in flight hold the server's call slots, or its room for
        large replies), ``"full"`` (its memory budget or a partition's row limit is
        reached, and nothing was cleared within the call's wait); ``None`` where waiting
        changes nothing.
    """

    field: str | None
    key: str | None
    expected: Any
    actual: Any
    partition: str | None
    retry: str | None

    def __init__(
        self,
        *args: object,
        field: str | None = None,
        key: str | None = None,
        expected: Any = None,
        actual: Any = None,
        partition: str | None = None,
        retry: str | None = None,
    ) -> None:
        super().__init__(*args)
        self.field = field
        self.key = key
        self.expected = expected
        self.actual = actual
        self.partition = partition
        self.retry = retry

    def attributes(self) -> dict[str, Any]:
        """The structured attributes that are set (not ``None``)."""
        return {a: getattr(self, a) for a in ATTRIBUTES if getattr(self, a, None) is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (Ray, multiprocessing) with its attributes, which args alone would lose.
        return (_rebuild, (type(self), self.args, self.attributes()))


def _rebuild(cls: type[FlightqError], args: tuple[object, ...], attrs: dict[str, Any]) -> Any:
    return cls(*args, **attrs)


class SchemaError(FlightqError, ValueError):
    """A schema definition is invalid (bad field, bad dtype, bad shape)."""


class SchemaMismatchError(SchemaError):
    """Two parties disagree about a schema (fingerprints or field declarations differ)."""


class EvolutionError(SchemaError):
    """A schema version breaks the evolution rules of ``schemas/README.md``."""


class UnknownSchemaError(FlightqError, KeyError):
    """A schema name or version is not in the registry."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class EncodeError(FlightqError, ValueError):
    """Data cannot be encoded under its schema."""


class DTypeError(EncodeError, TypeError):
    """A tensor's dtype is not the one its field declares."""


class ShapeError(EncodeError):
    """A tensor's shape breaks its field's declaration or its byte length."""


class UndeclaredFieldError(EncodeError):
    """A column is not declared by the schema; flightq never drops or registers it."""


class MissingFieldError(EncodeError):
    """A required column, or a column asked for by name, is absent."""


class DecodeError(FlightqError, ValueError):
    """A record batch cannot be decoded (bad metadata, bad lengths, bad codec)."""


class ProtocolError(FlightqError, ValueError):
    """A ticket, action body or descriptor is malformed."""


class NotFoundError(FlightqError, KeyError):
    """An unknown partition, task or row key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MediaUnknownError(NotFoundError):
    """A put references media (digest and hint, no payload) that no payload its partition
    holds hashes to (cleared since, the server restarted, another shard, a look-alike
    under that hint). ``field`` names the column, ``actual`` lists the missing digests
    (hex, the first few). Nothing is stored; a flightq client sends the
    put again with the payloads."""


class MediaDigestError(DecodeError):
    """A media payload does not hash to the digest the writer claimed for it (or names a
    hash the server does not know). Nothing is stored."""


class ConflictError(FlightqError, ValueError):
    """A request conflicts with what is stored (existing column, different declaration)."""


class LeaseExpiredError(ConflictError):
    """An ``ack`` came too late for some rows: their claim's lease had ended and another
    claim took them (or they went to the dead letters), so they are delivered again.
    ``key`` names the first, ``actual`` counts them."""


class FlightqTimeoutError(FlightqError, TimeoutError):
    """A call did not finish within its timeout."""


class ClaimTimeoutError(FlightqTimeoutError):
    """Not enough rows became ready for a claim before its timeout."""


class ClaimCancelledError(FlightqError):
    """A waiting claim was stopped by its caller (``Client.cancel_claim`` naming its
    ``call_id``, an asyncio claim cancelled, or its client closed while it waited); it
    took no rows."""

    @classmethod
    def of(cls, partition: str, task: str | None = None) -> ClaimCancelledError:
        """The error of a claim from ``partition`` (for ``task``) its caller cancelled."""
        of = "" if task is None else f" for task {task!r}"
        return cls(
            f"claim from {partition!r}{of} was cancelled by its caller; no rows were taken",
            partition=partition,
        )


class WriterFullError(FlightqTimeoutError):
    """A :class:`flightq.Writer`'s queue stayed full for the whole timeout of a ``put``:
    the server takes puts more slowly than they come. Raised in the caller, never sent
    over the wire; nothing of that put was queued."""


class UnavailableError(FlightqError, ConnectionError):
    """The server cannot be reached."""


class ResourceExhaustedError(FlightqError, RuntimeError):
    """The server is full (memory budget or row limit) and no space freed in time, or a
    request passes one of its size limits (:mod:`flightq.server.budget`).

    Not a ``MemoryError``: this process has memory; the server refused to hold more.
    """

    @property
    def busy(self) -> bool:
        """Refused for want of call slots ("server busy", the server's ``max_calls``) or
        of room for a large reply: the call may go through once another ends
        (``retry == "busy"``)."""
        return self.retry == RETRY_BUSY

    @property
    def room_may_come(self) -> bool:
        """Refused for a while only: the server busy, or full (memory budget, row limit)
        with nothing cleared within the call's wait, where a consumer's clear makes room;
        not a request past a size limit, which no wait lifts (``retry`` is set)."""
        return self.retry is not None


class UnauthenticatedError(FlightqError, PermissionError):
    """The request carries no valid credentials."""


class DeviceError(FlightqError, RuntimeError):
    """A device cannot be used here: no CUDA, no torch, no such device, or a bad name."""


#: Wire name to class, for carrying errors from server to client (see protocol).
ERROR_CLASSES: dict[str, type[FlightqError]] = {
    cls.__name__: cls
    for cls in (
        FlightqError,
        SchemaError,
        SchemaMismatchError,
        EvolutionError,
        UnknownSchemaError,
        EncodeError,
        DTypeError,
        ShapeError,
        UndeclaredFieldError,
        MissingFieldError,
        DecodeError,
        ProtocolError,
        NotFoundError,
        MediaUnknownError,
        MediaDigestError,
        ConflictError,
        LeaseExpiredError,
        FlightqTimeoutError,
        ClaimTimeoutError,
        ClaimCancelledError,
        UnavailableError,
        ResourceExhaustedError,
        UnauthenticatedError,
        DeviceError,
    )
}
