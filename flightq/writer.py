"""A generator's puts in the background: :class:`Writer`.

``writer.put(keys, columns, tags)`` queues the put and returns at once; one background
thread encodes and sends the queued puts in order, so generation never waits on the
network. The queue is bounded (``max_pending`` puts): when the server takes puts more
slowly than they come, ``put`` blocks until there is room, or raises
:class:`~flightq.WriterFullError` after its ``timeout``.

Every put carries its own ``put_id``. A put that fails for a reason that passes (the
server unreachable or restarting, a timeout, the server's memory budget or row limit
full with nothing cleared in time, the server busy) is sent again with the same id, so a
retry never stores a row twice, backing off up to 2 s between tries, until ``retry_for``
seconds (5 minutes by default) have passed since its first try. A put the server refuses
for its content (``DTypeError``, ``ShapeError``, ``ConflictError``, an unknown
partition...) is not retried. The first error that retries do not fix stops the writer:
it is raised by the next ``put``, by ``flush()`` and by ``close()``, and the puts queued
behind it are not sent, so every put before it is stored and none after it.

No put the writer accepted is lost silently: each is acknowledged (``writer.puts``,
``writer.rows``), or listed in ``writer.dropped_puts`` (known not stored: refused, or
never sent) or in ``writer.unsure_puts`` (it may have been stored: its last try timed
out, lost the server, or was cut off by ``close``). Each listed :class:`WriterPut` can be
sent again (:meth:`WriterPut.send`) with its own ``put_id``, which stores nothing twice.

A writer still open when its process exits is closed then: what it queued is sent,
within 30 s in all (:data:`flightq.exiting.EXIT_FLUSH_S`), and what is not sent by then
is logged as an error. Close it yourself to know.

The tensors a put names are read when the put is sent, not when it is queued: do not
write into them until ``flush()`` returns (generators hand over fresh tensors per
rollout, which is what this is for). The values of object fields (text, message logs) are
packed when ``put`` is called, where the partition's schema could be read: a log the
caller goes on appending to is stored as it was.

Examples
--------
>>> import numpy as np, flightq
>>> with flightq.Server() as srv, flightq.connect(srv.location) as c:
...     _ = c.create_partition("r", "rollout_text@1", tasks=["train"])
...     with flightq.Writer(srv.location, "r", max_pending=4) as w:
...         for g in range(8):
...             _ = w.put([f"p{g}_g0"], {"input_ids": [np.arange(5)]})
...     w.rows, c.inspect("r")["rows"], w.dropped_puts, w.unsure_puts
(8, 8, [], [])
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

from . import exiting, forks
from .client.client import connect
from .client.interface import DataPlane
from .errors import (
    FlightqError,
    FlightqTimeoutError,
    ResourceExhaustedError,
    UnavailableError,
    WriterFullError,
)
from .rows import columns_of

__all__ = ["Writer", "WriterPut", "DEFAULT_RETRY_FOR"]

#: Seconds a put is retried for by default: a trainer's pause, a server's restart.
DEFAULT_RETRY_FOR = 300.0
#: The longest wait between two tries of a put.
MAX_BACKOFF = 2.0
#: Errors after which a put may have been stored: retried with the same put id.
UNSURE = (UnavailableError, FlightqTimeoutError)


@dataclass(frozen=True, eq=False)
class WriterPut:
    """A put a :class:`Writer` accepted, as it would send it.

    Attributes
    ----------
    put_id:
        The id every try of this put carried: sending it again with it stores nothing
        twice (the server remembers the last 4096 put ids of a partition).
    partition, keys, columns, tags, overwrite:
        As given to :meth:`Writer.put`.
    """

    put_id: str
    partition: str
    keys: list[str]
    columns: Mapping[str, Any]
    tags: Sequence[Mapping[str, Any] | None] | None
    overwrite: bool

    def send(self, client: DataPlane, timeout: float | None = None) -> int:
        """Send this put with ``client`` under its own ``put_id``; returns the rows
        acknowledged (as :meth:`flightq.Client.put`, whose errors it raises)."""
        return int(
            client.put(
                self.partition,
                self.keys,
                self.columns,
                self.tags,
                overwrite=self.overwrite,
                timeout=timeout,
                put_id=self.put_id,
            )
        )


def _retried(e: BaseException) -> bool:
    if isinstance(e, UNSURE):
        return True
    return isinstance(e, ResourceExhaustedError) and e.room_may_come


def _may_be_stored(e: BaseException) -> bool:
    # A timeout, a lost server, or the transport's own untyped failure (a call cancelled
    # by close): the server may have stored the put. A typed refusal stored nothing.
    return isinstance(e, UNSURE) or type(e) is FlightqError


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
    retry_for:
        Seconds after a put's first try during which it is sent again (same put id) after
        an error that may pass: the server unreachable, a timeout, the server full with
        nothing cleared in time or busy. No try starts later; ``0`` never retries.
    retries:
        The most tries after the first, within ``retry_for``; None: no such limit.
    schemas, connect_kwargs:
        For :func:`flightq.connect` when ``target`` is a location.

    Attributes
    ----------
    rows, puts:
        Rows and puts the server acknowledged.
    dropped_puts:
        Puts known not stored: the one the server refused, and those queued behind the
        error that stopped the writer (or cut off by :meth:`close`), in order.
    unsure_puts:
        Puts that may have been stored: the writer gave up on them after a timeout or a
        lost server, or :meth:`close` cut them off in flight. Sending one again with its
        ``put_id`` (:meth:`WriterPut.send`) is safe.

    Raises
    ------
    ValueError
        If ``max_pending``, ``retry_for`` or ``retries`` is out of range.
    """

    def __init__(
        self,
        target: str | DataPlane,
        partition: str,
        *,
        max_pending: int = 8,
        retry_for: float = DEFAULT_RETRY_FOR,
        retries: int | None = None,
        schemas: Sequence[str] = (),
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if not retry_for >= 0:
            raise ValueError(f"retry_for must be seconds, 0 or more, got {retry_for!r}")
        if retries is not None and retries < 0:
            raise ValueError(f"retries must be None, 0 or more, got {retries}")
        if isinstance(target, str):
            self._client: Any = connect(target, schemas, **dict(connect_kwargs or {}))
            self._owned = True
        else:
            self._client, self._owned = target, False
        self.partition = partition
        self.max_pending = max_pending
        self.retry_for = float(retry_for)
        self.retries = retries
        self.rows = 0
        self.puts = 0
        self.dropped_puts: list[WriterPut] = []
        self.unsure_puts: list[WriterPut] = []
        self._prefix = uuid.uuid4().hex[:16]
        self._schema: Any = None  # the partition's, once known (object fields packed at put)
        self._seq = 0
        self._queue: collections.deque[WriterPut] = collections.deque()
        self._sending: WriterPut | None = None  # taken off the queue, not finished
        self._cut: WriterPut | None = None  # in flight when close gave up on it
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="flightq-writer", daemon=True)
        self._thread.start()
        exiting.writer_open(self)  # what it queued is sent at exit if it is not closed

    @property
    def dropped(self) -> int:
        """How many puts are known not stored (``len(dropped_puts)``)."""
        return len(self.dropped_puts)

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
        ProtocolError
            In a process forked after the writer started (its thread is not there).
        """
        forks.check(f"writer to {self.partition!r}")
        columns = self._objects_packed(keys, columns)
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
            self._queue.append(
                WriterPut(put_id, self.partition, list(keys), columns, tags, overwrite)
            )
            self._cond.notify_all()
        return put_id

    def _objects_packed(self, keys: Sequence[str], columns: Mapping[str, Any]) -> Mapping[str, Any]:
        """``columns`` with its object fields' values packed now, where the partition's
        schema has any: a message log the caller goes on appending to is stored as it was
        when put, and a value no object field holds is refused here (``EncodeError``,
        naming the row), not by a later put or ``close()``. Tensors are read when sent, and
        so are object values while the partition's schema cannot be read."""
        if self._schema is None:
            try:
                self._schema = self._client.partition_schema(self.partition)
            except FlightqError:  # not reachable or not there yet: packed when sent
                return columns
        if not any(f.role == "object" for f in self._schema.fields):
            return columns
        return columns_of(columns, self._schema, list(keys))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued put is stored.

        Raises
        ------
        FlightqError
            The error that stopped the writer (nothing after it was sent).
        FlightqTimeoutError
            If puts are still queued after ``timeout`` seconds (they stay queued).
        """
        forks.check(f"writer to {self.partition!r}")  # its thread is not in a fork
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not self._wait_sent(deadline):
                raise FlightqTimeoutError(
                    f"writer to {self.partition!r}: {self._unfinished()} puts not stored "
                    f"after {timeout}s",
                    partition=self.partition,
                )
            if self._error is not None:
                raise self._error

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, stop the thread, and close the connection the writer
        opened, all within ``timeout`` seconds (None: however long the puts take).

        At the deadline the writer gives up: the queued puts go to ``dropped_puts``, the
        one in flight to ``unsure_puts`` (its call is cancelled where the writer owns the
        connection; otherwise its answer, when it comes, still counts it acknowledged).

        Raises
        ------
        FlightqError
            The error that stopped the writer, as :meth:`flush`.
        FlightqTimeoutError
            If puts were not stored by the deadline, naming the one that may have been.
        """
        forks.check(f"writer to {self.partition!r}")  # its thread is not in a fork
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._cond:
                self._closed = True  # the thread sends what is queued, then ends
                self._cond.notify_all()
                if not self._wait_sent(deadline):
                    self._give_up(timeout)
                if self._error is not None:
                    raise self._error
        finally:
            exiting.writer_closed(self)
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self._owned:
                self._owned = False
                self._client.close()  # cancels a put still in flight

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

    def _unfinished(self) -> int:
        return len(self._queue) + (self._sending is not None)

    def _wait_sent(self, deadline: float | None) -> bool:
        # With the lock held: False if puts are still unfinished at the deadline.
        while self._unfinished() and self._error is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _give_up(self, timeout: float | None) -> None:
        # With the lock held, at close's deadline: nothing more is sent.
        queued, flying = list(self._queue), self._sending
        self._queue.clear()
        self.dropped_puts.extend(queued)
        shown = f"{len(queued)} queued puts were not sent (writer.dropped_puts)"
        key = queued[0].keys[0] if queued and queued[0].keys else None
        if flying is not None:
            self._cut = flying
            self.unsure_puts.append(flying)
            key = flying.keys[0] if flying.keys else key
            shown = (
                f"put {flying.put_id!r} ({len(flying.keys)} rows) was in flight and may have "
                "been stored (writer.unsure_puts: send it again with its put_id, which stores "
                f"nothing twice); {shown}"
            )
        self._error = FlightqTimeoutError(
            f"writer to {self.partition!r} closed after {timeout:g}s with puts not stored: {shown}",
            key=key,
            partition=self.partition,
        )
        self._cond.notify_all()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._sending = self._queue.popleft()
                self._cond.notify_all()  # room for a blocked put
            try:
                rows, error, unsure = self._send(item)
            except BaseException as e:  # a bug of its own: never a silent, dead thread
                rows, error, unsure = 0, e, True
            with self._cond:
                self._sending = None
                if self._cut is item:  # close listed it unsure; only an ack says more
                    self._cut = None
                    if error is None:
                        self.unsure_puts.remove(item)
                if error is None:
                    self.rows += rows
                    self.puts += 1
                elif self._error is None:
                    (self.unsure_puts if unsure else self.dropped_puts).append(item)
                    self.dropped_puts.extend(self._queue)
                    self._queue.clear()
                    self._error = error
                self._cond.notify_all()
                if error is not None:
                    return

    def _send(self, item: WriterPut) -> tuple[int, BaseException | None, bool]:
        """Send ``item``, retried while its error may pass; returns the rows acknowledged,
        the error given up on, and whether it may have been stored."""
        start, tries, unsure = time.monotonic(), 0, False
        while True:
            try:
                return item.send(self._client), None, False
            except Exception as e:
                unsure = unsure or _may_be_stored(e)
                left = self.retry_for - (time.monotonic() - start)
                if (
                    not _retried(e)
                    or left <= 0
                    or (self.retries is not None and tries >= self.retries)
                ):
                    return 0, e, unsure
                error: BaseException = e
            with self._cond:  # close can cut the wait short
                if self._cut is not item:
                    # 2**tries capped: a float past 2**1023 would overflow (an hour's tries)
                    self._cond.wait(min(MAX_BACKOFF, 0.1 * 2 ** min(tries, 16), left))
                if self._cut is item:
                    return 0, error, True
            tries += 1
