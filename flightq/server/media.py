"""Media held once per partition: content-addressed, reference-counted copies.

Every media dictionary entry a put brings is named by its digest (:mod:`flightq.digest`):
the writer's claim, checked against the payload, or the server's own hash where the
writer claimed none. A partition keeps one :class:`Copy` per ``(column, hash, digest,
shape)``; an entry whose digest the partition holds already is served from that copy,
and a writer may send the digest alone (an empty entry). Stored pieces keep their media
columns without the bytes (indices and shapes only); the bytes live in the copies.

Each copy counts the stored row cells that use it. A copy's bytes live in the buffer of
the dictionary message that brought them (its :class:`Home`, zero-copy): the memory
budget counts a home whole, once, while any of its copies is used, and lets it go when
the last one is (clear, drop, overwrite). See ``docs/protocol.md``, "Media sent once".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..digest import HASH, HASHES, digest_of, empty_digest, parse_claims
from ..errors import DecodeError, MediaDigestError, MediaUnknownError, ProtocolError
from ..layout import MEDIA_TYPE, SHAPE_SUFFIX, binary_offsets, media_row_bytes
from ..validation import validate

if TYPE_CHECKING:
    from .partition import Partition, Piece, Row

__all__ = [
    "Home",
    "Copy",
    "media_piece",
    "acquire",
    "release",
    "cell_copies",
    "row_copies",
    "waiting_homes",
    "media_column",
    "same_media",
    "grouped_by_media",
]

#: A copy's name in its partition: column, hash, digest, segment shape.
Name = tuple[str, str, bytes, tuple[int, ...]]


@dataclass(eq=False)
class Home:
    """The received dictionary whose buffer holds copies' bytes."""

    entries: pa.Array
    #: Bytes the budget counts while the home is used (the dictionary's buffers).
    nbytes: int
    #: Copies of it some stored row uses.
    live: int = 0


@dataclass(eq=False)
class Copy:
    """One media payload a partition holds, and how many stored row cells use it."""

    name: Name
    home: Home
    #: Its entry in the home's dictionary.
    index: int
    nbytes: int
    refs: int = 0

    @property
    def entry(self) -> pa.Array:
        """The payload as a one-entry large_binary array (zero-copy)."""
        return self.home.entries.slice(self.index, 1)


def media_piece(
    p: Partition,
    batch: pa.RecordBatch,
    app_metadata: pa.Buffer | None,
    what: str,
    limit: int | None,
) -> Piece:
    """A put's record batch resolved against ``p``'s media, validated, made a piece.

    Payloads are checked against the digests the writer claims (``app_metadata``,
    :func:`flightq.digest.parse_claims`), or hashed where it claims none; entries sent as
    the digest alone are found among ``p``'s copies. The piece keeps the batch with empty
    media dictionaries, its copies beside it (:attr:`Piece.media`). Reads ``p``'s copies
    without the store's lock (one dict lookup each); the put's commit takes them.

    Raises
    ------
    MediaDigestError
        If a payload does not hash to its claimed digest, or the hash is unknown here.
    MediaUnknownError
        If a digest sent alone names no copy of ``p`` (with that shape).
    ProtocolError
        If the digests do not match the batch's dictionaries.
    """
    from .partition import make_piece

    media = [f.name for f in p.schema.fields if f.role == "media" and f.name in batch.schema.names]
    if not media:
        return make_piece(batch, validate(batch, p.schema), limit)
    try:
        batch.validate(full=True)  # offsets are read below, before validation proper
    except pa.ArrowException as e:
        raise DecodeError(f"{what}: malformed record batch: {e}") from e
    claims = parse_claims(app_metadata.to_pybytes() if app_metadata else None, what)
    hash, claimed = claims if claims is not None else (HASH, {})
    if hash not in HASHES:
        raise MediaDigestError(
            f"{what}: the media digests are {hash!r}, this server knows {sorted(HASHES)}",
            expected=sorted(HASHES),
            actual=hash,
        )
    view, stored = batch, batch
    copies: dict[str, list[Copy | None]] = {}
    brings = 0
    for name in media:
        col = batch.column(name)
        shapes_name = name + SHAPE_SUFFIX
        if col.type != MEDIA_TYPE or shapes_name not in batch.schema.names:
            continue  # validation names what is wrong
        found, home = _resolve(
            p, name, col, batch.column(shapes_name), claimed.get(name), hash, what
        )
        copies[name] = found
        if home is not None and home.nbytes:
            brings += home.nbytes
        i = batch.schema.get_field_index(name)
        if any(c is None or c.home is not home for c in found):
            view = view.set_column(i, batch.schema.field(i), _with_entries(col, found))
        stored = stored.set_column(i, batch.schema.field(i), _with_entries(col, None))
    checked = validate(view, p.schema)
    nbytes = checked.nbytes.copy()
    for name in copies:  # media bytes count once, on the partition (their copies)
        nbytes -= media_row_bytes(view.column(name))
    piece = make_piece(stored, dataclasses.replace(checked, nbytes=nbytes), limit)
    piece.media = {n: [c for c in found if c is not None] for n, found in copies.items()}
    piece.media_index = {n: _positions(found) for n, found in copies.items()}
    piece.brings = brings
    return piece


