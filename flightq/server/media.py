"""Media held once per partition: content-addressed, reference-counted copies.

A partition files each :class:`Copy` it holds under its hint (:func:`flightq.digest.hint_of`:
column, size and a CRC of samples, with the segment shape), worked out by the server on
receipt in microseconds. A copy is hashed only where it may serve another put: when a
writer sends a reference (digest and hint, no payload), the copies under that hint are
hashed (once each, :data:`MAX_HASHED` at most per reference) and the one whose digest
matches serves it; a payload arriving where copies share its hint is hashed to find an
equal one. A copy serves another put only once its bytes hashed to the digest asked for,
so a writer's lie (a payload under a crafted hint) reaches no rows but its own put's.
Stored pieces keep their media columns without the bytes (indices and shapes only); the
bytes live in the copies.

Each copy counts the stored row cells that use it. A copy's bytes live in the buffer of
the dictionary message that brought them (its :class:`Home`, zero-copy): the memory
budget counts a home whole, once, while any of its copies is used, and lets it go when
the last one is (clear, drop, overwrite). See ``docs/protocol.md``, "Media sent once".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..digest import (
    DIGEST_BYTES,
    HASH,
    HASHES,
    HINT_BYTES,
    digest_of,
    empty_digest,
    hint_of,
    parse_claims,
)
from ..errors import DecodeError, MediaDigestError, MediaUnknownError, ProtocolError
from ..layout import MEDIA_TYPE, SHAPE_SUFFIX, binary_offsets, media_row_bytes
from ..objects import check_columns, check_sizes, coded
from ..validation import validate
from . import copied
from .budget import COPY_OVERHEAD

if TYPE_CHECKING:
    from .partition import Partition, Piece, Row

__all__ = [
    "MAX_HASHED",
    "MAX_LOOKED_AT",
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
    "piece_answer",
    "prepare_answer",
    "kept_answer",
    "rows_answer",
    "RowsAnswer",
    "Answered",
    "WholeAnswer",
    "KEEP_ANSWER_BYTES",
    "KEPT_COLUMN_BYTES",
    "grouped_by_media",
]

#: Where a partition files a copy: column, hint, segment shape.
Key = tuple[str, bytes, tuple[int, ...]]

#: Most copies filed under one hint that one reference (or one payload sharing a hint)
#: hashes: a writer flooding a hint with payloads cannot make a lookup hash more.
MAX_HASHED = 4
#: Most copies filed under one hint (the newest) a lookup looks at: past them a writer's
#: reference is refused as unknown, and it sends the payload (honest hints never pile up).
MAX_LOOKED_AT = 16


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

    key: Key
    home: Home
    #: Its entry in the home's dictionary.
    index: int
    nbytes: int
    refs: int = 0
    #: Its digests, by hash, once worked out (from its bytes: never a writer's word).
    digests: dict[str, bytes] = dataclasses.field(default_factory=dict)

    @property
    def entry(self) -> pa.Array:
        """The payload as a one-entry large_binary array (zero-copy)."""
        return self.home.entries.slice(self.index, 1)

    def payload(self) -> memoryview:
        """The payload's bytes (zero-copy)."""
        offsets = binary_offsets(self.home.entries)
        a, b = int(offsets[self.index]), int(offsets[self.index + 1])
        data = self.home.entries.buffers()[2]
        return memoryview(data)[a:b] if data is not None else memoryview(b"")

    def same_as(self, other: Copy) -> bool:
        """Whether both hold the same payload, as far as their digests show."""
        if self is other:
            return True
        # A snapshot of the items: a lookup without the store's lock may add a digest.
        return self.key == other.key and any(
            other.digests.get(h) == d for h, d in list(self.digests.items())
        )


