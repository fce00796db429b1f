"""Partitions, rows, columns, per-task claims: the server's in-memory state.

A partition is declared once with a schema, the consumer tasks that will claim from it and
an optional group size. Rows point into the received record batches, and a partition plans
and applies each put (:mod:`flightq.server.partition`); serving rows is
:mod:`flightq.server.assemble`.

The store holds the one lock, the waiting and the memory budget. Every mutation happens
under the lock, after all checks pass, so a put is all or nothing. Puts waiting for room
wait on a condition variable that every change notifies; each waiting claim on a condition
of its own, which every change notifies too, except a put: a put wakes only the claims on
its partition that its ready rows may now serve (as many ready rows as they take), so a
put beside many waiting claims wakes none that would only wait again. The claims waiting
right now are counted per partition and task, and the puts waiting for room per partition
(:meth:`Store.stats`).
"""

from __future__ import annotations

import difflib
import heapq
import itertools
import operator
import threading
import time
import types
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from ..errors import (
    RETRY_FULL,
    ClaimCancelledError,
    ClaimTimeoutError,
    ConflictError,
    FlightqError,
    FlightqTimeoutError,
    MissingFieldError,
    NotFoundError,
    ProtocolError,
    ResourceExhaustedError,
    UnavailableError,
)
from ..schema import Schema
from .budget import (
    MAX_NAME_CHARS,
    MAX_PARTITIONS,
    MAX_TASKS,
    RECORDS_SHARE,
    RECORDS_SLACK,
    REPLY_ENTRY_BYTES,
    WAITING_SHARE,
    Tally,
    declaration_cost,
    row_overhead,
    shrunk,
)
from .leases import DEFAULT_LEASE, DEFAULT_MAX_FAILURES, Lease, Progress, TaskState
from .media import grouped_by_media, waiting_homes
from .merge import Merge
from .partition import HiddenTags, Partition, Piece, PutKeys, Row, put_keys
from .putplan import Stored, plan_put, stored
from .readiness import (
    complete_keys,
    count_ready,
    forget_rows,
    may_serve,
    maybe_remnant,
    ready_rows,
)
from .readings import Reading
from .replies import SMALL_REPLY_BYTES

__all__ = ["Store"]

#: Seconds between checks that a waiting claim's caller is still there.
_POLL = 0.2
#: Times a put is planned outside the lock before it is planned under it (each time a
#: write of its keys landed while it planned).
_PLANS = 3


