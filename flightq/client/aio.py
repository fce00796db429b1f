"""The asyncio twin of :class:`flightq.client.client.Client`, for loops that must not block.

Every method of :class:`AsyncClient` is a coroutine with the same parameters, results and
errors as the blocking client's. Calls run on a small thread pool owned by the client
(Arrow Flight's Python client is blocking), so a generator's event loop keeps turning
while a put streams or a claim waits.

Examples
--------
>>> import asyncio, flightq, flightq.aio, numpy as np
>>> async def main(location):
...     async with await flightq.aio.connect(location, ["rollout_text@1"]) as c:
...         await c.create_partition("r", "rollout_text@1", tasks=["train"])
...         await c.put("r", ["k0"], {"input_ids": [np.arange(3)]})
...         return len(await c.claim("r", "train", 1))
>>> with flightq.Server() as srv:
...     asyncio.run(main(srv.location))
1
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..registry import SchemaRegistry
from ..schema import Schema
from .client import DEFAULT_TIMEOUT, Client
from .client import connect as _connect

__all__ = ["AsyncClient", "connect"]

_METHODS = (
    "health",
    "check_schemas",
    "register_schema",
    "create_partition",
    "describe",
    "put",
    "put_batch",
    "get",
    "claim",
    "reset",
    "clear",
    "drop",
    "stats",
    "inspect",
    "partitions",
    "snapshot",
)


async def connect(
    location: str,
    schemas: Iterable[str | Schema] = (),
    *,
    registry: SchemaRegistry | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_workers: int = 4,
    **kwargs: Any,
) -> AsyncClient:
    """Connect and check schemas, as :func:`flightq.connect`, without blocking the loop."""
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="flightq-aio")
    loop = asyncio.get_running_loop()
    try:
        client = await loop.run_in_executor(
            pool,
            functools.partial(
                _connect, location, list(schemas), registry=registry, timeout=timeout, **kwargs
            ),
        )
    except BaseException:
        pool.shutdown(wait=False)
        raise
    return AsyncClient(client, pool)


class AsyncClient:
    """Coroutine versions of every :class:`~flightq.client.client.Client` method.

    Parameters
    ----------
    client:
        The blocking client to drive.
    pool:
        Threads the calls run on; concurrent calls (a claim waiting while a put streams)
        each take one.
    """

    def __init__(self, client: Client, pool: ThreadPoolExecutor | None = None) -> None:
        self.client = client
        self._pool = pool or ThreadPoolExecutor(max_workers=4, thread_name_prefix="flightq-aio")

    def __getattr__(self, name: str) -> Any:
        if name not in _METHODS:
            raise AttributeError(f"AsyncClient has no method {name!r}")
        method = getattr(self.client, name)

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool, functools.partial(method, *args, **kwargs)
            )

        return call

    async def close(self) -> None:
        """Close the connection and the thread pool."""
        self.client.close()
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
