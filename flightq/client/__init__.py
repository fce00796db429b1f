"""The clients: :class:`Client` and :func:`connect` (:mod:`.client`), the transport under them
(:mod:`.transport`), reads (:mod:`.reads`), parallel streams (:mod:`.streams`), the interface
every client offers (:mod:`.interface`) and the asyncio twin (:mod:`.aio`, public as
:mod:`flightq.aio`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client import DEFAULT_TIMEOUT, SHM_MIN_BYTES, Client, connect

__all__ = ["DEFAULT_TIMEOUT", "SHM_MIN_BYTES", "Client", "connect"]


def __getattr__(name: str) -> object:
    # The client imports pyarrow.flight: load it on first use, so that flightq.DataPlane and
    # flightq.PutReceipt (from .interface) leave `import flightq` fast.
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'flightq.client' has no attribute {name!r}")
