"""A trainer's claims as a torch ``IterableDataset``: :class:`ClaimDataset`.

Each item is one claimed microbatch (a :class:`~flightq.Batch`, or a TensorDict with
``as_="tensordict"``), leased to this consumer until it is acknowledged:

- asking for the next item acknowledges the one before (the trainer is done with it);
- ``ds.ack()`` acknowledges the current one now, ``ds.nack()`` gives it back;
- ``ds.close()`` acknowledges the current one and closes the connection the dataset
  opened; ``with ds:`` does the same on leaving, and gives the current one back when the
  block ends with an exception;
- an error inside the iteration (a failed claim, a failed ack) gives back what it holds;
- a consumer that dies loses nothing: its session ends and the rows are claimable again.

With workers, build the loader with ``ds.loader(num_workers=N)``: each worker process
opens its own connection from the location (a live client is never pickled) and claims
its share of ``max_batches``; the trainer's process acknowledges each batch when it asks
the loader for the next, as without workers, so a trainer that dies loses nothing even
from the batches its workers prefetched. The workers claim under the trainer's process's
consumer session, not their own: torch retires a worker whose share is done while the
trainer may still hold its last batches (in the loader's reorder buffer), and a worker's
own session would give them back as it ended, to be claimed and trained on a second
time. A worker that dies leaves the batches it claimed and had not handed over leased to
the trainer's session until their lease runs out (or the trainer's process ends). A
worker whose trainer's session ended (the link dropped, the server restarted) opens its
own. Workers start by ``spawn``: gRPC's state does not survive a fork (a forked worker's
first call would hang), so a worker started by fork raises instead. Under a plain
``DataLoader(ds, batch_size=None, num_workers=N, multiprocessing_context="spawn")``
nobody in the trainer's process sees the batches go by, so a worker acknowledges a batch
once the loader has asked it for ``prefetch_factor`` batches after it (by then the
trainer has asked for the batch after that one), and the batches it still holds when its
share is done.

torch's default conversion of a loader's items walks a TensorDict row by row; pass
``collate_fn=flightq.torch.keep`` (or build the loader with :meth:`ClaimDataset.loader`)
for TensorDicts. Batches pass through as they are.

Examples
--------
>>> import numpy as np, flightq
>>> from flightq.torch import ClaimDataset
>>> with flightq.Server() as srv, flightq.connect(srv.location) as c:
...     c.create_partition("r", "rollout_text@1", tasks=["train"])
...     _ = c.put("r", ["a", "b", "c", "d"], {"input_ids": [np.arange(3)] * 4})
...     with ClaimDataset(srv.location, "r", "train", 2, max_batches=2) as ds:
...         seen = [b.keys for b in ds.loader()]
...     seen, c.inspect("r")["acked"]
([['a', 'b'], ['c', 'd']], {'train': 4})
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

try:
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
except ImportError as e:  # pragma: no cover - exercised in the torch-free environment
    raise ImportError("flightq.torch needs torch: pip install 'flightq[torch]'") from e

from .client.client import Client, connect
from .errors import ClaimTimeoutError
from .sharding.client import ShardedClient, connect_sharded

__all__ = ["ClaimDataset", "ClaimLoader", "keep"]

#: What ``on_timeout`` takes: end the iteration, or raise the ClaimTimeoutError.
ON_TIMEOUT = ("stop", "raise")


def keep(item: Any) -> Any:
    """A loader's ``collate_fn`` that hands each item over unchanged (TensorDicts too)."""
    return item