class Store:
    """All partitions of one server."""

    def __init__(self, memory_budget: int | None = None) -> None:
        self.memory_budget = memory_budget
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._parts: dict[str, Partition] = {}
        #: What the partitions count, kept current by each (:meth:`Partition.attach`).
        self._tally = Tally()
        #: Claims waiting for rows right now: partition name -> task -> count, and each
        #: one (a put wakes only those its partition's ready rows may serve).
        self._waiting: dict[str, dict[str, int]] = {}
        self._claims: dict[str, dict[_Waiter, None]] = {}
        #: Waiting claims by partition and the name their caller gave them (``call``;
        #: several: a stale one whose stream broke and its retry), and the names cancels
        #: came for (oldest first, bounded by count and age, for a claim still on its way;
        #: each a name of at most 64 characters under a partition that exists).
        self._calls: dict[tuple[str, str], dict[_Waiter, None]] = {}
        self._cancelled: dict[tuple[str, str, str | None], float] = {}
        #: Puts waiting for room (memory budget, row limit) right now: partition -> count.
        self._waiting_puts: dict[str, int] = {}
        #: Consumer sessions open right now (:meth:`open_session`).
        self._sessions: set[str] = set()
        #: Bytes of put pieces read but not yet stored or let go (:meth:`reserve`).
        self._pending = 0
        #: Bytes the server holds outside the store, counted in the budget all the same:
        #: answers in shared memory waiting for their reader (set by the server), and
        #: those being written (:meth:`take_outside`).
        self.unread: Callable[[], int] | None = None
        self._outside = 0
        #: Bytes of puts waiting for room that they hold, received and not yet counted.
        self._waiting_bytes = 0
        self._closing = False

    def _wake(self) -> None:
        """Wake every waiting put and claim to look again, after a change (which may have
        made records of the past: :meth:`_fit`). With the lock."""
        self._fit()
        self._changed.notify_all()
        for waiters in self._claims.values():
            for w in waiters:
                w.changed.notify()

    def _wake_claims(self, name: str, p: Partition) -> None:
        """Wake the claims waiting on partition ``name`` (now ``p``) that its ready rows
        may now serve, after a put to it: a put changes no other partition, and a claim
        finds nothing in fewer ready rows than it takes
        (:func:`~flightq.server.readiness.may_serve`), counting only those that carry the
        fields it waits for (each count made once per task and set of fields). With the
        lock."""
        g = p.group_size
        counts: dict[tuple[str, tuple[str, ...]], int] = {}
        for w in self._claims.get(name, ()):
            st = p.progress.tasks.get(w.task)
            if st is None:
                w.changed.notify()
                continue
            if not may_serve(st, w.batch_size, g):
                continue
            if not (g and st.ready and maybe_remnant(st, g)):
                n = counts.get((w.task, w.need))
                if n is None:
                    n = counts[w.task, w.need] = count_ready(st, complete_keys(p, w.need))
                if n < w.batch_size:
                    continue
            w.changed.notify()

    def close(self) -> None:
        """Refuse new waits and wake every waiting claim and put (server shutdown)."""
        with self._changed:
            self._closing = True
            self._wake()

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closing

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
        lease: float = DEFAULT_LEASE,
        max_failures: int = DEFAULT_MAX_FAILURES,
    ) -> bool:
        """Declare a partition; idempotent for identical arguments. Returns whether new.

        ``lease`` is the seconds a claim's rows stay leased without an ack, ``max_failures``
        the failed deliveries after which a row goes to the dead letters
        (:mod:`flightq.server.leases`).

        Raises
        ------
        ConflictError
            If the partition exists with another schema, tasks, group size, row limit,
            lease or failure limit.
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
        if not lease > 0:
            raise ProtocolError(f"lease must be > 0 seconds, got {lease}", partition=name)
        if max_failures < 1:
            raise ProtocolError(
                f"max_failures must be >= 1, got {max_failures}",
                actual=max_failures,
                partition=name,
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
                    or p.lease != lease
                    or p.max_failures != max_failures
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
                        )
                        + (
                            f"; lease {p.lease:g}s and max_failures {p.max_failures}, got "
                            f"{lease:g}s and {max_failures}"
                            if (p.lease, p.max_failures) != (lease, max_failures)
                            else ""
                        ),
                        partition=name,
                    )
                return False
            _check_names(name, tasks)  # a new one: those declared before stand as they are
            self._room_for_declaration(name, tasks)
            p = self._parts[name] = Partition(
                name,
                schema,
                tuple(tasks),
                group_size,
                max_rows=max_rows,
                lease=lease,
                max_failures=max_failures,
            )
            p.attach(self._tally)
            return True

    def _room_for_declaration(self, name: str, tasks: Sequence[str]) -> None:
        # With the lock held: refused at once (a control call waits for nothing).
        if len(self._parts) >= MAX_PARTITIONS:
            raise ResourceExhaustedError(
                f"declare {name!r}: the server holds {len(self._parts)} partitions, its limit "
                f"of {MAX_PARTITIONS}; drop partitions no longer used",
                expected=MAX_PARTITIONS,
                actual=len(self._parts) + 1,
                partition=name,
            )
        budget = self.memory_budget
        cost = declaration_cost(name, tasks)
        held = self._held() + self._standing()  # records of the past make room (_fit)
        if budget is not None and held + cost > budget:
            raise ResourceExhaustedError(
                f"declare {name!r} ({cost} bytes with its {len(tasks)} tasks): the server holds "
                f"{held} of its {budget}-byte memory budget; clear consumed rows or drop "
                "partitions no longer used",
                expected=budget,
                actual=held + cost,
                partition=name,
            )
        self._fit(cost)

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
            raise _near(
                NotFoundError(f"unknown partition {name!r}", partition=name), name, self._parts
            )
        return p

    def partitions(self) -> list[Partition]:
        """Every partition, by name."""
        with self._lock:
            return [self._parts[n] for n in sorted(self._parts)]

    def schemas_used(self) -> set[str]:
        """The refs of the schemas the partitions are declared with."""
        with self._lock:
            return {p.schema.ref for p in self._parts.values()}

    def capture(
        self, names: Sequence[str] | None = None, reading: list[Reading] | None = None
    ) -> list[Partition]:
        """Consistent copies of partitions (all when ``names`` is None), for a snapshot;
        with ``reading``, the rows of each are read by the snapshot from now (one
        :class:`Reading` a partition appended: :meth:`end_reading`). Leases past their
        expiry are ended first, as any call that looks at them does.

        Under the lock only what changes in place is copied, at C speed: each partition's
        table of rows (a stored :class:`Row` is never changed, a write replaces it) and
        each task's sets and maps. The copies are built from those after the lock is let
        go, so a snapshot of many rows holds no other call for long. The stored record
        batches the rows point to are immutable and shared.
        """
        with self._lock:
            parts = list(self._parts.values()) if names is None else [self._get(n) for n in names]
            for p in parts:
                self._expire(p)
            frozen = [
                (
                    p,
                    dict(p.rows),
                    [
                        (
                            t,
                            set(st.done),
                            dict(st.dead),
                            dict(st.deliveries),
                            dict(st.failures),
                            st.trimmed,
                        )
                        for t, st in p.progress.tasks.items()
                    ],
                    (p.next_group, p.nbytes, p.held, dict(p.recent_puts)),
                )
                for p in parts
            ]
            for p, rows, *_ in frozen:
                self._read(p, rows.values(), reading)
        return [
            Partition(
                p.name,
                p.schema,
                p.tasks,
                p.group_size,
                rows=rows,
                progress=_copy_progress(p, rows, tasks),
                next_group=next_group,
                nbytes=nbytes,
                held=held,
                max_rows=p.max_rows,
                recent_puts=recent,
                lease=p.lease,
                max_failures=p.max_failures,
            )
            for p, rows, tasks, (next_group, nbytes, held, recent) in frozen
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
                p.attach(self._tally)
                self._parts[p.name] = p
            self._wake()

    def let_go(self) -> None:
        """Remove every partition and its rows: the server stopped, and no call runs.

        A stopped server's object may outlive its stop (some pyarrow releases keep a
        Flight server's Python object referenced from C++ for good): its rows, and the
        shared-memory segments they lie in, go here instead of with the object.
        """
        with self._changed:
            parts, self._parts = self._parts, {}
            for p in parts.values():
                p.attach(None)
            self._wake()

    def drop(self, name: str) -> None:
        """Remove a partition and its rows (what answers under way read of them stays
        counted until they end)."""
        with self._changed:
            p = self._get(name)
            if p.readings:
                p.cleared(p.rows.values())
            p.attach(None)
            del self._parts[name]
            self._wake()

    # ------------------------------------------------------------------ writes

    def held(self) -> int:
        """Bytes the memory budget counts now: stored rows and pieces of puts on their way
        in (:mod:`flightq.server.budget`)."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        # With the lock held.
        t = self._tally
        return t.held + self._pending + self._held_outside() + t.kept.bytes

    def _read(self, p: Partition, rows: Collection[Row], reading: list[Reading] | None) -> None:
        # With the lock held: ``rows`` of ``p`` are read by an answer or a snapshot from
        # now until :meth:`end_reading` (what they keep alive stays counted).
        if reading is not None:
            rd = Reading(p, rows, p.media_fields)
            p.readings[id(rd)] = rd
            reading.append(rd)

    def reading_count(self) -> int:
        """How many answers and snapshots are reading rows of the store's partitions now."""
        with self._lock:
            return sum(len(p.readings) for p in self._parts.values())

    def end_reading(self, reading: Reading) -> None:
        """An answer or a snapshot is over: what only it kept alive stops counting."""
        with self._changed:
            reading.partition.readings.pop(id(reading), None)
            if self._tally.kept.end(reading):
                self._wake()

    def counted(self) -> int:
        """Bytes the memory budget counts now: :meth:`held`, :meth:`declared` and
        :meth:`records`."""
        with self._lock:
            return self._counted()

    def declared(self) -> int:
        """Bytes the memory budget counts for the declared partitions themselves
        (:attr:`~flightq.server.partition.Partition.declared`)."""
        with self._lock:
            return self._declared()

    def records(self) -> int:
        """Bytes the memory budget counts for what partitions keep of their past
        (:attr:`~flightq.server.partition.Partition.records`)."""
        with self._lock:
            return self._records()

    def _counted(self) -> int:
        # With the lock held: what the budget counts, the partitions' declarations and
        # records of the past included.
        return self._held() + self._standing() + self._records()

    def _declared(self) -> int:
        # With the lock held.
        return self._tally.declared

    def _leased(self) -> int:
        # With the lock held: what the partitions' live claims keep (their keys), and the
        # logs of keys moved while large puts merge.
        return self._tally.leased

    def _standing(self) -> int:
        # With the lock held: what the budget counts that no record drop can free.
        return self._declared() + self._leased()

    def _records(self) -> int:
        # With the lock held.
        return self._tally.records

    def _fit(self, need: int = 0) -> None:
        """Forget records of the past (journal entries, ended leases, put ids: the oldest
        of any partition first) until they fit what the budget leaves them with ``need``
        bytes more, or :data:`~flightq.server.budget.RECORDS_SHARE` of it, whichever is
        more. With the lock.

        Records are made without asking for room (a clear, an ack), so they are called
        to fit after every change, and they never make a put or a declaration wait: what
        is waited for leaves them out, and they make way for it here. Their share is kept
        even where rows, declarations and live claims fill the budget (a claim is never
        refused, so these may pass it for a while): the newest records make repeated acks
        and put retries work, and what is counted passes the budget by at most that share
        and the live claims. Each drop goes :data:`~flightq.server.budget.RECORDS_SLACK`
        of the budget below what is allowed, so the next waits for that many new
        records; only the partitions keeping records are looked at."""
        budget = self.memory_budget
        t = self._tally
        if budget is None or not t.records:
            return
        allowed = max(budget - self._held() - self._standing() - need, budget // RECORDS_SHARE)
        if t.records <= allowed:
            return
        drop = min(t.records, t.records - allowed + budget // RECORDS_SLACK)
        parts = [
            (stamp, i, p) for i, p in t.holders.items() if (stamp := p.oldest_record()) is not None
        ]
        heapq.heapify(parts)
        while drop > 0 and parts:
            _, i, p = parts[0]
            drop -= p.drop_oldest_record()
            stamp = p.oldest_record()
            if stamp is None:
                heapq.heappop(parts)
            else:
                heapq.heapreplace(parts, (stamp, i, p))

    def _held_outside(self) -> int:
        # With the lock held: answers being written, and those waiting for their reader.
        return self._outside + (0 if self.unread is None else self.unread())

    def take_outside(self, n: int, cap: int) -> bool:
        """Count ``n`` bytes the server is about to hold outside the store (an answer
        written into shared memory for its reader) if they fit: under the memory budget,
        and with what :attr:`unread` already counts, under ``cap``. Returns whether they
        were counted; :meth:`give_outside` stops counting them once :attr:`unread` does."""
        with self._lock:
            budget = self.memory_budget
            if self._held_outside() + n > cap or (
                budget is not None and self._held() + self._standing() + n > budget
            ):
                return False
            self._fit(n)
            self._outside += n
            return True

    def give_outside(self, n: int) -> None:
        """Stop counting bytes :meth:`take_outside` counted."""
        with self._changed:
            self._outside -= n
            self._wake()

    def advance(self, name: str, timeout: float) -> Advance:
        """Bytes a put to ``name`` will hold before its pieces exist, counted from the
        moment they are taken (:class:`Advance`); it waits up to ``timeout`` seconds for
        room, from now."""
        return Advance(self, name, time.monotonic() + timeout)

    def reserve(
        self,
        name: str,
        piece: Piece,
        so_far: int,
        timeout: float,
        advance: Advance | None = None,
    ) -> None:
        """Count a piece of a put to ``name`` as held from now on, waiting up to
        ``timeout`` seconds for room under the memory budget; ``so_far`` is what the put's
        earlier pieces reserved. Bytes the put counted in ``advance`` are taken over
        first, without waiting. A piece reserved before counts only what it grew by.
        Whoever lets go of the piece without storing it calls :meth:`release`; :meth:`put`
        takes the reservation over.

        Raises
        ------
        ResourceExhaustedError
            If the put passes the whole budget, or no room is made within ``timeout``.
        """
        # Its rows, the media payloads it brought, and the memory beyond it (the first's).
        n = int(piece.held.sum()) + int(piece.own.sum()) + piece.brings + piece.extra
        more = n - piece.reserved  # a piece reserved already counts what it grew by
        with self._changed:
            ahead = 0 if advance is None else min(more, advance.left)
            if more > ahead:  # may raise: the advance keeps its bytes until the put lets go
                self._wait_for_space(name, more - ahead, timeout, whole=so_far + n, holding=True)
            if advance is not None:
                ahead = advance.take(more)
            self._pending += more - ahead
            piece.reserved = n

    def release(self, pieces: Iterable[Piece]) -> None:
        """Stop counting pieces that were reserved and will not be stored."""
        with self._changed:
            freed = 0
            for pc in pieces:
                freed, pc.reserved = freed + pc.reserved, 0
            if freed:
                self._pending -= freed
                self._wake()

    def _wait_for_rows(self, name: str, new: int, timeout: float) -> bool:
        """Wait until the partition's row limit has room for a put's ``new`` rows; returns
        whether it waited (let go of the lock)."""
        limit = self._get(name).max_rows
        if limit is None:
            return False
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            self._check_open(f"put to {name!r}")
            p = self._get(name)
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
                    retry=RETRY_FULL,
                )
            self._wait_for_room(name, left)
            waited = True

    def _wait_for_space(
        self,
        name: str,
        need: int,
        timeout: float,
        whole: int | None = None,
        mine: int = 0,
        holding: bool = False,
    ) -> bool:
        """Wait until the memory budget has room for ``need`` more bytes (of a put of
        ``whole`` bytes, ``need`` when None; ``mine`` of what is held is the put's own
        reservation); returns whether it waited (let go of the lock). ``holding``: the
        put holds those bytes already (received, not counted): it is refused at once
        rather than kept waiting where the puts waiting so would hold more than
        ``budget // WAITING_SHARE`` in all with it."""
        budget = self.memory_budget
        if budget is None:
            return False
        whole = need if whole is None else whole
        declared = self._declared()
        if whole > budget - declared:
            raise ResourceExhaustedError(
                f"put to {name!r} carries {whole} bytes, more than the server's whole memory "
                f"budget of {budget} bytes"
                + (f" less the {declared} its partitions' declarations hold" if declared else "")
                + "; split it",
                expected=budget - declared,
                actual=whole,
                partition=name,
            )
        deadline = time.monotonic() + timeout
        waited = False
        counted = 0  # of this put's bytes, among those of the puts waiting
        try:
            while True:
                self._check_open(f"put to {name!r}")
                held = self._held() - mine
                declared, leased = self._declared(), self._leased()
                if held + declared + leased + need <= budget:  # records of the past make way
                    self._fit(need - mine)
                    return waited
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhaustedError(
                        f"put to {name!r} of {need} bytes: the server holds {held} of its "
                        f"{budget}-byte memory budget (and {declared} in its "
                        f"{len(self._parts)} partitions' declarations, {leased} in their "
                        "live claims' records and merging puts' logs) and no space was "
                        f"cleared within {timeout:g}s; clear consumed rows",
                        expected=budget,
                        actual=held + declared + leased + need,
                        partition=name,
                        retry=RETRY_FULL,
                    )
                if holding and not counted:
                    counted = self._waiting_room(name, need, budget)
                self._wait_for_room(name, left)
                waited = True
        finally:
            self._waiting_bytes -= counted

    def _waiting_room(self, name: str, need: int, budget: int) -> int:
        """Count ``need`` bytes a put holds among those of the puts waiting for room, if
        they fit ``budget // WAITING_SHARE`` (any put waits where none does, whatever its
        size); returns them. With the lock.

        Raises
        ------
        ResourceExhaustedError
            If they do not: the put is refused at once, its bytes let go.
        """
        share = budget // WAITING_SHARE
        if self._waiting_bytes and self._waiting_bytes + need > share:
            raise ResourceExhaustedError(
                f"put to {name!r} of {need} bytes: the server's memory budget of {budget} "
                f"bytes is full and puts holding {self._waiting_bytes} bytes wait for room "
                f"already, at most {share} in all; try again once a consumer clears rows",
                expected=share,
                actual=self._waiting_bytes + need,
                partition=name,
                retry=RETRY_FULL,
            )
        self._waiting_bytes += need
        return need

    def _wait_for_room(self, name: str, left: float) -> None:
        """Let go of the lock until a change or ``left`` seconds pass, counted meanwhile as
        a put waiting for room in ``name`` (:meth:`stats`)."""
        self._waiting_puts[name] = self._waiting_puts.get(name, 0) + 1
        # inf or huge: wait in chunks; while answers wait for their reader, look again
        # each second (a reader taking one tells no one)
        chunk = 1.0 if self.unread is not None and self.unread() else 3600.0
        try:
            self._changed.wait(min(left, chunk))
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
    ) -> Stored:
        """Store the rows of validated pieces, all or nothing. Returns what it did: the
        rows written, and those of them it created.

        Under the lock: the partition plans the put (every check), the store waits for
        room by the plan's numbers (memory budget, row limit), and the partition applies
        it. With a budget or a row limit, waits up to ``timeout`` seconds for clears to make
        room. A retry is idempotent: a ``put_id`` seen recently in the partition, or a put
        whose every cell and tag equals what its rows already hold, is acknowledged again
        and stores nothing (a replay: it created nothing).

        Raises
        ------
        ConflictError, MissingFieldError, ShapeError, EncodeError
            Naming the row key and field; nothing is stored.
        ResourceExhaustedError
            If the budget has no room for the put within ``timeout``.
        """
        keys = put_keys(pieces)
        deadline = time.monotonic() + timeout
        epochs = {pc.epoch for pc in pieces} - {0}
        for attempt in itertools.count():
            locked = attempt >= _PLANS  # lost to writes of its keys each time: plan here
            merge: Merge | None = None
            if not locked:
                p = self.partition(name)
                _same_partition(p, epochs)
                seen = p.writes  # read before any row: later writes are in the journal
                try:
                    plan = plan_put(p, pieces, overwrite, put_id, seen)
                except FlightqError:
                    if p.writes != seen:
                        keys.set()  # for the check below: built here, not under the lock
                    with self._lock:  # refused on what it read: is that still so?
                        if not self._stale(name, p, seen, keys):
                            raise
                    continue
                if plan.replay is None and Merge.wanted(p, plan):
                    with self._lock:
                        merge = Merge.begin(p, plan)
                    try:
                        merge.build(plan)  # outside the lock, a slice at a time
                    except BaseException:
                        with self._changed:
                            self._end_merge(merge)
                        raise
                if p.writes != seen:
                    keys.set()  # as above
            with self._changed:
                try:
                    if locked:
                        p = self._get(name)
                        _same_partition(p, epochs)
                        plan = plan_put(p, pieces, overwrite, put_id, p.writes)
                    elif self._stale(name, p, plan.seen, keys):
                        continue
                    if plan.replay is not None:
                        return stored(plan)
                    mine = sum(pc.reserved for pc in pieces)  # counted already, as pending
                    left = max(0.0, deadline - time.monotonic())
                    need = plan.need + waiting_homes(pieces)  # media counted once, as it goes live
                    waited = self._wait_for_space(name, need, left, mine=mine)
                    waited = self._wait_for_rows(name, len(plan.new), left) or waited
                    if waited and self._stale(name, p, plan.seen, keys):
                        if not locked:
                            continue  # the lock was let go meanwhile: plan again
                        p = self._get(name)
                        _same_partition(p, epochs)
                        plan = plan_put(p, pieces, overwrite, put_id, p.writes)
                        if plan.replay is not None:
                            return stored(plan)
                    p.commit(plan, merge)
                    for pc in pieces:  # stored: counted by the rows from now on
                        self._pending -= pc.reserved
                        pc.reserved = 0
                    self._fit()  # its journal entry and put id, the oldest records out
                    self._changed.notify_all()  # puts waiting for room (budget, row limit)
                    self._wake_claims(name, p)
                    return stored(plan)
                finally:
                    if merge is not None:
                        self._end_merge(merge)
        raise AssertionError("unreachable")  # pragma: no cover

    def _end_merge(self, merge: Merge) -> None:
        # With the lock: the merge's logs of moved keys go, and puts waiting for room
        # look again (the budget counted them).
        merge.end()
        self._changed.notify_all()

    def _stale(self, name: str, p: Partition, seen: int, keys: PutKeys) -> bool:
        # With the lock held: whether a plan of ``p`` from write count ``seen`` may no
        # longer hold (the partition was dropped or replaced, or a write touched ``keys``).
        if self._parts.get(name) is not p:
            return True
        return p.writes != seen and p.touched(seen, keys.set())

    def clear(
        self,
        name: str,
        keys: Sequence[str] | None,
        put_id: str | None = None,
        groups: Sequence[int] | None = None,
        missing_ok: bool = False,
    ) -> int:
        """Remove rows (all when ``keys`` is None). Returns how many were removed. A
        cleared row counts as acknowledged: the leases holding it end for it. With
        ``put_id``, the partition also forgets that put id, in the same step: a retry of
        the put is stored again, not acknowledged as a replay.

        With ``groups`` (``[first, end]``, a put's :class:`~flightq.protocol.PutCreated`),
        only the rows among ``keys`` whose creation number lies in ``[first, end)`` go:
        the rows that one put created, which no other put's row shares, whatever was put
        or cleared since. Keys not held are skipped: undoing a put never removes a row it
        did not create, such as one a replay or a write-back only acknowledged. With
        ``missing_ok``, keys not held are skipped too (the others go).

        Raises
        ------
        NotFoundError
            If a key is unknown, without ``groups`` or ``missing_ok`` (nothing is removed
            then), or the partition is.
        """
        with self._changed:
            p = self._get(name)
            if groups is not None:
                first, end = groups
                named = list(p.rows) if keys is None else keys
                rows = p.rows
                keys = [
                    k for k in named if (r := rows.get(k)) is not None and first <= r.group < end
                ]
            if keys is None:
                n = len(p.rows)
                p.cleared(p.rows.values())
                p.rows.clear()
                forget_rows(p, None)
                p.nbytes = 0
                p.held = 0
                p.progress.removed_all()
                p.wrote(None)
            else:
                if groups is None and not missing_ok:
                    _known(p, keys)
                gone = []
                for k in keys:
                    row = p.rows.pop(k, None)
                    if row is None:
                        continue
                    gone.append(row)
                    p.nbytes -= row.nbytes
                n = len(gone)
                p.rows = shrunk(p.rows)  # swapped: a plan or merge reading it sees it whole
                left = p.cleared(gone)
                if gone:  # the journal names each removed row once, a no-op clear nothing
                    removed = [row.key for row in gone]
                    p.wrote(removed)
                    p.progress.removed(removed)
                    forget_rows(p, removed)
                for lease in list(p.progress.leases.values()):
                    p.progress.settle(lease)
                p.compact(left)  # last: the clear stands whatever it does
            if put_id is not None:
                p.forget_put(put_id)
            self._wake()
            return n

    def reset(self, name: str, task: str, keys: Sequence[str] | None) -> int:
        """Make rows (all when None) claimable again for ``task``, whatever their state
        (leased, acknowledged, dead), their deliveries forgotten. Returns how many were
        not ready before."""
        with self._changed:
            p = self._get(name)
            _task(p, task)
            if keys is not None:
                _known(p, keys)
            n = p.progress.reset(task, keys, p.rows)
            self._wake()
            return n

    # ------------------------------------------------------------------ leases

    def _expire(self, p: Partition) -> None:
        # With the lock held: end the partition's leases past their time.
        if p.progress.expire(time.monotonic()):
            self._wake()

    def _lease(self, p: Partition, claim: str) -> Lease:
        lease = p.progress.find(claim)
        if lease is None:
            raise NotFoundError(
                f"partition {p.name!r} knows no claim {claim[:64]!r} (a claim's id is "
                "remembered until a few thousand later ones have ended, or the memory "
                "budget needs the room, and not over a restart)",
                key=claim[:64],
                partition=p.name,
            )
        return lease

    def ack(self, name: str, claim: str, keys: Sequence[str] | None) -> tuple[int, list[str]]:
        """Mark rows of a claim (all when ``keys`` is None) done for its task. Returns the
        rows acknowledged and those the claim had lost to another (its lease expired and
        another claim took them, or they went to the dead letters).

        Raises
        ------
        NotFoundError
            If the partition has no such claim holding rows, or a key is not the claim's.
        """
        with self._changed:
            p = self._get(name)
            self._expire(p)
            lease = self._lease(p, claim)
            _of_lease(p, lease, keys)
            rows = p.rows
            born = {k: r.group for k in lease.keys if (r := rows.get(k)) is not None}
            out = p.progress.ack(lease, keys, born)
            self._wake()
            return out

    def nack(
        self, name: str, claim: str, keys: Sequence[str] | None, failed: bool
    ) -> tuple[int, int]:
        """Release rows of a claim (all it holds when ``keys`` is None): ready again, or,
        with ``failed`` counting a failed delivery, dead once they reach the partition's
        ``max_failures``. Returns (rows made ready, rows gone dead).

        Raises
        ------
        NotFoundError
            If a key is not the claim's.
        """
        with self._changed:
            p = self._get(name)
            self._expire(p)
            lease = self._lease(p, claim)
            _of_lease(p, lease, keys)
            out = p.progress.nack(lease, keys, failed)
            self._wake()
            return out

    def dead_letters(
        self, name: str, task: str, limit: int
    ) -> tuple[list[str], list[str], list[int], int]:
        """The first ``limit`` dead rows of ``task``: keys, why, deliveries, and how many
        there are in all."""
        with self._lock:
            p = self._get(name)
            st = _task(p, task)
            keys = list(itertools.islice(st.dead, limit))
            return (
                keys,
                [st.dead[k] for k in keys],
                [st.deliveries.get(k, 0) for k in keys],
                len(st.dead),
            )

    def _session_open(self, name: str, session: str | None) -> None:
        # With the lock held: refuse a claim under a session that is not open.
        if session is not None and session not in self._sessions:
            raise NotFoundError(
                f"claim from {name!r}: session {session[:64]!r} is not open (the "
                "connection that opened it is gone); open a new one",
                key=session[:64],
                partition=name,
            )

    def open_session(self) -> str:
        """A new consumer session; its leases end when :meth:`end_session` is called."""
        sid = uuid.uuid4().hex
        with self._lock:
            self._sessions.add(sid)
        return sid

    def end_session(self, sid: str) -> int:
        """The consumer's connection is gone: its leases end, each row's failures
        counted. Returns the rows released."""
        with self._changed:
            self._sessions.discard(sid)
            n = sum(p.progress.session_ended(sid) for p in self._parts.values())
            if n:
                self._wake()
            return n

    # ------------------------------------------------------------------ reads

    def rows_for_get(
        self,
        name: str,
        keys: Sequence[str],
        fields: Sequence[str] | None,
        reading: list[Reading] | None = None,
    ) -> tuple[Partition, list[Row], list[str]]:
        """Rows by key, in order, and the fields to return; with ``reading``, the rows are
        read by an answer from now (a :class:`Reading` appended: :meth:`end_reading`).

        Raises
        ------
        NotFoundError
            Naming every unknown key.
        MissingFieldError
            Naming a requested field and the rows that lack it.
        """
        with self._lock:
            p = self._get(name)
            try:
                rows = list(map(p.rows.__getitem__, keys))
            except KeyError:
                _known(p, keys)  # names every unknown key
                raise
            self._read(p, rows, reading)
        # Outside the lock: the rows found are never edited (a put replaces a row).
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
        lease: float | None = None,
        session: str | None = None,
        park: Callable[[], Callable[[], None] | None] | None = None,
        call: str | None = None,
        reading: list[Reading] | None = None,
    ) -> tuple[Partition, list[Row], list[str], Lease]:
        """Wait for ``batch_size`` ready rows, lease them to ``task``, return them.

        A row is ready when no claim of the task holds it, it is neither acknowledged nor
        dead, and it has every field named in ``fields`` (the schema's required fields
        when ``fields`` is None) and in ``wait_for``. In a partition with a group size,
        only whole ready groups are taken, in creation order. The rows are returned with
        ``fields`` (every column they have when None), under a lease of ``lease`` seconds
        (the partition's when None) that also ends when ``session`` ends. ``cancelled``
        (e.g. ``ServerCallContext.is_cancelled``) is polled while waiting: a claim its
        caller abandoned stops waiting and takes no rows. ``park()`` is called once the
        claim must wait (it may refuse, raising) and returns what is called when it stops
        waiting (or None). ``call``: the caller's name for the claim, which
        :meth:`cancel_claim` names to stop it. ``reading``: as :meth:`rows_for_get`'s.

        Raises
        ------
        ClaimTimeoutError
            If not enough rows become ready within ``timeout`` seconds.
        ClaimCancelledError
            If :meth:`cancel_claim` named ``call`` while the claim waited, or before. A
            claim of the same name coming while another waits (its caller's retry) waits
            beside it, and a cancel stops both.
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
            if p.max_rows is not None and batch_size > p.max_rows:
                raise ProtocolError(
                    f"claim from {name!r}: batch_size {batch_size} is more than the "
                    f"partition's limit of {p.max_rows} rows; no claim could be served",
                    expected=p.max_rows,
                    actual=batch_size,
                    partition=name,
                )
            need = tuple(fields) if fields is not None else p.schema.required
            need = tuple(dict.fromkeys((*need, *wait_for)))
            for f in need:
                p.schema[f]  # raises on an undeclared field
            self._session_open(name, session)
            if call is not None:
                self._call_free(name, call, session)
            waiter: _Waiter | None = None  # once it waits
            unpark: Callable[[], None] | None = None
            seen = (0, -1)  # the partition (its epoch) and its progress version last looked at
            try:
                while True:
                    self._check_open(f"claim from {name!r}")
                    if waiter is not None and waiter.cancelled:
                        raise ClaimCancelledError.of(name, task)
                    if cancelled is not None and cancelled():
                        raise FlightqTimeoutError(
                            f"claim from {name!r} for task {task!r} was cancelled by its "
                            "caller; no rows were taken",
                            partition=name,
                        )
                    p = self._get(name)  # the partition may have been dropped meanwhile
                    self._expire(p)
                    if (p.epoch, p.progress.version) != seen:
                        seen = (p.epoch, p.progress.version)
                        complete = complete_keys(p, need)
                        picked = ready_rows(p.rows, g, p.progress.tasks[task], complete, batch_size)
                        if picked is not None:
                            # The session may have ended while the claim waited: rows
                            # taken under it now would stay leased to no one.
                            self._session_open(name, session)
                            picked = grouped_by_media(p, picked)  # each image once
                            now = time.monotonic()
                            secs = p.lease if lease is None else lease
                            keys = [r.key for r in picked]
                            born = [r.group for r in picked]
                            taken = p.progress.take(task, keys, secs, now, session, born)
                            self._read(p, picked, reading)
                            return p, picked, _fields_for(p, picked, fields), taken
                    now = time.monotonic()
                    left = deadline - now
                    if left <= 0:
                        ready = count_ready(p.progress.tasks[task], complete_keys(p, need))
                        raise ClaimTimeoutError(
                            f"claim of {batch_size} rows for task {task!r} from partition "
                            f"{name!r} timed out after {timeout:g}s: {ready} rows ready with "
                            f"fields {list(need)}",
                            expected=batch_size,
                            actual=ready,
                            partition=name,
                        )
                    if waiter is None:
                        unpark = park() if park is not None else None
                        waiter = _Waiter(
                            threading.Condition(self._lock), task, batch_size, need, call, session
                        )
                        if call is not None:
                            self._calls.setdefault((name, call), {})[waiter] = None
                        self._claims.setdefault(name, {})[waiter] = None
                        tasks = self._waiting.setdefault(name, {})
                        tasks[task] = tasks.get(task, 0) + 1
                    # Until a change, the next lease expiry or the deadline (in chunks when
                    # inf or huge); a caller that may go away is polled more often.
                    wake = min(left, p.progress.next_expiry - now + 0.001)
                    waiter.changed.wait(min(wake, 3600.0 if cancelled is None else _POLL))
            finally:
                if waiter is not None:
                    self._stop_waiting(name, waiter)
                if unpark is not None:
                    unpark()

    def cancel_claim(self, name: str, call: str, session: str | None = None) -> int:
        """Stop the claims on partition ``name`` that their caller named ``call`` (under
        consumer session ``session`` only, where given): those waiting now wake and fail
        :class:`ClaimCancelledError` (returns 1; 0 where none waited), and the name is
        kept (:data:`_CANCELS_KEPT` names, :data:`_CANCEL_KEPT_S` seconds), so that a claim
        of that name arriving after its cancel (late, or a retry of one whose stream
        broke) is refused at once. A claim that took its rows already is left alone: its
        caller gives them back.

        Raises
        ------
        NotFoundError
            If there is no partition ``name``.
        """
        with self._lock:
            self._get(name)  # an unknown partition: NotFoundError (and no name kept)
            waiters = [
                w
                for w in self._calls.get((name, call), {})
                if session is None or w.session == session
            ]
            for waiter in waiters:  # a stale one (its stream broke) and its retry alike
                waiter.cancelled = True
                waiter.changed.notify()
            # Kept even where one waited: a retry of it may still be on its way.
            now = time.monotonic()
            kept = self._cancelled
            key = (name, call, session)
            kept.pop(key, None)
            kept[key] = now
            for old, at in list(kept.items()):
                if len(kept) <= _CANCELS_KEPT and now - at < _CANCEL_KEPT_S:
                    break
                del kept[old]
            return 1 if waiters else 0

    def _call_free(self, name: str, call: str, session: str | None) -> None:
        """Refuse a claim named ``call`` (under ``session``) whose cancel came before it:
        one naming its session, or none. With the lock."""
        now = time.monotonic()
        for key in {(name, call, session), (name, call, None)}:
            at = self._cancelled.pop(key, None)
            if at is not None and now - at < _CANCEL_KEPT_S:
                raise ClaimCancelledError.of(name)

    def _stop_waiting(self, name: str, waiter: _Waiter) -> None:
        if waiter.call is not None:
            same = self._calls.get((name, waiter.call), {})
            same.pop(waiter, None)
            if not same:
                self._calls.pop((name, waiter.call), None)
        claims = self._claims[name]
        del claims[waiter]
        if not claims:
            del self._claims[name]
        tasks = self._waiting[name]
        tasks[waiter.task] -= 1
        if not tasks[waiter.task]:
            del tasks[waiter.task]
            if not tasks:
                del self._waiting[name]

    def unclaim(self, name: str, lease: Lease, sent: bool = True) -> None:
        """Undo a claim whose rows never reached the consumer whole: they are ready again,
        no failure counted. ``sent``: its answer broke off on its way, a delivery (the
        rows go behind the ready ones); else it never left: back where they were, no
        delivery counted."""
        with self._changed:
            p = self._parts.get(name)
            if p is not None and p.progress.leases.get(lease.id) is lease:
                if sent:
                    p.progress.release(lease, None)
                else:
                    p.progress.unclaim(lease)
                self._wake()

    def scan(
        self, name: str, reading: list[Reading] | None = None
    ) -> tuple[Partition, list[Row], list[str]]:
        """Every row not yet cleared, and the union of the fields they carry; ``reading``:
        as :meth:`rows_for_get`'s.

        The rows are listed under the store's lock (a copy of the row table: a few ms for
        1e6 rows), their fields gathered without it, a slice of rows at a time, and only
        until every declared field was seen (a put replaces a row and never edits one):
        describing or scanning a large partition stops no other call (gathering the fields
        of 600 000 rows under the lock, in one call, held it for 60 ms)."""
        with self._lock:
            p = self._get(name)
            rows = list(p.rows.values())
            self._read(p, rows, reading)
        return p, rows, _fields_for(p, rows, None)

    # ------------------------------------------------------------------ description

    def stats(self) -> dict[str, Any]:
        """Rows, bytes (payload, and ``held``: what the budget counts) and per-task progress
        of every partition, the claims waiting for rows
        right now (per partition and task, and in all) and the puts waiting for room right
        now (per partition)."""
        with self._lock:
            for p in self._parts.values():
                self._expire(p)
            return {
                "partitions": {n: self._partition_stats(n) for n in self._parts},
                "rows": sum(len(p.rows) for p in self._parts.values()),
                "bytes": sum(p.nbytes for p in self._parts.values()),
                "held": self._held(),
                "waiting_claims": sum(sum(t.values()) for t in self._waiting.values()),
            }

    def lease_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per partition and task, since it was declared: ``redelivered`` (deliveries
        after a row's first), ``expired`` and ``gone`` (rows whose lease ended by expiry,
        or by the end of its consumer's session), for metrics."""
        with self._lock:
            for p in self._parts.values():
                self._expire(p)
            return {
                n: {
                    t: {"redelivered": st.redelivered, "expired": st.expired, "gone": st.gone}
                    for t, st in p.progress.tasks.items()
                }
                for n, p in self._parts.items()
            }

    def inspect(self, name: str) -> dict[str, Any]:
        """One partition in detail: fields present, per task delivered and ready rows and
        waiting claims, and its puts waiting for room.

        The counts over every row (fields present, ready rows) are taken from a snapshot
        made under the store's lock (copies of the row table and of each task's ready
        and leased keys: a few ms for 1e6 rows; the rows themselves are shared, as a put
        replaces a row and never edits one) and counted without it, so that inspecting
        a large partition never stops other clients' calls (counting 200 000 rows under
        the lock held it for 0.3 s). They are exact as of the snapshot."""
        with self._lock:
            p = self._get(name)
            self._expire(p)
            d = self._partition_stats(name)
            rows = dict(p.rows)
            tasks = {
                t: types.SimpleNamespace(ready=list(st.ready), leased=list(st.leased))
                for t, st in p.progress.tasks.items()
            }
        counts = {f.name: 0 for f in p.schema.fields}
        for r in rows.values():
            for f in r.cells:
                counts[f] += 1
        d["fields"] = {k: v for k, v in counts.items() if v}
        g = p.group_size
        d["ready"] = {t: len(ready_rows(rows, g, st, None, None) or []) for t, st in tasks.items()}
        return d

    def list_keys(
        self,
        name: str,
        keys: Sequence[str] | None,
        hold: Callable[[int], None] | None = None,
        hide_tag_values: str | None = None,
    ) -> dict[str, Any]:
        """Rows' keys (all, in insertion order, when ``keys`` is None), their tags and the
        fields each has, as the ``list_keys`` reply; tags whose key starts with
        ``hide_tag_values`` with their value left out (None). ``hold`` is told, before the reply is
        built, about how many bytes it takes: what the budget counts for the rows' own
        keys and tags and :data:`~flightq.server.budget.REPLY_ENTRY_BYTES` a row
        (:mod:`flightq.server.replies`).

        Raises
        ------
        NotFoundError
            Naming every unknown key.

        The rows are picked under the store's lock, their tags and fields read outside it
        (a put replaces a row, with new maps of cells and tags, and never edits one), so
        that listing a large partition stops no other call. Where the reply must wait for
        room, it waits holding no row (a row cleared meanwhile would keep its data alive,
        no longer counted), and picks them again once it has room.
        """

        def pick() -> tuple[Partition, list[Row]]:
            with self._lock:
                p = self._get(name)
                if keys is None:
                    return p, list(p.rows.values())
                _known(p, keys)
                rows = [p.rows[k] for k in keys]
                _listable(p, rows)
                return p, rows

        p, rows = pick()
        if hold is not None:
            per_row = REPLY_ENTRY_BYTES - row_overhead(len(p.tasks))
            n = sum(r.held for r in rows) + per_row * len(rows)
            if n > SMALL_REPLY_BYTES:  # it may wait
                del p, rows
                hold(n)
                p, rows = pick()
            else:
                hold(n)
        hidden = None if hide_tag_values is None else HiddenTags(hide_tag_values)
        tags = [dict(r.tags if hidden is None else hidden.shown(r.tags)) for r in rows]
        cells = [r.cells for r in rows]
        names = _present(p, rows)
        index = {n: i for i, n in enumerate(names)}
        return {
            "keys": [r.key for r in rows],
            "tags": tags,
            "fields": names,
            "present": [sorted(index[f] for f in c) for c in cells],
        }

    def _partition_stats(self, name: str) -> dict[str, Any]:
        # With the lock held: one partition and what waits on it right now.
        p = self._get(name)
        return _describe(p, self._waiting.get(name, {}), self._waiting_puts.get(name, 0))


