"""The asyncio twin of :class:`flightq.client.client.Client`, for loops that must not block.

Every method of :class:`AsyncClient` is a coroutine with the same parameters, results and
errors as the blocking client's. Calls run on a small thread pool owned by the client
(Arrow Flight's Python client is blocking), so a generator's event loop keeps turning
while a put streams or a claim waits.

Cancelling a call (``asyncio.wait_for``, ``task.cancel()``) that has not started yet
drops it. A claim cancelled while it waits is stopped on the server
(:meth:`flightq.Client.cancel_claim`, sent on a thread of its own): its thread is free
again at once, and a loop that polls with ``wait_for(c.claim(...), t)`` never runs out of
threads. Any other call already running goes on in its thread (the blocking call cannot
be interrupted) until it ends, keeping that thread. A cancelled claim that took its rows
before the cancel came gives them back at once (``nack``, no failed delivery counted), so
no rows stay leased to a caller that went away; a cancelled put may still be stored
(retry it with its ``put_id``).

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
import concurrent.futures
import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import FlightqError, UnavailableError
from ..registry import SchemaRegistry
from ..schema import Schema
from .client import DEFAULT_TIMEOUT
from .client import connect as _connect
from .interface import DataPlane, PutReceipt

if TYPE_CHECKING:
    import pyarrow as pa

    from ..batch import Batch, Claim

__all__ = ["AsyncClient", "connect"]

T = TypeVar("T")


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
    """Coroutine versions of every :class:`~flightq.client.interface.DataPlane` method.

    Each method takes the parameters of the blocking client's and returns, or raises,
    what it does (see :class:`flightq.Client`).

    Parameters
    ----------
    client:
        The blocking client to drive: a :class:`~flightq.Client` or a
        :class:`~flightq.ShardedClient`.
    pool:
        Threads the calls run on; concurrent calls (a claim waiting while a put streams)
        each take one.
    """

    def __init__(self, client: DataPlane, pool: ThreadPoolExecutor | None = None) -> None:
        self.client = client
        self._pool = pool or ThreadPoolExecutor(max_workers=4, thread_name_prefix="flightq-aio")
        # Cancels of waiting claims: never queued behind the calls that fill the pool.
        self._cancels = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flightq-aio-cancel")
        self._closing = False

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _claimed(
        self,
        fn: Callable[..., Batch],
        partition: str,
        *args: Any,
        call_id: str | None = None,
        **kwargs: Any,
    ) -> Batch:
        """``fn`` (a claim from ``partition``) on the pool, under ``call_id`` (a name of
        its own when None); if the caller is cancelled while it runs, the server is told
        to stop it, and the rows it took, if it took any before that, are given back."""
        call = uuid.uuid4().hex if call_id is None else call_id
        running = self._pool.submit(fn, partition, *args, call_id=call, **kwargs)
        try:
            return await asyncio.wrap_future(running)
        except FlightqError:
            if self._closing and call_id is None:  # stopped by close(), or refused after it
                raise asyncio.CancelledError from None
            raise
        except asyncio.CancelledError:
            running.add_done_callback(self._give_back)
            if not running.cancelled():  # it started: stop its wait on the server
                with contextlib.suppress(RuntimeError):  # closed: the claim ends with it
                    self._cancels.submit(self._cancel, partition, call)
            raise

    def _cancel(self, partition: str, call: str) -> None:
        for _ in range(3):  # a connection the link dropped fails once; gRPC reconnects
            try:
                self.client.cancel_claim(partition, call)
                return
            except UnavailableError:
                time.sleep(0.2)
            except Exception:  # the claim fails or ends by itself anyway
                return

    def _give_back(self, done: concurrent.futures.Future[Batch]) -> None:
        # On the pool's thread that ran the claim: nobody awaits its rows any more.
        if done.cancelled() or done.exception() is not None:
            return
        with contextlib.suppress(Exception):  # the lease ends anyway
            self.client.nack(done.result())

    async def health(self, timeout: float | None = None) -> dict[str, Any]:
        """See :meth:`flightq.Client.health`."""
        return await self._call(self.client.health, timeout)

    async def check_schemas(self, schemas: Iterable[Schema]) -> None:
        """See :meth:`flightq.Client.check_schemas`."""
        return await self._call(self.client.check_schemas, list(schemas))

    async def register_schema(self, schema: Schema) -> None:
        """See :meth:`flightq.Client.register_schema`."""
        return await self._call(self.client.register_schema, schema)

    async def create_partition(
        self,
        name: str,
        schema: str | Schema,
        tasks: Sequence[str] = (),
        group_size: int | None = None,
        *,
        max_rows: int | None = None,
        lease: float | None = None,
        max_failures: int | None = None,
        registry: SchemaRegistry | None = None,
    ) -> bool:
        """See :meth:`flightq.Client.create_partition`."""
        return await self._call(
            self.client.create_partition,
            name,
            schema,
            tasks,
            group_size,
            max_rows=max_rows,
            lease=lease,
            max_failures=max_failures,
            registry=registry,
        )

    async def describe(self, partition: str) -> dict[str, Any]:
        """See :meth:`flightq.Client.describe`."""
        return await self._call(self.client.describe, partition)

    async def partition_schema(self, partition: str) -> Schema:
        """See :meth:`flightq.Client.partition_schema`."""
        return await self._call(self.client.partition_schema, partition)

    async def clear(
        self, partition: str, keys: Sequence[str] | None = None, *, missing_ok: bool = False
    ) -> int:
        """See :meth:`flightq.Client.clear`."""
        return await self._call(
            functools.partial(self.client.clear, missing_ok=missing_ok), partition, keys
        )

    async def reset(self, partition: str, task: str, keys: Sequence[str] | None = None) -> int:
        """See :meth:`flightq.Client.reset`."""
        return await self._call(self.client.reset, partition, task, keys)

    async def drop(self, partition: str) -> None:
        """See :meth:`flightq.Client.drop`."""
        return await self._call(self.client.drop, partition)

    async def stats(self) -> dict[str, Any]:
        """See :meth:`flightq.Client.stats`."""
        return await self._call(self.client.stats)

    async def inspect(self, partition: str) -> dict[str, Any]:
        """See :meth:`flightq.Client.inspect`."""
        return await self._call(self.client.inspect, partition)

    async def list_keys(
        self,
        partition: str,
        keys: Sequence[str] | None = None,
        *,
        hide_tag_values: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """See :meth:`flightq.Client.list_keys`."""
        return await self._call(
            self.client.list_keys, partition, keys, hide_tag_values=hide_tag_values
        )

    async def put(
        self,
        partition: str,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> PutReceipt:
        """See :meth:`flightq.Client.put`."""
        return await self._call(
            self.client.put,
            partition,
            keys,
            columns,
            tags,
            overwrite=overwrite,
            timeout=timeout,
            put_id=put_id,
        )

    async def put_batch(
        self,
        partition: str,
        batch: pa.RecordBatch | Sequence[pa.RecordBatch],
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> PutReceipt:
        """See :meth:`flightq.Client.put_batch`."""
        return await self._call(
            self.client.put_batch,
            partition,
            batch,
            overwrite=overwrite,
            timeout=timeout,
            put_id=put_id,
        )

    async def get(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        as_: str = "torch",
        copy: bool = False,
        timeout: float | None = None,
        device: Any = None,
        sync: bool = True,
        hide_tag_values: str | None = None,
    ) -> Batch:
        """See :meth:`flightq.Client.get`."""
        return await self._call(
            self.client.get,
            partition,
            keys,
            fields,
            as_=as_,
            copy=copy,
            timeout=timeout,
            device=device,
            sync=sync,
            hide_tag_values=hide_tag_values,
        )

    async def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        *,
        wait_for: Sequence[str] = (),
        timeout: float | None = None,
        as_: str = "torch",
        copy: bool = False,
        device: Any = None,
        sync: bool = True,
        lease: float | None = None,
        call_id: str | None = None,
        hide_tag_values: str | None = None,
    ) -> Batch:
        """See :meth:`flightq.Client.claim`. ``with batch:`` acks or gives back as there,
        blocking the loop for that one call: ``await c.ack(batch)`` does not. Cancelled
        while it waits, it is stopped on the server and its thread is free at once; rows
        it took before the cancel came are given back. ``call_id``: its name (one is
        made for it when None)."""
        return await self._claimed(
            self.client.claim,
            partition,
            task,
            batch_size,
            fields,
            call_id=call_id,
            wait_for=wait_for,
            timeout=timeout,
            as_=as_,
            copy=copy,
            device=device,
            sync=sync,
            lease=lease,
            hide_tag_values=hide_tag_values,
        )

    async def cancel_claim(self, partition: str, call_id: str) -> int:
        """See :meth:`flightq.Client.cancel_claim` (on the thread of the cancels, never
        queued behind the waiting claims that may fill the pool)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._cancels, self.client.cancel_claim, partition, call_id
        )

    async def ack(self, claim: Claim | Batch, keys: Sequence[str] | None = None) -> int:
        """See :meth:`flightq.Client.ack`."""
        return await self._call(self.client.ack, claim, keys)

    async def nack(
        self, claim: Claim | Batch, keys: Sequence[str] | None = None, *, failed: bool = False
    ) -> int:
        """See :meth:`flightq.Client.nack`."""
        return await self._call(self.client.nack, claim, keys, failed=failed)

    async def dead_letters(self, partition: str, task: str, limit: int = 1000) -> dict[str, Any]:
        """See :meth:`flightq.Client.dead_letters`."""
        return await self._call(self.client.dead_letters, partition, task, limit)

    async def snapshot(
        self, name: str, partition: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """See :meth:`flightq.Client.snapshot`."""
        return await self._call(self.client.snapshot, name, partition, timeout)

    async def partitions(self) -> list[str]:
        """See :meth:`flightq.Client.partitions`."""
        return await self._call(self.client.partitions)

    async def close(self) -> None:
        """Close the connection and the thread pool. Claims still waiting are stopped on
        the server and end cancelled; the blocking close (up to 5 s against a stalled
        server) runs off the loop."""
        self._closing = True
        await asyncio.to_thread(self.client.close)
        self._pool.shutdown(wait=False)
        self._cancels.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