class _Lookup:
    """Finds, among copies filed under one hint, the one whose bytes hash to a digest;
    says what it hashed (``hashed``)."""

    def __init__(self, p: Partition, hash: str, hashed: Callable[[int], None] | None) -> None:
        self.table = p.media
        self.hash = hash
        self.hashed = hashed
        #: Copies this put's record batch brings, by where they are filed.
        self.local: dict[Key, list[Copy]] = {}

    def under(self, key: Key) -> list[Copy]:
        """The copies filed under ``key``, the newest :data:`MAX_LOOKED_AT` of them."""
        held = self.table.get(key, ())
        return [*held[-MAX_LOOKED_AT:], *self.local.get(key, ())]

    def digest(self, payload: memoryview) -> bytes:
        if self.hashed is not None:
            self.hashed(payload.nbytes)
        return digest_of(payload, self.hash)

    def find(self, copies: list[Copy], d: bytes) -> Copy | None:
        """The copy of ``copies`` whose bytes hash to ``d``: those hashed before first,
        then up to :data:`MAX_HASHED` more (newest first), each hashed once in its life."""
        h = self.hash
        for c in copies:
            if c.digests.get(h) == d:
                return c
        left = MAX_HASHED
        for c in reversed(copies):
            if left == 0:
                break
            if h in c.digests:
                continue
            left -= 1
            # Without the store's lock: a racing lookup may hash it too, to the same value.
            got = c.digests[h] = self.digest(c.payload())
            if got == d:
                return c
        return None


