"""A put's plan: every check, and the rows it stores, worked out without the store's lock.

Planning a put is the per-row work (each key looked up, conflicts and shapes checked, a
:class:`~flightq.server.partition.Row` built for every row it creates or changes); for a
million rows that takes seconds, so the store plans outside its lock and holds the lock
only to check that the plan still holds and to commit it
(:meth:`~flightq.server.partition.Partition.commit`: a few dict updates).

Planning reads the partition while other threads may write it. Each read is one dict
lookup, atomic in CPython, and a stored row is never changed in place (a write replaces the
row by a new one), so a plan sees every row whole, as it was at some moment. The plan
records the partition's write count when it began; under the lock, the store asks the
partition whether a write since then touched one of the put's keys
(:meth:`~flightq.server.partition.Partition.touched`) and plans again if one did.

A retry is recognised here too (:func:`replays`): by its ``put_id``, or, without one and
without ``overwrite``, because each of its record batches equals a record batch the
partition stored and still holds whole. One Arrow comparison per batch (memcmp speed),
never a cell by cell walk.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConflictError, MissingFieldError, ShapeError
from ..layout import in_slices, mapped, pylist
from ..protocol import PutCreated
from . import merge
from .budget import journal_cost, row_overhead, tags_size

if TYPE_CHECKING:
    from .partition import Partition, Piece, Row

__all__ = ["PutPlan", "Stored", "plan_put", "replays", "stored"]

_MISSING = object()
#: Rows up to which a piece's new rows are built one by one (numpy costs more there).
_FEW = 8


@dataclass(frozen=True)
class Stored:
    """What a put did, as its acknowledgement tells the client
    (:class:`~flightq.protocol.PutAck`, :class:`~flightq.protocol.PutCreated`)."""

    #: The rows acknowledged: the put's, or for a replay what the first attempt said.
    rows: int
    #: The rows it created (none for a replay or a put that only added columns).
    created: int = 0
    #: The creation numbers ``(first, end)`` of the rows it created; None if none.
    groups: tuple[int, int] | None = None
    #: Whether it was acknowledged again as a retry, storing nothing.
    replay: bool = False

    def record(self) -> PutCreated:
        """The message that tells the client what the put created."""
        groups = None if self.groups is None else list(self.groups)
        return PutCreated(created=self.created, replay=self.replay, groups=groups)


@dataclass(frozen=True)
class PutPlan:
    """What a put does to a partition, worked out by :func:`plan_put`."""

    pieces: list[Piece]
    #: Every row key of the put, in order.
    keys: list[str]
    put_id: str | None
    #: The partition's write count when planning began (:meth:`Partition.touched`).
    seen: int = 0
    #: The rows to acknowledge again without storing anything (a retry), or None.
    replay: int | None = None
    #: Keys of the rows the put creates, in order, and as the entries each task's ready
    #: index gains (None where a merge adds them: :data:`flightq.server.merge.MERGE_ROWS`
    #: or more new rows into a partition that held rows).
    new: list[str] = field(default_factory=list)
    ready: dict[str, None] | None = field(default_factory=dict)
    #: Where the partition held no row when planned: per task, a ready index of the new
    #: rows of its own (``ready`` the first), which the commit adopts whole instead of
    #: copying each entry under the store's lock; else empty.
    fresh: tuple[dict[str, None], ...] = ()
    #: The rows to store, by key: new rows, and new versions of the rows it changes.
    rows: dict[str, Row] = field(default_factory=dict)
    #: Change in the partition's payload bytes.
    nbytes: int = 0
    #: Change in what the rows it stores hold of their own (:attr:`Row.held`).
    held: int = 0
    #: Per piece, how many more stored rows use it (fewer where negative: the rows it
    #: replaces): what the budget counts follows (:meth:`Partition.use`).
    uses: list[tuple[Piece, int]] = field(default_factory=list)
    #: Bytes the budget must find room for (every piece's, before cells it replaces).
    need: int = 0
    #: The creation numbers ``(first, end)`` reserved for the rows it creates (group
    #: numbers: a grouped partition's rows share one per group; else one per row). They
    #: are never given out twice in a partition, so they tell the rows of this put from
    #: any other's (:meth:`~flightq.server.store.Store.clear` with ``groups``).
    groups: tuple[int, int] = (0, 0)
    #: Stored pieces whose rows this put changes (a cell replaced, a tag rewritten).
    damaged: list[Piece] = field(default_factory=list)
    #: Bytes the budget counts for the put's entry in the partition's journal of recent
    #: writes (:func:`~flightq.server.budget.journal_cost`; None: the partition works it
    #: out), counted from the commit while the journal keeps it.
    journal: int | None = None


def stored(plan: PutPlan) -> Stored:
    """What ``plan`` did once committed (or, for a replay, acknowledged)."""
    if plan.replay is not None:
        return Stored(plan.replay, replay=True)
    return Stored(len(plan.keys), len(plan.new), plan.groups if plan.new else None)


def plan_put(
    p: Partition, pieces: list[Piece], overwrite: bool, put_id: str | None, seen: int
) -> PutPlan:
    """What storing ``pieces`` in ``p`` would do, after every check; changes nothing.

    Safe without the store's lock (see the module's docstring): the plan holds if no write
    since write count ``seen`` (``p.writes``, read before calling) touched its keys.

    Raises
    ------
    MissingFieldError
        If a new row lacks a required field, or has it null.
    ConflictError
        If a row has a column already and ``overwrite`` is false.
    ShapeError
        If a row's token length differs from the stored row's, or a grouped partition
        would get part of a group.
    """
    from .partition import JOURNAL_KEYS, Row

    # One piece's own list where there is one: a copy of a million keys is one more
    # list for the garbage collector to walk.
    keys = (
        pieces[0].checked.keys
        if len(pieces) == 1
        else [k for pc in pieces for k in pc.checked.keys]
    )
    if put_id is not None and put_id in p.recent_puts:
        return PutPlan(pieces, keys, put_id, seen, replay=p.recent_puts[put_id])
    if not overwrite and replays(p, pieces):
        return PutPlan(pieces, keys, put_id, seen, replay=len(keys))
    name, required, rows = p.name, p.schema.required, p.rows
    # Per piece, the stored row of each key (None: new), read once and used throughout.
    olds: list[list[Row | None]] = []
    n_new = 0
    for pc in pieces:
        ck = pc.checked
        missing = [f for f in required if f not in ck.fields]
        holes = [f for f in required if f in ck.fields and pc.valid(f)]
        # Into an empty partition every row is new (a row stored meanwhile is a write the
        # journal names: the plan is made again).
        mine: list[Row | None] = mapped(rows.get, ck.keys) if rows else [None] * len(ck.keys)
        olds.append(mine)
        if not rows or not any(mine):  # every row new (a generator's put): the checks in bulk
            _check_new(pc, missing, holes, name)
            n_new += len(mine)
            continue
        for i, (k, row) in enumerate(zip(ck.keys, mine, strict=True)):
            if row is None:
                if missing:
                    raise MissingFieldError(
                        f"row key {k!r} is new in partition {name!r} and lacks "
                        f"required field(s) {missing}",
                        field=missing[0],
                        key=k,
                        partition=name,
                    )
                if holes:
                    _check_required_not_null(pc, i, holes, k, name)
                n_new += 1
                continue
            if not overwrite:
                for f in ck.fields:
                    if f in row.cells and _valid_at(pc, f, i):
                        raise _conflict(p, pc, i, row, f, put_id)
            s = int(ck.seq_lens[i])
            if s >= 0 and row.seq_len >= 0 and s != row.seq_len:
                raise ShapeError(
                    f"row key {k!r}: token fields of this put have sequence length "
                    f"{s}, the stored row has {row.seq_len}",
                    key=k,
                    expected=row.seq_len,
                    actual=s,
                    partition=name,
                )
    g = p.group_size
    if g and n_new % g:
        raise ShapeError(
            f"partition {name!r} has group size {g}: a put creates whole groups, "
            f"got {n_new} new rows",
            actual=n_new,
            partition=name,
        )
    reserved = n_new // g if g else n_new
    group = p.reserve_groups(reserved)
    out: dict[str, Row] = {}
    new: list[str] = []
    damaged: dict[int, Piece] = {}
    uses: dict[int, list[Any]] = {}  # id -> [piece, rows more that use it]
    nbytes_in = held_in = gone = own_delta = 0
    sized: dict[tuple[int, int], int] = {}  # merged tags maps' sizes
    for pc, mine in zip(pieces, olds, strict=True):
        ck = pc.checked
        dense = [f for f in ck.fields if pc.valid(f) is None]
        sparse = [(f, v) for f in ck.fields if (v := pc.valid(f)) is not None]
        seq_lens, nbytes = pylist(ck.seq_lens), pylist(ck.nbytes)
        held = pylist(pc.held) if len(pc.held) else nbytes
        own = pylist(pc.own) if len(pc.own) else [0] * len(nbytes)
        nbytes_in += sum(nbytes)
        held_in += sum(held) + pc.extra + sum(own)
        mine_used = uses[id(pc)] = [pc, 0]  # stored rows that will use it
        if not sparse and len(mine) > _FEW and (not rows or not any(mine)):
            # Every row new with every field: the rows built in a few C-level passes.
            first = len(new)
            made = _new_rows(pc, dense, group, g, first, seq_lens, nbytes, own)
            own_delta += sum(own)
            mine_used[1] += len(made) if dense else 0
            for ks, rs in zip(in_slices(ck.keys), in_slices(made), strict=True):
                out.update(zip(ks, rs, strict=True))
            if len(pieces) == 1:
                new = ck.keys  # its own list, as ``keys``
            else:
                new.extend(ck.keys)
            continue
        for i, (k, old) in enumerate(zip(ck.keys, mine, strict=True)):
            cell = (pc, i)
            fields = dense + [f for f, v in sparse if v[i]] if sparse else dense
            t = pc.tags[i]
            if fields:
                mine_used[1] += 1
            if old is None:
                n = len(new)
                out[k] = Row(
                    k,
                    group + (n // g if g else n),
                    dict.fromkeys(fields, cell),
                    t or {},  # the piece's map, never changed in place
                    seq_lens[i],
                    nbytes[i],
                    own[i],
                    cell if fields and len(fields) == len(ck.fields) else None,
                )
                own_delta += own[i]
                new.append(k)
                continue
            cells = dict(old.cells)
            freed = 0
            lost: list[Piece] = []  # pieces whose cells it replaced
            for f in fields:
                was = cells.get(f)
                if was is not None:  # overwrite: the old cell's bytes go
                    freed += was[0].cell_nbytes(f, was[1])
                    damaged[id(was[0])] = was[0]
                    if not any(was[0] is q for q in lost):
                        lost.append(was[0])
                cells[f] = cell
            tags = old.tags
            kept = old.held
            if t and any(not _same_value(tags.get(a, _MISSING), b) for a, b in t.items()):
                for was in old.cells.values():  # their tags are no longer all there
                    damaged[id(was[0])] = was[0]
                tags = {**tags, **t}  # an equal map stays as it is
                # A map of its own now: counted as the row's, in place of the old one (sized
                # once per old map and new tags: a group's rows share both).
                pair = (id(old.tags), id(t))
                size = sized.get(pair)
                if size is None:
                    size = sized[pair] = tags_size(tags)
                kept = sys.getsizeof(k) + row_overhead(len(p.tasks)) + size
                own_delta += kept - old.held
            gone += freed
            if lost:  # one user less for each the new row no longer uses
                still = {id(c[0]) for c in cells.values()}
                for used in lost:
                    if id(used) not in still:
                        uses.setdefault(id(used), [used, 0])[1] -= 1
            out[k] = Row(
                k,
                old.group,
                cells,
                tags,
                seq_lens[i] if seq_lens[i] >= 0 else old.seq_len,
                old.nbytes - freed + nbytes[i],
                kept,
            )
    # Into a partition holding rows, many new rows are merged into copies of the ready
    # orders outside the store's lock (flightq.server.merge), from ``new``: no index of
    # them is built here, only at a commit that must update in place.
    ready = _index(new) if not rows or len(new) < merge.MERGE_ROWS else None
    # An empty partition (a fresh one, or cleared) takes the plan's dicts as they are: one
    # ready index per task (a partition of no task merges its rows as usual).
    fresh = (
        (ready, *(_index(new) for _ in p.tasks[1:]))
        if p.tasks and not rows and len(new) > _FEW and ready is not None
        else ()
    )
    return PutPlan(
        pieces,
        keys,
        put_id,
        seen,
        new=new,
        ready=ready,
        fresh=fresh,
        rows=out,
        nbytes=nbytes_in - gone,
        held=own_delta,
        uses=[(u[0], u[1]) for u in uses.values() if u[1]],
        need=held_in,
        groups=(group, group + reserved),
        damaged=list(damaged.values()),
        # Worked out here, outside the store's lock (a write the journal keeps whole).
        journal=journal_cost(keys) if len(keys) <= JOURNAL_KEYS // 4 else None,
    )


def _same_value(a: Any, b: Any) -> bool:
    """Whether two tag values are the same as stored: equal and of one type all the way
    down (``1``, ``1.0`` and ``True`` are equal in Python, not in msgpack)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _index(keys: list[str]) -> dict[str, None]:
    """``dict.fromkeys(keys)``, built a slice at a time (:func:`~flightq.layout.in_slices`)."""
    out: dict[str, None] = {}
    for part in in_slices(keys):
        out.update(dict.fromkeys(part))
    return out


