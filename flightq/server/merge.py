"""A large put's next row table and ready orders, built outside the store's lock.

Storing a put is dict updates under the store's lock
(:meth:`~flightq.server.partition.Partition.commit`). Into a partition that holds rows
already, a put of a million rows spent 0.4 s there: the row table and each task's ready
order gained a million entries, each update one C call that keeps the GIL as well as the
lock, and every other client waited. A :class:`Merge` builds copies of them with the
put's rows added, a slice at a time outside the lock; the commit swaps the copies in after
replaying what changed since they were taken:

- rows written or cleared since: the partition's write journal names their keys
  (:meth:`~flightq.server.partition.Partition.written_since`), and each is copied from the
  table as it is now (none of them is one of the put's keys: the store plans again when a
  write touched those);
- keys that entered or left a task's ready order in place since (taken, acked, released,
  cleared, other puts' rows): :attr:`~flightq.server.leases.TaskState.moved` names them
  (counted against the memory budget meanwhile), and each is kept or dropped as the order
  holds it now. A key that came back since (a ``nack``, an expiry) then sits behind the
  put's rows rather than before them.

Where that record does not reach back (the table or an order replaced since, by a clear
that rebuilt it at its size among others; the journal overrun; more keys moved than
:data:`~flightq.server.leases.MOVED_KEPT`), the commit updates under the lock as before.
Replay is idempotent: each key is set to what the partition holds at the commit, so a
change made while a copy was taken is right either way.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from ..layout import SLICE

if TYPE_CHECKING:
    from .leases import TaskState
    from .partition import Partition, Row
    from .putplan import PutPlan

__all__ = ["MERGE_ROWS", "Merge"]

#: Entries from which a put's rows (or its new rows, for the ready orders) are merged
#: outside the lock; fewer take less than a millisecond under it.
MERGE_ROWS = 1 << 15


class Merge:
    """A put's rows merged into copies of a partition's row table and ready orders.

    Made (:meth:`begin`) and ended (:meth:`end`) with the store's lock; :meth:`build`
    without it; :meth:`rows` and :meth:`readies` with it, at the commit."""

    def __init__(self, p: Partition, plan: PutPlan) -> None:
        self._p = p
        self._writes = p.writes
        self._base: dict[str, Row] | None = p.rows if len(plan.rows) >= MERGE_ROWS else None
        self._rows: dict[str, Row] | None = None
        # Per task: its state, its ready order then, where its log stood, its reshapes.
        self._tasks: list[tuple[TaskState, dict[str, None], int, int]] = []
        self._readies: list[dict[str, None]] = []

    @staticmethod
    def wanted(p: Partition, plan: PutPlan) -> bool:
        """Whether ``plan`` is large enough, and ``p`` not empty, for a merge to pay."""
        return bool(p.rows) and max(len(plan.rows), len(plan.new)) >= MERGE_ROWS

    @classmethod
    def begin(cls, p: Partition, plan: PutPlan) -> Merge:
        """Start recording what changes in ``p`` from now. With the store's lock."""
        m = cls(p, plan)
        if len(plan.new) >= MERGE_ROWS:
            p.progress.watch()
            for st in p.progress.tasks.values():
                assert st.moved is not None
                m._tasks.append((st, st.ready, len(st.moved), st.reshaped))
        return m

    def build(self, plan: PutPlan) -> None:
        """Copy the table and orders taken at :meth:`begin` and add the put's rows, a slice
        at a time (other threads run between slices). Without the store's lock."""
        if self._base is not None:
            self._rows = _merged(self._base, plan.rows)
        self._readies = [_appended(base, plan.new) for _, base, _, _ in self._tasks]

    def end(self) -> None:
        """Stop recording (committed or not). With the store's lock."""
        if self._tasks:
            self._p.progress.unwatch()
        self._tasks = []

    def rows(self) -> dict[str, Row] | None:
        """The partition's next row table, what changed since :meth:`begin` replayed; None
        when it cannot be told (update in place). With the store's lock."""
        p, out = self._p, self._rows
        if out is None or p.rows is not self._base:
            return None
        written = p.written_since(self._writes)
        if written is None:
            return None
        now = p.rows
        for keys in written:
            for k in keys:
                row = now.get(k)
                if row is None:
                    out.pop(k, None)
                else:
                    out[k] = row
        return out

    def readies(self) -> list[dict[str, None] | None]:
        """Per task in order, its next ready order, the keys moved since :meth:`begin`
        replayed; None for a task where that cannot be told. With the store's lock."""
        out: list[dict[str, None] | None] = []
        for (st, base, start, reshaped), merged in zip(self._tasks, self._readies, strict=True):
            if st.ready is not base or st.reshaped != reshaped or st.moved is None:
                out.append(None)
                continue
            ready = st.ready
            for k in itertools.islice(st.moved, start, None):
                if k in ready:
                    merged[k] = None
                else:
                    merged.pop(k, None)
            out.append(merged)
        return out


def _appended(base: dict[str, None], keys: list[str]) -> dict[str, None]:
    # ``{**base, **dict.fromkeys(keys)}``, built a slice of ``keys`` at a time.
    out = dict(base)
    for i in range(0, len(keys), SLICE):
        out.update(dict.fromkeys(keys[i : i + SLICE]))
    return out


def _merged(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    # ``{**base, **more}``, built a slice of ``more`` at a time.
    out = dict(base)
    keys, values = list(more), list(more.values())
    for i in range(0, len(keys), SLICE):
        out.update(zip(keys[i : i + SLICE], values[i : i + SLICE], strict=True))
    return out
