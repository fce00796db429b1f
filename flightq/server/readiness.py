"""Which ready rows a claim can take, found without testing every ready row.

A row is ready for a task when its :class:`~flightq.server.leases.TaskState` says so; a
claim takes the first ready rows that carry every field it needs (whole groups first in a
grouped partition, then remnants: :func:`ready_rows`). Every row carries the schema's
required fields, so a claim that needs only those takes the first ready rows as they
come. A claim that waits for a column written back later (``wait_for``, or ``fields``
naming one) would otherwise test every ready row's cells each time its partition changes,
under the store's lock: 0.1 s for 200 000 rows that lack the column, for each claim
waiting, on every write-back.

Such a claim asks its partition for a :class:`Complete` index of that set of fields: the
keys of the rows that carry them all. The index follows the partition's writes through the
write journal (:meth:`~flightq.server.partition.Partition.written_since`), a few checks
per key written, and walks every row only when it is made or the journal no longer reaches
back. With it a claim counts the ready rows it could take by walking whichever of the
index and the ready order is smaller, and walks the ready order only when they may be
enough. A partition keeps at most :data:`MAX_INDEXES` indexes (the least recently used
goes); each holds a key reference per row that carries its fields, and lets go of a
row's key when the row is cleared (:func:`forget_rows`), not at its next sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .budget import shrunk

if TYPE_CHECKING:
    from .leases import TaskState
    from .partition import Partition, Row

__all__ = [
    "Complete",
    "MAX_INDEXES",
    "complete_keys",
    "count_ready",
    "forget_rows",
    "may_serve",
    "maybe_remnant",
    "ready_rows",
]

#: Indexes of field sets a partition keeps at once.
MAX_INDEXES = 4


class Complete:
    """The keys of one partition's rows that carry every field of ``fields``, as of the
    partition's write count ``writes`` (-1: not built yet)."""

    __slots__ = ("fields", "keys", "writes")

    def __init__(self, fields: tuple[str, ...]) -> None:
        self.fields = fields
        self.keys: set[str] = set()
        self.writes = -1

    def sync(self, p: Partition) -> None:
        """Bring the index up to ``p``'s writes. With the store's lock."""
        if self.writes == p.writes:
            return
        written = p.written_since(self.writes) if self.writes >= 0 else None
        fields, rows = self.fields, p.rows
        if written is None:
            self.keys = {k for k, r in rows.items() if all(f in r.cells for f in fields)}
        else:
            keys = self.keys
            for some in written:
                for k in some:
                    r = rows.get(k)
                    if r is not None and all(f in r.cells for f in fields):
                        keys.add(k)
                    else:
                        keys.discard(k)
        self.writes = p.writes


def complete_keys(p: Partition, need: Sequence[str]) -> set[str] | None:
    """The keys of ``p``'s rows that carry every field of ``need``, kept up to date in
    ``p``'s index of them; None when ``need`` names only required fields (every row
    carries them). With the store's lock."""
    extra = frozenset(need).difference(p.schema.required)
    if not extra:
        return None
    index = p.complete.pop(extra, None)  # put back last: the most recently used
    if index is None:
        index = Complete(tuple(sorted(extra)))
        while len(p.complete) >= MAX_INDEXES:
            del p.complete[next(iter(p.complete))]
    p.complete[extra] = index
    index.sync(p)
    return index.keys


def forget_rows(p: Partition, keys: Sequence[str] | None) -> None:
    """Rows ``keys`` of ``p`` (every row when None) were cleared: its indexes let go of
    their keys now, not at their next sync (which a claim waiting for those fields may
    never make), and of what they took of their tables
    (:func:`~flightq.server.budget.shrunk`). With the store's lock."""
    if keys is None:
        p.complete.clear()  # a claim makes its index again, from the rows then
        return
    for index in p.complete.values():
        index.keys.difference_update(keys)
        index.keys = shrunk(index.keys)


