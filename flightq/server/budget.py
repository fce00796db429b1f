"""What a put costs the server to hold, and the caps on what one may carry.

The memory budget (``Server(memory_budget=...)``) counts every byte a stored row keeps
alive, not only its payload: per row, its payload bytes, its share of the rest of its
record batch's Arrow buffers (shapes, offsets, keys, the tags' msgpack bytes, validity)
and of the batch's schema metadata, the row key as a Python string, its tags as the Python
objects they decode to, and a measured constant for the row's Python objects
(:data:`ROW_OVERHEAD`); per stored record batch, a measured constant for its own objects,
shared by its rows (:data:`PIECE_OVERHEAD`). Media payloads are the partition's, not a
row's: each distinct payload is held once per partition, whichever puts brought it, and
counts once, while a stored row uses it (:mod:`flightq.server.media`). A put's pieces
count from the moment each record batch is read (with the media payloads it brought),
while it waits for the put's other parts, until it is stored or refused.

A declared partition counts :func:`declaration_cost` while it exists, and its name, its
tasks and the partitions a server holds are capped (:data:`MAX_NAME_CHARS`,
:data:`MAX_TASKS`, :data:`MAX_PARTITIONS`). What is no row's business is refused before it
is held: a media dictionary entry that no
row of the put uses, a row key longer than :data:`MAX_KEY_BYTES`, tags longer than
per row :data:`MAX_TAGS_BYTES`, an Arrow schema whose metadata passes
:data:`MAX_METADATA_BYTES`, and a registered schema past :data:`MAX_SCHEMA_BYTES` or
beyond :data:`MAX_SCHEMAS` in the registry. Each refusal is a
:class:`~flightq.errors.ResourceExhaustedError` naming the cap, what arrived and where.
See ``docs/reliability.md``.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from ..errors import ResourceExhaustedError
from ..frames import SchemaMemo
from ..layout import KEY, MEDIA_TYPE, TAGS, binary_offsets, mapped

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_TAGS_BYTES",
    "MAX_TAGS_LIMIT",
    "MAX_METADATA_BYTES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMAS",
    "RECORDS_SHARE",
    "REPLY_COPIES",
    "REPLY_ENTRY_BYTES",
    "STATS_NAMES",
    "STATS_TASK_NAMES",
    "RETURNED_KEY_BYTES",
    "RECORDS_SLACK",
    "ROW_OVERHEAD",
    "PIECE_OVERHEAD",
    "COPY_OVERHEAD",
    "WAITING_SHARE",
    "Tally",
    "TASK_ROW_BYTES",
    "MAX_NAME_CHARS",
    "MAX_TASKS",
    "MAX_PARTITIONS",
    "declaration_cost",
    "record_stamp",
    "journal_cost",
    "put_id_cost",
    "moved_cost",
    "keys_size",
    "shrunk",
    "check_batch",
    "DictionaryUse",
    "underlying_bytes",
    "metadata_bytes",
    "row_costs",
    "tags_size",
]

#: Longest row key, in UTF-8 bytes.
MAX_KEY_BYTES = 1024
#: Longest tags of one row, in msgpack bytes, unless the server is told another
#: (``Server(max_tags_bytes=...)``, ``flightq serve --max-tags-bytes``).
MAX_TAGS_BYTES = 64 * 1024
#: The most a server may be told to take of one row's tags: they are decoded into Python
#: objects (counted in the budget) and listed whole by ``list_keys``.
MAX_TAGS_LIMIT = 16 << 20
#: Most bytes of metadata (keys and values, schema-level and on every field) a put's Arrow
#: schema may carry; a flightq schema's JSON is a few KiB.
MAX_METADATA_BYTES = 64 * 1024
#: Longest schema JSON ``register_schema`` accepts.
MAX_SCHEMA_BYTES = 32 * 1024
#: Most schemas a server's registry holds (shipped and loaded ones included).
MAX_SCHEMAS = 64
#: Bytes a stored row's Python objects take beyond its key and tags, measured with
#: tracemalloc over 100 000 one-token rows (the :class:`~flightq.server.partition.Row`,
#: its cells map, the partition's and its validation's entries for it): 660 bytes,
#: counted with room for per-row state to come.
ROW_OVERHEAD = 1024
#: Bytes a stored record batch takes beyond its Arrow buffers, whatever its rows: its
#: Arrow and Python objects (an array and its data per column, the batch, the piece and
#: its validation's arrays) and what the received message keeps around its buffers.
#: Measured as a server's RSS over 10 000 one-row batches put (6.7 KB a batch, 2.8 KB of it
#: counted per row) and 24 000 cells written back one per batch (4.9 KB, 1.4 KB counted):
#: about 4 KB a batch uncounted, which let a server of one-cell batches pass 3 budgets.
PIECE_OVERHEAD = 4096
#: Bytes a partition's media copy takes beyond its payload while stored rows use it: the
#: copy, its key and digests, its entries in the partition's table and in the per-row
#: lists answers keep. Measured with tracemalloc over 40 000 copies of 4-byte payloads:
#: about 450 bytes on the server (all of it was uncounted: a client putting many tiny
#: distinct segments held 7.7 budgets of RSS with the budget 40% full).
COPY_OVERHEAD = 512
#: Puts waiting for room under a full budget hold what they carry, received and not yet
#: counted: at most ``budget // WAITING_SHARE`` of it in all (or one put's, whatever its
#: size); a put that would pass it is refused at once (``retry="full"``) instead of
#: waiting. Before, 48 request streams each
#: waiting with a 3.9 MiB frame grew a 64 MiB server by 440 MiB.
WAITING_SHARE = 2
#: Bytes a stored row takes for each task of its partition past the first, measured with
#: tracemalloc over 1 600 rows of a 64-task partition: its entry in that task's index of
#: ready rows (35 bytes), and once delivered to the task its counts of deliveries and
#: failures and its lease or dead-letter entry (131 more). Counted from the put on, with
#: room.
TASK_ROW_BYTES = 192


#: Records of the past may keep their newest bytes up to this share of the budget even
#: where rows, declarations and live claims fill it (``Store._fit``).
RECORDS_SHARE = 16
#: Records of the past dropped for room go this share of the budget below what they are
#: allowed (``Store._fit``), so the next drop waits for as many new records.
RECORDS_SLACK = 64

#: Longest partition or task name, in characters; most tasks one partition declares; most
#: partitions a server holds.
MAX_NAME_CHARS = 256
MAX_TASKS = 64
MAX_PARTITIONS = 65536
#: Bytes a declared partition takes before any row (its ready orders, progress and leases
#: maps), and per task: measured with tracemalloc over 2000 declarations, 1.8 KB with no
#: task and 0.8 KB more per task, counted with room for the allocator's share (a server
#: declaring partitions of 64 tasks until refused grew its RSS by 2.9 budgets counting
#: half this: test_budget_rss.py).
PARTITION_OVERHEAD = 8192
TASK_OVERHEAD = 2048


#: Times a ``stats`` reply writes each task name of a partition (its tasks, and per task
#: its delivered, acked, leased, dead and waiting counts) and the partition's name.
STATS_TASK_NAMES = 6
STATS_NAMES = 1
#: Copies of a reply's bytes the server holds while it sends it: its msgpack bytes and
#: gRPC's message.
REPLY_COPIES = 2
#: Bytes of a listed entry's Python objects in a reply (``list_keys``, ``dead_letters``)
#: beyond its key and tags: its map of tags and list of fields, its slots in the reply's
#: lists, its bytes packed (keys and tags are counted apart).
REPLY_ENTRY_BYTES = 512


def declaration_cost(name: str, tasks: Sequence[str]) -> int:
    """Bytes the memory budget counts for a declared partition while it exists: its
    objects, its names as held, and its names as often as ``stats`` replies copy them
    (:data:`STATS_TASK_NAMES` times a task name, in :data:`REPLY_COPIES` copies of the
    reply), so that a ``stats`` reply never takes more than the declarations count
    (:mod:`flightq.server.replies`)."""
    copies = REPLY_COPIES * STATS_TASK_NAMES
    return (
        PARTITION_OVERHEAD
        + TASK_OVERHEAD * len(tasks)
        + (1 + REPLY_COPIES * STATS_NAMES) * len(name.encode())
        + (1 + copies) * sum(len(t.encode()) for t in tasks)
    )


#: What a partition keeps of its past after its rows are cleared (its journal of recent
#: writes, ended leases, recent put ids) counts against the budget while kept
#: (:attr:`~flightq.server.partition.Partition.records`); the store drops such records,
#: the oldest of any partition first, when the budget needs their room. Each is stamped
#: with the next of these numbers when made, so that "oldest" spans partitions and kinds.
_STAMPS = itertools.count(1)


def record_stamp() -> int:
    """The next record's stamp: larger than every earlier one's."""
    return next(_STAMPS)


#: Bytes a journal entry takes beyond its keys' list and strings (its tuple and number),
#: an ended lease beyond its keys' strings (the lease, its id, maps) and per key (its
#: list and tuple slots, its row number), and a put id beyond its string (its entry and
#: number): measured with tracemalloc (97, 550, 56 and 57 bytes), counted with room.
JOURNAL_ENTRY_OVERHEAD = 128
LEASE_OVERHEAD = 1024
LEASE_KEY_OVERHEAD = 64
#: Bytes a lease's set of rows given back (``nack``) may take per key it names: a set's
#: table is at most 4 slots of 16 bytes an entry. Counted from the claim on, whether or
#: not a row is ever given back, so a lease's count does not change while it lives.
RETURNED_KEY_BYTES = 64
PUT_ID_OVERHEAD = 96
#: Bytes a key takes in a task's log of keys moved while a large put merges
#: (:attr:`~flightq.server.leases.TaskState.moved`) beyond its string: its list slot,
#: measured with tracemalloc over 65 536 keys (8.6 bytes), counted with room.
MOVED_KEY_OVERHEAD = 16


def keys_size(keys: Iterable[str]) -> int:
    """Bytes the Python strings of ``keys`` take (``sys.getsizeof``)."""
    return sum(map(sys.getsizeof, keys))


def journal_cost(keys: Sequence[str] | None) -> int:
    """Bytes the budget counts for a journal entry naming ``keys`` (None: every row),
    while the journal keeps it: its keys' strings whole, as if no row held them."""
    if keys is None:
        return JOURNAL_ENTRY_OVERHEAD
    return JOURNAL_ENTRY_OVERHEAD + sys.getsizeof(keys) + keys_size(keys)