class _Waiter:
    """A claim waiting for rows, woken through ``changed`` (a condition on the store's
    lock); equal only to itself."""

    __slots__ = ("batch_size", "call", "cancelled", "changed", "need", "session", "task")

    def __init__(
        self,
        changed: threading.Condition,
        task: str,
        batch_size: int,
        need: tuple[str, ...],
        call: str | None = None,
        session: str | None = None,
    ) -> None:
        self.changed, self.task, self.batch_size, self.need = changed, task, batch_size, need
        #: The caller's name for the claim (None: none), its consumer session, and
        #: whether a cancel named it.
        self.call, self.session = call, session
        self.cancelled = False


#: Names cancelled, kept for a claim of them arriving after its cancel: at most this
#: many, for at most this many seconds.
_CANCELS_KEPT = 1024
_CANCEL_KEPT_S = 60.0


#: Most names an error lists: other partitions are never listed wholesale (they may be
#: other users'), and a partition's tasks only while they are this few.
_LISTED = 8
#: Most names searched for close matches, and the characters of each compared: difflib's
#: worst case over names a client chose is then under 20 ms of CPU per error.
_CANDIDATES = 256
_COMPARED = 48


def _near(e: NotFoundError, name: str, names: Iterable[str]) -> NotFoundError:
    """``e``, remembering the names (at most :data:`_CANDIDATES`, copied now, under the
    store's lock) that :func:`suggest` later searches for ones close to ``name``."""
    e.__dict__["_near"] = (name, list(itertools.islice(names, _CANDIDATES)))
    return e


