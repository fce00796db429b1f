"""Serving rows: record batches built from zero-copy slices of the stored batches.

Consecutive rows whose cells come from consecutive rows of the same stored batches are one
slice per column (the usual case: a claim of what one put wrote, plus the columns a
write-back added); a field a row lacks is null there. A media slice carries only the part
of the stored batch's dictionary that its rows use: Arrow IPC sends a record batch's
dictionaries whole, so the slice of one prompt group would otherwise carry every image of
the put.

Media payloads live in the partition's copies (:mod:`flightq.server.media`): a media
column of an answer carries each distinct copy its rows use once, whichever puts brought
the rows, and answers of media rows are cut by their distinct bytes, so rows streamed in
one put each still travel with their shared image once per answer batch.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import operator
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import pyarrow as pa

from ..layout import KEY, SHAPE_SUFFIX, TAGS, arrow_schema
from . import copied
from .media import (
    Answered,
    Copy,
    Home,
    RowsAnswer,
    kept_answer,
    media_column,
    piece_answer,
    row_copies,
    rows_answer,
)
from .partition import HiddenTags, Partition, Piece, Row

if TYPE_CHECKING:
    from ..protocol import GetTicket

__all__ = ["assemble", "PartCuts", "KEPT_CUTS", "SMALL_RUN_BYTES", "COALESCED_BYTES"]

_HOME = operator.attrgetter("home")

#: Slices smaller than this are copied together when an answer coalesces.
SMALL_RUN_BYTES = 1 << 20
#: Most payload bytes of one coalesced record batch.
COALESCED_BYTES = 4 << 20


def assemble(
    p: Partition,
    rows: list[Row],
    fields: list[str],
    max_bytes: int,
    coalesce: bool = False,
    held: list[Answered] | None = None,
    hide: str | None = None,
) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The Arrow schema and record batches that serve ``rows`` with ``fields``.

    Consecutive rows whose cells come from consecutive rows of the same stored batches
    are served as one zero-copy slice per column; a field a row lacks is null there.
    Batches are cut before the row that would take them past ``max_bytes`` of payload
    (a row larger than that goes alone), so a prompt group travels with its image once.
    With ``coalesce``, consecutive slices of less than :data:`SMALL_RUN_BYTES` each (rows
    of many small puts, such as one prompt group of text each) are copied into one batch
    of up to :data:`COALESCED_BYTES` (never past ``max_bytes``): each record batch costs
    both ends a fixed amount of work, more than copying a small one does. Where the
    answer is stored batches whole or runs of their rows, each one's
    :class:`~.media.WholeAnswer` or :class:`~.media.RowsAnswer` is appended to ``held``
    (once the batches are made).

    ``hide``: tags whose key starts with it go with their value left out (null); where
    any row has one, the answer's tags are packed afresh and nothing is answered as a
    stored batch whole (``held`` stays empty).
    """
    hidden = None if hide is None else HiddenTags(hide)
    if hidden is not None and hidden.any(rows):
        schema, plain = assemble(p, rows, fields, max_bytes, coalesce)
        return schema, _hidden(plain, rows, hidden)
    schema = arrow_schema(p.schema, fields)
    cols = [n for n in schema.names if n not in (KEY, TAGS)]
    # A media field's payload column is named as the field (its shapes column is no
    # dictionary): found from the roles, not by building each column's Arrow field.
    roles = {f.name: f.role for f in p.schema.fields}
    media = [c for c in cols if roles.get(c) == "media"]
    if media:
        return schema, _media_batches(rows, fields, schema, cols, media, max_bytes, held)

    def runs() -> Iterator[tuple[int, int]]:
        # A run ends before the row that would take it past max_bytes: that is the row
        # carrying a new image (a row counts a shared image where its group uses it
        # first), so a prompt group's rows and their image stay in one record batch.
        if _one_run(rows, max_bytes):
            yield 0, len(rows)
            return
        start = 0
        acc = 0
        # The keys of the run: one asked again starts another (a record batch holds each
        # key once), also where no cell tells them apart (no field asked, or none either
        # row has, where rows in any order run on).
        seen: set[str] = set()
        for i, row in enumerate(rows):
            if i > start and (
                acc + row.nbytes > max_bytes
                or row.key in seen
                or not _continues(rows[i - 1], row, fields)
            ):
                yield start, i
                start, acc = i, 0
                seen.clear()
            acc += row.nbytes
            seen.add(row.key)
        yield start, len(rows)

    def batches() -> Iterator[pa.RecordBatch]:
        if not rows:
            yield pa.RecordBatch.from_pylist([], schema=schema)
            return
        spans = list(runs())
        if not coalesce or len(spans) == 1:  # one slice goes as it is either way
            for lo, hi in spans:
                yield sliced(lo, hi)
            return
        limit = min(COALESCED_BYTES, max_bytes)
        small = min(SMALL_RUN_BYTES, limit)
        pending: list[pa.RecordBatch] = []
        pending_keys: set[str] = set()
        held = 0
        for lo, hi in spans:
            batch = sliced(lo, hi)
            # What the slice carries: only the fields asked for, and the images of all its
            # rows (a row's size counts a shared image on the group's first row only).
            size = batch.nbytes
            if size >= small:
                yield from _joined(pending)
                pending, pending_keys, held = [], set(), 0
                yield batch
                continue
            keys = {r.key for r in rows[lo:hi]}
            # A get may name a key twice; one record batch holds each key once.
            if held + size > limit or keys & pending_keys:
                yield from _joined(pending)
                pending, pending_keys, held = [], set(), 0
            pending.append(batch)
            pending_keys |= keys
            held += size
        yield from _joined(pending)

    def sliced(lo: int, hi: int) -> pa.RecordBatch:
        """Rows ``[lo, hi)`` as slices of the stored batches."""
        run = rows[lo:hi]
        n = hi - lo
        first = run[0]
        whole = _one_piece(first, fields, schema)
        if whole is not None and all(map(_HOME, run)):
            # Rows as one put made them, with its schema (a get of what a put wrote): the
            # stored batch's slice, keys and tags included (the rows' tags are its own).
            pc, idx = whole
            return pc.batch.slice(idx, n)
        arrays = _keys_tags(run, schema)
        if whole is not None:
            # Every cell from one stored batch with the answer's schema: slice it whole, a
            # third of assembling the same columns one by one.
            pc, idx = whole
            out = pc.batch.slice(idx, n).set_column(0, schema.field(0), arrays[0])
            return out.set_column(1, schema.field(1), arrays[1])
        for c in cols:
            base = c[: -len(SHAPE_SUFFIX)] if c.endswith(SHAPE_SUFFIX) else c
            cell = first.cells.get(base)
            if cell is None:
                arrays.append(pa.nulls(n, type=schema.field(c).type))
            else:
                pc, idx = cell
                arrays.append(pc.batch.column(c).slice(idx, n))
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    return schema, batches()


