"""The clients: :class:`Client` and :func:`connect` (:mod:`.client`), parallel streams
(:mod:`.streams`) and the asyncio twin (:mod:`.aio`, public as :mod:`flightq.aio`)."""

from .client import DEFAULT_TIMEOUT, SHM_MIN_BYTES, Client, connect

__all__ = ["DEFAULT_TIMEOUT", "SHM_MIN_BYTES", "Client", "connect"]