def media_piece(
    p: Partition,
    batch: pa.RecordBatch,
    app_metadata: pa.Buffer | None,
    what: str,
    limit: int | None,
    hashed: Callable[[int], None] | None = None,
    max_claims_bytes: int | None = None,
) -> Piece:
    """A put's record batch resolved against ``p``'s media, validated, made a piece.

    Payloads are filed under their hints, unhashed, except where the writer claims a
    digest (``app_metadata``, :func:`flightq.digest.parse_claims`: checked against it) or
    ``p`` holds copies with the same hint (hashed to find an equal one); references are
    found among ``p``'s copies by hint, then digest; ``hashed`` is told the bytes of each
    payload hashed (refused puts included); ``max_claims_bytes`` caps the claims
    (the server's ``max_request_bytes``). The piece keeps the batch with empty media
    dictionaries, its copies beside it (:attr:`Piece.media`). Reads ``p``'s copies
    without the store's lock (one dict lookup each); the put's commit takes them.

    Raises
    ------
    MediaDigestError
        If a payload does not hash to its claimed digest, or the hash is unknown here.
    MediaUnknownError
        If a reference names no copy of ``p`` (with that shape) whose bytes hash to it.
    ProtocolError
        If the claims do not match the batch's dictionaries.
    ResourceExhaustedError
        If the claims, or what they decode to, pass ``max_claims_bytes``.
    EncodeError
        If a row of an object field holds bytes that are not one value such a field
        holds, or that decode to more than ``max_claims_bytes``
        (:func:`flightq.objects.check_columns`).
    """
    from .partition import make_piece

    check_sizes(batch, p.schema.fields, max_claims_bytes)  # before any frame is decoded
    media = [f.name for f in p.schema.fields if f.role == "media" and f.name in batch.schema.names]
    if not media:
        checked = validate(batch, p.schema, decoded=coded(p.schema.fields))
        check_columns(batch, p.schema.fields, max_claims_bytes)  # decodes what validate left
        return make_piece(batch, checked, limit, len(p.tasks))
    try:
        batch.validate(full=True)  # offsets are read below, before validation proper
    except pa.ArrowException as e:
        raise DecodeError(f"{what}: malformed record batch: {e}") from e
    claims = parse_claims(app_metadata, what, max_claims_bytes)
    hash, claimed = claims if claims is not None else (HASH, {})
    if hash not in HASHES:
        raise MediaDigestError(
            f"{what}: the media digests are {hash!r}, this server knows {sorted(HASHES)}",
            expected=sorted(HASHES),
            actual=hash,
        )
    view, stored = batch, batch
    lookup = _Lookup(p, hash, hashed)
    copies: dict[str, list[Copy | None]] = {}
    brings = 0
    for name in media:
        col = batch.column(name)
        shapes_name = name + SHAPE_SUFFIX
        if col.type != MEDIA_TYPE or shapes_name not in batch.schema.names:
            continue  # validation names what is wrong
        found, home = _resolve(
            p, name, col, batch.column(shapes_name), claimed.get(name), lookup, what
        )
        copies[name] = found
        if home is not None and home.nbytes:
            new = len({id(c) for c in found if c is not None and c.home is home})
            brings += home.nbytes + COPY_OVERHEAD * new
        i = batch.schema.get_field_index(name)
        # Checked as it arrived unless some entry names a copy held before (none: the
        # batch is malformed, which validation names, or no row uses an entry).
        if any(c is not None for c in found) and any(
            c is None or c.home is not home for c in found
        ):
            view = view.set_column(i, batch.schema.field(i), _with_entries(col, found))
        stored = stored.set_column(i, batch.schema.field(i), _with_entries(col, None))
    checked = validate(view, p.schema, decoded=coded(p.schema.fields))
    check_columns(view, p.schema.fields, max_claims_bytes)
    nbytes = checked.nbytes.copy()
    for name in copies:  # media bytes count once, on the partition (their copies)
        nbytes -= media_row_bytes(view.column(name))
    piece = make_piece(stored, dataclasses.replace(checked, nbytes=nbytes), limit, len(p.tasks))
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
    lookup: _Lookup,
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
            f"{what}: column {name!r}: {len(claims)} media claims for {n} dictionary entries"
        )
    idx = segs.indices.to_numpy(zero_copy_only=False)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        return [None] * n, None  # validation refuses it
    # Each entry's segment shapes (all segments of a referenced entry must agree).
    souter = shapes.offsets.to_numpy()
    seg_shapes = shapes.values.slice(int(souter[0]), int(souter[-1] - souter[0]))
    if len(seg_shapes) != len(idx) or seg_shapes.null_count:
        return [None] * n, None
    # Views, each segment's dims made Python ints in turn: a put's shapes may carry many
    # (and dims no segment uses, which the batch's own validation accepts).
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
    hash = lookup.hash
    empty = empty_digest(hash)
    out: list[Copy | None] = []
    missing: list[str] = []
    for j in range(n):
        shape = shape_of.get(j)
        a, b = int(offsets[j]), int(offsets[j + 1])
        claim = claims[j] if claims is not None else b""
        if shape is None:
            out.append(None)
            continue
        if b == a and claim and claim[:DIGEST_BYTES] != empty:  # a reference
            d, hint = claim[:DIGEST_BYTES], claim[DIGEST_BYTES:]
            if len(hint) != HINT_BYTES:
                raise ProtocolError(
                    f"{what}: column {name!r}: media dictionary entry {j} is empty and "
                    f"claims a digest without a hint; a reference is the digest followed "
                    f"by the payload's {HINT_BYTES}-byte hint"
                )
            if j in mixed:
                raise MediaUnknownError(
                    f"{what}: column {name!r}: media named by digest {d.hex()[:16]} is "
                    "used with different shapes; send its payload",
                    field=name,
                    actual=[d.hex()],
                    partition=p.name,
                )
            c = lookup.find(lookup.under((name, hint, shape)), d)
            if c is None:
                missing.append(d.hex())
            out.append(c)
            continue
        if len(claim) > DIGEST_BYTES:
            raise ProtocolError(
                f"{what}: column {name!r}: media dictionary entry {j} carries a payload "
                "and a hint; a hint travels only with a reference (an empty entry)"
            )
        payload = memoryview(data)[a:b] if data is not None else memoryview(b"")
        key = (name, hint_of(payload), shape)
        same = lookup.under(key)
        got = None
        if claim or same:  # checked against the claim, or against its look-alikes
            got = lookup.digest(payload)
        if claim and claim != got:
            assert got is not None
            raise MediaDigestError(
                f"{what}: column {name!r}: media dictionary entry {j} ({b - a} bytes) hashes "
                f"to {hash} {got.hex()[:16]}..., the writer claimed {claim.hex()[:16]}...; "
                "nothing was stored",
                field=name,
                expected=claim.hex(),
                actual=got.hex(),
                partition=p.name,
            )
        c = lookup.find(same, got) if got is not None and same else None
        if c is None:
            c = Copy(key, home, j, b - a)
            if got is not None:
                c.digests[hash] = got
            lookup.local.setdefault(key, []).append(c)
        out.append(c)
    if missing:
        raise MediaUnknownError(
            f"{what}: column {name!r}: {len(missing)} media referenced by digest match no "
            f"payload partition {p.name!r} holds (cleared, the server restarted, another "
            f"shard holds them, or the bytes held differ): "
            f"{', '.join(m[:16] for m in missing[:4])}; send their payloads",
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


def _consecutive(copies: list[Copy]) -> bool:
    """Whether the copies are consecutive entries of one home (one zero-copy slice)."""
    if not copies:
        return True
    home, first = copies[0].home, copies[0].index
    return all(c.home is home and c.index == first + k for k, c in enumerate(copies))


def _with_entries(col: pa.Array, found: list[Copy | None] | None) -> pa.Array:
    """``col`` with its dictionary replaced: by the copies' payloads (``found``; an
    entry no row uses by an empty one: the budget refuses it from the batch as it
    arrived, and copying its bytes here would hold them twice), or by empty entries
    (None)."""
    outer = col.offsets
    values = col.values
    entries = values.dictionary
    if found is None:
        new = _empty_entries(len(entries))
    else:
        parts = [c.entry if c is not None else _empty_entries(1) for c in found]
        new = copied.made(pa.concat_arrays(parts)) if len(parts) != 1 else parts[0]
    dict_arr = pa.DictionaryArray.from_arrays(values.indices, new)
    mask = col.is_null() if col.null_count else None
    return pa.LargeListArray.from_arrays(outer, dict_arr, mask=mask)


# ---- the copies' lives, with the store's lock


def cell_copies(pc: Piece, f: str, i: int) -> Iterator[Copy]:
    """The distinct copies row ``i`` of piece ``pc`` uses in media column ``f``."""
    copies = pc.media.get(f)
    if not copies:
        return iter(())
    rows = pc.copies_of_rows.get(f)
    if rows is None:
        rows = pc.copies_of_rows[f] = _copies_of_rows(pc, f, copies)
    return iter(rows[i])


def _copies_of_rows(pc: Piece, f: str, copies: list[Copy]) -> list[tuple[Copy, ...]]:
    # One pass over the column's offsets and entry indices for all its rows.
    col = pc.batch.column(f)
    # Offsets index the whole child array, as ``values`` gives it, sliced batch or not.
    outer = col.offsets.to_numpy(zero_copy_only=False).tolist()
    idx = col.values.indices.to_numpy(zero_copy_only=False)
    pos = pc.media_index[f][idx].tolist() if len(idx) else []
    out: list[tuple[Copy, ...]] = []
    for a, b in itertools.pairwise(outer):
        out.append(tuple(copies[k] for k in dict.fromkeys(pos[a:b])))
    return out


def acquire(p: Partition, copies: Iterable[Copy]) -> None:
    """Count a use of each copy by a stored row cell; a copy used first joins ``p``'s
    copies (filed under its hint, newest last), and its home's bytes count from then on."""
    table = p.media
    for c in copies:
        c.refs += 1
        if c.refs > 1:
            continue
        table.setdefault(c.key, []).append(c)  # raced by an equal copy: lives beside it
        p.nbytes += c.nbytes  # payload bytes, as stats report them
        p.held += COPY_OVERHEAD
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
        filed = table.get(c.key)
        if filed is not None:
            # Copies compare by identity: this one leaves, an equal one beside it stays.
            filed.remove(c)
            if not filed:
                del table[c.key]
        p.nbytes -= c.nbytes
        p.held -= COPY_OVERHEAD
        h = c.home
        h.live -= 1
        if h.live == 0:
            p.held -= h.nbytes
            p.media_bytes -= h.nbytes
            p.let_go(h, h.nbytes)


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
    entries, places, _ = _dictionary_of(order)
    if places is not None:
        idx_all = places[idx_all]
    segs = pa.DictionaryArray.from_arrays(pa.array(idx_all, type=pa.int32()), entries)
    mask = pa.array(nulls, type=pa.bool_()) if any(nulls) else None
    out = pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), segs, mask=mask)
    return out, sum(c.nbytes for c in order)