def put_id_cost(put_id: str) -> int:
    """Bytes the budget counts for a put id a partition remembers."""
    return PUT_ID_OVERHEAD + sys.getsizeof(put_id)


def moved_cost(keys: Collection[str]) -> int:
    """Bytes the budget counts for ``keys`` in a task's log of keys moved while a large
    put merges, while the log keeps them: their strings whole, as if no row held them."""
    return MOVED_KEY_OVERHEAD * len(keys) + keys_size(keys)


#: A dict or set whose table takes more than this many bytes an entry (and 1 KiB) once
#: entries went is rebuilt at its size (:func:`shrunk`).
SHRINK_BYTES_PER_ENTRY = 128

_Table = TypeVar("_Table", dict[Any, Any], set[Any])


def shrunk(table: _Table) -> _Table:
    """``table``, or a copy of it at its size (in its order) where deletions left it more
    than :data:`SHRINK_BYTES_PER_ENTRY` bytes an entry: Python never shrinks a dict or set
    on deletion, so a partition cleared of most of its rows would keep, uncounted, tables
    sized for its peak. The caller swaps the copy in. Rebuilding the table in place would
    show it empty midway to those who read it without the store's lock (a put's plan, a
    large put's merge, a media lookup), which then took its rows for gone.

    Amortized O(1) a deletion: a copy takes at most 64 bytes an entry (and 1 KiB), so the
    next is made only once half its entries or more went."""
    if sys.getsizeof(table) > 1024 + SHRINK_BYTES_PER_ENTRY * len(table):
        return type(table)(table)
    return table