class PartCuts:
    """Where the server cuts the rows of a get in parts (:class:`~flightq.protocol.GetTicket`)
    into ``parts`` runs of consecutive rows, one per stream, and the cuts of the last
    :data:`KEPT_CUTS` such gets, so that a get's other streams take its first stream's
    cuts instead of working them out again (a walk over every row and its media).

    Each cut goes where it costs least: the bytes by which the runs before it miss an
    equal share (each media copy counted where it first appears), plus the bytes of the
    copies the rows on both sides of it use (a prompt group's image would travel on two
    streams), plus a quarter of a share unless a stored batch starts there (a run of
    whole stored batches goes as stored, with no work per row). A run may be empty (a
    stream that answers no rows) where no cut is worth its cost, as within one prompt
    group. Cuts are kept by the partition, the fields, the number of parts, the keys and
    the rows' bytes: streams that take the same cuts answer disjoint runs that cover the
    rows whatever was written between them, and a write that changes the rows' bytes
    makes the next get work its cuts out afresh. Only those numbers are kept, never a row.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[tuple[Any, ...], list[int]] = collections.OrderedDict()
        #: Cuts worked out (not taken from an earlier stream): for tests and metrics.
        self.worked = 0

    def rows(self, ticket: GetTicket, p: Partition, rows: list[Row], names: list[str]) -> list[Row]:
        """Run ``ticket.part`` of ``rows`` (every row of ``ticket.keys``, in order, of
        partition ``p``, answered with the fields ``names``)."""
        assert ticket.part is not None and ticket.parts is not None
        cuts = self.cuts(ticket, p, rows, names)
        return rows[cuts[ticket.part] : cuts[ticket.part + 1]]

    def cuts(self, ticket: GetTicket, p: Partition, rows: list[Row], names: list[str]) -> list[int]:
        """``ticket.parts + 1`` row indices, from 0 to ``len(rows)``."""
        assert ticket.parts is not None
        fields = None if ticket.fields is None else tuple(ticket.fields)
        nbytes = sum(map(_NBYTES, rows))
        key = (ticket.partition, fields, ticket.parts, len(rows), hash(tuple(ticket.keys)), nbytes)
        with self._lock:
            hit = self._kept.get(key)
            if hit is not None:
                self._kept.move_to_end(key)
                return hit
        media = [f.name for f in p.schema.fields if f.role == "media" and f.name in names]
        cuts = _part_cuts(rows, media, ticket.parts)
        with self._lock:
            self.worked += 1
            self._kept[key] = cuts
            while len(self._kept) > KEPT_CUTS:
                self._kept.popitem(last=False)
        return cuts


#: Gets in parts whose cuts a server keeps for their later streams.
KEPT_CUTS = 64
_NBYTES = operator.attrgetter("nbytes")


def _part_cuts(rows: list[Row], media: list[str], parts: int) -> list[int]:
    """Where :class:`PartCuts` cuts: ``parts + 1`` row indices, from 0 to ``len(rows)``."""
    n = len(rows)
    shared = [0] * n  # bytes of the copies row j shares with row j - 1
    if not media:
        ahead = [0, *itertools.accumulate(r.nbytes for r in rows)]
    else:
        ahead = [0]  # bytes of the rows before row j, each copy once
        seen: set[int] = set()
        before: dict[int, Copy] = {}
        for j, row in enumerate(rows):
            mine = {id(c): c for c in row_copies(row, media)}
            shared[j] = sum(c.nbytes for k, c in mine.items() if k in before)
            new = sum(c.nbytes for k, c in mine.items() if k not in seen)
            ahead.append(ahead[-1] + row.nbytes + new)
            seen.update(mine)
            before = mine
    share = ahead[-1] / parts
    off_stored = share / 4

    def cost(j: int, target: float, last: int) -> float:
        off = abs(ahead[j] - target)
        if j in (last, n):  # no new cut: an empty run, or the rest in this one
            return off
        home = rows[j].home
        return off + shared[j] + (0.0 if home is not None and home[1] == 0 else off_stored)

    cuts = [0]
    for k in range(1, parts):
        target, last = share * k, cuts[-1]
        # Outward from the row nearest the target; a cost is at least its distance.
        mid = min(max(bisect.bisect_left(ahead, target, last, n + 1), last), n)
        best, at = cost(mid, target, last), mid
        for step in (-1, 1):
            j = mid + step
            while last <= j <= n and abs(ahead[j] - target) < best:
                c = cost(j, target, last)
                if c < best:
                    best, at = c, j
                j += step
        cuts.append(at)
    cuts.append(n)
    return cuts


def _media_batches(
    rows: list[Row],
    fields: list[str],
    schema: pa.Schema,
    cols: list[str],
    media: list[str],
    max_bytes: int,
    held: list[Answered] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Record batches of rows with media: cut before the row that would take a batch
    past ``max_bytes`` (each distinct copy counted once; a row larger goes alone), each
    key once per batch; consecutive rows of one stored batch are zero-copy slices."""
    if not rows:
        yield pa.RecordBatch.from_pylist([], schema=schema)
        return
    stored = _stored_batches(rows, schema, media, max_bytes, held)
    if stored is None:
        stored = _stored_runs(rows, schema, media, max_bytes, held)
    if stored is not None:
        yield from stored
        return
    yield from _cut_media_rows(rows, fields, schema, cols, media, max_bytes)


