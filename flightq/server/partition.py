"""What the server stores: validated pieces of puts, rows that point into them, partitions.

A row holds, per field, a reference to the received record batch (a :class:`Piece`) and the
row index that carries it: nothing is rebuilt or copied on the way in.

A put is planned, then applied: :meth:`Partition.plan_put` runs every check and works out
what the put does (the rows it creates, the cells it replaces, the bytes it brings, or that
it is a retry of one that landed) without changing anything; :meth:`Partition.apply` then
makes those changes. Locking, waiting for room and the memory budget are the store's
(:mod:`flightq.server.store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

from ..errors import (
    ConflictError,
    EncodeError,
    MissingFieldError,
    ResourceExhaustedError,
    ShapeError,
)
from ..layout import MEDIA_TYPE, SHAPE_SUFFIX, TAGS, binary_offsets, media_row_bytes
from ..schema import Schema
from ..validation import Checked
from .budget import row_costs, tags_size
from .leases import DEFAULT_LEASE, DEFAULT_MAX_FAILURES, Progress

__all__ = ["Piece", "Row", "Partition", "PutPlan", "make_piece", "put_keys"]

#: Put ids remembered per partition (for idempotent retries).
RECENT_PUTS = 4096
_MISSING = object()


@dataclass
class Piece:
    """One validated record batch of a put, with what validation learned."""

    batch: pa.RecordBatch
    checked: Checked
    tags: list[dict[str, Any] | None]
    #: Per row, the bytes the memory budget counts while the row is stored
    #: (:func:`flightq.server.budget.row_costs`).
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Bytes of this piece the store counts as pending (read, not yet stored or let go).
    reserved: int = 0
    _valid: dict[str, list[bool] | None] = field(default_factory=dict, repr=False)
    _nbytes: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def valid(self, f: str) -> list[bool] | None:
        """Per row whether the batch carries field ``f``; None when every row does."""
        if f not in self._valid:
            col = self.batch.column(f)
            self._valid[f] = None if col.null_count == 0 else col.is_valid().to_pylist()
        return self._valid[f]

    def cell_nbytes(self, f: str, i: int) -> int:
        """Payload bytes of field ``f`` in row ``i``, counted as validation counts them: a
        media entry shared by several rows counts on the first row that uses it."""
        if f not in self._nbytes:
            col = self.batch.column(f)
            if col.type == pa.large_binary():
                sizes = np.diff(binary_offsets(col)).tolist()
            elif col.type == MEDIA_TYPE:
                sizes = media_row_bytes(col).tolist()
            else:
                sizes = [0] * len(col)
            self._nbytes[f] = sizes
        return self._nbytes[f][i]


@dataclass
class Row:
    """A stored row: per field, the piece and index holding it."""

    key: str
    group: int
    cells: dict[str, tuple[Piece, int]] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    seq_len: int = -1
    nbytes: int = 0
    #: Bytes the memory budget counts for the row (payload and what holding it costs).
    held: int = 0


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
    #: Bytes the memory budget counts for the partition's rows (:attr:`Row.held`).
    held: int = 0
    #: Acknowledgements of recent puts by put id (oldest first), for idempotent retries.
    recent_puts: dict[str, int] = field(default_factory=dict)
    #: Most rows the partition holds at once; a put that would pass it waits for clears.
    max_rows: int | None = None
    #: Seconds a claim's rows stay leased without an ack (a claim may say otherwise).
    lease: float = DEFAULT_LEASE
    #: Failed deliveries after which a row goes to the dead letters.
    max_failures: int = DEFAULT_MAX_FAILURES

    def __post_init__(self) -> None:
        if self.progress is None:
            self.progress = Progress(self.tasks, self.max_failures)

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

    def plan_put(self, pieces: list[Piece], overwrite: bool, put_id: str | None) -> PutPlan:
        """What storing ``pieces`` would do, after every check; changes nothing.

        A retry is recognised first: a ``put_id`` seen recently, or (without
        ``overwrite``) a put whose every cell and tag equals what its rows already hold,
        is planned as a replay (:attr:`PutPlan.replay`), to acknowledge again.

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
        keys = [k for pc in pieces for k in pc.checked.keys]
        if put_id is not None and put_id in self.recent_puts:
            return PutPlan(pieces, keys, put_id, replay=self.recent_puts[put_id])
        if not overwrite and _is_replay(self, pieces):
            return PutPlan(pieces, keys, put_id, replay=len(keys))
        name = self.name
        new: list[str] = []
        # Bytes of the cells an overwrite replaces, counted before anything changes.
        replaced: dict[tuple[str, str], int] = {}
        for pc in pieces:
            ck = pc.checked
            missing = [f for f in self.schema.required if f not in ck.fields]
            # Required fields with null rows in this piece (usually none).
            holes = [f for f in self.schema.required if f in ck.fields and pc.valid(f)]
            for i, k in enumerate(ck.keys):
                row = self.rows.get(k)
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
                    new.append(k)
                    continue
                for f in ck.fields:
                    if not _valid_at(pc, f, i):
                        continue
                    old = row.cells.get(f)
                    if old is None:
                        continue
                    if not overwrite:
                        raise ConflictError(
                            f"row key {k!r} already has column {f!r} in partition "
                            f"{name!r}; pass overwrite=True to rewrite it",
                            field=f,
                            key=k,
                            partition=name,
                        )
                    replaced[(k, f)] = old[0].cell_nbytes(f, old[1])
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
        g = self.group_size
        if g and len(new) % g:
            raise ShapeError(
                f"partition {name!r} has group size {g}: a put creates whole groups, "
                f"got {len(new)} new rows",
                actual=len(new),
                partition=name,
            )
        return PutPlan(pieces, keys, put_id, new=new, replaced=replaced)

    def apply(self, plan: PutPlan) -> int:
        """Make the changes ``plan`` (from :meth:`plan_put` on this partition as it is now)
        describes. Returns the rows written."""
        if plan.replay is not None:
            return plan.replay
        g = self.group_size
        new_set = set(plan.new)
        n_new = 0
        for pc in plan.pieces:
            ck = pc.checked
            # Fields every row of the piece carries, and the others with their rows.
            dense = [f for f in ck.fields if pc.valid(f) is None]
            sparse = [(f, v) for f in ck.fields if (v := pc.valid(f)) is not None]
            seq_lens, nbytes = ck.seq_lens.tolist(), ck.nbytes.tolist()
            held = pc.held.tolist() if len(pc.held) else nbytes
            for i, k in enumerate(ck.keys):
                cell = (pc, i)
                if k in new_set:
                    group = self.next_group + n_new // g if g else self.next_group + n_new
                    n_new += 1
                    row = Row(k, group)
                    self.rows[k] = row
                    row.cells = dict.fromkeys(dense, cell)
                    fields = [f for f, v in sparse if v[i]]
                else:
                    row = self.rows[k]
                    fields = dense + [f for f, v in sparse if v[i]]
                for f in fields:
                    gone = plan.replaced.get((k, f), 0)  # overwrite: the old cell's bytes
                    row.nbytes -= gone
                    self.nbytes -= gone
                    row.held -= gone
                    self.held -= gone
                    row.cells[f] = cell
                if pc.tags[i]:
                    row.tags.update(pc.tags[i])  # type: ignore[arg-type]
                if seq_lens[i] >= 0:
                    row.seq_len = seq_lens[i]
                row.nbytes += nbytes[i]
                self.nbytes += nbytes[i]
                row.held += held[i]
                self.held += held[i]
        self.next_group += (n_new // g) if g else n_new
        self.progress.added(plan.new)
        if plan.put_id is not None:
            self.recent_puts[plan.put_id] = len(plan.keys)
            while len(self.recent_puts) > RECENT_PUTS:
                del self.recent_puts[next(iter(self.recent_puts))]
        return len(plan.keys)


@dataclass(frozen=True)
class PutPlan:
    """What a put does to a partition, worked out by :meth:`Partition.plan_put`."""

    pieces: list[Piece]
    #: Every row key of the put, in order.
    keys: list[str]
    put_id: str | None
    #: The rows to acknowledge again without storing anything (a retry), or None.
    replay: int | None = None
    #: Keys of the rows the put creates, in order.
    new: list[str] = field(default_factory=list)
    #: ``(key, field)`` of each cell an overwrite replaces, to the bytes it held.
    replaced: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Payload bytes the put carries."""
        return sum(int(pc.checked.nbytes.sum()) for pc in self.pieces)

    @property
    def held(self) -> int:
        """Bytes the memory budget counts for the put (what it must have room for)."""
        return sum(
            int(pc.held.sum()) if len(pc.held) else int(pc.checked.nbytes.sum())
            for pc in self.pieces
        )


def put_keys(pieces: list[Piece]) -> list[str]:
    """Every row key of a put, in order.

    Raises
    ------
    EncodeError
        If a key repeats within the put.
    """
    keys = [k for pc in pieces for k in pc.checked.keys]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise EncodeError(f"duplicate row key {dup!r} within one put", key=dup)
    return keys


def _is_replay(p: Partition, pieces: list[Piece]) -> bool:
    """Whether every row of the put exists and already holds each of its cells and tags.

    Such a put is a retry of one that landed (its acknowledgement was lost): answering it
    again stores nothing, so a retry never duplicates or conflicts.
    """
    for pc in pieces:
        for i, k in enumerate(pc.checked.keys):
            row = p.rows.get(k)
            if row is None:
                return False
            t = pc.tags[i]
            if t and any(row.tags.get(a, _MISSING) != b for a, b in t.items()):
                return False
            for f in pc.checked.fields:
                if not _valid_at(pc, f, i):
                    continue
                cell = row.cells.get(f)
                if cell is None:
                    return False
                names = [f] if p.schema[f].role == "scalar" else [f, f + SHAPE_SUFFIX]
                for c in names:
                    mine = cell[0].batch.column(c).slice(cell[1], 1)
                    if not pc.batch.column(c).slice(i, 1).equals(mine):
                        return False
    return True


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


def _decode_tags(
    piece_batch: pa.RecordBatch, keys: list[str], limit: int | None
) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    size = 0
    for k, b in zip(keys, piece_batch.column(TAGS).to_pylist(), strict=True):
        if b is None:
            out.append(None)
            continue
        try:
            t = msgpack.unpackb(b, raw=False)
        except Exception as e:  # hostile bytes raise assorted errors
            raise EncodeError(
                f"tags of row {k!r} are not valid msgpack: {e}", field=TAGS, key=k
            ) from e
        if not isinstance(t, dict):
            raise EncodeError(
                f"tags of row {k!r} must be a msgpack map, got {type(t).__name__}",
                field=TAGS,
                key=k,
                actual=type(t).__name__,
            )
        if limit is not None:
            size += tags_size(t)
            if size > limit:
                raise ResourceExhaustedError(
                    f"the tags of a record batch take more than {limit} bytes as Python "
                    f"objects (at row {k!r}), more than the server's whole memory budget",
                    field=TAGS,
                    key=k,
                    expected=limit,
                )
        out.append(t)
    return out


def make_piece(batch: pa.RecordBatch, checked: Checked, limit: int | None = None) -> Piece:
    """Wrap a validated batch, parsing its tags (refusing invalid msgpack, and tags whose
    Python objects would take more than ``limit`` bytes), and count what it holds."""
    tags = _decode_tags(batch, checked.keys, limit)
    return Piece(batch, checked, tags, row_costs(batch, checked.keys, tags, checked.nbytes))