def metadata_bytes(schema: pa.Schema) -> int:
    """Bytes of metadata an Arrow schema carries: keys and values, its own and its fields'."""
    # Every put of a partition carries the same few schemas: count each once. A schema
    # past the cap is never kept (its metadata could be huge): it is refused anyway.
    n = _METADATA_BYTES.find(schema)
    if n is None:
        n = _metadata_bytes(schema)
        if n <= MAX_METADATA_BYTES:
            _METADATA_BYTES.keep(schema, n)
    return n


def _media_columns(schema: pa.Schema, keep: bool) -> tuple[int, ...]:
    """The indices of a schema's media columns, found once per schema (``keep``: one
    within the metadata cap; a larger one is never kept, as :func:`metadata_bytes`)."""
    found = _MEDIA_COLUMNS.find(schema)
    if found is None:
        found = tuple(i for i, f in enumerate(schema) if f.type == MEDIA_TYPE)
        if keep:
            _MEDIA_COLUMNS.keep(schema, found)
    return found


def _metadata_bytes(schema: pa.Schema) -> int:
    total = sum(len(k) + len(v) for k, v in (schema.metadata or {}).items())
    for f in schema:
        total += sum(len(k) + len(v) for k, v in (f.metadata or {}).items())
    return total


_METADATA_BYTES = SchemaMemo(16)
#: The media columns of each schema seen (their dictionaries are counted apart).
_MEDIA_COLUMNS = SchemaMemo(16)
#: Key and tag column types whose values are measured (others: validation refuses them).
_CAPPED_TYPES = (pa.utf8(), pa.binary())