def _stored_batches(
    rows: list[Row],
    schema: pa.Schema,
    media: list[str],
    max_bytes: int,
    held: list[Answered] | None = None,
) -> list[pa.RecordBatch] | None:
    """The answer as the stored batches themselves, where ``rows`` are every row of one
    or more stored batches, each in its order and unchanged (:attr:`Row.home`; the usual
    get of a step, and a claim of whole puts), the answer asks for exactly their columns,
    and cutting at the stored batches costs nothing: each fits ``max_bytes`` with its
    media (or is one row), none shares a copy with another (a prompt group's image
    streamed in one put per row travels once per answer batch), and none but the last is
    under :data:`SMALL_RUN_BYTES`. Each media dictionary carries its batch's distinct
    copies' payloads (:func:`~.media.piece_answer`): no work per row. None otherwise."""
    out: list[Answered] = []
    seen: set[int] = set()
    at = size = 0
    while at < len(rows):
        home = rows[at].home
        if home is None or home[1] != 0 or (out and size < SMALL_RUN_BYTES):
            return None
        pc = home[0]
        n = pc.batch.num_rows
        run = rows[at : at + n]
        if len(run) != n or not pc.batch.schema.equals(schema, check_metadata=True):
            return None
        for k, row in enumerate(run):
            h = row.home
            if h is None or h[0] is not pc or h[1] != k:
                return None
        whole = piece_answer(pc, schema, media)
        if not seen.isdisjoint(whole.copies):
            return None
        seen |= whole.copies
        size = sum(r.nbytes for r in run) + whole.nbytes
        if size > max_bytes and n > 1:  # a row larger than that goes alone
            return None
        out.append(whole)
        at += n
    if held is not None:
        held.extend(out)
    return [w.batch for w in out]