def _check_new(pc: Piece, missing: list[str], holes: list[str], partition: str) -> None:
    """The checks of a piece whose rows are all new, raising what the per-row checks
    raise at the first row that fails them."""
    keys = pc.checked.keys
    if not keys:
        return
    if missing:
        raise MissingFieldError(
            f"row key {keys[0]!r} is new in partition {partition!r} and lacks "
            f"required field(s) {missing}",
            field=missing[0],
            key=keys[0],
            partition=partition,
        )
    if holes:
        present = np.logical_and.reduce([np.asarray(pc.valid(f), dtype=bool) for f in holes])
        if not present.all():
            i = int(np.argmin(present))
            _check_required_not_null(pc, i, holes, keys[i], partition)


def _new_rows(
    pc: Piece,
    fields: list[str],
    group: int,
    g: int | None,
    first: int,
    seq_lens: list[int],
    nbytes: list[int],
    own: list[int],
) -> list[Row]:
    """The rows of a piece whose rows are all new and carry every one of ``fields``: the
    put's new rows ``first`` onwards (their group numbers follow from that)."""
    from .partition import Row

    n = len(pc.checked.keys)
    at = np.arange(first, first + n)
    groups = pylist(group + (at // g if g else at))
    homes: list[tuple[Piece, int]] = []
    for part in in_slices(range(n)):
        homes.extend(zip(itertools.repeat(pc), part))
    cells = map(dict.fromkeys, itertools.repeat(fields, n), homes)
    # The piece's maps, never changed in place (rows of a group may share one).
    tags = [t or {} for t in pc.tags]
    if not fields:  # rows of no field use no cell of the piece: no home in it
        homes = [None] * n  # type: ignore[list-item]
    return list(map(Row, pc.checked.keys, groups, cells, tags, seq_lens, nbytes, own, homes))


def replays(p: Partition, pieces: Iterable[Piece]) -> bool:
    """Whether each record batch of a put equals one the partition stored and still holds
    whole: every row there, each cell of it the stored batch's, no tag of it rewritten.

    Such a put is a retry of one that landed (its acknowledgement was lost): answering it
    again stores nothing, so a retry never duplicates or conflicts. The stored batch is
    found through the put's first row (its first cell must be that batch's first), then
    compared whole in one Arrow call (which lets go of the GIL).
    """
    for pc in pieces:
        twin = _twin(p, pc)
        if twin is None or not _same_batch(pc, twin):
            return False
    return True


def _same_batch(pc: Piece, stored: Piece) -> bool:
    """Whether ``pc`` carries what the stored piece ``stored`` did: an equal record batch
    (one Arrow comparison) naming the same media."""
    from .media import same_media

    if not pc.batch.equals(stored.batch, check_metadata=True):
        return False
    return not (pc.media or stored.media) or same_media(pc, stored)


def _conflict(
    p: Partition, pc: Piece, i: int, row: Row, f: str, put_id: str | None
) -> ConflictError:
    """The refusal of a put without ``overwrite`` whose row ``i`` of ``pc`` has column
    ``f`` stored already (``row``).

    The put may retry one that was stored and whose answer was lost, its rows cleared or
    rewritten in part since (else it would be a replay), its put id forgotten (the
    partition keeps its last :data:`~flightq.server.partition.RECENT_PUTS`, fewer when the
    memory budget needs their room) or never given: nothing tells it from a new put of
    those keys, so it is refused, never stored twice. The message says whether an earlier
    put of this same record batch stored the row (one comparison, on a refusal only), and
    that the put id is not remembered."""
    from .partition import RECENT_PUTS

    k, name = pc.checked.keys[i], p.name
    where = f"row key {k!r} already has column {f!r} in partition {name!r}"
    forgotten = (
        ""
        if put_id is None
        else f"put id {put_id[:64]!r} is not among those the partition remembers (its "
        f"last {RECENT_PUTS}, fewer when the server's memory budget needs their room)"
    )
    stored, at = row.cells[f]
    if at == i and stored is not pc and stored.stored and _same_batch(pc, stored):
        message = (
            f"{where}, stored by an earlier put of this same record batch (its rows cleared "
            f"or rewritten in part since){', and ' + forgotten if forgotten else ''}: if "
            "this put retries one whose answer was lost, that one was stored; count it as "
            "stored and do not send it again (overwrite=True stores it again all the same)"
        )
    elif forgotten:
        message = (
            f"{where}, and {forgotten}: a retry of a put that was stored, some of whose rows "
            "were cleared since, is refused so, never stored twice; if this put is no "
            "retry, pass overwrite=True to rewrite the column"
        )
    else:
        message = f"{where}; pass overwrite=True to rewrite it"
    return ConflictError(message, field=f, key=k, partition=name)


def _twin(p: Partition, pc: Piece) -> Piece | None:
    """The stored piece a retry of ``pc`` would find whole, or None."""
    keys = pc.checked.keys
    if not keys:
        return None
    row = p.rows.get(keys[0])
    if row is None:
        return None
    f = next((f for f in pc.checked.fields if _valid_at(pc, f, 0)), None)
    cell = row.cells.get(f) if f is not None else None
    if cell is None or cell[1] != 0:
        return None
    twin = cell[0]
    if twin is pc or not twin.stored or twin.damaged:
        return None
    if twin.batch.num_rows != pc.batch.num_rows:
        return None
    return twin


def _valid_at(pc: Piece, f: str, i: int) -> bool:
    valid = pc.valid(f)
    return valid is None or valid[i]


def _check_required_not_null(
    pc: Piece, i: int, fields: list[str], key: str, partition: str
) -> None:
    for f in fields:
        if not _valid_at(pc, f, i):
            raise MissingFieldError(
                f"row key {key!r}: required field {f!r} is null",
                field=f,
                key=key,
                partition=partition,
            )