def suggest(e: BaseException) -> None:
    """Add ``"; did you mean 'a', 'b'?"`` (at most 3 close names) to the message of a
    :class:`NotFoundError` the store raised for an unknown name. Called where the error
    leaves the server, outside the store's lock: a close-name search runs difflib over
    names a client may have chosen to make it slow, and no other call waits for it."""
    near = e.__dict__.pop("_near", None)
    if near is None or not e.args:
        return
    name, names = near
    found = difflib.get_close_matches(name[:_COMPARED], [n[:_COMPARED] for n in names], n=3)
    if found:
        full = {n[:_COMPARED]: n for n in reversed(names)}  # the first name of each prefix
        e.args = (f"{e.args[0]}; did you mean {', '.join(repr(full[n]) for n in found)}?",)


def _known(p: Partition, keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in p.rows]
    if missing:
        shown = ", ".join(repr(k) for k in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise NotFoundError(
            f"partition {p.name!r} has no row key {shown}{more}", key=missing[0], partition=p.name
        )


def _task(p: Partition, task: str) -> TaskState:
    st = p.progress.tasks.get(task)
    if st is None:
        few = len(p.tasks) <= _LISTED
        e = NotFoundError(
            f"partition {p.name!r} declares no task {task!r}"
            + (f"; declared: {list(p.tasks)}" if few else ""),
            expected=list(p.tasks),
            actual=task,
            partition=p.name,
        )
        raise e if few else _near(e, task, p.tasks)
    return st


def _of_lease(p: Partition, lease: Lease, keys: Sequence[str] | None) -> None:
    """Refuse keys that are not the lease's (nothing is acknowledged or released then)."""
    if keys is None:
        return
    mine = set(lease.keys)
    other = [k for k in keys if k not in mine]
    if other:
        raise NotFoundError(
            f"claim {lease.id!r} of partition {p.name!r} did not take row key "
            f"{other[0]!r}" + (f" and {len(other) - 1} more" if len(other) > 1 else ""),
            key=other[0],
            partition=p.name,
        )


def _copy_progress(
    p: Partition,
    rows: dict[str, Row],
    tasks: list[tuple[str, set[str], dict[str, Any], dict[str, int], dict[str, int], bool]],
) -> Progress:
    """A partition's progress for a snapshot, from copies of its rows and its tasks' done,
    dead, deliveries and failures: leased rows are not done, so after a restore they are
    ready again."""
    out = Progress(p.tasks, p.max_failures)
    for t, done, dead, deliveries, failures, trimmed in tasks:
        c = out.tasks[t]
        c.done, c.dead, c.deliveries, c.failures, c.trimmed = (
            done,
            dead,
            deliveries,
            failures,
            trimmed,
        )
        c.ready = {k: None for k in rows if k not in done and k not in dead}
    return out


_CELLS = operator.attrgetter("cells")


#: What a ``list_keys`` naming keys may cost beyond listing each of the partition's rows
#: once (the slack for a partition of few rows).
LIST_SLACK_BYTES = 16 * 2**20


def _listable(p: Partition, rows: list[Row]) -> None:
    """Refuse a listing of ``rows`` (keys named, some perhaps many times) that would take
    more than listing every row of the partition once, and :data:`LIST_SLACK_BYTES`: each
    entry copies its row's tags, so a key named thousands of times turns a few KB of
    request into gigabytes of reply (and past 2 GiB, one gRPC message, the process ends).

    Raises
    ------
    ResourceExhaustedError
        Naming the partition, the keys, what the listing would take and the fix.
    """
    cost = sum(r.held for r in rows)
    whole = sum(r.held for r in p.rows.values()) if cost > LIST_SLACK_BYTES else 0
    if cost > whole + LIST_SLACK_BYTES:
        raise ResourceExhaustedError(
            f"list_keys of {p.name!r}: the {len(rows)} keys named (some more than once) would "
            f"take about {cost} bytes to list, more than listing each of the partition's "
            f"{len(p.rows)} rows once ({whole} bytes) and {LIST_SLACK_BYTES} more; name each "
            "key once, or fewer keys per call",
            partition=p.name,
            expected=whole + LIST_SLACK_BYTES,
            actual=cost,
        )


#: Rows whose fields are gathered in one call (:func:`_present`): one such call holds the
#: interpreter for about 0.1 ms.
PRESENT_SLICE = 1024


def _present(p: Partition, rows: Sequence[Row]) -> list[str]:
    """The declared fields that some row of ``rows`` carries, in the schema's order.

    Gathered a slice of :data:`PRESENT_SLICE` rows at a time, so that other threads run
    between slices, and only until every declared field was seen (usually the first row)."""
    declared = len(p.schema.fields)
    present: set[str] = set(rows[0].cells) if rows else set()
    if len(present) >= declared:  # the first row has them all: the common case
        return [f.name for f in p.schema.fields]
    for i in range(0, len(rows), PRESENT_SLICE):
        present.update(*map(_CELLS, rows[i : i + PRESENT_SLICE]))
        if len(present) >= declared:
            break
    return [f.name for f in p.schema.fields if f.name in present]


def _fields_for(p: Partition, rows: list[Row], fields: Sequence[str] | None) -> list[str]:
    if fields is None:
        return _present(p, rows)
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


def _describe(p: Partition, waiting: dict[str, int], waiting_puts: int) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": p.schema.ref,
        "fingerprint": p.schema.fingerprint,
        "tasks": list(p.tasks),
        "group_size": p.group_size,
        "rows": len(p.rows),
        "bytes": p.nbytes,
        "held": p.held,
        "delivered": {t: len(st.done) + len(st.leased) for t, st in p.progress.tasks.items()},
        "acked": {t: len(st.done) for t, st in p.progress.tasks.items()},
        "leased": {t: len(st.leased) for t, st in p.progress.tasks.items()},
        "dead": {t: len(st.dead) for t, st in p.progress.tasks.items()},
        "claims": len(p.progress.leases),
        "waiting": {t: waiting.get(t, 0) for t in p.tasks},
        "waiting_puts": waiting_puts,
    }
    return d