def _stored_runs(
    rows: list[Row],
    schema: pa.Schema,
    media: list[str],
    max_bytes: int,
    held: list[Answered] | None = None,
) -> list[pa.RecordBatch] | None:
    """The answer as slices of the kept answer forms of stored batches (a claim of a
    prompt group, a get of part of a step), where ``rows`` are runs of consecutive rows of
    stored batches, each unchanged (:attr:`Row.home`), whose forms are kept
    (:func:`~.media.prepare_answer`) with exactly the answer's columns: a record batch per
    run, its dictionaries views of the entries its rows use (:func:`~.media.rows_answer`),
    no work per row but a look at its place. As :func:`_stored_batches`, only where the
    runs fit ``max_bytes``, none but the last is under :data:`SMALL_RUN_BYTES` and no two
    come from one stored batch or share a copy; None otherwise (cut row by row). Each
    run's :class:`~.media.RowsAnswer` is appended to ``held``."""
    out: list[RowsAnswer] = []
    seen: set[int] = set()
    pieces: set[int] = set()
    at = size = 0
    while at < len(rows):
        home = rows[at].home
        if home is None or (out and size < SMALL_RUN_BYTES):
            return None
        pc, first = home
        whole = kept_answer(pc, media)
        if (
            whole is None
            or id(pc) in pieces
            or not seen.isdisjoint(whole.copies)
            or not pc.batch.schema.equals(schema, check_metadata=True)
        ):
            return None
        end = at + 1
        while end < len(rows):
            h = rows[end].home
            if h is None or h[0] is not pc or h[1] != first + end - at:
                break
            end += 1
        made = rows_answer(whole, first, end - at)
        if made is None:
            return None
        part, payloads = made
        size = sum(r.nbytes for r in rows[at:end]) + payloads
        if size > max_bytes and end - at > 1:  # a row larger than that goes alone
            return None
        out.append(part)
        seen |= whole.copies
        pieces.add(id(pc))
        at = end
    if held is not None:
        held.extend(out)
    return [r.batch for r in out]