def piece_column(pc: Piece, name: str) -> tuple[pa.Array, list[Copy], bool]:
    """Media column ``name`` of every row of ``pc``, for an answer: the stored column with
    each distinct copy's payload once in its dictionary, those copies, and whether the
    dictionary is a view of their homes (no payload copied). Entries that name one copy
    (equal payloads of one put, such as a size tensor many images share) become one;
    where none do, the stored indices go as they are."""
    col = pc.batch.column(name)
    copies = pc.media.get(name)
    if not copies:
        return col, [], True  # no row has a segment: nothing to fill in
    made = pc.answer_entries.get(name)
    if made is None:
        made = pc.answer_entries[name] = _answer_entries(copies, pc.media_index[name])
    distinct, remap = made
    entries, at, viewed = _dictionary_of(distinct)
    if at is not None:
        remap = at if remap is None else at[remap]
    indices = col.values.indices
    if remap is not None:
        indices = pa.array(remap[indices.to_numpy(zero_copy_only=False)], type=indices.type)
    out = pa.DictionaryArray.from_arrays(indices, entries)
    mask = col.is_null() if col.null_count else None
    col = pa.LargeListArray.from_arrays(col.offsets, out, mask=mask)
    return col, distinct, viewed


#: Payload bytes of entries no answer row uses that a dictionary sent as a view of its
#: home may carry between the ones it uses (an answer's small size tensors: see
#: :func:`_dictionary_of`): at most this, and at most the bytes it uses or
#: :data:`_SPARE_FLOOR`, whichever is more (over the socket they are sent).
SPARE_ENTRY_BYTES = 64 << 10
_SPARE_FLOOR = 4 << 10


def _few_spare(span: int, used: int) -> bool:
    """Whether a view of ``span`` payload bytes, ``used`` of them by the answer's rows,
    carries few enough others (:data:`SPARE_ENTRY_BYTES`, :data:`_SPARE_FLOOR`)."""
    return span - used <= min(SPARE_ENTRY_BYTES, max(used, _SPARE_FLOOR))


def _dictionary_of(copies: list[Copy]) -> tuple[pa.Array, np.ndarray | None, bool]:
    """One large_binary dictionary holding each copy's payload, where each copy's entry
    is in it (None: in order), and whether it is a view of their home (no payload
    copied). A zero-copy slice of their home where they are consecutive entries of it,
    or where they are entries of one home with few bytes of others between them
    (:data:`SPARE_ENTRY_BYTES`; a piece's distinct size tensors: equal ones share a copy,
    so the ones left are scattered); a copy of their bytes otherwise."""
    if not copies:
        return _empty_entries(0), None, True
    home = copies[0].home
    if _consecutive(copies):
        return home.entries.slice(copies[0].index, len(copies)), None, True
    if all(c.home is home for c in copies):
        at = np.fromiter((c.index for c in copies), dtype=np.int64, count=len(copies))
        lo, hi = int(at.min()), int(at.max()) + 1
        span = home.entries.slice(lo, hi - lo)
        offsets = binary_offsets(span)
        used = sum(c.nbytes for c in copies)
        if _few_spare(int(offsets[-1] - offsets[0]), used):
            return span, (at - lo).astype(np.int32), True
    return copied.made(pa.concat_arrays([c.entry for c in copies])), None, False