def count_ready(st: TaskState, complete: set[str] | None) -> int:
    """The task's ready rows that carry the fields (every one when ``complete`` is None)."""
    ready = st.ready
    if complete is None:
        return len(ready)
    if len(complete) < len(ready):
        return sum(1 for k in complete if k in ready)
    return sum(1 for k in ready if k in complete)


def ready_rows(
    rows: dict[str, Row],
    g: int | None,
    st: TaskState | Any,
    complete: set[str] | None,
    limit: int | None,
) -> list[Row] | None:
    """The first ready rows that carry the fields (those keyed in ``complete``; every row
    when None), whole groups if grouped, or None if fewer than ``limit``.

    ``st`` is a task's state, or a copy of its ``ready`` and ``leased`` keys (for
    :meth:`~flightq.server.store.Store.inspect`). In a grouped partition a group whose other
    rows are settled for the task (acknowledged, dead or cleared) and none leased is a
    remnant: its ready rows go out together, after the whole groups, and a claim that holds
    one returns even when short of ``limit``, so nothing is stranded by a group acked in
    part.

    It walks the task's ready order only, and not at all when too few ready rows carry the
    fields (counted from ``complete`` when it is the smaller) or the order holds fewer rows
    than ``limit`` (and, grouped, no remnant can be in it)."""
    ready = st.ready
    if limit is not None:
        if not may_serve(st, limit, g):
            return None
        small = complete is not None and len(complete) < len(ready)
        if small and not _may_hold(rows, g, st, complete, limit):  # type: ignore[arg-type]
            return None
    has = complete.__contains__ if complete is not None else None
    out: list[Row] = []
    if not g:
        for k in ready:
            if has is None or has(k):
                out.append(rows[k])
                if limit is not None and len(out) == limit:
                    return out
        return out if limit is None else None
    groups: dict[int, list[Row]] = {}
    lacking: set[int] = set()  # groups with a ready row that lacks the fields
    for k in ready:
        r = rows[k]
        members = groups.setdefault(r.group, [])
        members.append(r)
        if has is not None and not has(k):
            lacking.add(r.group)
        if len(members) == g and r.group not in lacking:
            out.extend(members)
            if limit is not None and len(out) == limit:
                return out
    partial = [m for m in groups.values() if len(m) < g]
    if partial:
        # Whole groups are leased whole, so a group with a leased row is one given back in
        # part: the rest of it is still out, and the group waits for it.
        held = {rows[k].group for k in st.leased if k in rows}
        took = False
        for members in partial:
            if members[0].group in held or members[0].group in lacking:
                continue
            if limit is not None and len(out) + len(members) > limit:
                continue
            out.extend(members)
            took = True
            if limit is not None and len(out) == limit:
                return out
        if took:
            return out
    return out if limit is None else None


def may_serve(st: TaskState, limit: int, g: int | None) -> bool:
    """Whether the task's ready rows may serve a claim of ``limit`` (:func:`ready_rows`
    finds none otherwise): as many ready rows, or, grouped, perhaps a remnant."""
    return len(st.ready) >= limit or bool(g and maybe_remnant(st, g))


def maybe_remnant(st: TaskState, g: int) -> bool:
    """Whether the task's ready index may hold a remnant: a group some of whose rows
    were settled or cleared (two groups cleared in part may leave a multiple of ``g``
    rows ready, none settled)."""
    return bool(len(st.ready) % g or st.done or st.dead or st.trimmed)


def _may_hold(
    rows: dict[str, Row], g: int | None, st: TaskState, complete: set[str], limit: int
) -> bool:
    """Whether the ready rows keyed in ``complete`` (smaller than the ready order) may
    serve a claim of ``limit``: as many of them; grouped, as many in whole groups of them,
    or a group in part that may be a remnant."""
    ready = st.ready
    have = [k for k in complete if k in ready]
    if not g:
        return len(have) >= limit
    per: dict[int, int] = {}
    for k in have:
        n = rows[k].group
        per[n] = per.get(n, 0) + 1
    whole = sum(1 for n in per.values() if n == g)
    return whole * g >= limit or (len(per) > whole and maybe_remnant(st, g))