def _cut_media_rows(
    rows: list[Row],
    fields: list[str],
    schema: pa.Schema,
    cols: list[str],
    media: list[str],
    max_bytes: int,
) -> Iterator[pa.RecordBatch]:
    """:func:`_media_batches` of rows that are not a stored batch whole, row by row.

    Where the rows' media cells move on to another stored batch (the rows of one put's
    record batch, written back to or not), the answer batch is cut there too if those
    rows would not all fit it: the put cut its batches so that each fits and keeps its
    prompt groups whole, and each answer batch's images are then one slice of one stored
    dictionary, not a copy. Likewise before a row that brings an image, if the rows that
    share it would not fit: a group's image travels once.

    It is also cut before a row whose new images lie in another put's dictionary than
    the batch's images of that field (a prompt group a put cut in two, rows of another
    step) where joining them would copy at least :data:`SMALL_RUN_BYTES` of payloads
    (small ones, such as size tensors equal to another put's, are copied together):
    one dictionary cannot be a view of two, and a record batch more costs less than
    such a copy (through shared memory, a copy and a segment of the server's own)."""
    mines = [{id(c): c for c in row_copies(row, media)} for row in rows]
    pieces = [_media_piece(row, media) for row in rows]
    start = acc = 0
    seen: set[int] = set()
    keys: set[str] = set()
    homes: dict[str, Home] = {}  # per media field, the dictionary its payloads are in
    payloads: dict[str, int] = {}  # per media field, the bytes of its payloads
    last: Piece | None = None  # the stored batch of the last media cell so far
    for i, row in enumerate(rows):
        mine = mines[i]
        piece = pieces[i]
        if i > start and _cut_ahead(rows, mines, pieces, i, last, seen, max_bytes - acc):
            yield _joined_rows(rows[start:i], fields, schema, cols, media)
            start, acc, seen, keys, homes, payloads = i, 0, set(), set(), {}, {}
        if piece is not None:
            last = piece
        new = [c for k, c in mine.items() if k not in seen]
        brings = sum(c.nbytes for c in new)
        if i > start and (
            acc + row.nbytes + brings > max_bytes
            or row.key in keys
            or _copied_if_joined(new, homes, payloads) >= SMALL_RUN_BYTES
        ):
            yield _joined_rows(rows[start:i], fields, schema, cols, media)
            start, acc, seen, keys, homes, payloads = i, 0, set(), set(), {}, {}
            new = list(mine.values())
            brings = sum(c.nbytes for c in new)
        for c in new:
            homes.setdefault(c.key[0], c.home)
            payloads[c.key[0]] = payloads.get(c.key[0], 0) + c.nbytes
        acc += row.nbytes + brings
        seen.update(mine)
        keys.add(row.key)
    yield _joined_rows(rows[start:], fields, schema, cols, media)


def _copied_if_joined(copies: list[Copy], homes: dict[str, Home], held: dict[str, int]) -> int:
    """The payload bytes that joining ``copies`` to a batch would copy: every payload of
    each media field where one of them lies in another dictionary than the batch's
    (``homes``; ``held``: the bytes of the batch's payloads, per field)."""
    adds: dict[str, int] = {}
    moved: set[str] = set()
    for c in copies:
        f = c.key[0]
        adds[f] = adds.get(f, 0) + c.nbytes
        if homes.get(f, c.home) is not c.home:
            moved.add(f)
    return sum(held.get(f, 0) + adds[f] for f in moved)


def _media_piece(row: Row, media: list[str]) -> Piece | None:
    """The stored batch holding ``row``'s first media cell (None: it has none)."""
    for f in media:
        cell = row.cells.get(f)
        if cell is not None:
            return cell[0]
    return None


