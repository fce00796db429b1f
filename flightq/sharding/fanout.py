"""The shards of a sharded client: a connection to each, parallel calls, control calls.

:class:`Fanout` holds one :class:`flightq.Client` per shard and runs a call on several
shards at once; a failure comes back as the same flightq class with the shard's location
in front of its message (with every other failing shard listed). The control calls
(declare, clear, reset, drop, stats, ...) live here; the data calls (put, get, claim) in
:mod:`flightq.sharding.client`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .. import forks
from ..client.client import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_TIMEOUT,
    STOP_S,
    Client,
    resolve_schemas,
    stop_named,
)
from ..client.recent import Recent
from ..client.transport import Transport
from ..cuda import PinnedPool
from ..errors import FlightqError, UnavailableError
from ..registry import SchemaRegistry
from ..schema import Schema
from .router import Router, group_key, sum_description, sum_stats

__all__ = ["Fanout", "DEFAULT_POLL", "at_shard"]

T = TypeVar("T")
F = TypeVar("F", bound="Fanout")

#: Seconds a sharded claim blocks on one shard before looking at the others again.
DEFAULT_POLL = 0.05


def at_shard(location: str, e: FlightqError) -> FlightqError:
    """The same error class and attributes (``key``, ``partition``, ...), its message
    prefixed with the shard's location."""
    return _retold(e, f"shard {location}: {e}")


def _retold(e: FlightqError, message: str) -> FlightqError:
    """An error of ``e``'s class and attributes, saying ``message``."""
    return type(e)(message, **e.attributes())