class ClaimDataset(IterableDataset):
    """Claimed microbatches of ``task`` in ``partition``, acked as the trainer moves on.

    Parameters
    ----------
    source:
        Where to connect: a location (``"grpc://host:port"``), a list of shard locations
        (:func:`flightq.connect_sharded`), or a connected client (``num_workers=0``
        only: a worker process cannot use a connection made before it started).
    partition, task, batch_size, fields, wait_for, lease:
        As for :meth:`flightq.Client.claim`; whole groups when the partition has a group
        size.
    as_:
        ``"torch"`` (a :class:`~flightq.Batch`) or ``"tensordict"``.
    max_batches:
        Stop after this many batches (split between a loader's workers); None: claim
        until a claim times out.
    timeout:
        Seconds one claim waits for rows (the client's default when None).
    on_timeout:
        ``"stop"`` ends the iteration when a claim times out; ``"raise"`` raises the
        :class:`~flightq.ClaimTimeoutError`.
    schemas, connect_kwargs:
        Passed to :func:`flightq.connect` when the dataset opens its own connection
        (``token=``, ``shm=``, ...).
    prefetch_factor:
        The loader's ``prefetch_factor`` (torch's default 2): how many batches a worker
        holds unacknowledged behind the one it claims.

    Raises
    ------
    ValueError
        On a bad ``as_``, ``on_timeout``, ``batch_size`` or ``max_batches``.
    """

    def __init__(
        self,
        source: str | Sequence[str] | Client | ShardedClient,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        *,
        wait_for: Sequence[str] = (),
        as_: str = "torch",
        max_batches: int | None = None,
        timeout: float | None = None,
        on_timeout: str = "stop",
        lease: float | None = None,
        schemas: Sequence[str] = (),
        connect_kwargs: Mapping[str, Any] | None = None,
        prefetch_factor: int = 2,
    ) -> None:
        if as_ not in ("torch", "tensordict"):
            raise ValueError(f"as_ must be 'torch' or 'tensordict', got {as_!r}")
        if on_timeout not in ON_TIMEOUT:
            raise ValueError(f"on_timeout must be one of {ON_TIMEOUT}, got {on_timeout!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if max_batches is not None and max_batches < 0:
            raise ValueError(f"max_batches must be 0 or more, got {max_batches}")
        if isinstance(source, (Client, ShardedClient)):
            self._given: Client | ShardedClient | None = source
            self._where: str | list[str] | None = None
        else:
            self._given = None
            self._where = source if isinstance(source, str) else list(source)
        self.partition, self.task, self.batch_size = partition, task, batch_size
        self.fields = None if fields is None else list(fields)
        self.wait_for = list(wait_for)
        self.as_, self.max_batches, self.timeout = as_, max_batches, timeout
        self.on_timeout, self.lease = on_timeout, lease
        self.schemas = list(schemas)
        self.connect_kwargs = dict(connect_kwargs or {})
        self.prefetch_factor = prefetch_factor
        # This process's connection and the batches it holds unacknowledged, oldest first.
        self._client: Client | ShardedClient | None = None
        self._pid = os.getpid()
        self._parent = os.getppid()
        self._held: collections.deque[Any] = collections.deque()
        #: Set on the copy a ClaimLoader's workers run: the trainer's process acks.
        self._main_acks = False
        #: On that copy: the trainer's process's consumer session per server location,
        #: which the workers claim under (:meth:`flightq.client.session.Session.borrow`).
        self._sessions: dict[str, str] = {}

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        client = self._connection()
        self._settle_all(ack=True)  # a new iteration means the last one is done with
        share = self._share(info)
        behind = 0 if info is None else self.prefetch_factor
        done = 0
        try:
            while share is None or done < share:
                while len(self._held) > behind and not self._main_acks:
                    client.ack(self._held.popleft())
                try:
                    item = client.claim(
                        self.partition,
                        self.task,
                        self.batch_size,
                        self.fields,
                        wait_for=self.wait_for,
                        timeout=self.timeout,
                        as_=self.as_,
                        lease=self.lease,
                    )
                except ClaimTimeoutError:
                    if self.on_timeout == "raise":
                        raise
                    break
                if not self._main_acks:
                    self._held.append(item)
                done += 1
                yield item
        except GeneratorExit:
            # Stopped early (a break, an error in the loop, the loader dropped): the
            # current batch waits for ack(), nack(), close() or the end of the session.
            raise
        except BaseException:
            self._settle_all(ack=False)
            raise
        # The loader asked for the item after the last: done with them (in a worker, unless
        # the trainer's process is gone: its session's end gives them back).
        if info is None or os.getppid() == self._parent:
            self._settle_all(ack=True)

    def loader(self, **kwargs: Any) -> DataLoader:
        """A ``DataLoader`` over this dataset, one claimed batch per item
        (``batch_size=None``, :func:`keep` as ``collate_fn``); ``kwargs`` go to it
        (``num_workers=``, ``pin_memory=``, ...). With workers, a :class:`ClaimLoader`:
        workers start by ``spawn`` unless ``multiprocessing_context`` says otherwise, and
        this process acknowledges each batch when the next is asked for."""
        kwargs.setdefault("collate_fn", keep)
        if kwargs.get("num_workers", 0) == 0:
            return DataLoader(self, batch_size=None, **kwargs)
        kwargs.setdefault("prefetch_factor", self.prefetch_factor)
        kwargs.setdefault("multiprocessing_context", "spawn")  # gRPC does not survive fork
        return ClaimLoader(self, **kwargs)

    # ------------------------------------------------------------------ acks

    @property
    def current(self) -> Any:
        """The batch handed out last and not acknowledged yet, else None."""
        return self._held[-1] if self._held else None

    def ack(self) -> int:
        """Acknowledge every batch this dataset holds now; returns the rows acked."""
        return self._settle_all(ack=True)

    def nack(self, *, failed: bool = False) -> int:
        """Give back every batch this dataset holds (``failed`` counts a failed
        delivery of each row); returns the rows given back."""
        return self._settle_all(ack=False, failed=failed)

    def close(self) -> None:
        """Acknowledge the batches held, and close the connection the dataset opened."""
        try:
            self.ack()
        finally:
            self._disconnect()

    def __enter__(self) -> ClaimDataset:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self._settle_all(ack=False)
        finally:
            self._disconnect()

    def _settle_all(self, ack: bool, failed: bool = False) -> int:
        if not self._held:
            return 0
        client = self._client if self._client is not None else self._given
        n = 0
        try:
            while self._held:
                item = self._held.popleft()
                if client is None or self._pid != os.getpid():
                    continue  # not ours to settle: the session that took it ends it
                n += client.ack(item) if ack else client.nack(item, failed=failed)
        finally:
            self._held.clear()
        return n

    # ------------------------------------------------------------------ connections

    def _connection(self) -> Client | ShardedClient:
        if self._pid != os.getpid():
            raise ValueError(
                "ClaimDataset in a DataLoader worker started by fork: gRPC's state does not "
                "survive a fork, so its connection would hang; start workers with "
                "multiprocessing_context='spawn' (or 'forkserver'), as ds.loader(num_workers=N) "
                "does"
            )
        if self._given is not None:
            return self._given
        if self._client is None:
            assert self._where is not None
            kw = self.connect_kwargs
            if isinstance(self._where, str):
                self._client = connect(self._where, self.schemas, **kw)
            else:
                self._client = connect_sharded(self._where, self.schemas, **kw)
            for c in _shards(self._client):
                if c.location in self._sessions:  # a ClaimLoader's worker
                    c.session.borrow(self._sessions[c.location], self._trainer_alive)
        return self._client

    def _trainer_alive(self) -> bool:
        """Whether the process that started this worker still lives (its parent)."""
        return os.getppid() == self._parent

    def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            client.close()

    def _share(self, info: Any) -> int | None:
        """This process's share of ``max_batches``: all of it, or a worker's part."""
        if self.max_batches is None or info is None:
            return self.max_batches
        base, extra = divmod(self.max_batches, info.num_workers)
        return base + (1 if info.id < extra else 0)

    def __getstate__(self) -> dict[str, Any]:
        if self._given is not None:
            raise TypeError(
                "a ClaimDataset over a connected client cannot go to another process (a "
                "DataLoader worker): pass the location instead (ClaimDataset(client.location, "
                "...)), and each worker opens its own connection"
            )
        state = dict(self.__dict__)
        state["_client"], state["_held"] = None, collections.deque()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in a worker started by spawn: this process's own dataset.
        self.__dict__.update(state)
        self._pid, self._parent = os.getpid(), os.getppid()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._disconnect()


def _shards(client: Client | ShardedClient) -> list[Client]:
    """The one-server clients ``client`` claims through: itself, or a sharded client's."""
    return list(client.shard_clients) if isinstance(client, ShardedClient) else [client]


class ClaimLoader(DataLoader):
    """A ``DataLoader`` whose workers claim and whose own process acknowledges: each
    batch when the next is asked for (:meth:`ClaimDataset.loader` builds one).

    The dataset's :meth:`~ClaimDataset.ack`, :meth:`~ClaimDataset.nack`,
    :meth:`~ClaimDataset.close` and ``with`` act on the batch handed out last, as without
    workers; an error inside the loader gives it back.
    """

    def __init__(self, dataset: ClaimDataset, **kwargs: Any) -> None:
        workers = copy.copy(dataset)
        workers._main_acks = True
        super().__init__(workers, batch_size=None, **kwargs)
        self.owner = dataset

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self.owner
        # This process's connection and consumer session, opened before the workers
        # claim anything: they claim under it (they go to the workers with the dataset).
        workers: ClaimDataset = self.dataset  # type: ignore[assignment]
        workers._sessions = {c.location: c.session.id() for c in _shards(ds._connection())}
        it = super().__iter__()
        try:
            while True:
                ds._settle_all(ack=True)  # asking for the next: done with the last
                try:
                    item = next(it)
                except StopIteration:
                    return
                ds._held.append(item)
                yield item
        except GeneratorExit:
            raise
        except BaseException:
            ds._settle_all(ack=False)
            raise
