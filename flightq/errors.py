"""The flightq error tree.

Every error flightq raises derives from :class:`FlightqError` and also from the built-in
exception it resembles, so callers may catch either. Errors raised on a server reach the
client as the same class with the same message (see :mod:`flightq.protocol`).
"""

from __future__ import annotations

__all__ = [
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
    "ConflictError",
    "ClaimTimeoutError",
    "FlightqTimeoutError",
    "UnavailableError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "DeviceError",
    "ERROR_CLASSES",
]


class FlightqError(Exception):
    """Root of every error flightq raises."""


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


class ConflictError(FlightqError, ValueError):
    """A request conflicts with what is stored (existing column, different declaration)."""


class FlightqTimeoutError(FlightqError, TimeoutError):
    """A call did not finish within its timeout."""


class ClaimTimeoutError(FlightqTimeoutError):
    """Not enough rows became ready for a claim before its timeout."""


class UnavailableError(FlightqError, ConnectionError):
    """The server cannot be reached."""


class ResourceExhaustedError(FlightqError, MemoryError):
    """The server is full (memory budget or row limit) and no space freed in time."""


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
        ConflictError,
        FlightqTimeoutError,
        ClaimTimeoutError,
        UnavailableError,
        ResourceExhaustedError,
        UnauthenticatedError,
    )
}
