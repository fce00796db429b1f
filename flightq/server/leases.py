"""Claims as leases: per task, which rows are ready, leased, acknowledged or dead.

A claim takes ready rows under a :class:`Lease`. The rows stay the lease's until one of
these ends it:

- ``ack``: they are done for the task (clearing a row also ends it);
- ``nack``: they are ready again, and no longer the lease's (a later ``ack`` of it
  leaves them alone);
- the lease expires, or the consumer's session (its connection) ends: ready again, each
  row's failures counted;
- a ``nack`` with ``failed``: ready again, the named rows' failures counted.

A row whose failures reach the partition's ``max_failures`` goes to the dead letters of
the task instead of back to ready: it no longer blocks or poisons claims, stays stored
(``get`` reads it, :meth:`TaskState.dead` names it) and ``reset`` makes it ready again.
Rows released go to the back of the task's ready order, behind rows ready already.

Nothing here locks or waits: :class:`flightq.server.store.Store` holds its lock around
every call.
"""

from __future__ import annotations

import math
import uuid
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .budget import (
    LEASE_KEY_OVERHEAD,
    LEASE_OVERHEAD,
    RETURNED_KEY_BYTES,
    Tally,
    keys_size,
    moved_cost,
    record_stamp,
    shrunk,
    tallied,
)

__all__ = [
    "TaskState",
    "Lease",
    "Progress",
    "lease_cost",
    "DEFAULT_LEASE",
    "DEFAULT_MAX_FAILURES",
]

#: Seconds a claim's rows stay leased without an ack, unless the partition or the claim
#: says otherwise.
DEFAULT_LEASE = 600.0
#: Failed deliveries (an expired lease, a consumer gone, a ``nack`` with ``failed``) after
#: which a row goes to the dead letters.
DEFAULT_MAX_FAILURES = 3
#: Leases that ended, remembered per partition so that a late or repeated ``ack`` of one
#: still acknowledges its rows that no other claim took meanwhile; each counts against the
#: memory budget while remembered (:func:`lease_cost`), and the store forgets the oldest
#: first when the budget needs their room (:meth:`Progress.drop_ended`).
ENDED_KEPT = 4096
#: Keys a task's :attr:`TaskState.moved` keeps while a large put merges outside the
#: store's lock; past it the merge falls back to the in-lock update. What the log keeps
#: counts against the memory budget meanwhile (:func:`~flightq.server.budget.moved_cost`).
MOVED_KEPT = 1 << 16


@dataclass
class TaskState:
    """Where each row stands for one task."""

    #: Rows that can be claimed, in claim order.
    ready: dict[str, None] = field(default_factory=dict)
    #: Rows under a lease, to the lease's id.
    leased: dict[str, str] = field(default_factory=dict)
    #: Rows acknowledged.
    done: set[str] = field(default_factory=set)
    #: Rows given up on, to why (``"expired"``, ``"gone"``, ``"failed"``).
    dead: dict[str, str] = field(default_factory=dict)
    #: Times each row was delivered (claimed), for rows delivered at least once.
    deliveries: dict[str, int] = field(default_factory=dict)
    #: Failed deliveries of each row that has had one.
    failures: dict[str, int] = field(default_factory=dict)
    #: Whether some rows were cleared since every row was: a group may have lost rows
    #: without any being settled (its rest is a remnant).
    trimmed: bool = False
    #: Since the partition was declared: rows delivered again (a delivery after the
    #: first), and rows whose lease ended by expiry or by its session's end. Never reset.
    redelivered: int = 0
    expired: int = 0
    gone: int = 0
    #: While a large put builds this task's next ready order outside the store's lock
    #: (:class:`flightq.server.merge.Merge`, ``merging`` of them): the keys that entered or
    #: left ``ready`` in place since, for the merge to replay, and the bytes the budget
    #: counts for them (:func:`~flightq.server.budget.moved_cost`, in
    #: :attr:`Progress.moved_bytes`). None while none is under way.
    moved: list[str] | None = field(default=None, repr=False)
    moved_bytes: int = field(default=0, repr=False)
    merging: int = field(default=0, repr=False)
    #: Bumped when ``ready`` changes in place in a way ``moved`` does not name (emptied
    #: whole, or more keys moved than :data:`MOVED_KEPT`).
    reshaped: int = field(default=0, repr=False)

    def note(self, keys: Collection[str], cost: int | None = None) -> int:
        """Record that ``keys`` entered or left ``ready`` in place, for the merge under way
        (:attr:`moved` is a list); ``cost`` is their :func:`moved_cost` where known. Returns
        the change of :attr:`moved_bytes`."""
        log = self.moved
        assert log is not None
        before = self.moved_bytes
        if len(log) + len(keys) > MOVED_KEPT:
            log.clear()
            self.moved_bytes = 0
            self.reshaped += 1
        else:
            log.extend(keys)
            self.moved_bytes += moved_cost(keys) if cost is None else cost
        return self.moved_bytes - before

    def forget(self, key: str) -> None:
        """Drop every trace of a row (it was cleared)."""
        self.ready.pop(key, None)
        self.leased.pop(key, None)
        self.done.discard(key)
        self.dead.pop(key, None)
        self.deliveries.pop(key, None)
        self.failures.pop(key, None)

    def clear(self) -> None:
        for d in (self.ready, self.leased, self.dead, self.deliveries, self.failures):
            d.clear()
        self.done.clear()
        self.trimmed = False
        self.reshaped += 1