def _cut_ahead(
    rows: list[Row],
    mines: list[dict[int, Copy]],
    pieces: list[Piece | None],
    i: int,
    last: Piece | None,
    held: set[int],
    room: int,
) -> bool:
    """Whether the rows from ``i`` on that belong with row ``i`` take more than ``room``
    bytes of a batch holding the copies ``held``, and so go whole into the next batch:
    the rest of its stored batch where its media move on from ``last``'s, and the prompt
    group whose image it brings (the rows after it sharing a copy it brings)."""
    piece = pieces[i]
    moved_on = piece is not None and last is not None and piece is not last
    if moved_on and _bytes_ahead(rows, mines, i, held, _same_piece(pieces, piece)) > room:
        return True
    brought = mines[i].keys() - held
    return bool(brought) and _bytes_ahead(rows, mines, i, held, _shares(brought)) > room


def _same_piece(
    pieces: list[Piece | None], piece: Piece | None
) -> Callable[[int, dict[int, Copy]], bool]:
    """Whether row ``j`` goes on with ``piece``'s rows: its media cells are there, or it
    has none."""
    return lambda j, mine: pieces[j] is None or pieces[j] is piece


def _shares(brought: set[int]) -> Callable[[int, dict[int, Copy]], bool]:
    """Whether a row uses one of the copies ``brought`` (its prompt group's image)."""
    return lambda j, mine: not brought.isdisjoint(mine)


def _bytes_ahead(
    rows: list[Row],
    mines: list[dict[int, Copy]],
    i: int,
    held: set[int],
    goes_on: Callable[[int, dict[int, Copy]], bool],
) -> int:
    """Bytes row ``i`` and the rows after it, while ``goes_on(j, copies of row j)``, add
    to a batch that holds the copies ``held``, each distinct copy once."""
    total = 0
    seen = set(held)
    for j in range(i, len(rows)):
        mine = mines[j]
        if j > i and not goes_on(j, mine):
            break
        total += rows[j].nbytes + sum(c.nbytes for k, c in mine.items() if k not in seen)
        seen.update(mine)
    return total


def _joined_rows(
    rows: list[Row], fields: list[str], schema: pa.Schema, cols: list[str], media: list[str]
) -> pa.RecordBatch:
    """One record batch of ``rows``: per column, the slices of its runs of consecutive
    stored rows (one zero-copy slice when it is one run); media from their copies."""
    spans: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(rows)):
        if not _continues(rows[i - 1], rows[i], fields):
            spans.append((lo, i))
            lo = i
    spans.append((lo, len(rows)))
    arrays = _built_keys_tags(rows)
    for c in cols:
        base = c[: -len(SHAPE_SUFFIX)] if c.endswith(SHAPE_SUFFIX) else c
        if c in media:
            runs: list[tuple[Piece, int, int] | None] = []
            for a, b in spans:
                cell = rows[a].cells.get(c)
                runs.extend([None] * (b - a) if cell is None else [(cell[0], cell[1], b - a)])
            arrays.append(media_column(runs, c)[0])
            continue
        parts = []
        for a, b in spans:
            cell = rows[a].cells.get(base)
            if cell is None:
                parts.append(pa.nulls(b - a, type=schema.field(c).type))
            else:
                parts.append(cell[0].batch.column(c).slice(cell[1], b - a))
        arrays.append(parts[0] if len(parts) == 1 else copied.made(pa.concat_arrays(parts)))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _hidden(
    batches: Iterator[pa.RecordBatch], rows: list[Row], hidden: HiddenTags
) -> Iterator[pa.RecordBatch]:
    """``batches`` (``rows`` in order, as :func:`assemble` makes them) with the tags under
    the prefix left out: a batch whose rows have such a tag gets its tags column packed
    afresh from the rows' maps, the hidden values null."""
    pack = msgpack.Packer(use_bin_type=True).pack
    shown = hidden.shown
    at = 0
    for b in batches:
        run = rows[at : at + b.num_rows]
        at += b.num_rows
        maps = [r.tags and shown(r.tags) for r in run]  # a row's own map: nothing hidden
        if any(m is not r.tags for m, r in zip(maps, run, strict=True)):
            tags = [pack(m) if m else None for m in maps]
            i = b.schema.get_field_index(TAGS)
            b = b.set_column(i, b.schema.field(i), copied.made(pa.array(tags, type=pa.binary())))
        yield b


