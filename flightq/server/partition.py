"""What the server stores: validated pieces of puts, rows that point into them, partitions.

A row holds, per field, a reference to the received record batch (a :class:`Piece`) and the
row index that carries it: nothing is rebuilt or copied on the way in.

A put is planned, then committed: :func:`flightq.server.putplan.plan_put` runs every check
and builds the rows the put stores (or finds it is a retry of one that landed) without the
store's lock and without changing anything; :meth:`Partition.commit` then stores them in a
few dict updates, after :meth:`Partition.touched` says no write meanwhile touched the put's
keys. Locking, waiting for room and the memory budget are the store's
(:mod:`flightq.server.store`).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import pyarrow as pa
from pyarrow.compute import unique as arrow_unique

from ..errors import EncodeError, ResourceExhaustedError
from ..layout import (
    KEY,
    MEDIA_TYPE,
    SLICE,
    TAGS,
    binary_offsets,
    in_slices,
    mapped,
    media_row_bytes,
    pylist,
)
from ..schema import Schema
from ..validation import Checked
from .budget import (
    PIECE_OVERHEAD,
    Tally,
    declaration_cost,
    journal_cost,
    piece_share,
    put_id_cost,
    record_stamp,
    row_costs,
    row_overhead,
    shrunk,
    tags_size,
    tallied,
)
from .leases import DEFAULT_LEASE, DEFAULT_MAX_FAILURES, Progress

if TYPE_CHECKING:
    from .media import Copy
    from .merge import Merge
    from .putplan import PutPlan
    from .readiness import Complete
    from .readings import Reading

__all__ = [
    "Block",
    "HiddenTags",
    "Piece",
    "Row",
    "Partition",
    "PutKeys",
    "make_piece",
    "put_keys",
    "row_pieces",
]

#: Put ids remembered per partition (for idempotent retries); each counts against the
#: memory budget while remembered (:attr:`Partition.records`).
RECENT_PUTS = 4096
#: Numbers each partition made in this process: a partition dropped and created again
#: under its name is another one.
_EPOCHS = itertools.count(1)
#: Bytes a piece counts from which :meth:`Partition.compact` copies its last rows out, and
#: most rows it walks and bytes it copies to do so (under the store's lock).
COMPACT_MIN_BYTES = 1 << 20
COMPACT_MAX_ROWS = 1 << 14
COMPACT_MAX_BYTES = 32 << 20
#: Writes, and row keys in all, the journal of recent writes keeps (:meth:`Partition.touched`);
#: what it keeps counts against the memory budget (:attr:`Partition.records`).
JOURNAL_WRITES = 1024
JOURNAL_KEYS = 65536


@dataclass(eq=False)
class Block:
    """Memory that the pieces read from it hold beyond their own buffers (a Flight
    message's header, a frame, a shared-memory segment copied whole, gaps a client left),
    freed only with the last of them: counted while any of them is used."""

    cost: int
    #: Its pieces that stored rows use.
    users: int = 0


@dataclass
class Piece:
    """One validated record batch of a put, with what validation learned.

    Its memory lives as long as one stored row uses one of its cells: the budget counts
    it whole (:attr:`cost`) from the first row that uses it to the last, whatever was
    cleared or replaced meanwhile (:meth:`Partition.use`)."""

    batch: pa.RecordBatch
    checked: Checked
    tags: list[dict[str, Any] | None]
    #: Per row, the bytes of it the memory budget counts while a row uses the piece, and
    #: those the row holds of its own (key, tags map, its objects), counted while it is
    #: stored (:func:`flightq.server.budget.row_costs`).
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    own: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Bytes of this piece the store counts as pending (read, not yet stored or let go).
    reserved: int = 0
    #: How many stored rows use it (what it counts then: :attr:`cost`).
    users: int = 0
    #: The memory it shares with the other pieces read from the same place, if any, and
    #: the bytes of it this piece reserves while the put waits (the first piece's).
    block: Block | None = None
    extra: int = 0
    #: Whether a put stored it, and whether its partition no longer holds it whole (a
    #: cell of it replaced, a row of it cleared, a tag of its rows rewritten); a stored
    #: piece held whole is what a retry without ``put_id`` is compared with.
    stored: bool = False
    damaged: bool = False
    #: Per media column, the copies its dictionary entries name (:mod:`flightq.server.media`;
    #: the batch keeps the column without the bytes), each entry's position among them,
    #: and the bytes of the payloads this piece brought.
    media: dict[str, list[Copy]] = field(default_factory=dict)
    media_index: dict[str, np.ndarray] = field(default_factory=dict)
    brings: int = 0
    #: The :attr:`Partition.epoch` of the partition it was validated against (0: none
    #: said, e.g. a restored snapshot's); a put stores it only into that one.
    epoch: int = 0
    _valid: dict[str, list[bool] | None] = field(default_factory=dict, repr=False)
    _nbytes: dict[str, list[int]] = field(default_factory=dict, repr=False)
    #: Per media column, per row, the distinct copies the row's cell uses (made on first
    #: use: every answer of a row with media asks for them).
    copies_of_rows: dict[str, list[tuple[Copy, ...]]] = field(default_factory=dict, repr=False)
    #: Per media column, its distinct copies and each dictionary entry's place among them
    #: (made on first use: a stored batch answered whole, :func:`~.media.piece_column`).
    answer_entries: dict[str, tuple[list[Copy], np.ndarray | None]] = field(
        default_factory=dict, repr=False
    )
    #: The piece as an answer sends it whole, kept where :func:`~.media.piece_answer`
    #: says; made on first use, for the batch it was made from.
    answer_whole: Any = field(default=None, repr=False)

    @property
    def cost(self) -> int:
        """Bytes counted while any stored row uses it: its rows' :attr:`held`."""
        return int(self.held.sum())

    def valid(self, f: str) -> list[bool] | None:
        """Per row whether the batch carries field ``f``; None when every row does."""
        if f not in self._valid:
            col = self.batch.column(f)
            self._valid[f] = None if col.null_count == 0 else pylist(col.is_valid())
        return self._valid[f]

    def cell_nbytes(self, f: str, i: int) -> int:
        """Payload bytes of field ``f`` in row ``i``, counted as validation counts them: a
        media entry shared by several rows counts on the first row that uses it."""
        if f not in self._nbytes:
            col = self.batch.column(f)
            if col.type == pa.large_binary():
                sizes = pylist(np.diff(binary_offsets(col)))
            elif col.type == MEDIA_TYPE:
                sizes = pylist(media_row_bytes(col))
            else:
                sizes = [0] * len(col)
            self._nbytes[f] = sizes
        return self._nbytes[f][i]


@dataclass(slots=True)
class Row:
    """A stored row: per field, the piece and index holding it. Never changed once
    stored: a write replaces it by a new one (:mod:`flightq.server.putplan`)."""

    key: str
    group: int
    cells: dict[str, tuple[Piece, int]] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    seq_len: int = -1
    nbytes: int = 0
    #: Bytes the memory budget counts for what the row holds of its own (its key, its tags
    #: map, its objects); its cells' pieces count on their own (:attr:`Piece.cost`).
    held: int = 0
    #: The piece and index holding every field of the row, where the row has every field
    #: that piece carries and its tags are that piece's (a row as a put created it); None
    #: otherwise. Rows with consecutive homes in one piece are one slice of it, keys and
    #: tags included (:mod:`flightq.server.assemble`).
    home: tuple[Piece, int] | None = None


class HiddenTags:
    """Rows' tags with the values of the keys under ``prefix`` left out (None), as a get,
    a claim or a listing asked (``hide_tag_values``). Which keys of a map are hidden is
    found once per set of keys (the rows of a partition mostly share theirs): a lookup
    per row instead of a test per key."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._by_keys: dict[tuple[str, ...], frozenset[str]] = {}

    def of(self, tags: dict[str, Any]) -> frozenset[str]:
        """The keys of ``tags`` under the prefix (empty: none)."""
        ks = tuple(tags)
        got = self._by_keys.get(ks)
        if got is None:
            got = self._by_keys[ks] = frozenset(
                k for k in ks if isinstance(k, str) and k.startswith(self.prefix)
            )
        return got

    def shown(self, tags: dict[str, Any]) -> dict[str, Any]:
        """``tags`` with the hidden values None: a new map, or ``tags`` itself where none
        is hidden."""
        hidden = self.of(tags)
        return {k: None if k in hidden else v for k, v in tags.items()} if hidden else tags

    def any(self, rows: list[Row]) -> bool:
        """Whether a row of ``rows`` has a tag under the prefix."""
        of = self.of
        return any(r.tags and of(r.tags) for r in rows)


#: Partition attributes the store's :class:`~flightq.server.budget.Tally` adds up.
_TALLIED = {
    "held": "held",
    "declared": "declared",
    "journal_bytes": "records",
    "put_id_bytes": "records",
}


@dataclass
class Partition:
    """A declared partition and its rows (insertion-ordered)."""

    name: str
    schema: Schema
    tasks: tuple[str, ...]
    group_size: int | None
    rows: dict[str, Row] = field(default_factory=dict)
    #: Per task, where each row stands (ready, leased, done, dead), and the leases.
    progress: Progress = None  # type: ignore[assignment]  # made from ``tasks``
    next_group: int = 0
    nbytes: int = 0
    #: Bytes the memory budget counts for the partition: its rows' own
    #: (:attr:`Row.held`), the pieces they use (:meth:`use`) and its media copies (counted
    #: once, ``media_bytes`` of it).
    held: int = 0
    #: The media copies its rows use, filed by hint (column, hint, shape), oldest first
    #: (:mod:`flightq.server.media`).
    media: dict[Any, list[Copy]] = field(default_factory=dict, repr=False)
    media_bytes: int = 0
    #: Acknowledgements of recent puts by put id (oldest first), for idempotent retries
    #: (changed through :meth:`remember_put` and :meth:`forget_put`, which count them).
    recent_puts: dict[str, int] = field(default_factory=dict)
    #: Most rows the partition holds at once; a put that would pass it waits for clears.
    max_rows: int | None = None
    #: Seconds a claim's rows stay leased without an ack (a claim may say otherwise).
    lease: float = DEFAULT_LEASE
    #: Failed deliveries after which a row goes to the dead letters.
    max_failures: int = DEFAULT_MAX_FAILURES
    #: Writes of rows so far, and the recent ones' keys (:meth:`touched`), each with the
    #: bytes the budget counts for it (:func:`~flightq.server.budget.journal_cost`) and
    #: its :func:`~flightq.server.budget.record_stamp`.
    writes: int = 0
    journal: deque[tuple[int, Sequence[str] | None, int, int]] = field(
        default_factory=deque, repr=False
    )
    _journaled: int = field(default=0, repr=False)
    #: Bytes the budget counts for the journal, and for the put ids remembered.
    journal_bytes: int = field(default=0, repr=False)
    put_id_bytes: int = field(default=0, repr=False)
    _put_stamps: dict[str, int] = field(default_factory=dict, repr=False)
    _groups: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: Per set of fields some claim needs beyond the required ones, the keys of the rows
    #: that carry them all (:mod:`flightq.server.readiness`).
    complete: dict[frozenset[str], Complete] = field(default_factory=dict, repr=False)
    #: Bytes the memory budget counts for the declaration itself while it exists
    #: (:func:`flightq.server.budget.declaration_cost`).
    declared: int = 0
    #: This partition among those ever made under its name (:data:`_EPOCHS`).
    epoch: int = field(default_factory=lambda: next(_EPOCHS), repr=False)
    #: The store's running totals it keeps current (:meth:`attach`); None: a copy.
    tally: Tally | None = field(default=None, repr=False, compare=False)
    #: Answers and snapshots reading its rows now (:mod:`flightq.server.readings`), by id.
    readings: dict[int, Reading] = field(default_factory=dict, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        total = _TALLIED.get(name)
        t = self.__dict__.get("tally") if total is not None else None
        if t is not None:
            t.set(self, name, total, value, self)
        else:
            object.__setattr__(self, name, value)

    def attach(self, tally: Tally | None) -> None:
        """Add what the partition counts to ``tally`` (the store's) and keep it current as
        it changes; None: take it out again (the partition leaves the store)."""
        if self.tally is not None:
            self.tally.holders.pop(id(self), None)
        tallied(self, _TALLIED, self.tally, -1)
        tallied(self, _TALLIED, tally, 1)
        object.__setattr__(self, "tally", tally)
        self.progress.attach(tally, self)
        if tally is not None:
            tally.note(self)

    def __post_init__(self) -> None:
        if self.progress is None:
            self.progress = Progress(self.tasks, self.max_failures)
        self.declared = declaration_cost(self.name, self.tasks)
        self.put_id_bytes = sum(map(put_id_cost, self.recent_puts))
        self._put_stamps = {k: record_stamp() for k in self.recent_puts}

    @property
    def records(self) -> int:
        """Bytes the memory budget counts for what the partition keeps of its past, which
        its rows do not hold: the journal of recent writes, ended leases and recent put
        ids. The store drops them, the oldest of any partition first, when the budget
        needs their room (:meth:`drop_oldest_record`)."""
        return self.journal_bytes + self.put_id_bytes + self.progress.ended_bytes

    def oldest_record(self) -> int | None:
        """The stamp (:func:`~flightq.server.budget.record_stamp`) of the oldest of
        :attr:`records`; None when it keeps none."""
        heads = [
            self.journal[0][3] if self.journal else None,
            next(iter(self._put_stamps.values())) if self._put_stamps else None,
            self.progress.oldest_ended(),
        ]
        return min((h for h in heads if h is not None), default=None)

    def drop_oldest_record(self) -> int:
        """Forget the oldest of :attr:`records` (one must be kept); returns the bytes it
        counted. With the store's lock.

        Each kind fails safe: a plan or merge that the journal no longer reaches back for
        is made again, or updates in place (:meth:`written_since`); an ``ack`` of a
        forgotten lease is ``NotFoundError``, and the rows it did not acknowledge are
        delivered again; a retry of a forgotten put id is stored again, unless its rows
        are still stored whole (then it is a retry by content)."""
        oldest = self.oldest_record()
        if self.journal and self.journal[0][3] == oldest:
            return self._forget_write()
        if self._put_stamps and next(iter(self._put_stamps.values())) == oldest:
            return self._forget_oldest_put()
        return self.progress.drop_ended()

    def _forget_oldest_put(self) -> int:
        put_id = next(iter(self._put_stamps))
        self.forget_put(put_id)
        return put_id_cost(put_id)

    def remember_put(self, put_id: str, rows: int) -> None:
        """Remember a put id (for a retry of it) and what it acknowledged, forgetting the
        oldest past :data:`RECENT_PUTS`. With the store's lock."""
        puts = self.recent_puts
        if put_id not in puts:
            self.put_id_bytes += put_id_cost(put_id)
            self._put_stamps[put_id] = record_stamp()
        puts[put_id] = rows
        while len(puts) > RECENT_PUTS:
            self._forget_oldest_put()

    def forget_put(self, put_id: str) -> None:
        """Forget a put id (a retry of it is stored again). With the store's lock."""
        if self.recent_puts.pop(put_id, None) is not None:
            del self._put_stamps[put_id]
            self.put_id_bytes -= put_id_cost(put_id)

    def declaration(self) -> dict[str, Any]:
        """The declaration as sent by ``declare``."""
        return {
            "partition": self.name,
            "schema": self.schema.canonical_json,
            "schema_ref": self.schema.ref,
            "fingerprint": self.schema.fingerprint,
            "tasks": list(self.tasks),
            "group_size": self.group_size,
            "max_rows": self.max_rows,
            "lease": self.lease,
            "max_failures": self.max_failures,
        }

    def reserve_groups(self, n: int) -> int:
        """Take ``n`` group numbers for a put's new rows; returns the first. A put that is
        refused or planned again leaves a gap, which nothing minds: a group number only
        tells which rows belong together."""
        with self._groups:
            first = self.next_group
            self.next_group += n
            return first

    def touched(self, seen: int, keys: set[str]) -> bool:
        """Whether a write since write count ``seen`` may have touched one of ``keys`` (True
        also when the journal no longer reaches back that far). With the store's lock."""
        written = self.written_since(seen)
        return written is None or any(not keys.isdisjoint(w) for w in written)

    def written_since(self, seen: int) -> list[Sequence[str]] | None:
        """The keys of each write since write count ``seen``, newest first; None when the
        journal no longer reaches back that far or one of them may have written any row.
        With the store's lock."""
        if self.writes == seen:
            return []
        journal = self.journal
        if not journal or journal[0][0] > seen + 1:
            return None
        out: list[Sequence[str]] = []
        for n, written, _, _ in reversed(journal):
            if n <= seen:
                break
            if written is None:
                return None
            out.append(written)
        return out

    def wrote(self, keys: Sequence[str] | None, cost: int | None = None) -> None:
        """Count a write of rows ``keys`` (None: possibly every row) in the journal that
        :meth:`touched` reads; ``cost`` is its :func:`~flightq.server.budget.journal_cost`
        where known. With the store's lock."""
        self.writes += 1
        if keys is not None and len(keys) > JOURNAL_KEYS // 4:
            keys = None  # too many to keep: plans running now will plan again
            cost = None
        if cost is None:
            cost = journal_cost(keys)
        self.journal.append((self.writes, keys, cost, record_stamp()))
        self._journaled += len(keys) if keys is not None else 0
        self.journal_bytes += cost
        while len(self.journal) > JOURNAL_WRITES or self._journaled > JOURNAL_KEYS:
            self._forget_write()

    def _forget_write(self) -> int:
        """Drop the journal's oldest entry; returns the bytes it counted."""
        _, old, cost, _ = self.journal.popleft()
        self._journaled -= len(old) if old is not None else 0
        self.journal_bytes -= cost
        return cost

    def commit(self, plan: PutPlan, merge: Merge | None = None) -> int:
        """Store what ``plan`` (:func:`flightq.server.putplan.plan_put`, still valid:
        :meth:`touched` is false for its keys) describes: dict updates only, each row
        replaced whole, or the dicts ``merge`` built outside the lock swapped in
        (:mod:`flightq.server.merge`). With the store's lock. Returns the rows written."""
        if plan.replay is not None:
            return plan.replay
        if self.media_fields:
            self._count_media(plan.rows)
        # Into a partition holding no row, the plan's dicts are adopted whole: a million
        # entries copied here would keep the lock (and the GIL) for a tenth of a second.
        fresh = bool(plan.fresh) and not self.rows
        if self.readings and not fresh:
            self._replaced(self.rows.get(k) for k in plan.rows)
        merged = merge.rows() if merge is not None and not fresh else None
        if fresh:
            self.rows = plan.rows
        elif merged is not None:
            self.rows = merged
        else:
            self.rows.update(plan.rows)
        self.nbytes += plan.nbytes
        self.held += plan.held
        for pc, n in plan.uses:
            self.use(pc, n)
        for pc in plan.damaged:
            pc.damaged = True
        for pc in plan.pieces:
            pc.stored = True
            b = pc.block
            if not pc.users and b is not None and b.users:
                # No row uses it (tags rewritten, fields all null), but its buffers lie in
                # a block another stored batch keeps alive: counted with the block from now.
                b.cost += pc.cost
                self.held += pc.cost
        if fresh:
            self.progress.adopt(plan.fresh)
        else:  # built outside the lock by the plan (and by the merge)
            ready = plan.ready if plan.ready is not None else plan.new
            self.progress.added(ready, merge.readies() if merge is not None else ())
        if plan.put_id is not None:
            self.remember_put(plan.put_id, len(plan.keys))
        self.wrote(plan.keys, plan.journal)
        return len(plan.keys)

    def cleared(self, rows: Iterable[Row]) -> list[Piece]:
        """Rows removed: the pieces holding their cells no longer hold whole what they
        stored (a retry of them is not a replay), and the media copies they used are used
        once less (a table of copies left mostly empty is rebuilt at its size:
        :func:`~flightq.server.budget.shrunk`). Returns the pieces that rows still use,
        each once. With the store's lock."""
        from .media import release, row_copies

        fields = self.media_fields
        touched: dict[int, Piece] = {}
        for r in rows:
            self.held -= r.held
            self.let_go(r, r.held)  # its key and tags, where an answer still reads it
            for pc in row_pieces(r):
                pc.damaged = True
                self.use(pc, -1)
                touched[id(pc)] = pc
            if fields:
                release(self, row_copies(r, fields))
        if fields:
            self.media = shrunk(self.media)  # swapped: a lookup under way reads the old one
        return [pc for pc in touched.values() if pc.users]

    def compact(self, pieces: Iterable[Piece]) -> int:
        """Copy the rows still stored out of each of ``pieces`` that they use little (at
        most half its rows, :data:`COMPACT_MIN_BYTES` or more counted, no media column)
        into a piece of their own (at most :data:`COMPACT_MAX_ROWS` rows walked and
        :data:`COMPACT_MAX_BYTES` copied; none whose block other pieces keep alive; none
        where the copy fails), so that the rest of its memory goes: rows cleared from
        a put no longer keep its whole batch alive (a dead letter, a row kept from each
        put). The rows are replaced by new ones (answers under way keep reading the old),
        as a write of their keys. Returns the rows moved. With the store's lock."""
        moved = 0
        for pc in pieces:
            n = len(pc.checked.keys)
            if pc.media or not 0 < pc.users * 2 <= n or pc.cost < COMPACT_MIN_BYTES:
                continue
            if n > COMPACT_MAX_ROWS or pc.cost // n * pc.users > COMPACT_MAX_BYTES:
                continue  # too long a copy under the store's lock: it stays counted whole
            if pc.block is not None and pc.block.users > 1:
                continue  # other batches keep its memory alive: a copy would free nothing
            try:
                moved += self._compact(pc)
            except Exception:  # an allocation refused (the memory cap): it stays as it is
                continue
        return moved

    def _compact(self, pc: Piece) -> int:
        keys = pc.checked.keys
        at: list[int] = []
        rows: list[Row] = []
        for i, k in enumerate(keys):
            r = self.rows.get(k)
            if r is not None and any(c[0] is pc and c[1] == i for c in r.cells.values()):
                at.append(i)
                rows.append(r)
        if len(rows) != pc.users:  # what the count says differs: leave it be
            return 0
        idx = np.asarray(at, dtype=np.int64)
        ck = pc.checked
        checked = Checked(
            ck.schema, [keys[i] for i in at], ck.fields, ck.seq_lens[idx], ck.nbytes[idx]
        )
        # The rows' shares of the old batch, and of the new batch's own objects.
        held = pc.held[idx] + piece_share(PIECE_OVERHEAD, len(at)) if len(pc.held) else pc.held
        own = pc.own[idx] if len(pc.own) else pc.own
        new = Piece(pc.batch.take(pa.array(idx)), checked, [pc.tags[i] for i in at], held, own=own)
        new.stored = new.damaged = True  # not what a put sent: a retry is stored again
        new.epoch = pc.epoch
        if self.readings:
            self._replaced(rows)
        for j, r in enumerate(rows):
            cell = (new, j)
            cells = {f: cell if c[0] is pc else c for f, c in r.cells.items()}
            home = cell if r.home is not None and r.home[0] is pc else r.home
            self.rows[r.key] = Row(r.key, r.group, cells, r.tags, r.seq_len, r.nbytes, r.held, home)
        self.use(new, len(rows))
        self.use(pc, -pc.users)
        self.wrote(checked.keys)  # plans and merges that read the old rows see it
        return len(rows)

    def use(self, pc: Piece, n: int) -> None:
        """``n`` more stored rows use ``pc`` (fewer where negative): the budget counts it,
        and its block, from its first user to its last. With the store's lock."""
        before = pc.users
        pc.users = after = before + n
        if (before > 0) == (after > 0):
            return
        step = 1 if after > 0 else -1
        b = pc.block
        if b is None:
            self.held += step * pc.cost
            if step < 0:
                self.let_go(pc, pc.cost)
            return
        b.users += step
        if step > 0:
            self.held += pc.cost + (b.cost if b.users == 1 else 0)
        elif b.users:  # its buffers are slices of the block, which others keep alive
            b.cost += pc.cost
        else:
            self.held -= pc.cost + b.cost
            self.let_go(b, pc.cost + b.cost)

    def _replaced(self, rows: Iterable[Row | None]) -> None:
        """Rows replaced by new ones (a write of their keys, a compaction): what an answer
        under way still reading one keeps alive stays counted, its own bytes in full (an
        upper bound: the new row may share its key and tags). With the store's lock."""
        for r in rows:
            if r is not None:
                self.let_go(r, r.held)

    def let_go(self, holder: Any, nbytes: int) -> None:
        """The partition stopped counting ``nbytes`` that ``holder`` (a row, a piece, a
        block, a media home) keeps alive: they stay counted while an answer or a snapshot
        under way reads it or rows that use it (:mod:`flightq.server.readings`). With the
        store's lock."""
        if self.readings and self.tally is not None:
            self.tally.kept.keep(self.readings.values(), holder, nbytes)

    @property
    def media_fields(self) -> tuple[str, ...]:
        """The schema's media fields."""
        return tuple(f.name for f in self.schema.fields if f.role == "media")

    def _count_media(self, rows: dict[str, Row]) -> None:
        """The media copies of rows about to be stored: each new cell's used once more,
        each cell they replace once less. With the store's lock."""
        from .media import acquire, cell_copies, release

        gained: list[Copy] = []
        lost: list[Copy] = []
        fields = self.media_fields  # once: a property that walks the schema
        for k, row in rows.items():
            old = self.rows.get(k)
            for f in fields:
                cell = row.cells.get(f)
                was = old.cells.get(f) if old is not None else None
                if cell is was:
                    continue
                if cell is not None:
                    gained.extend(cell_copies(cell[0], f, cell[1]))
                if was is not None:
                    lost.extend(cell_copies(was[0], f, was[1]))
        acquire(self, gained)  # first: a copy both gained and lost stays
        if lost:
            release(self, lost)
            self.media = shrunk(self.media)


def row_pieces(row: Row) -> list[Piece]:
    """The pieces ``row``'s cells lie in, each once."""
    cells = row.cells
    if row.home is not None:
        return [row.home[0]]
    out: list[Piece] = []
    for pc, _ in cells.values():
        if not any(pc is q for q in out):
            out.append(pc)
    return out


class PutKeys:
    """Every row key of a put, checked not to repeat (:func:`put_keys`), as a set built
    only when first asked for: a set of a million keys costs each garbage collection that
    walks it tens of milliseconds of the GIL, and a put asks for it only when a write of
    its partition landed while it planned (:meth:`Partition.touched`)."""

    def __init__(self, pieces: list[Piece], unique: set[str] | None = None) -> None:
        self._pieces = pieces
        self._unique = unique

    def set(self) -> set[str]:
        """The keys, as a set."""
        if self._unique is None:
            self._unique = _key_set(self._pieces)
        return self._unique


def put_keys(pieces: list[Piece]) -> PutKeys:
    """Every row key of a put.

    Raises
    ------
    EncodeError
        If a key repeats within the put.
    """
    if len(pieces) <= 1:  # validation refused a key repeating within its batch
        return PutKeys(pieces)
    n = sum(len(pc.checked.keys) for pc in pieces)
    unique: set[str] | None = None
    if n <= SLICE:
        unique = _key_set(pieces)
        distinct = len(unique)
    else:  # counted by Arrow, which lets go of the GIL, and leaves no set behind
        distinct = len(arrow_unique(pa.chunked_array([pc.batch.column(KEY) for pc in pieces])))
    if distinct != n:
        seen: set[str] = set()
        keys = (k for pc in pieces for k in pc.checked.keys)
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise EncodeError(f"duplicate row key {dup!r} within one put", key=dup)
    return PutKeys(pieces, unique)


def _key_set(pieces: list[Piece]) -> set[str]:
    unique: set[str] = set()
    for pc in pieces:
        for part in in_slices(pc.checked.keys):
            unique.update(part)
    return unique


#: Rows up to which a batch's tags are decoded row by row (Arrow's dictionary of
#: distinct values costs more than it saves there).
_FEW = 8


def _decode_tags(
    piece_batch: pa.RecordBatch, keys: list[str], limit: int | None
) -> tuple[list[dict[str, Any] | None], np.ndarray]:
    """Each row's tags decoded, and what the budget counts of them per row (their Python
    objects' size, :func:`tags_size`; 0 for none or an empty map).

    Each distinct value is decoded and measured once: the rows of a prompt group share
    their tags' bytes, and share the map they decode to (nothing changes a stored map in
    place). Each row still counts the map whole, as if it held its own. The first row (in
    order) whose tags are not a msgpack map, or take the batch's past ``limit``, is named.
    """
    col = piece_batch.column(TAGS)
    if len(col) > _FEW and col.null_count == len(col):  # no row has tags
        return [None] * len(col), np.zeros(len(col), dtype=np.int64)
    values = pylist(col)
    if len(values) <= _FEW:
        return _tags_row_by_row(values, keys, limit)
    # Each distinct value's number, in order of first use (a dict, not Arrow's dictionary
    # encoding: its hash table stays in Arrow's pool, which rows of distinct tags grow),
    # a slice at a time (:func:`~flightq.layout.pylist`).
    seen: dict[bytes, int] = {}
    at = np.concatenate(
        [
            np.array([-1 if b is None else seen.setdefault(b, len(seen)) for b in part], np.int64)
            for part in in_slices(values)
        ]
    )
    maps: list[dict[str, Any] | None] = []
    sizes: list[int] = []
    for j, b in enumerate(seen):
        try:
            t = msgpack.unpackb(b, raw=False)
        except Exception:  # hostile bytes raise assorted errors
            t = None
        if not _string_keyed(t):
            # Refused at the first row with these bytes, unless earlier rows pass the limit.
            first = int(np.argmax(at == j))
            _check_tag_limit(at[:first], sizes, keys, limit)
            t = _tags_map(b, keys[first])  # raises, naming that row
        maps.append(t)
        sizes.append(tags_size(t))
    _check_tag_limit(at, sizes, keys, limit)
    counted = np.array([s if t else 0 for t, s in zip(maps, sizes, strict=True)] + [0])
    maps.append(None)  # index -1: a row without tags
    return mapped(maps.__getitem__, pylist(at)), counted[at]


def _tags_row_by_row(
    values: list[bytes | None], keys: list[str], limit: int | None
) -> tuple[list[dict[str, Any] | None], np.ndarray]:
    """:func:`_decode_tags` of a few rows, one at a time."""
    out: list[dict[str, Any] | None] = []
    sizes: list[int] = []
    size = 0
    for k, b in zip(keys, values, strict=True):
        if b is None:
            out.append(None)
            sizes.append(0)
            continue
        t = _tags_map(b, k)
        s = tags_size(t)
        size += s
        if limit is not None and size > limit:
            raise _tags_past(limit, k)
        out.append(t)
        sizes.append(s if t else 0)  # an empty map is stored as no tags
    return out, np.asarray(sizes, dtype=np.int64)


def _tags_map(b: bytes, k: str) -> dict[str, Any]:
    """The map the tags ``b`` of row ``k`` decode to.

    Raises
    ------
    EncodeError
        If ``b`` is not msgpack, or not a map with string keys.
    """
    try:
        t = msgpack.unpackb(b, raw=False)
    except Exception as e:  # hostile bytes raise assorted errors
        raise EncodeError(f"tags of row {k!r} are not valid msgpack: {e}", field=TAGS, key=k) from e
    if not isinstance(t, dict):
        raise EncodeError(
            f"tags of row {k!r} must be a msgpack map, got {type(t).__name__}",
            field=TAGS,
            key=k,
            actual=type(t).__name__,
        )
    odd = next((x for x in t if not isinstance(x, str)), None)
    if odd is not None:
        raise EncodeError(
            f"tags of row {k!r} must have string keys, got key {odd!r} ({type(odd).__name__})",
            field=TAGS,
            key=k,
            actual=type(odd).__name__,
        )
    return t


def _string_keyed(t: Any) -> bool:
    """Whether ``t`` is a map whose keys are all strings (what tags are)."""
    return isinstance(t, dict) and all(isinstance(x, str) for x in t)


def _tags_past(limit: int, k: str) -> ResourceExhaustedError:
    return ResourceExhaustedError(
        f"the tags of a record batch take more than {limit} bytes as Python "
        f"objects (at row {k!r}), more than the server's whole memory budget",
        field=TAGS,
        key=k,
        expected=limit,
    )


def _check_tag_limit(at: np.ndarray, sizes: list[int], keys: list[str], limit: int | None) -> None:
    """Refuse rows whose tags (distinct map ``at[i]`` per row, -1 none; ``sizes`` each
    map's) add up past ``limit``, naming the row where they first do."""
    if limit is None or not len(at):
        return
    each = np.array([*sizes, 0], dtype=np.int64)[at]
    total = np.cumsum(each)
    if total[-1] > limit:
        raise _tags_past(limit, keys[int(np.argmax(total > limit))])


def make_piece(
    batch: pa.RecordBatch, checked: Checked, limit: int | None = None, tasks: int = 1
) -> Piece:
    """Wrap a validated batch, parsing its tags (refusing invalid msgpack, and tags whose
    Python objects would take more than ``limit`` bytes), and count what it holds, its rows
    as rows of a partition of ``tasks`` tasks."""
    tags, sizes = _decode_tags(batch, checked.keys, limit)
    held, own = row_costs(batch, checked.keys, sizes, checked.nbytes, row_overhead(tasks))
    return Piece(batch, checked, tags, held, own=own)