def _resolve(
    p: Partition,
    name: str,
    col: pa.Array,
    shapes: pa.Array,
    claims: list[bytes] | None,
    hash: str,
    what: str,
) -> tuple[list[Copy | None], Home | None]:
    """Per dictionary entry of ``col``, its copy (None: an entry no segment uses, which
    the budget's checks refuse), and the home of the payloads it brings."""
    outer = col.offsets.to_numpy()
    lo, hi = int(outer[0]), int(outer[-1])
    segs = col.values.slice(lo, hi - lo)
    entries = segs.dictionary
    n = len(entries)
    if claims is not None and len(claims) != n:
        raise ProtocolError(
            f"{what}: column {name!r}: {len(claims)} media digests for {n} dictionary entries"
        )
    idx = segs.indices.to_numpy(zero_copy_only=False)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        return [None] * n, None  # validation refuses it
    # Each entry's segment shapes (all segments of an entry named alone must agree).
    souter = shapes.offsets.to_numpy()
    seg_shapes = shapes.values.slice(int(souter[0]), int(souter[-1] - souter[0]))
    if len(seg_shapes) != len(idx) or seg_shapes.null_count:
        return [None] * n, None
    so = seg_shapes.offsets.to_numpy()
    sv = seg_shapes.values.to_numpy(zero_copy_only=False)
    shape_of: dict[int, tuple[int, ...]] = {}
    mixed: set[int] = set()
    for s, j in enumerate(idx.tolist()):
        shp = tuple(sv[so[s] : so[s + 1]].tolist())
        if shape_of.setdefault(j, shp) != shp:
            mixed.add(j)
    offsets = binary_offsets(entries)
    data = entries.buffers()[2]
    home = Home(entries, entries.get_total_buffer_size())
    table = p.media
    empty = empty_digest(hash)
    out: list[Copy | None] = []
    missing: list[str] = []
    for j in range(n):
        shape = shape_of.get(j)
        a, b = int(offsets[j]), int(offsets[j + 1])
        claim = claims[j] if claims is not None else None
        if shape is None:
            out.append(None)
            continue
        if b == a and claim is not None and claim != empty:  # the digest alone
            if j in mixed:
                raise MediaUnknownError(
                    f"{what}: column {name!r}: media named by digest {claim.hex()[:16]} is "
                    "used with different shapes; send its payload",
                    field=name,
                    actual=[claim.hex()],
                    partition=p.name,
                )
            c = table.get((name, hash, claim, shape))
            if c is None:
                missing.append(claim.hex())
            out.append(c)
            continue
        payload = memoryview(data)[a:b] if data is not None else b""
        d = digest_of(payload, hash)
        if claim is not None and claim != d:
            raise MediaDigestError(
                f"{what}: column {name!r}: media dictionary entry {j} ({b - a} bytes) hashes "
                f"to {hash} {d.hex()[:16]}..., the writer claimed {claim.hex()[:16]}...; "
                "nothing was stored",
                field=name,
                expected=claim.hex(),
                actual=d.hex(),
                partition=p.name,
            )
        c = table.get((name, hash, d, shape))
        out.append(c if c is not None else Copy((name, hash, d, shape), home, j, b - a))
    if missing:
        raise MediaUnknownError(
            f"{what}: column {name!r}: {len(missing)} media named by digest alone are not held "
            f"by partition {p.name!r} (cleared, the server restarted, or another shard holds "
            f"them): {', '.join(m[:16] for m in missing[:4])}; send their payloads",
            field=name,
            actual=missing,
            partition=p.name,
        )
    return out, home if any(c is not None and c.home is home for c in out) else None