def check_batch(batch: pa.RecordBatch, what: str, max_tags: int = MAX_TAGS_BYTES) -> None:
    """Refuse a put's record batch whose schema metadata, keys or tags pass their caps
    (a row's tags: ``max_tags`` bytes), from Arrow offsets alone (before any key or tag
    becomes a Python object).

    Raises
    ------
    ResourceExhaustedError
        Naming the cap, the size that arrived and the row (by index) at fault.
    """
    meta = metadata_bytes(batch.schema)
    if meta > MAX_METADATA_BYTES:
        raise ResourceExhaustedError(
            f"{what}: the record batch's schema carries {meta} bytes of metadata, more than "
            f"the server's limit of {MAX_METADATA_BYTES}",
            expected=MAX_METADATA_BYTES,
            actual=meta,
        )
    names = batch.schema.names
    for name, cap, label in ((KEY, MAX_KEY_BYTES, "row key"), (TAGS, max_tags, "tags")):
        if name not in names:
            continue  # validation names the missing column
        col = batch.column(name)
        if col.type not in _CAPPED_TYPES or not len(col):
            continue
        _, buf, data = col.buffers()
        if buf is None or data is None or data.size <= cap:
            continue  # no row holds more than the whole value buffer: nothing to measure
        sizes = np.diff(np.frombuffer(buf, np.int32, len(col) + 1, col.offset * 4))
        i = int(np.argmax(sizes))
        if sizes[i] > cap:
            raise ResourceExhaustedError(
                f"{what}: a {label} of {int(sizes[i])} bytes (row {i} of the batch) is longer "
                f"than the server's limit of {cap} bytes",
                field=name,
                expected=cap,
                actual=int(sizes[i]),
            )


class DictionaryUse:
    """Which entries of a put's media dictionaries its rows use, batch by batch.

    Batches of one stream share a dictionary until the writer replaces it (slices of one
    encoded batch travel with it once), so an entry counts as used when a row of any batch
    sharing its dictionary uses it. A dictionary is judged once replaced, and at the end.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        #: Per media column, its current dictionary's identity, entries and use flags.
        self._current: dict[str, tuple[tuple[int, int], pa.Array, np.ndarray]] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        """Note the entries the rows of ``batch`` use.

        Raises
        ------
        ResourceExhaustedError
            If a dictionary it replaces has an entry no row used.
        """
        schema = batch.schema
        found = _media_columns(schema, keep=metadata_bytes(schema) <= MAX_METADATA_BYTES)
        names = schema.names if found else []
        for i in found:  # not every column of the batch built to find them
            name, col = names[i], batch.column(i)
            entries = col.values.dictionary
            offsets = entries.buffers()[1]
            ident = (offsets.address if offsets is not None else 0, len(entries))
            cur = self._current.get(name)
            if cur is None or cur[0] != ident:
                if cur is not None:
                    self._judge(name, cur[1], cur[2])
                cur = self._current[name] = (ident, entries, np.zeros(len(entries), dtype=bool))
            outer = col.offsets.to_numpy(zero_copy_only=False)
            lo, hi = int(outer[0]), int(outer[-1])
            idx = col.values.indices.slice(lo, hi - lo).to_numpy(zero_copy_only=False)
            cur[2][idx[(idx >= 0) & (idx < len(entries))]] = True  # validation refuses others

    def finish(self) -> None:
        """Judge the dictionaries still current at the end of the put.

        Raises
        ------
        ResourceExhaustedError
            Naming the column, the unused entries and their bytes.
        """
        for name, (_, entries, used) in self._current.items():
            self._judge(name, entries, used)

    def _judge(self, name: str, entries: pa.Array, used: np.ndarray) -> None:
        if used.all():
            return
        sizes = np.diff(binary_offsets(entries))
        n, nbytes = int((~used).sum()), int(sizes[~used].sum())
        raise ResourceExhaustedError(
            f"{self._what}: column {name!r}: {n} media dictionary entries ({nbytes} bytes) "
            "are used by no row of the put; the server holds only what rows use",
            field=name,
            actual=nbytes,
        )


def tags_size(tags: Any) -> int:
    """Bytes the Python objects of one row's decoded tags take (``sys.getsizeof``, walked)."""
    total = 0
    stack = [tags]
    while stack:
        x = stack.pop()
        total += sys.getsizeof(x)
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def underlying_bytes(batches: Sequence[pa.RecordBatch]) -> int:
    """Bytes of the distinct memory blocks the buffers of ``batches`` are slices of (a
    request-stream frame, a Flight message's body): what holding them keeps alive,
    whatever of it the batches reference."""
    tops: dict[int, int] = {}

    def walk(arr: pa.Array) -> None:
        for b in arr.buffers():
            if b is None:
                continue
            while b.parent is not None:
                b = b.parent
            tops[b.address] = b.size
        if pa.types.is_dictionary(arr.type):
            walk(arr.dictionary)
        values = getattr(arr, "values", None)
        if isinstance(values, pa.DictionaryArray):
            walk(values.dictionary)

    for batch in batches:
        for col in batch.columns:
            walk(col)
    return sum(tops.values())