#: Fewest bytes a piece counts itself (its rows and the payloads it brought) for the
#: answer form of its batch read whole to be kept on it: what the form holds beside the
#: piece's own memory (Python objects, 9-20 kB for a schema of tens of fields) stays a
#: small share of what the budget counts for the piece.
KEEP_ANSWER_BYTES = 1 << 20
#: A bound on what a kept answer form holds per column of its batch (the batch's arrays,
#: the buffer table's description of them: about 0.7-1.5 kB measured); a piece keeps its
#: form only where that is at most a sixteenth of what it counts, whatever the schema.
KEPT_COLUMN_BYTES = 2048


@dataclass(eq=False)
class WholeAnswer:
    """A stored batch as an answer sends it whole: the batch with each media column's
    distinct copies in its dictionary (:func:`piece_column`), those copies' identities
    and bytes; where it is kept on its piece (``kept``), also what
    :mod:`flightq.shm.table` found describing it (``described``)."""

    source: pa.RecordBatch
    media: tuple[str, ...]
    batch: pa.RecordBatch
    copies: frozenset[int]
    nbytes: int
    kept: bool = False
    described: Any = None
    #: The answer through shared memory last sent of this batch read whole (first among
    #: others, :mod:`flightq.shm.table`), kept for the next reader of the same.
    reply: Any = None


def piece_answer(pc: Piece, schema: pa.Schema, media: list[str]) -> WholeAnswer:
    """Every row of ``pc`` with the columns of ``schema`` (the piece's own), its media
    columns filled in as :func:`piece_column` makes them. Kept on the piece for the next
    answer (a step is read by several workers) where no payload was copied for it and
    the piece counts at least :data:`KEEP_ANSWER_BYTES` itself (its rows and the payloads
    it brought, not copies another put brought: a row streamed with a reference to its
    group's image counts a few kB), and 16 :data:`KEPT_COLUMN_BYTES` per column: the batch
    then holds only memory the piece's copies hold anyway, and what the kept form adds
    stays a small share of what the piece counts."""
    made = kept_answer(pc, media)
    if made is not None:
        return made
    source = batch = pc.batch
    ids: set[int] = set()
    nbytes = 0
    viewed = True
    for name in media:
        col, distinct, view = piece_column(pc, name)
        ids.update(map(id, distinct))
        nbytes += sum(c.nbytes for c in distinct)
        viewed = viewed and view
        i = schema.get_field_index(name)
        batch = batch.set_column(i, schema.field(i), col)
    kept = viewed and keeps_answer(pc)
    made = WholeAnswer(source, tuple(media), batch, frozenset(ids), nbytes, kept)
    if kept:
        pc.answer_whole = made
    return made


@dataclass(eq=False)
class RowsAnswer:
    """Rows ``[lo, lo + len(batch))`` of a kept answer form as an answer sends them
    (:func:`rows_answer`): the batch, whose columns ``made`` (the media ones) were made
    afresh and the others are slices of the form's (:mod:`flightq.shm.table` describes
    those from the form's kept description)."""

    whole: WholeAnswer
    lo: int
    batch: pa.RecordBatch
    made: frozenset[int]


#: What an answer's stored batches are made from, for :mod:`flightq.shm.table`.
Answered = WholeAnswer | RowsAnswer