def _positions(found: list[Copy | None]) -> np.ndarray:
    """Per dictionary entry, its position among the piece's copies (-1: unused)."""
    pos = np.full(len(found), -1, dtype=np.int64)
    k = 0
    for j, c in enumerate(found):
        if c is not None:
            pos[j] = k
            k += 1
    return pos


def _empty_entries(n: int) -> pa.Array:
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(),
        n,
        [None, pa.py_buffer(np.zeros(n + 1, dtype=np.int64)), pa.py_buffer(b"")],
    )


def _entries_of(copies: list[Copy]) -> pa.Array:
    """One large_binary array of the copies' payloads: a zero-copy slice where they are
    consecutive entries of one home, else a copy of their bytes."""
    if not copies:
        return _empty_entries(0)
    home, first = copies[0].home, copies[0].index
    if all(c.home is home and c.index == first + k for k, c in enumerate(copies)):
        return home.entries.slice(first, len(copies))
    return pa.concat_arrays([c.entry for c in copies])


def _with_entries(col: pa.Array, found: list[Copy | None] | None) -> pa.Array:
    """``col`` with its dictionary replaced: by the copies' payloads (``found``; an
    unused entry keeps what arrived), or by empty entries (None)."""
    outer = col.offsets
    values = col.values
    entries = values.dictionary
    if found is None:
        new = _empty_entries(len(entries))
    else:
        parts = [c.entry if c is not None else entries.slice(j, 1) for j, c in enumerate(found)]
        new = pa.concat_arrays(parts) if len(parts) != 1 else parts[0]
    dict_arr = pa.DictionaryArray.from_arrays(values.indices, new)
    mask = col.is_null() if col.null_count else None
    return pa.LargeListArray.from_arrays(outer, dict_arr, mask=mask)


# ---- the copies' lives, with the store's lock


def cell_copies(pc: Piece, f: str, i: int) -> Iterator[Copy]:
    """The distinct copies row ``i`` of piece ``pc`` uses in media column ``f``."""
    copies = pc.media.get(f)
    if not copies:
        return iter(())
    col = pc.batch.column(f)
    outer = col.offsets
    a, b = outer[i].as_py(), outer[i + 1].as_py()
    if a == b:
        return iter(())
    idx = col.values.indices.slice(a, b - a).to_numpy(zero_copy_only=False)
    pos = pc.media_index[f][idx]
    return (copies[k] for k in dict.fromkeys(pos.tolist()))


def acquire(p: Partition, copies: Iterable[Copy]) -> None:
    """Count a use of each copy by a stored row cell; a copy used first joins ``p``'s
    copies, and its home's bytes count from then on."""
    table = p.media
    for c in copies:
        c.refs += 1
        if c.refs > 1:
            continue
        table.setdefault(c.name, c)  # raced by an equal copy: this one lives beside it
        p.nbytes += c.nbytes  # payload bytes, as stats report them
        h = c.home
        h.live += 1
        if h.live == 1:  # what the budget counts: the buffer holding them, whole
            p.held += h.nbytes
            p.media_bytes += h.nbytes


