"""A generator's puts in the background: :class:`Writer`.

``writer.put(keys, columns, tags)`` queues the put and returns at once; one background
thread encodes and sends the queued puts in order, so generation never waits on the
network. The queue is bounded (``max_pending`` puts): when the server takes puts more
slowly than they come, ``put`` blocks until there is room, or raises
:class:`~flightq.WriterFullError` after its ``timeout``.

Every put carries its own ``put_id``; a put that fails on the way (the server
unreachable, a timeout) is retried with the same id, so a retry never stores a row twice.
The first error that a retry does not fix stops the writer: it is raised by the next
``put``, by ``flush()`` and by ``close()``, and the puts queued behind it are not sent
(``writer.dropped`` counts them), so every put before it is stored and none after it.

The tensors a put names are read when the put is sent, not when it is queued: do not
write into them until ``flush()`` returns (generators hand over fresh tensors per
rollout, which is what this is for).

Examples
--------
>>> import numpy as np, flightq
>>> with flightq.Server() as srv, flightq.connect(srv.location) as c:
...     c.create_partition("r", "rollout_text@1", tasks=["train"])
...     with flightq.Writer(srv.location, "r", max_pending=4) as w:
...         for g in range(8):
...             _ = w.put([f"p{g}_g0"], {"input_ids": [np.arange(5)]})
...     w.rows, c.inspect("r")["rows"]
(8, 8)
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .client.client import connect
from .client.interface import DataPlane
from .errors import FlightqTimeoutError, UnavailableError, WriterFullError

__all__ = ["Writer"]

#: Errors a put is retried after, with the same put id: the put may or may not have landed.
RETRIED = (UnavailableError, FlightqTimeoutError)


@dataclass(frozen=True)
class _Put:
    put_id: str
    keys: list[str]
    columns: Mapping[str, Any]
    tags: Sequence[Mapping[str, Any] | None] | None
    overwrite: bool


class Writer:
    """Puts to ``partition`` from a bounded queue, sent by a background thread.

    Parameters
    ----------
    target:
        A client (:func:`flightq.connect`, :func:`flightq.connect_sharded`) or a location
        the writer connects to (and closes on :meth:`close`).
    partition:
        Where the rows go.
    max_pending:
        Puts queued, not yet sent, at most: ``put`` blocks while the queue is full.
    retries:
        Times a put is sent again after an error the server may not have seen the end
        of (unreachable, timed out), with the same put id.
    schemas, connect_kwargs:
        For :func:`flightq.connect` when ``target`` is a location.

    Raises
    ------
    ValueError
        If ``max_pending`` or ``retries`` is out of range.
    """

    def __init__(
        self,
        target: str | DataPlane,
        partition: str,
        *,
        max_pending: int = 8,
        retries: int = 3,
        schemas: Sequence[str] = (),
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        if isinstance(target, str):
            self._client: Any = connect(target, schemas, **dict(connect_kwargs or {}))
            self._owned = True
        else:
            self._client, self._owned = target, False
        self.partition = partition
        self.max_pending = max_pending
        self.retries = retries
        #: Rows and puts the server acknowledged; puts not sent after an error.
        self.rows = 0
        self.puts = 0
        self.dropped = 0
        self._prefix = uuid.uuid4().hex[:16]
        self._seq = 0
        self._queue: collections.deque[_Put] = collections.deque()
        self._sending = 0  # puts taken off the queue and not finished
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="flightq-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side

    def put(
        self,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        overwrite: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Queue one put (as :meth:`flightq.Client.put`, all or nothing); returns its id.

        Blocks while ``max_pending`` puts wait, for at most ``timeout`` seconds (None:
        until there is room).

        Raises
        ------
        WriterFullError
            (a ``TimeoutError``) if the queue stayed full for ``timeout``; not queued.
        FlightqError
            The error that stopped the writer, from an earlier put.
        ValueError
            If the writer is closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_stopped()
                if len(self._queue) < self.max_pending:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WriterFullError(
                        f"writer to {self.partition!r}: {len(self._queue)} puts still queued "
                        f"after {timeout}s (max_pending={self.max_pending}): the server takes "
                        "puts more slowly than they come; wait longer, raise max_pending, or "
                        "add servers",
                        actual=len(self._queue),
                        expected=self.max_pending,
                        partition=self.partition,
                    )
                self._cond.wait(left)
            self._seq += 1
            put_id = f"{self._prefix}-{self._seq}"
            self._queue.append(_Put(put_id, list(keys), columns, tags, overwrite))
            self._cond.notify_all()
        return put_id

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued put is stored.

        Raises
        ------
        FlightqError
            The error that stopped the writer (nothing after it was sent).
        FlightqTimeoutError
            If puts are still queued after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._sending) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise FlightqTimeoutError(
                        f"writer to {self.partition!r}: {len(self._queue) + self._sending} "
                        f"puts not stored after {timeout}s",
                        partition=self.partition,
                    )
                self._cond.wait(left)
            if self._error is not None:
                raise self._error

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the thread, and close the connection the writer opened.

        Raises
        ------
        FlightqError
            The error that stopped the writer, as :meth:`flush`.
        """
        try:
            if not self._closed:
                self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout)
            if self._owned:
                self._owned = False
                self._client.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the block's own error wins over the writer's
            self.close()

    def _raise_stopped(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ValueError(f"writer to {self.partition!r} is closed")

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._sending = 1
                self._cond.notify_all()  # room for a blocked put
            try:
                rows = self._send(item)
            except BaseException as e:
                with self._cond:
                    self._error = e
                    self.dropped = len(self._queue)
                    self._queue.clear()
                    self._sending = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self.rows += rows
                self.puts += 1
                self._sending = 0
                self._cond.notify_all()

    def _send(self, item: _Put) -> int:
        for attempt in range(self.retries + 1):
            try:
                return int(
                    self._client.put(
                        self.partition,
                        item.keys,
                        item.columns,
                        item.tags,
                        overwrite=item.overwrite,
                        put_id=item.put_id,
                    )
                )
            except RETRIED:
                if attempt == self.retries:
                    raise
                time.sleep(min(2.0, 0.1 * 2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover
