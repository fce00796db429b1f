"""The asyncio client, :func:`connect` and :class:`AsyncClient` (:mod:`flightq.client.aio`)."""

from .client.aio import AsyncClient, connect

__all__ = ["AsyncClient", "connect"]