@dataclass
class Lease:
    """Rows one claim took for one task, until ``expires`` (``time.monotonic()``)."""

    id: str
    task: str
    keys: list[str]
    seconds: float
    expires: float
    #: The consumer's session: when it ends, so does the lease. None: expiry only.
    session: str | None = None
    #: Per key, which row it named when taken (the row's number in its partition, never
    #: reused): a row cleared and put again under the key is another row, not the lease's.
    born: tuple[int, ...] = ()
    #: Rows the consumer gave back (``nack``) or acknowledged: no longer its own, whatever
    #: ``ack`` says later (a blanket ack of the claim must not swallow a row it handed
    #: on; an ack again of a row it acknowledged is no news).
    returned: set[str] = field(default_factory=set)
    #: Bytes the memory budget counts for it (:func:`lease_cost`, while it holds rows and
    #: once it ended), and when it ended (:func:`~flightq.server.budget.record_stamp`).
    kept: int = 0
    ended_at: int = 0


def lease_cost(lease: Lease) -> int:
    """Bytes the memory budget counts for a lease, live or ended and remembered: its keys'
    strings whole (the rows they named may be gone), their slots and row numbers, room
    for every key in its set of rows given back, the lease's own objects. The same from
    the claim to the last: a partial ``nack`` grows nothing uncounted."""
    return (
        LEASE_OVERHEAD
        + (LEASE_KEY_OVERHEAD + RETURNED_KEY_BYTES) * len(lease.keys)
        + keys_size(lease.keys)
    )


#: Progress attributes the store's :class:`~flightq.server.budget.Tally` adds up.
_TALLIED = {"ended_bytes": "records", "live_bytes": "leased", "moved_bytes": "leased"}