def _check_names(name: str, tasks: Sequence[str]) -> None:
    """A partition's name and tasks within their caps (:mod:`flightq.server.budget`).

    Raises
    ------
    ResourceExhaustedError
        Naming the cap and what arrived.
    """
    if len(name) > MAX_NAME_CHARS:
        raise ResourceExhaustedError(
            f"partition name of {len(name)} characters: the limit is {MAX_NAME_CHARS}",
            expected=MAX_NAME_CHARS,
            actual=len(name),
        )
    if len(tasks) > MAX_TASKS:
        raise ResourceExhaustedError(
            f"partition {name!r} declares {len(tasks)} tasks: the limit is {MAX_TASKS}",
            expected=MAX_TASKS,
            actual=len(tasks),
            partition=name,
        )
    long = next((t for t in tasks if len(t) > MAX_NAME_CHARS), None)
    if long is not None:
        raise ResourceExhaustedError(
            f"partition {name!r}: a task name of {len(long)} characters; the limit is "
            f"{MAX_NAME_CHARS}",
            expected=MAX_NAME_CHARS,
            actual=len(long),
            partition=name,
        )


def _same_partition(p: Partition, epochs: set[int]) -> None:
    """Refuse a put whose pieces were checked against another partition of ``p``'s name
    (dropped and created again while the put streamed: its schema may differ)."""
    if epochs and epochs != {p.epoch}:
        raise ConflictError(
            f"put to {p.name!r}: the partition was dropped and created again while the put "
            "was sent; its rows were checked against the old one, nothing was stored; put "
            "them again",
            partition=p.name,
        )