def rows_answer(whole: WholeAnswer, lo: int, n: int) -> tuple[RowsAnswer, int] | None:
    """Rows ``[lo, lo + n)`` of a kept answer form (:func:`piece_answer`, ``kept``): the
    slice of its batch, each media dictionary cut to the entries those rows use (a view of
    the put's dictionary, as the form's is), and the payload bytes they use. None where
    their entries lie apart with more bytes of others between them than
    :func:`_dictionary_of` lets a view carry (the caller cuts the rows one by one)."""
    batch = whole.batch.slice(lo, n)
    schema = batch.schema
    nbytes = 0
    made = []
    for name in whole.media:
        i = schema.get_field_index(name)
        col = batch.column(i)
        offsets = np.frombuffer(
            col.buffers()[1], dtype=np.int64, count=n + 1, offset=8 * col.offset
        )
        first, end = int(offsets[0]), int(offsets[-1])
        segs = col.values.slice(first, end - first)
        entries = segs.dictionary
        idx = segs.indices.to_numpy(zero_copy_only=False)
        lo_e, hi_e = (int(idx.min()), int(idx.max()) + 1) if idx.size else (0, 0)
        span = entries.slice(lo_e, hi_e - lo_e)
        ends = binary_offsets(span)
        if hi_e - lo_e == len(idx) and bool((np.diff(idx) == 1).all()):  # one each, in order
            taken = int(ends[-1] - ends[0])
        else:
            sizes = np.diff(ends)
            used = np.zeros(len(span), dtype=bool)
            used[idx - lo_e] = True
            taken = int(sizes[used].sum())
            if not _few_spare(int(ends[-1] - ends[0]), taken):
                return None
        nbytes += taken
        indices = pa.array(np.subtract(idx, lo_e, dtype=np.int32))
        out = pa.DictionaryArray.from_arrays(indices, span)
        mask = col.is_null() if col.null_count else None
        starts = pa.array(np.subtract(offsets, first))
        col = pa.LargeListArray.from_arrays(starts, out, mask=mask)
        batch = batch.set_column(i, schema.field(i), col)
        made.append(i)
    return RowsAnswer(whole, lo, batch, frozenset(made)), nbytes


def kept_answer(pc: Piece, media: list[str]) -> WholeAnswer | None:
    """The answer form kept on ``pc`` for its batch as stored now with media columns
    ``media``; None where none is (a batch replaced since makes a new one)."""
    made = pc.answer_whole
    if made is not None and made.source is pc.batch and made.media == tuple(media):
        return made
    return None


def keeps_answer(pc: Piece) -> bool:
    """Whether ``pc`` counts enough itself to keep the answer form of its batch read
    whole (:func:`piece_answer`, where no payload is copied for it)."""
    least = max(KEEP_ANSWER_BYTES, 16 * KEPT_COLUMN_BYTES * pc.batch.num_columns)
    return pc.cost + pc.brings >= least


def prepare_answer(pc: Piece, roles: dict[str, str]) -> WholeAnswer | None:
    """The kept answer form of a piece just stored, made now for its first reader (a get
    of the step by key then pays no more than the next ones): None where the piece keeps
    none (:func:`piece_answer`). ``roles``: the role of each field of its partition."""
    if not pc.stored or pc.damaged or not keeps_answer(pc):
        return None
    schema = pc.batch.schema
    made = piece_answer(pc, schema, [n for n in schema.names if roles.get(n) == "media"])
    return made if made.kept else None


def _answer_entries(copies: list[Copy], index: np.ndarray) -> tuple[list[Copy], np.ndarray | None]:
    """A piece's distinct copies of one column, in order of first use, and per dictionary
    entry its copy's place among them (None: each entry its own copy, in order)."""
    place: dict[int, int] = {}
    distinct: list[Copy] = []
    at = np.empty(len(copies), dtype=np.int32)
    for k, c in enumerate(copies):
        j = place.get(id(c))
        if j is None:
            j = place[id(c)] = len(distinct)
            distinct.append(c)
        at[k] = j
    if len(distinct) == len(copies) and np.array_equal(index, np.arange(len(copies))):
        return distinct, None
    return distinct, np.where(index >= 0, at[np.maximum(index, 0)], 0).astype(np.int32)


def same_media(a: Piece, b: Piece) -> bool:
    """Whether two pieces' media dictionaries name the same payloads (their batches keep
    no media bytes, so an equal batch says nothing about them)."""
    if a.media.keys() != b.media.keys():
        return False
    return all(
        len(a.media[f]) == len(b.media[f])
        and all(x.same_as(y) for x, y in zip(a.media[f], b.media[f], strict=True))
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