class Tally:
    """Running totals of what the memory budget counts in a store's partitions, kept
    current by each partition as its counts change (``Partition.attach``): the store reads
    them at every change without walking its partitions."""

    __slots__ = ("declared", "held", "holders", "kept", "leased", "records")

    def __init__(self) -> None:
        from .readings import Kept

        #: What partitions let go of that answers and snapshots under way still hold.
        self.kept = Kept()
        #: The partitions keeping records of the past now, by ``id``: those the store
        #: drops records from, without walking the others.
        self.holders: dict[int, Any] = {}
        #: Rows, the pieces they use and media copies (``Partition.held``).
        self.held = 0
        #: The declarations themselves (``Partition.declared``).
        self.declared = 0
        #: Records of the past: journals, ended leases, put ids (``Partition.records``).
        self.records = 0
        #: Live leases, and the keys logged for large puts merging (``Progress.live_bytes``,
        #: ``Progress.moved_bytes``).
        self.leased = 0

    def set(self, obj: object, name: str, total: str, value: int, owner: Any) -> None:
        """Set ``obj``'s counted attribute ``name`` to ``value``, adding the change to
        ``total``; a change of records files ``owner`` (its partition) or not
        (:meth:`note`)."""
        setattr(self, total, getattr(self, total) + value - getattr(obj, name))
        object.__setattr__(obj, name, value)
        if total == "records" and owner is not None:
            self.note(owner)

    def note(self, partition: Any) -> None:
        """File ``partition`` among :attr:`holders` while it keeps records."""
        if partition.records:
            self.holders[id(partition)] = partition
        else:
            self.holders.pop(id(partition), None)


def tallied(obj: object, fields: dict[str, str], tally: Tally | None, sign: int) -> None:
    """Add (``sign`` 1) or take out (-1) ``obj``'s counted attributes (attribute ->
    :class:`Tally` total) to or from ``tally``."""
    if tally is None:
        return
    for name, total in fields.items():
        setattr(tally, total, getattr(tally, total) + sign * getattr(obj, name))


def row_overhead(tasks: int) -> int:
    """Bytes a stored row of a partition of ``tasks`` tasks takes beyond its key, tags and
    cells: :data:`ROW_OVERHEAD`, and :data:`TASK_ROW_BYTES` for each task past the first."""
    return ROW_OVERHEAD + TASK_ROW_BYTES * max(tasks - 1, 0)


def piece_share(nbytes: int, rows: int) -> int:
    """Each of ``rows`` rows' share of ``nbytes`` held for them all (rounded up)."""
    return -(-nbytes // rows)


def row_costs(
    batch: pa.RecordBatch,
    keys: Sequence[str],
    tag_sizes: np.ndarray,
    payload: np.ndarray,
    overhead: int = ROW_OVERHEAD,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a validated batch, the bytes the budget counts while it is stored, in
    two parts. What lies in the batch, counted while any stored row uses it: ``payload``
    (per row, from validation) plus the row's share of the batch's other Arrow buffers,
    schema metadata and :data:`PIECE_OVERHEAD`, and the put's decoded tags map
    (``tag_sizes`` per row, :func:`tags_size`, 0 for none; rows sharing one map each count
    it whole). What the row
    holds of its own, counted while it is stored: its key, its tags map, and ``overhead``
    (:func:`row_overhead` of its partition's tasks)."""
    n = batch.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    meta = metadata_bytes(batch.schema)
    rest = batch.get_total_buffer_size() - int(payload.sum()) + meta + PIECE_OVERHEAD
    for i in _media_columns(batch.schema, keep=meta <= MAX_METADATA_BYTES):
        # Batches of a stream may share one dictionary: its entries count in the payload
        # of the rows using them (first use per batch), not once per batch sharing it.
        rest -= batch.column(i).values.dictionary.get_total_buffer_size()
    share = piece_share(max(rest, 0), n)
    tags = np.asarray(tag_sizes, dtype=np.int64)
    piece = payload.astype(np.int64) + share + tags
    own = np.asarray(mapped(sys.getsizeof, keys), dtype=np.int64) + overhead + tags
    return piece, own
