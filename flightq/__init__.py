"""flightq: rollout batches, media included, as Arrow record batches over Arrow Flight.

The user API: schemas and their registry, :func:`encode` / :func:`decode` of
self-describing record batches, and the errors. The Flight server and client live in
:mod:`flightq.server` and :mod:`flightq.client` and are re-exported here lazily, so
that ``import flightq`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .batch import (
    Batch,
    Claim,
    MediaColumn,
    ObjectColumn,
    Packed,
    Received,
    ScalarColumn,
    TensorColumn,
    decode,
)
from .client.interface import DataPlane, PutReceipt
from .codecs import Raw, Zstd
from .draft import draft_schema
from .encode import encode
from .errors import (
    ClaimCancelledError,
    ClaimTimeoutError,
    ConflictError,
    DecodeError,
    DeviceError,
    DTypeError,
    EncodeError,
    EvolutionError,
    FlightqError,
    FlightqTimeoutError,
    LeaseExpiredError,
    MediaDigestError,
    MediaUnknownError,
    MissingFieldError,
    NotFoundError,
    ProtocolError,
    ResourceExhaustedError,
    SchemaError,
    SchemaMismatchError,
    ShapeError,
    UnauthenticatedError,
    UnavailableError,
    UndeclaredFieldError,
    UnknownSchemaError,
    WriterFullError,
)
from .memory import keep_freed_memory
from .registry import SchemaRegistry
from .schema import Field, Schema

if TYPE_CHECKING:
    from .client.aio import AsyncClient
    from .client.client import Client, connect
    from .server.flight import Server
    from .sharding.client import ShardedClient, connect_sharded
    from .writer import Writer

__version__ = "0.1.0.dev0"

_LAZY = {
    "Server": "server",
    "Client": "client",
    "connect": "client",
    "AsyncClient": "aio",
    "ShardedClient": "sharding",
    "connect_sharded": "sharding",
    "Writer": "writer",
}


#: Public submodules reachable as attributes after ``import flightq`` (loaded on first use).
_SUBMODULES = frozenset(
    {
        "aio",
        "ray",
        "cuda",
        "shm",
        "sharding",
        "server",
        "client",
        "compat",
        "tensordicts",
        "media",
        "torch",
    }
)


def __getattr__(name: str) -> object:
    # The Flight edges import pyarrow.flight; load them on first use.
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flightq' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "Batch",
    "Received",
    "Claim",
    "Client",
    "DataPlane",
    "PutReceipt",
    "Server",
    "ShardedClient",
    "connect",
    "connect_sharded",
    "ClaimCancelledError",
    "ClaimTimeoutError",
    "ConflictError",
    "LeaseExpiredError",
    "DTypeError",
    "DecodeError",
    "DeviceError",
    "EncodeError",
    "EvolutionError",
    "Field",
    "FlightqError",
    "FlightqTimeoutError",
    "MediaColumn",
    "MissingFieldError",
    "MediaDigestError",
    "MediaUnknownError",
    "NotFoundError",
    "ObjectColumn",
    "Packed",
    "ProtocolError",
    "Raw",
    "ResourceExhaustedError",
    "ScalarColumn",
    "Schema",
    "SchemaError",
    "SchemaMismatchError",
    "SchemaRegistry",
    "ShapeError",
    "TensorColumn",
    "UnauthenticatedError",
    "UnavailableError",
    "UndeclaredFieldError",
    "UnknownSchemaError",
    "Writer",
    "WriterFullError",
    "Zstd",
    "decode",
    "draft_schema",
    "encode",
    "keep_freed_memory",
]