class Fanout:
    """One client per shard, calls on several shards in parallel, and the control calls.

    The base of :class:`flightq.ShardedClient`; see it for the data calls, which read
    through each shard's :class:`~flightq.client.transport.Transport` (``transports``).
    """

    def __init__(
        self,
        locations: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        key_fn: Callable[[str], str] = group_key,
        poll: float = DEFAULT_POLL,
        **flight_kwargs: Any,
    ) -> None:
        self.router = Router(locations, key_fn)
        self.locations = self.router.locations
        self.timeout = timeout
        self.poll = poll
        self._clients: list[Client] = []
        try:
            for loc in self.locations:
                self._clients.append(
                    Client(loc, timeout=timeout, max_batch_bytes=max_batch_bytes, **flight_kwargs)
                )
        except FlightqError as e:
            self.close()
            raise at_shard(self.locations[len(self._clients)], e) from e
        #: Each shard's connections, in ``locations`` order.
        self.transports: list[Transport] = [c.transport for c in self._clients]
        #: Each shard's client (its consumer session included), in ``locations`` order.
        self.shard_clients: tuple[Client, ...] = tuple(self._clients)
        #: Pinned host buffers and copy streams of reads into CUDA tensors.
        self.pinned = PinnedPool()
        self._pool = ThreadPoolExecutor(max(4, 2 * len(self._clients)), "flightq-shard")
        # Per partition, for the partitions used last (a run may name one per step).
        self._decls: Recent[str, tuple[Schema, int | None]] = Recent()
        self._turn = itertools.count()
        #: Per shard, until when (``time.monotonic()``) claims ask it last: it left a
        #: claim unanswered (stopped, or too slow), so claims look at the others first.
        self._slow_until: list[float] = [0.0] * len(self._clients)

    # ------------------------------------------------------------------ plumbing

    def _run(
        self, calls: Mapping[int, Callable[[Client], T]]
    ) -> tuple[dict[int, T], list[tuple[int, FlightqError]]]:
        """Run ``calls[s](client of s)`` on the shards in parallel; results and failures."""
        if len(calls) == 1:
            ((s, fn),) = calls.items()
            try:
                return {s: fn(self._clients[s])}, []
            except FlightqError as e:
                return {}, [(s, e)]
        futures = {s: self._pool.submit(fn, self._clients[s]) for s, fn in calls.items()}
        out: dict[int, T] = {}
        errors: list[tuple[int, FlightqError]] = []
        for s, fut in futures.items():
            try:
                out[s] = fut.result()
            except FlightqError as e:
                errors.append((s, e))
        return out, errors

    def _error(self, errors: Sequence[tuple[int, FlightqError]], *notes: str) -> FlightqError:
        """The first failure's class and attributes, naming its shard, then the other
        failures and notes."""
        parts = [f"shard {self.locations[t]}: {e}" for t, e in errors] + [n for n in notes if n]
        return _retold(errors[0][1], "; ".join(parts))

    def _fan(self, calls: Mapping[int, Callable[[Client], T]]) -> dict[int, T]:
        """:meth:`_run`, raising the failures (see :meth:`_error`) after all finish."""
        out, errors = self._run(calls)
        if errors:
            raise self._error(errors) from errors[0][1]
        return out

    def _all(self, fn: Callable[[Client], T]) -> list[T]:
        res = self._fan(dict.fromkeys(range(len(self._clients)), fn))
        return [res[s] for s in range(len(self._clients))]

    def _by_shard(self, keys: Sequence[str], fn: Callable[[Client, list[str]], T]) -> dict[int, T]:
        """``fn(client, its keys)`` on each shard holding some of ``keys``, in parallel."""
        ks = list(keys)

        def call(pos: list[int]) -> Callable[[Client], T]:
            return lambda c: fn(c, [ks[i] for i in pos])

        return self._fan({s: call(pos) for s, pos in self.router.split(ks).items()})

    def _first(self, fn: Callable[[Client], T]) -> T:
        """``fn`` on the first shard that can be reached."""
        errors: list[tuple[int, FlightqError]] = []
        for s, c in enumerate(self._clients):
            try:
                return fn(c)
            except UnavailableError as e:
                errors.append((s, e))
            except FlightqError as e:
                raise self._error([(s, e)]) from e
        raise self._error(errors) from errors[0][1]

    def _decl(self, partition: str) -> tuple[Schema, int | None]:
        """The partition's schema and group size (cached)."""
        d = self._decls.get(partition)
        if d is None:
            info = self.describe(partition)
            d = (Schema.from_json(info["schema"]), info["group_size"])
            self._decls[partition] = d
        return d

    def _decl_changed(
        self, partition: str, kept: tuple[Schema, int | None]
    ) -> tuple[Schema, int | None] | None:
        """The partition's declaration as the shards give it now, where its schema or
        group size differs from ``kept`` (another client dropped it and declared it
        again); None where neither does."""
        self._decls.pop(partition)
        fresh = self._decl(partition)
        same = fresh[0].fingerprint == kept[0].fingerprint and fresh[1] == kept[1]
        return None if same else fresh

    # ------------------------------------------------------------------ control

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """Every shard's health: ``{"ok": True, "shards": {location: health}}``."""
        res = self._all(lambda c: c.health(timeout))
        return {
            "ok": all(h.get("ok") for h in res),
            "shards": dict(zip(self.locations, res, strict=True)),
        }

    def check_schemas(self, schemas: Iterable[Schema]) -> None:
        """Check that every shard holds these exact schema versions."""
        wanted = list(schemas)
        self._all(lambda c: c.check_schemas(wanted))

    def register_schema(self, schema: Schema) -> None:
        """Add a schema to every shard's registry."""
        self._all(lambda c: c.register_schema(schema))

    def create_partition(
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
        """Declare the partition on every shard (idempotent); True if any shard created it.

        ``max_rows`` caps the rows each shard holds at once; ``lease`` and
        ``max_failures`` apply on each shard (see :meth:`flightq.Client.create_partition`).
        """
        s = resolve_schemas([schema], registry)[0]
        res = self._all(
            lambda c: c.create_partition(
                name,
                s,
                tasks,
                group_size,
                max_rows=max_rows,
                lease=lease,
                max_failures=max_failures,
            )
        )
        self._decls[name] = (s, group_size)
        return any(res)

    def describe(self, partition: str) -> dict[str, Any]:
        """The partition's declaration, from the first shard that answers."""
        return self._first(lambda c: c.describe(partition))

    def partition_schema(self, partition: str) -> Schema:
        """The schema ``partition`` is declared with (asked of a shard once, then kept)."""
        return self._decl(partition)[0]

    def clear(
        self, partition: str, keys: Sequence[str] | None = None, *, missing_ok: bool = False
    ) -> int:
        """Remove rows (all when ``keys`` is None) on their shards; returns how many.

        With keys, each shard clears its rows atomically; an unknown key fails its own
        shard's part (``NotFoundError`` naming the shard), not the others', unless
        ``missing_ok`` (keys not held skipped, as :meth:`flightq.Client.clear`).
        """
        if keys is None:
            return sum(self._all(lambda c: c.clear(partition, None)))
        return sum(
            self._by_shard(
                keys, lambda c, ks: c.clear(partition, ks, missing_ok=missing_ok)
            ).values()
        )

    def reset(self, partition: str, task: str, keys: Sequence[str] | None = None) -> int:
        """Make rows claimable again for ``task`` (all when ``keys`` is None)."""
        if keys is None:
            return sum(self._all(lambda c: c.reset(partition, task, None)))
        return sum(self._by_shard(keys, lambda c, ks: c.reset(partition, task, ks)).values())

    def drop(self, partition: str) -> None:
        """Remove the partition and its rows from every shard."""
        self._all(lambda c: c.drop(partition))
        self._decls.pop(partition, None)

    def stats(self) -> dict[str, Any]:
        """Rows, bytes and per-task progress, summed over shards; ``"shards"`` has each."""
        res = self._all(lambda c: c.stats())
        return {**sum_stats(res), "shards": dict(zip(self.locations, res, strict=True))}

    def inspect(self, partition: str) -> dict[str, Any]:
        """One partition, summed over shards; ``"shards"`` has each shard's view."""
        res = self._all(lambda c: c.inspect(partition))
        out = sum_description(res)
        out["shards"] = dict(zip(self.locations, res, strict=True))
        return out

    def list_keys(
        self,
        partition: str,
        keys: Sequence[str] | None = None,
        *,
        hide_tag_values: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Rows without their data, from their shards (see :meth:`flightq.Client.list_keys`):
        every shard's rows, shard after shard, when ``keys`` is None, else in the order asked."""
        hide = hide_tag_values
        if keys is None:
            out: dict[str, dict[str, Any]] = {}
            for part in self._all(lambda c: c.list_keys(partition, None, hide_tag_values=hide)):
                out.update(part)
            return out
        found: dict[str, dict[str, Any]] = {}
        listed = self._by_shard(
            keys, lambda c, ks: c.list_keys(partition, ks, hide_tag_values=hide)
        )
        for part in listed.values():
            found.update(part)
        return {k: found[k] for k in keys}

    def snapshot(
        self, name: str, partition: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Make every shard write a snapshot of one partition (all when None) to its disk.

        Returns ``{"partitions": {name: rows over every shard}, "shards": {location:
        that shard's answer, its "path" included}}``.

        Raises
        ------
        ProtocolError, ConflictError
            As :meth:`flightq.Client.snapshot`, naming the shard.
        """
        res = self._all(lambda c: c.snapshot(name, partition, timeout))
        rows: dict[str, int] = {}
        for r in res:
            for p, n in r["partitions"].items():
                rows[p] = rows.get(p, 0) + n
        return {"partitions": rows, "shards": dict(zip(self.locations, res, strict=True))}

    def partitions(self) -> list[str]:
        """Names of the partitions any shard holds."""
        return sorted({p for names in self._all(lambda c: c.partitions()) for p in names})

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close every shard's connection, once every shard's named claims still waiting
        were cancelled side by side (a stalled shard would delay the others' cancels)."""
        deadline = time.monotonic() + STOP_S
        if not forks.forked():  # (in a forked child, each client's close touches nothing)
            with contextlib.suppress(RuntimeError):  # closed before: its pool is gone
                self._run(
                    {s: (lambda c: stop_named(c, deadline)) for s in range(len(self._clients))}
                )
        for c in self._clients:
            c.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self: F) -> F:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