class Progress:
    """Every task's :class:`TaskState` of one partition, and its leases."""

    _tally: Tally | None = None
    _owner: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        total = _TALLIED.get(name)
        if total is not None and self._tally is not None:
            owner = self._owner() if self._owner is not None else None
            self._tally.set(self, name, total, value, owner)
        else:
            object.__setattr__(self, name, value)

    def attach(self, tally: Tally | None, owner: Any = None) -> None:
        """Keep ``tally`` current with what the leases count, as part of ``owner`` (its
        partition); None: stop."""
        tallied(self, _TALLIED, self._tally, -1)
        tallied(self, _TALLIED, tally, 1)
        object.__setattr__(self, "_tally", tally)
        # A weak reference: a strong one would make partition and progress a cycle, which
        # keeps a dropped partition's rows until the cyclic collector runs.
        object.__setattr__(self, "_owner", None if owner is None else weakref.ref(owner))

    def __init__(self, tasks: Iterable[str], max_failures: int = DEFAULT_MAX_FAILURES) -> None:
        self.tasks: dict[str, TaskState] = {t: TaskState() for t in tasks}
        self.leases: dict[str, Lease] = {}
        #: Leases that hold no row any more, oldest first (at most :data:`ENDED_KEPT`),
        #: and the bytes the budget counts for them (:func:`lease_cost`).
        self.ended: dict[str, Lease] = {}
        self.ended_bytes = 0
        #: Bytes the budget counts for the leases holding rows (:func:`lease_cost` each,
        #: from the claim on: a consumer could clear the rows it claimed while its lease
        #: keeps their keys). Never dropped to make room: a claim ends by ack or expiry.
        self.live_bytes = 0
        #: Bytes the budget counts for the tasks' logs of keys moved while a large put
        #: merges (:attr:`TaskState.moved_bytes` of each), from :meth:`watch` to
        #: :meth:`unwatch`; never dropped to make room: the merge ends soon.
        self.moved_bytes = 0
        self.max_failures = max_failures
        #: Bumped on every change that can make rows ready: a waiting claim looks again
        #: only after it moved.
        self.version = 0
        self._next_expiry = math.inf

    # ------------------------------------------------------------------ rows come and go

    def added(
        self,
        keys: Iterable[str] | dict[str, None],
        merged: Sequence[dict[str, None] | None] = (),
    ) -> None:
        """New rows: ready for every task. ``keys`` may be the ``dict.fromkeys`` of them,
        built beforehand (a put builds it outside the store's lock). ``merged`` may give,
        per task in order, its ready order with them added already
        (:meth:`flightq.server.merge.Merge.readies`), which it becomes (None: updated)."""
        ready = keys if isinstance(keys, dict) else None  # made only if some task needs it
        cost = None  # of noting them, worked out once for every task logging moves
        for i, st in enumerate(self.tasks.values()):
            whole = merged[i] if i < len(merged) else None
            if whole is not None:
                st.ready = whole
                continue
            if ready is None:
                ready = dict.fromkeys(keys)
            st.ready.update(ready)
            if st.moved is not None:
                cost = moved_cost(ready) if cost is None else cost
                self._note(st, ready, cost)
        self.version += 1

    def adopt(self, readies: Sequence[dict[str, None]]) -> None:
        """New rows of a partition that held none: ``readies`` holds, per task in order,
        a ``dict.fromkeys`` of them that the task's ready index becomes (no other holds
        it)."""
        for st, ready in zip(self.tasks.values(), readies, strict=True):
            if st.ready:
                st.ready.update(ready)
                self._note(st, ready)
            else:
                st.ready = ready
        self.version += 1

    def removed(self, keys: Sequence[str]) -> None:
        """Rows cleared: forgotten by every task (their leases end for them). Tables they
        leave mostly empty are rebuilt at their size (:func:`~flightq.server.budget.shrunk`)."""
        for k in keys:
            for st in self.tasks.values():
                st.forget(k)
        cost = None
        for st in self.tasks.values():
            st.trimmed = True
            if st.moved is not None:
                cost = moved_cost(keys) if cost is None else cost
                self._note(st, keys, cost)
            st.ready = shrunk(st.ready)  # a merge that copied the old one updates in place
            st.leased = shrunk(st.leased)
            st.done = shrunk(st.done)
            st.dead = shrunk(st.dead)
            st.deliveries = shrunk(st.deliveries)
            st.failures = shrunk(st.failures)
        self.version += 1

    def removed_all(self) -> None:
        """Every row cleared: the leases end (a later ``ack`` of one is harmless)."""
        for st in self.tasks.values():
            st.clear()
        for lease in list(self.leases.values()):
            self.settle(lease)
        self._next_expiry = math.inf
        self.version += 1

    # ------------------------------------------------------------------ merges

    def watch(self) -> None:
        """A large put begins merging (:class:`flightq.server.merge.Merge`): each task logs
        the keys that move in its ready order in place (:attr:`TaskState.moved`), counted
        in :attr:`moved_bytes`, until the last merge under way ends (:meth:`unwatch`)."""
        for st in self.tasks.values():
            st.merging += 1
            if st.moved is None:
                st.moved = []

    def unwatch(self) -> None:
        """A merge ended: the logs no merge under way reads go, with their count."""
        freed = 0
        for st in self.tasks.values():
            st.merging -= 1
            if not st.merging:
                st.moved = None
                freed += st.moved_bytes
                st.moved_bytes = 0
        if freed:
            self.moved_bytes -= freed

    def _note(self, st: TaskState, keys: Collection[str], cost: int | None = None) -> None:
        """Log ``keys`` as moved in ``st``'s ready order, for a merge under way (if one is:
        :meth:`TaskState.note`)."""
        if st.moved is not None:
            change = st.note(keys, cost)
            if change:
                self.moved_bytes += change

    # ------------------------------------------------------------------ leases

    def take(
        self,
        task: str,
        keys: Sequence[str],
        seconds: float,
        now: float,
        session: str | None,
        born: Sequence[int],
    ) -> Lease:
        """Lease ready ``keys`` of ``task`` for ``seconds``; ``born`` names the row each
        key holds now (see :attr:`Lease.born`). Returns the lease."""
        st = self.tasks[task]
        lease = Lease(
            uuid.uuid4().hex, task, list(keys), seconds, now + seconds, session, tuple(born)
        )
        for k in keys:
            del st.ready[k]
            st.leased[k] = lease.id
            st.deliveries[k] = n = st.deliveries.get(k, 0) + 1
            st.redelivered += n > 1
        self._note(st, keys)
        lease.kept = lease_cost(lease)
        self.live_bytes += lease.kept
        self.leases[lease.id] = lease
        self._next_expiry = min(self._next_expiry, lease.expires)
        return lease

    def held(self, lease: Lease, keys: Sequence[str] | None) -> list[str]:
        """Which of ``keys`` (all of the lease's when None) the lease still holds."""
        st = self.tasks[lease.task]
        ks = lease.keys if keys is None else dict.fromkeys(keys)  # a key named twice: once
        return [k for k in ks if st.leased.get(k) == lease.id]

    def ack(
        self, lease: Lease, keys: Sequence[str] | None, born: Mapping[str, int]
    ) -> tuple[int, list[str]]:
        """Mark rows of ``lease`` done. A row the lease lost (expired) counts as acked too
        while it waits ready; one taken by another claim, acked by another or dead since,
        is returned as lost (it will be, or was, processed twice). A row the consumer gave
        back (:meth:`nack`) or acknowledged already, or cleared since (``born`` names the
        row each key holds now), is left alone. Returns (rows acked, rows lost)."""
        st = self.tasks[lease.task]
        mine = dict(zip(lease.keys, lease.born, strict=True))
        acked, lost = 0, []
        for k in lease.keys if keys is None else keys:
            if k in lease.returned or born.get(k) != mine[k]:
                continue
            owner = st.leased.get(k)
            if owner == lease.id or (owner is None and k in st.ready):
                if st.ready.pop(k, 0) is None:
                    self._note(st, (k,))
                st.leased.pop(k, None)
                st.failures.pop(k, None)
                st.done.add(k)
                lease.returned.add(k)  # counted in lease_cost: room for every key
                acked += 1
            elif k in st.deliveries:
                lost.append(k)  # another claim has it now or acked it, or it is dead
        self.settle(lease)
        if acked:
            # The rest of a group acked in part may be claimable now (a remnant).
            self.version += 1
        return acked, lost

    def nack(self, lease: Lease, keys: Sequence[str] | None, failed: bool) -> tuple[int, int]:
        """The consumer gives rows of ``lease`` back (all it holds when None), each
        counting a failed delivery when ``failed``: :meth:`release`, and a later ``ack``
        of the lease leaves them alone. Returns (rows made ready, rows gone dead)."""
        held = self.held(lease, keys)
        lease.returned.update(held)
        return self.release(lease, held, failed=held if failed else (), why="failed")

    def release(
        self, lease: Lease, keys: Sequence[str] | None, failed: Sequence[str] = (), why: str = ""
    ) -> tuple[int, int]:
        """End the lease for ``keys`` (all it holds when None): back to ready, or to the
        dead letters for a row whose failures (``failed`` ones counted now) reach the
        limit. Returns (rows made ready, rows gone dead)."""
        st = self.tasks[lease.task]
        bad = set(failed)
        ready = dead = 0
        for k in self.held(lease, keys):
            del st.leased[k]
            if k in bad:
                st.failures[k] = st.failures.get(k, 0) + 1
            if st.failures.get(k, 0) >= self.max_failures:
                st.dead[k] = why or "failed"
                dead += 1
            else:
                st.ready[k] = None
                self._note(st, (k,))
                ready += 1
        self.settle(lease)
        self.version += 1
        return ready, dead

    def unclaim(self, lease: Lease) -> int:
        """Undo ``lease`` as if it had never been taken (its answer never left the
        server): its rows go back to the front of the ready order, in their order, their
        delivery not counted. Returns the rows made ready."""
        st = self.tasks[lease.task]
        keys = self.held(lease, None)
        for k in keys:
            del st.leased[k]
            n = st.deliveries.get(k, 0) - 1
            if n > 0:
                st.deliveries[k] = n
                st.redelivered -= 1  # the take counted it as a redelivery
            else:
                st.deliveries.pop(k, None)
        if keys:
            st.ready = {**dict.fromkeys(keys), **st.ready}
        self.settle(lease)
        self.version += 1
        return len(keys)

    def find(self, claim: str) -> Lease | None:
        """A lease by its claim's id: holding rows, or ended recently."""
        return self.leases.get(claim) or self.ended.get(claim)

    def settle(self, lease: Lease) -> None:
        """Move ``lease`` to the ended ones once it holds no row."""
        if lease.id in self.leases and not self.held(lease, None):
            del self.leases[lease.id]
            self.live_bytes -= lease.kept  # the same count moves to the ended ones
            lease.ended_at = record_stamp()
            self.ended[lease.id] = lease
            self.ended_bytes += lease.kept
            while len(self.ended) > ENDED_KEPT:
                self.drop_ended()

    def oldest_ended(self) -> int | None:
        """The stamp of the lease that ended first of those remembered; None: none is."""
        ended = self.ended
        return next(iter(ended.values())).ended_at if ended else None

    def drop_ended(self) -> int:
        """Forget the lease that ended first (a later ``ack`` of it is ``NotFoundError``;
        rows it did not acknowledge are delivered again). Returns the bytes it counted."""
        ended = self.ended
        lease = ended.pop(next(iter(ended)))
        self.ended_bytes -= lease.kept
        return lease.kept

    def expire(self, now: float) -> int:
        """End every lease past its time, each of its rows' failures counted. Returns the
        rows released."""
        if now < self._next_expiry:
            return 0
        n = 0
        for lease in [x for x in self.leases.values() if x.expires <= now]:
            held = self.held(lease, None)
            r, d = self.release(lease, None, failed=held, why="expired")
            self.tasks[lease.task].expired += r + d
            n += r + d
        self._next_expiry = min((x.expires for x in self.leases.values()), default=math.inf)
        return n

    def session_ended(self, session: str) -> int:
        """End the leases of a consumer whose session ended (each row's failures counted).
        Returns the rows released."""
        n = 0
        for lease in [x for x in self.leases.values() if x.session == session]:
            r, d = self.release(lease, None, failed=self.held(lease, None), why="gone")
            self.tasks[lease.task].gone += r + d
            n += r + d
        return n

    @property
    def next_expiry(self) -> float:
        """``time.monotonic()`` when the next lease expires (inf: none)."""
        return self._next_expiry

    # ------------------------------------------------------------------ reset

    def reset(self, task: str, keys: Sequence[str] | None, order: Iterable[str]) -> int:
        """Make rows (all when None) ready again for ``task``, whatever their state, and
        forget their deliveries. ``order`` is the partition's row order. Returns how many
        were not ready before."""
        st = self.tasks[task]
        want = None if keys is None else set(keys)
        n = 0
        for k in order:
            if want is not None and k not in want:
                continue
            if k not in st.ready:
                n += 1
            st.leased.pop(k, None)
            st.done.discard(k)
            st.dead.pop(k, None)
            st.deliveries.pop(k, None)
            st.failures.pop(k, None)
        # Rebuild ready in the partition's order, every reset row included.
        rest = st.ready
        st.ready = {
            k: None
            for k in order
            if k in rest
            or ((want is None or k in want) and k not in st.leased and k not in st.done)
        }
        for lease in list(self.leases.values()):
            if lease.task == task:
                self.settle(lease)
        self.version += 1
        return n