class Advance:
    """Bytes a put holds before its pieces exist, counted against the memory budget from
    the moment they are taken: the segment a put through shared memory is copied into,
    counted before the copy starts (:func:`flightq.shm.store_copy`).

    The put's pieces take the bytes over as they are reserved (:meth:`Store.reserve`).
    What they leave is freed once every holder has let go: the put (:meth:`release`), and
    whoever :meth:`share` gave a hold to, such as a read of the writer's memory that
    outlives the put, whose late writes land in the segment.
    """

    def __init__(self, store: Store, name: str, deadline: float) -> None:
        self._store = store
        self._name = name
        self._deadline = deadline
        #: Bytes counted and not yet taken over by a piece.
        self.left = 0
        self._holders = 1
        self._released = False

    def hold(self, total: int) -> None:
        """Count ``total`` bytes in all from now on, waiting for room under the budget
        until the put's deadline.

        Raises
        ------
        ResourceExhaustedError
            If ``total`` passes the whole budget, or no room is made in time.
        """
        s = self._store
        with s._changed:
            more = total - self.left
            if more <= 0:
                return
            left = max(0.0, self._deadline - time.monotonic())
            s._wait_for_space(self._name, more, left, whole=total)
            s._pending += more
            self.left = total

    def take(self, n: int) -> int:
        """Hand up to ``n`` counted bytes to a piece; returns how many. With the store's lock."""
        t = min(n, self.left)
        self.left -= t
        return t

    def share(self) -> Callable[[], None]:
        """One more holder; returns its ``let_go()``, to call exactly once."""
        with self._store._lock:
            self._holders += 1
        return self._let_go

    def release(self) -> None:
        """The put lets go (again: nothing)."""
        with self._store._lock:
            if self._released:
                return
            self._released = True
        self._let_go()

    def _let_go(self) -> None:
        s = self._store
        with s._changed:
            self._holders -= 1
            if self._holders or not self.left:
                return
            s._pending -= self.left
            self.left = 0
            s._wake()