def _joined(batches: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The batches as one (a copy; media dictionaries unified), or nothing if none."""
    if len(batches) > 1:
        yield copied.made(pa.concat_batches(batches))
    elif batches:
        yield batches[0]


def _one_piece(row: Row, fields: list[str], schema: pa.Schema) -> tuple[Piece, int] | None:
    """The stored batch and index holding every one of ``fields`` of ``row``, where that
    batch has exactly the answer's ``schema`` (columns, types, metadata); else None."""
    cells = [row.cells.get(f) for f in fields]
    first = cells[0] if cells else None
    if first is None or any(c is None or c[0] is not first[0] or c[1] != first[1] for c in cells):
        return None
    if not first[0].batch.schema.equals(schema, check_metadata=True):
        return None
    return first


def _one_run(rows: list[Row], max_bytes: int) -> bool:
    """Whether ``rows`` are consecutive rows of one stored batch as a put made them (each
    :attr:`Row.home` the next of one piece) within ``max_bytes``: one slice, found in a
    few loops in C instead of comparing the rows pair by pair (a get of what one put
    wrote)."""
    return len(rows) >= 2 and _home_run(rows) is not None and sum(map(_NBYTES, rows)) <= max_bytes


def _home_run(rows: list[Row]) -> tuple[Piece, int] | None:
    """The piece and first index of ``rows`` where they are consecutive rows of it as a
    put made them (each :attr:`Row.home` the next of one piece), else None."""
    if not rows:
        return None
    homes = list(map(_HOME, rows))
    first, last = homes[0], homes[-1]
    if first is None or last is None or last[0] is not first[0]:
        return None
    pc, lo = first
    if last[1] != lo + len(homes) - 1:
        return None
    try:  # a row without a home (None) raises here
        at = list(map(_AT, homes))
        same = all(map(operator.is_, map(_PIECE, homes), itertools.repeat(pc)))
    except TypeError:
        return None
    return first if same and at == list(range(lo, lo + len(homes))) else None


def _keys_tags(run: list[Row], schema: pa.Schema) -> list[pa.Array]:
    """The key and tags columns of ``run``: slices of the stored batch's own where the
    rows are consecutive rows of it as a put made them (a get of some of its fields),
    else built from the rows (their tags packed afresh)."""
    home = _home_run(run)
    if home is not None:
        b = home[0].batch
        k, t = b.column(KEY), b.column(TAGS)
        if k.type == schema.field(0).type and t.type == schema.field(1).type:
            return [k.slice(home[1], len(run)), t.slice(home[1], len(run))]
    return _built_keys_tags(run)


def _built_keys_tags(rows: list[Row]) -> list[pa.Array]:
    """The key and tags columns of ``rows`` built from the rows (their tags packed)."""
    pack = msgpack.Packer(use_bin_type=True).pack  # one packer: a third of packb's cost
    return [
        pa.array([r.key for r in rows], type=pa.utf8()),
        pa.array([pack(r.tags) if r.tags else None for r in rows], type=pa.binary()),
    ]


_NBYTES = operator.attrgetter("nbytes")
_PIECE = operator.itemgetter(0)
_AT = operator.itemgetter(1)


def _continues(prev: Row, row: Row, fields: list[str]) -> bool:
    a, b = prev.home, row.home
    if a is not None and b is not None and a[0] is b[0] and b[1] == a[1] + 1:
        return True  # consecutive rows of one piece as a put made them: every field goes on
    for f in fields:
        a, b = prev.cells.get(f), row.cells.get(f)
        if a is None and b is None:
            continue
        if a is None or b is None or a[0] is not b[0] or b[1] != a[1] + 1:
            return False
    return True
