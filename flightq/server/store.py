"""Partitions, rows, columns, per-task claims: the server's in-memory state.

A partition is declared once with a schema, the consumer tasks that will claim from it and
an optional group size. Rows point into the received record batches, and a partition plans
and applies each put (:mod:`flightq.server.partition`); serving rows is
:mod:`flightq.server.assemble`.

The store holds the one lock, the waiting and the memory budget. Every mutation happens
under the lock, after all checks pass, so a put is all or nothing. Claims, and puts waiting
for room, wait on a condition variable that puts, clears and resets notify; the claims
waiting right now are counted per partition and task, and the puts waiting for room per
partition (:meth:`Store.stats`).
"""

from __future__ import annotations

import difflib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import (
    ClaimTimeoutError,
    ConflictError,
    FlightqTimeoutError,
    MissingFieldError,
    NotFoundError,
    ProtocolError,
    ResourceExhaustedError,
    UnavailableError,
)
from ..schema import Schema
from .partition import Partition, Piece, Row, put_keys

__all__ = ["Store"]

#: Seconds between checks that a waiting claim's caller is still there.
_POLL = 0.2


class Store:
    """All partitions of one server."""

    def __init__(self, memory_budget: int | None = None) -> None:
        self.memory_budget = memory_budget
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._parts: dict[str, Partition] = {}
        #: Claims waiting for rows right now: partition name -> task -> count.
        self._waiting: dict[str, dict[str, int]] = {}
        #: Puts waiting for room (memory budget, row limit) right now: partition -> count.
        self._waiting_puts: dict[str, int] = {}
        self._closing = False

    def close(self) -> None:
        """Refuse new waits and wake every waiting claim and put (server shutdown)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()

    def _check_open(self, what: str) -> None:
        if self._closing:
            raise UnavailableError(f"{what}: the server is shutting down; retry on another")

    # ------------------------------------------------------------------ declarations

    def declare(
        self,
        name: str,
        schema: Schema,
        tasks: Sequence[str],
        group_size: int | None,
        max_rows: int | None = None,
    ) -> bool:
        """Declare a partition; idempotent for identical arguments. Returns whether new.

        Raises
        ------
        ConflictError
            If the partition exists with another schema, tasks, group size or row limit.
        """
        if max_rows is not None and max_rows < 1:
            raise ProtocolError(
                f"max_rows must be >= 1, got {max_rows}", actual=max_rows, partition=name
            )
        if not name or "/" in name:
            raise ProtocolError(
                f"partition name {name!r} must be non-empty and without '/'", partition=name
            )
        if group_size is not None and group_size < 1:
            raise ProtocolError(
                f"group_size must be >= 1, got {group_size}", actual=group_size, partition=name
            )
        if len(set(tasks)) != len(tasks):
            raise ProtocolError(
                f"tasks of partition {name!r} repeat: {list(tasks)}",
                actual=list(tasks),
                partition=name,
            )
        with self._lock:
            p = self._parts.get(name)
            if p is not None:
                if (
                    p.schema.fingerprint != schema.fingerprint
                    or p.tasks != tuple(tasks)
                    or p.group_size != group_size
                    or p.max_rows != max_rows
                ):
                    raise ConflictError(
                        f"partition {name!r} is declared with schema {p.schema.ref} "
                        f"({p.schema.fingerprint}), tasks {list(p.tasks)}, group_size "
                        f"{p.group_size}; got {schema.ref} ({schema.fingerprint}), tasks "
                        f"{list(tasks)}, group_size {group_size}"
                        + (
                            f"; max_rows {p.max_rows}, got {max_rows}"
                            if p.max_rows != max_rows
                            else ""
                        ),
                        partition=name,
                    )
                return False
            self._parts[name] = Partition(
                name,
                schema,
                tuple(tasks),
                group_size,
                delivered={t: set() for t in tasks},
                max_rows=max_rows,
            )
            return True

    def partition(self, name: str) -> Partition:
        """A partition by name.

        Raises
        ------
        NotFoundError
            If it was never declared.
        """
        with self._lock:
            return self._get(name)

    def _get(self, name: str) -> Partition:
        p = self._parts.get(name)
        if p is None:
            raise NotFoundError(
                f"unknown partition {name!r}{_close(name, self._parts)}", partition=name
            )
        return p

    def partitions(self) -> list[Partition]:
        """Every partition, by name."""
        with self._lock:
            return [self._parts[n] for n in sorted(self._parts)]

    def capture(self, names: Sequence[str] | None = None) -> list[Partition]:
        """Consistent copies of partitions (all when ``names`` is None), for a snapshot.

        Rows, cells, tags and delivered sets are copied under the lock; the stored record
        batches they point to are immutable and shared.
        """
        with self._lock:
            parts = list(self._parts.values()) if names is None else [self._get(n) for n in names]
            return [
                Partition(
                    p.name,
                    p.schema,
                    p.tasks,
                    p.group_size,
                    rows={
                        k: Row(r.key, r.group, dict(r.cells), dict(r.tags), r.seq_len, r.nbytes)
                        for k, r in p.rows.items()
                    },
                    delivered={t: set(d) for t, d in p.delivered.items()},
                    next_group=p.next_group,
                    nbytes=p.nbytes,
                    max_rows=p.max_rows,
                    recent_puts=dict(p.recent_puts),
                )
                for p in parts
            ]

    def restore(self, parts: Sequence[Partition]) -> None:
        """Adopt restored partitions (see :mod:`flightq.server.snapshot`).

        Raises
        ------
        ConflictError
            If a partition of that name exists already (nothing is adopted then).
        """
        with self._changed:
            clash = [p.name for p in parts if p.name in self._parts]
            if clash:
                raise ConflictError(
                    f"cannot restore partitions that exist already: {clash}", partition=clash[0]
                )
            for p in parts:
                self._parts[p.name] = p
            self._changed.notify_all()

    def drop(self, name: str) -> None:
        """Remove a partition and its rows."""
        with self._changed:
            self._get(name)
            del self._parts[name]
            self._changed.notify_all()

    # ------------------------------------------------------------------ writes

    def held(self) -> int:
        """Payload bytes held across partitions."""
        with self._lock:
            return sum(p.nbytes for p in self._parts.values())

    def _wait_for_rows(self, name: str, keys: list[str], timeout: float) -> bool:
        """Wait until the partition's row limit has room for the put's new rows; returns
        whether it waited (let go of the lock)."""
        limit = self._get(name).max_rows
        if limit is None:
            return False
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            self._check_open(f"put to {name!r}")
            p = self._get(name)
            new = sum(1 for k in keys if k not in p.rows)
            if new > limit:
                raise ResourceExhaustedError(
                    f"put to {name!r} creates {new} rows, more than the partition's limit of "
                    f"{limit} rows; split it",
                    expected=limit,
                    actual=new,
                    partition=name,
                )
            if len(p.rows) + new <= limit:
                return waited
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResourceExhaustedError(
                    f"put to {name!r} of {new} new rows: the partition holds {len(p.rows)} of "
                    f"its {limit}-row limit and no rows were cleared within {timeout:g}s; "
                    "clear consumed rows",
                    expected=limit,
                    actual=len(p.rows) + new,
                    partition=name,
                )
            self._wait_for_room(name, left)
            waited = True

    def _wait_for_space(self, name: str, need: int, timeout: float) -> bool:
        """Wait until the memory budget has room for ``need`` more bytes; returns whether
        it waited (let go of the lock)."""
        budget = self.memory_budget
        if budget is None:
            return False
        if need > budget:
            raise ResourceExhaustedError(
                f"put to {name!r} carries {need} bytes, more than the server's whole memory "
                f"budget of {budget} bytes; split it",
                expected=budget,
                actual=need,
                partition=name,
            )
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            self._check_open(f"put to {name!r}")
            held = sum(p.nbytes for p in self._parts.values())
            if held + need <= budget:
                return waited
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResourceExhaustedError(
                    f"put to {name!r} of {need} bytes: the server holds {held} of its "
                    f"{budget}-byte memory budget and no space was cleared within "
                    f"{timeout:g}s; clear consumed rows",
                    expected=budget,
                    actual=held + need,
                    partition=name,
                )
            self._wait_for_room(name, left)
            waited = True

    def _wait_for_room(self, name: str, left: float) -> None:
        """Let go of the lock until a change or ``left`` seconds pass, counted meanwhile as
        a put waiting for room in ``name`` (:meth:`stats`)."""
        self._waiting_puts[name] = self._waiting_puts.get(name, 0) + 1
        try:
            self._changed.wait(min(left, 3600.0))  # inf or huge: wait in chunks
        finally:
            n = self._waiting_puts[name] - 1
            if n:
                self._waiting_puts[name] = n
            else:
                del self._waiting_puts[name]

    def put(
        self,
        name: str,
        pieces: list[Piece],
        overwrite: bool,
        timeout: float = 0.0,
        put_id: str | None = None,
    ) -> int:
        """Store the rows of validated pieces, all or nothing. Returns the rows written.

        Under the lock: the partition plans the put (every check), the store waits for
        room by the plan's numbers (memory budget, row limit), and the partition applies
        it. With a budget or a row limit, waits up to ``timeout`` seconds for clears to make
        room. A retry is idempotent: a ``put_id`` seen recently in the partition, or a put
        whose every cell and tag equals what its rows already hold, is acknowledged again
        and stores nothing.

        Raises
        ------
        ConflictError, MissingFieldError, ShapeError, EncodeError
            Naming the row key and field; nothing is stored.
        ResourceExhaustedError
            If the budget has no room for the put within ``timeout``.
        """
        keys = put_keys(pieces)
        with self._changed:
            plan = self._get(name).plan_put(pieces, overwrite, put_id)
            if plan.replay is not None:
                return plan.replay
            waited = self._wait_for_space(name, plan.nbytes, timeout)
            waited = self._wait_for_rows(name, keys, timeout) or waited
            p = self._get(name)
            if waited:  # the lock was let go meanwhile: plan again on what is there now
                plan = p.plan_put(pieces, overwrite, put_id)
            n = p.apply(plan)
            self._changed.notify_all()
            return n

    def clear(self, name: str, keys: Sequence[str] | None) -> int:
        """Remove rows (all when ``keys`` is None). Returns how many were removed.

        Raises
        ------
        NotFoundError
            If a key is unknown (nothing is removed then).
        """
        with self._changed:
            p = self._get(name)
            if keys is None:
                n = len(p.rows)
                p.rows.clear()
                p.nbytes = 0
                for d in p.delivered.values():
                    d.clear()
            else:
                _known(p, keys)
                n = 0
                for k in keys:
                    row = p.rows.pop(k, None)
                    if row is None:
                        continue
                    n += 1
                    p.nbytes -= row.nbytes
                    for d in p.delivered.values():
                        d.discard(k)
            self._changed.notify_all()
            return n

    def reset(self, name: str, task: str, keys: Sequence[str] | None) -> int:
        """Make rows claimable again for ``task``. Returns how many were reset."""
        with self._changed:
            p = self._get(name)
            d = _task(p, task)
            if keys is None:
                n = len(d)
                d.clear()
            else:
                _known(p, keys)
                n = len(d.intersection(keys))
                d.difference_update(keys)
            self._changed.notify_all()
            return n

    # ------------------------------------------------------------------ reads

    def rows_for_get(
        self, name: str, keys: Sequence[str], fields: Sequence[str] | None
    ) -> tuple[Partition, list[Row], list[str]]:
        """Rows by key, in order, and the fields to return.

        Raises
        ------
        NotFoundError
            Naming every unknown key.
        MissingFieldError
            Naming a requested field and the rows that lack it.
        """
        with self._lock:
            p = self._get(name)
            _known(p, keys)
            rows = [p.rows[k] for k in keys]
            return p, rows, _fields_for(p, rows, fields)

    def claim(
        self,
        name: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None,
        timeout: float,
        wait_for: Sequence[str] = (),
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[Partition, list[Row], list[str]]:
        """Wait for ``batch_size`` ready rows, mark them delivered to ``task``, return them.

        A row is ready when not yet delivered to the task and it has every field named in
        ``fields`` (the schema's required fields when ``fields`` is None) and in
        ``wait_for``. In a partition with a group size, only whole ready groups are taken,
        in creation order. The rows are returned with ``fields`` (every column they have
        when None). ``cancelled`` (e.g. ``ServerCallContext.is_cancelled``) is polled while
        waiting: a claim its caller abandoned stops waiting and takes no rows.

        Raises
        ------
        ClaimTimeoutError
            If not enough rows become ready within ``timeout`` seconds.
        FlightqTimeoutError
            If ``cancelled()`` turns true while waiting.
        UnavailableError
            If the store closes (server shutdown) while waiting.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            p = self._get(name)
            _task(p, task)
            g = p.group_size
            if batch_size < 1 or (g and batch_size % g):
                raise ProtocolError(
                    f"claim from {name!r}: batch_size {batch_size} must be >= 1"
                    + (f" and a multiple of the group size {g}" if g else ""),
                    actual=batch_size,
                    partition=name,
                )
            need = tuple(fields) if fields is not None else p.schema.required
            need = tuple(dict.fromkeys((*need, *wait_for)))
            for f in need:
                p.schema[f]  # raises on an undeclared field
            waiting = False
            try:
                while True:
                    self._check_open(f"claim from {name!r}")
                    if cancelled is not None and cancelled():
                        raise FlightqTimeoutError(
                            f"claim from {name!r} for task {task!r} was cancelled by its "
                            "caller; no rows were taken",
                            partition=name,
                        )
                    p = self._get(name)  # the partition may have been dropped meanwhile
                    picked = _ready(p, task, need, batch_size)
                    if picked is not None:
                        p.delivered[task].update(r.key for r in picked)
                        return p, picked, _fields_for(p, picked, fields)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        ready = len(_ready(p, task, need, None) or [])
                        raise ClaimTimeoutError(
                            f"claim of {batch_size} rows for task {task!r} from partition "
                            f"{name!r} timed out after {timeout:g}s: {ready} rows ready with "
                            f"fields {list(need)}",
                            expected=batch_size,
                            actual=ready,
                            partition=name,
                        )
                    if not waiting:
                        waiting = True
                        tasks = self._waiting.setdefault(name, {})
                        tasks[task] = tasks.get(task, 0) + 1
                    # inf or huge: wait in chunks; poll a caller that may go away more often.
                    self._changed.wait(min(left, 3600.0 if cancelled is None else _POLL))
            finally:
                if waiting:
                    self._stop_waiting(name, task)

    def _stop_waiting(self, name: str, task: str) -> None:
        tasks = self._waiting[name]
        tasks[task] -= 1
        if not tasks[task]:
            del tasks[task]
            if not tasks:
                del self._waiting[name]

    def unclaim(self, name: str, task: str, keys: Sequence[str]) -> None:
        """Undo a claim whose rows never reached the consumer."""
        with self._changed:
            p = self._parts.get(name)
            if p is not None and task in p.delivered:
                p.delivered[task].difference_update(keys)
                self._changed.notify_all()

    def scan(self, name: str) -> tuple[Partition, list[Row], list[str]]:
        """Every row not yet cleared, and the union of the fields they carry."""
        with self._lock:
            p = self._get(name)
            rows = list(p.rows.values())
            return p, rows, _fields_for(p, rows, None)

    # ------------------------------------------------------------------ description

    def stats(self) -> dict[str, Any]:
        """Rows, bytes and per-task progress of every partition, the claims waiting for rows
        right now (per partition and task, and in all) and the puts waiting for room right
        now (per partition)."""
        with self._lock:
            return {
                "partitions": {n: self._partition_stats(n, detail=False) for n in self._parts},
                "rows": sum(len(p.rows) for p in self._parts.values()),
                "bytes": sum(p.nbytes for p in self._parts.values()),
                "waiting_claims": sum(sum(t.values()) for t in self._waiting.values()),
            }

    def inspect(self, name: str) -> dict[str, Any]:
        """One partition in detail: fields present, per task delivered and ready rows and
        waiting claims, and its puts waiting for room."""
        with self._lock:
            return self._partition_stats(name, detail=True)

    def list_keys(self, name: str, keys: Sequence[str] | None) -> dict[str, Any]:
        """Rows' keys (all, in insertion order, when ``keys`` is None), their tags and the
        fields each has, as the ``list_keys`` reply.

        Raises
        ------
        NotFoundError
            Naming every unknown key.
        """
        with self._lock:
            p = self._get(name)
            if keys is None:
                rows = list(p.rows.values())
            else:
                _known(p, keys)
                rows = [p.rows[k] for k in keys]
            names = [f.name for f in p.schema.fields if any(f.name in r.cells for r in rows)]
            index = {n: i for i, n in enumerate(names)}
            return {
                "keys": [r.key for r in rows],
                "tags": [dict(r.tags) for r in rows],
                "fields": names,
                "present": [sorted(index[f] for f in r.cells) for r in rows],
            }

    def _partition_stats(self, name: str, detail: bool) -> dict[str, Any]:
        # With the lock held: one partition and what waits on it right now.
        p = self._get(name)
        return _describe(p, self._waiting.get(name, {}), self._waiting_puts.get(name, 0), detail)


#: Most names an error lists: other partitions are never listed wholesale (they may be
#: other users'), and a partition's tasks only while they are this few.
_LISTED = 8
#: Most names searched for close matches.
_CANDIDATES = 10_000


def _close(name: str, names: Iterable[str]) -> str:
    """``"; did you mean 'a', 'b'?"`` with at most 3 names close to ``name``, or ``""``."""
    # Bounded: this runs under the store's lock, on a name a client chose.
    candidates = [n for n in itertools.islice(names, _CANDIDATES) if len(n) <= 256]
    near = difflib.get_close_matches(name[:256], candidates, n=3)
    return f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""


def _known(p: Partition, keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in p.rows]
    if missing:
        shown = ", ".join(repr(k) for k in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise NotFoundError(
            f"partition {p.name!r} has no row key {shown}{more}", key=missing[0], partition=p.name
        )


def _task(p: Partition, task: str) -> set[str]:
    d = p.delivered.get(task)
    if d is None:
        declared = (
            f"; declared: {list(p.tasks)}" if len(p.tasks) <= _LISTED else _close(task, p.tasks)
        )
        raise NotFoundError(
            f"partition {p.name!r} declares no task {task!r}{declared}",
            expected=list(p.tasks),
            actual=task,
            partition=p.name,
        )
    return d


def _fields_for(p: Partition, rows: list[Row], fields: Sequence[str] | None) -> list[str]:
    if fields is None:
        present = set().union(*(r.cells for r in rows)) if rows else set()
        return [f.name for f in p.schema.fields if f.name in present]
    out = []
    for name in fields:
        p.schema[name]  # undeclared: UnknownSchemaError naming the declared fields
        lacking = [r.key for r in rows if name not in r.cells]
        if lacking:
            shown = ", ".join(repr(k) for k in lacking[:10])
            raise MissingFieldError(
                f"field {name!r} is missing on row key {shown} of partition {p.name!r}",
                field=name,
                key=lacking[0],
                partition=p.name,
            )
        out.append(name)
    order = {f.name: i for i, f in enumerate(p.schema.fields)}
    return sorted(dict.fromkeys(out), key=order.__getitem__)


def _ready(p: Partition, task: str, need: Sequence[str], limit: int | None) -> list[Row] | None:
    """The first ready rows (whole groups if grouped), or None if fewer than ``limit``."""
    done = p.delivered[task]
    out: list[Row] = []
    if not p.group_size:
        for r in p.rows.values():
            if r.key not in done and all(f in r.cells for f in need):
                out.append(r)
                if limit is not None and len(out) == limit:
                    return out
        return out if limit is None else None
    groups: dict[int, list[Row]] = {}
    for r in p.rows.values():
        groups.setdefault(r.group, []).append(r)
    for members in groups.values():
        if len(members) != p.group_size:
            continue  # part of the group was cleared
        if all(r.key not in done and all(f in r.cells for f in need) for r in members):
            out.extend(members)
            if limit is not None and len(out) == limit:
                return out
    return out if limit is None else None


def _describe(
    p: Partition, waiting: dict[str, int], waiting_puts: int, detail: bool
) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": p.schema.ref,
        "fingerprint": p.schema.fingerprint,
        "tasks": list(p.tasks),
        "group_size": p.group_size,
        "rows": len(p.rows),
        "bytes": p.nbytes,
        "delivered": {t: len(s) for t, s in p.delivered.items()},
        "waiting": {t: waiting.get(t, 0) for t in p.tasks},
        "waiting_puts": waiting_puts,
    }
    if detail:
        counts = {f.name: 0 for f in p.schema.fields}
        for r in p.rows.values():
            for f in r.cells:
                counts[f] += 1
        d["fields"] = {k: v for k, v in counts.items() if v}
        d["ready"] = {t: len(_ready(p, t, p.schema.required, None) or []) for t in p.tasks}
    return d