def release(p: Partition, copies: Iterable[Copy]) -> None:
    """Count a use of each copy gone; an unused copy leaves ``p``, and its home's bytes
    stop counting once none of its copies is used."""
    table = p.media
    for c in copies:
        c.refs -= 1
        if c.refs > 0:
            continue
        if table.get(c.name) is c:
            del table[c.name]
        p.nbytes -= c.nbytes
        h = c.home
        h.live -= 1
        if h.live == 0:
            p.held -= h.nbytes
            p.media_bytes -= h.nbytes


def row_copies(row: Row, fields: Iterable[str]) -> Iterator[Copy]:
    """Every copy ``row``'s media cells use (once per cell)."""
    for f in fields:
        cell = row.cells.get(f)
        if cell is not None:
            yield from cell_copies(cell[0], f, cell[1])


def waiting_homes(pieces: Iterable[Piece]) -> int:
    """Bytes of the homes a put's copies need that no stored row uses now (fresh ones,
    and ones whose copies were let go meanwhile): what storing it adds to the budget."""
    seen: dict[int, int] = {}
    for pc in pieces:
        for copies in pc.media.values():
            for c in copies:
                if c.home.live == 0:
                    seen[id(c.home)] = c.home.nbytes
    return sum(seen.values())


def media_column(cells: list[tuple[Piece, int, int] | None], name: str) -> tuple[pa.Array, int]:
    """A media column for an answer: per run of rows (piece, first row, count; None: one
    row without the field), the segments of those rows, with each distinct copy's payload
    once in the dictionary. Returns the column and its payload bytes."""
    offsets = [0]
    nulls: list[bool] = []
    distinct: dict[int, int] = {}
    order: list[Copy] = []
    parts: list[np.ndarray] = []
    for run in cells:
        if run is None:
            nulls.append(True)
            offsets.append(offsets[-1])
            continue
        pc, i, n = run
        col = pc.batch.column(name).slice(i, n)
        outer = col.offsets.to_numpy()
        lo, hi = int(outer[0]), int(outer[-1])
        idx = col.values.indices.slice(lo, hi - lo).to_numpy(zero_copy_only=False)
        copies = pc.media.get(name, [])
        mine = np.empty(len(idx), dtype=np.int32)
        for k, q in enumerate(pc.media_index[name][idx].tolist() if len(idx) else ()):
            c = copies[q]
            at = distinct.get(id(c))
            if at is None:
                at = distinct[id(c)] = len(order)
                order.append(c)
            mine[k] = at
        parts.append(mine)
        base = offsets[-1]
        offsets.extend((outer[1:] - lo + base).tolist())
        if col.null_count:
            nulls.extend((~col.is_valid().to_numpy(zero_copy_only=False)).tolist())
        else:
            nulls.extend([False] * n)
    idx_all = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    segs = pa.DictionaryArray.from_arrays(pa.array(idx_all, type=pa.int32()), _entries_of(order))
    mask = pa.array(nulls, type=pa.bool_()) if any(nulls) else None
    out = pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), segs, mask=mask)
    return out, sum(c.nbytes for c in order)


def same_media(a: Piece, b: Piece) -> bool:
    """Whether two pieces' media dictionaries name the same payloads (their batches keep
    no media bytes, so an equal batch says nothing about them)."""
    if a.media.keys() != b.media.keys():
        return False
    return all(
        [c.name for c in a.media[f]] == [c.name for c in b.media[f]]
        and np.array_equal(a.media_index[f], b.media_index[f])
        for f in a.media
    )


def grouped_by_media(p: Partition, rows: list[Row]) -> list[Row]:
    """``rows`` with the rows that share media gathered where the first of them stands
    (a stable order otherwise): a claim of streamed rows then sends each image once,
    its rows in one answer batch, not once per batch its rows are spread over."""
    fields = p.media_fields
    if not fields or len(rows) < 2:
        return rows
    first: dict[int, int] = {}
    keys = []
    for i, r in enumerate(rows):
        c = next(row_copies(r, fields), None)
        keys.append((i if c is None else first.setdefault(id(c), i), i))
    if all(k == i for k, i in keys) or sorted(keys) == keys:
        return rows
    return [rows[i] for _, i in sorted(keys)]
