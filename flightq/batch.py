"""Decode self-describing record batches into a :class:`Batch` of views.

:func:`decode` needs no schema argument: the batch carries it. Tensors come back as
read-only views over the received Arrow buffers (pass ``copy=True`` for writable copies).
The encode side lives in :mod:`flightq.encode`, the column classes in
:mod:`flightq.columns`; both are re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

from .chunks import encode_chunks, row_nbytes, split_batch
from .codecs import RAW
from .columns import (
    ChunkedColumn,
    Column,
    MediaColumn,
    ObjectColumn,
    Packed,
    ScalarColumn,
    TensorColumn,
)
from .encode import encode
from .errors import DecodeError, MissingFieldError, ProtocolError
from .layout import TAGS, schema_of
from .schema import Schema
from .validation import Checked, validate

__all__ = [
    "encode",
    "decode",
    "PartDecoder",
    "Received",
    "Claim",
    "check_as",
    "join",
    "validate_part",
    "Batch",
    "Column",
    "TensorColumn",
    "MediaColumn",
    "ScalarColumn",
    "ObjectColumn",
    "ChunkedColumn",
    "Packed",
    "split_batch",
    "encode_chunks",
    "row_nbytes",
]


def validate_part(
    batch: pa.RecordBatch, first: Batch | None, decoded: Collection[str] = ()
) -> Checked:
    """Validate one record batch of a stream whose first part (if any) is ``first``;
    ``decoded``: as :func:`~flightq.validation.validate`'s.

    Raises
    ------
    DecodeError
        If the batch is invalid or carries another schema or other fields than ``first``.
    """
    c = validate(batch, duplicate_error=DecodeError, decoded=decoded)
    if first is not None and (c.schema != first.schema or c.fields != first.fields):
        raise DecodeError(
            f"record batches of one stream differ: {first.schema.ref} {first.fields} "
            f"then {c.schema.ref} {c.fields}"
        )
    return c


def decode(
    batch: pa.RecordBatch | Sequence[pa.RecordBatch], *, as_: str = "torch", copy: bool = False
) -> Batch:
    """Rebuild a record batch's rows from the schema it carries.

    Parameters
    ----------
    batch:
        A flightq record batch, or the record batches of one stream (same schema and
        fields), whose rows are concatenated in order.
    as_:
        ``"torch"`` (default) or ``"numpy"``; numpy returns bfloat16 and float8 as their bit
        patterns (uint16/uint8).
    copy:
        Return writable copies instead of read-only views over the batch's buffers.

    Returns
    -------
    Batch

    Raises
    ------
    DecodeError, ShapeError, UndeclaredFieldError
        If the batch is not a valid flightq batch.
    """
    check_as(as_)
    batches = [batch] if isinstance(batch, pa.RecordBatch) else list(batch)
    d = PartDecoder(as_, copy, prepare=False)
    for b in batches:
        d.add(b)
    return join(d.parts)


def _can_build(as_: str) -> bool:
    """Whether this process builds columns ``as_`` (torch may be missing)."""
    try:
        check_as(as_)
    except DecodeError:
        return False
    return True


def _coded(arrow: pa.Schema) -> tuple[str, ...]:
    """The compressed fields a record batch carries."""
    names = arrow.names
    return tuple(f.name for f in schema_of(arrow).fields if f.codec is not RAW and f.name in names)


def past_asked(most: int, rows: int, what: str) -> ProtocolError:
    """The error of an answer that holds ``rows`` rows so far, past the ``most`` its read
    asked for (a server that is not flightq's, or a bug): refused at the record batch
    that passes them, not read to its end."""
    return ProtocolError(
        f"{what}: the answer holds more than the {most} rows asked for ({rows} so far)"
    )


def check_as(as_: str) -> None:
    """Refuse an ``as_`` this process cannot decode to, before anything is read (so a
    claim takes no rows it could not return).

    Raises
    ------
    ValueError
        If ``as_`` is neither ``"torch"`` nor ``"numpy"``.
    DecodeError
        If ``as_`` is ``"torch"`` and torch is not installed.
    """
    if as_ not in ("torch", "numpy"):
        raise ValueError(f"as_ must be 'torch' or 'numpy', got {as_!r}")
    if as_ == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise DecodeError(
                "decoding to torch needs torch (pip install 'flightq[torch]'), or pass as_='numpy'"
            ) from e


class PartDecoder:
    """Decodes the record batches of one stream as they arrive (see :func:`decode`).

    With ``prepare``, each part's per-row tensors are built (:meth:`Batch.prepare`) as the
    record batch after it arrives, while gRPC receives the next one: a reader that decodes
    as batches arrive leaves little to do once the last one is in. The last part's are
    built when first asked for (its tags at once), so a reader that takes whole columns
    (``packed``, ``jagged``, a TensorDict) builds no per-row tensors it does not use.
    """

    def __init__(
        self,
        as_: str = "torch",
        copy: bool = False,
        prepare: bool = True,
        part: type[Batch] | None = None,
        most: int | None = None,
    ) -> None:
        self.as_ = as_
        #: The most rows the answer may hold (None: any): a stream past it is refused at
        #: the record batch that passes it, not read to its end.
        self.most = most
        self.rows = 0
        self.copy = copy
        self.prepare = prepare
        self.part = Batch if part is None else part  # the class of each decoded part
        self.parts: list[Batch] = []
        self.arrived = 0.0  # time.perf_counter() when the last record batch came in
        self.decode_s = 0.0  # seconds spent in add()
        #: Whether a part's compressed columns are built as it arrives, each frame
        #: decoded once (by the column, as exactly as validation would): a CPU batch of
        #: an ``as_`` this process can build.
        self.eager = self.part is Batch and _can_build(as_)
        self._coded: tuple[str, ...] | None = None  # the first part's (all parts share it)

    def add(self, rb: pa.RecordBatch) -> None:
        """Validate one record batch against the stream's first and decode it.

        Raises
        ------
        DecodeError, ShapeError, UndeclaredFieldError
            As :func:`decode`.
        """
        t = time.perf_counter()
        self.arrived = t
        self.rows += rb.num_rows
        if self.most is not None and self.rows > self.most:
            raise past_asked(self.most, self.rows, "a read")
        if self._coded is None:
            self._coded = _coded(rb.schema) if self.eager else ()
        coded = self._coded
        c = validate_part(rb, self.parts[0] if self.parts else None, coded)
        part = self.part(rb, c.schema, c.keys, c.fields, self.as_, self.copy, c.flat)
        for name in coded:
            part.column(name).decoded()  # its frames, which validation left: a bad one fails
        if self.prepare:
            if self.parts:
                self.parts[-1].prepare()  # not the last: another record batch came after it
            part.check_tags()  # malformed tags fail the read, not a later access
        self.parts.append(part)
        self.decode_s += time.perf_counter() - t


@dataclass(frozen=True)
class Claim:
    """The lease a claim's rows came under (``Batch.claim``): pass it, or the batch, to
    ``Client.ack`` when done with the rows, or to ``Client.nack`` to give them back.

    Attributes
    ----------
    partition, task:
        Where the rows were claimed, and for which task.
    id:
        The claim's id on the server (``ack``/``nack`` name it).
    keys:
        The rows, in the batch's order.
    deliveries:
        Per row, how many times it has been delivered to the task, this time included:
        above 1 the row came back (a consumer before gave it back, failed or went away).
    lease:
        Seconds the rows stay leased without an ack (``inf``: until acked, given back or
        the client goes away).
    expires:
        ``time.monotonic()`` in this process when the lease runs out.
    parts:
        A claim over several shards: one claim per shard, each with its ``shard``
        (the index in ``ShardedClient.locations``); empty otherwise.
    shard:
        The shard of a part, else None.
    """

    partition: str
    task: str
    id: str
    keys: tuple[str, ...]
    deliveries: tuple[int, ...]
    lease: float
    expires: float
    parts: tuple[Claim, ...] = ()
    shard: int | None = None


@dataclass(frozen=True)
class Received:
    """How a get's or claim's answer arrived (``Batch.received``).

    Attributes
    ----------
    record_batches:
        How many record batches the answer came in (over all its streams).
    arrived:
        ``time.perf_counter()`` when the last of them was handed to the decoder: what a
        caller waits for after it is the decode left over (``perf_counter() - arrived``
        once the rows are used).
    decode_s:
        Seconds spent validating and decoding the record batches as they arrived,
        per-row tensors included: wall time, waits for the interpreter lock included,
        summed over streams (each stream decodes on its thread, so over several streams
        it can pass the get's own time). Into a device: the time from the first request
        to the batch on the device, the copies included.
    route:
        The way the answer travelled: ``"socket"`` (one DoGet stream), ``"streams=N"``
        (a get split over N parallel DoGet streams, one connection each), ``"shm"``
        (through a shared-memory segment) or ``"device"`` (decoded into CUDA tensors).
    """

    record_batches: int
    arrived: float
    decode_s: float
    route: str = "socket"

    @classmethod
    def of(cls, decoders: Iterable[PartDecoder], route: str = "socket") -> Received:
        ds = list(decoders)
        return cls(
            sum(len(d.parts) for d in ds),
            max((d.arrived for d in ds), default=0.0),
            sum(d.decode_s for d in ds),
            route,
        )


#: Rows past which a batch's tags are decoded once per distinct value.
_FEW = 8
#: Values a shallow copy of a decoded map shares safely with the map it copies.
_IMMUTABLE = (str, int, float, bool, bytes, type(None))
_TAG_ERRORS = (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)


class _TagValues:
    """A batch's tags, each distinct value decoded and checked once (the rows of a prompt
    group carry equal bytes): ``maps`` (the decoded maps, ``{}`` last for a row without
    tags), ``picks`` (each row's map), ``shallow`` (per map, whether its values are
    immutable, so a shallow copy shares them safely), ``values`` (their bytes)."""

    def __init__(self, col: pa.Array, keys: list[str]) -> None:
        # Each distinct value numbered in order of first use, in Arrow (half the time of
        # a dict in Python over a W3 step's 512 rows).
        coded = col.dictionary_encode()
        idx = coded.indices
        picks: list[int] = (idx.fill_null(-1) if idx.null_count else idx).to_numpy().tolist()
        values: list[bytes] = coded.dictionary.to_pylist()
        maps: list[dict[str, Any]] = []
        for j, b in enumerate(values):
            try:
                t = msgpack.unpackb(b, raw=False)
            except _TAG_ERRORS as e:
                k = keys[picks.index(j)]  # the first row with these bytes
                raise DecodeError(
                    f"tags of row {k!r} are not valid msgpack: {e}", field=TAGS, key=k
                ) from e
            if not isinstance(t, dict):
                k = keys[picks.index(j)]
                raise DecodeError(
                    f"tags of row {k!r} are not a map", field=TAGS, key=k, actual=type(t).__name__
                )
            maps.append(t)
        self.shallow = [all(type(v) in _IMMUTABLE for v in t.values()) for t in maps]
        maps.append({})  # index -1: a row without tags
        self.maps, self.picks, self.values = maps, picks, values

    def rows(self) -> list[dict[str, Any]]:
        """Each row's own map (a caller may change one row's): a copy of the decoded one
        where its values are immutable, else decoded again."""
        maps, shallow = self.maps, self.shallow
        if all(shallow):
            return list(map(dict, map(maps.__getitem__, self.picks)))
        return [
            dict(maps[j]) if j < 0 or shallow[j] else msgpack.unpackb(self.values[j], raw=False)
            for j in self.picks
        ]


def join(parts: Sequence[Batch]) -> Batch:
    """Decoded parts (of one stream, or of several in order) as one batch of their class.

    Raises
    ------
    DecodeError
        If there are no parts, or they carry other schemas or fields.
    """
    if not parts:
        raise DecodeError("nothing to decode: no record batches")
    p0 = parts[0]
    odd = next((p for p in parts[1:] if p.schema != p0.schema or p.fields != p0.fields), None)
    if odd is not None:
        raise DecodeError(
            f"record batches of one answer differ: {p0.schema.ref} {p0.fields} "
            f"then {odd.schema.ref} {odd.fields}"
        )
    if len(parts) == 1:
        return p0
    whole = type(p0)(
        p0.record_batch, p0.schema, [k for p in parts for k in p.keys], p0.fields, p0._as, p0._copy
    )
    whole._parts = list(parts)
    return whole


class Batch:
    """Decoded rows: keys, tags, and one column per field present.

    ``batch[name]`` gives the per-row structures the writer passed in: a list of tensors
    (``None`` where a row lacks the field) for token and tensor fields, a list of segment
    lists for media, a 1-D tensor for scalars (a list with ``None`` entries if some rows
    lack the field). :meth:`column` gives the richer column object (concatenation,
    counts, shapes). Tensors are read-only views unless decoded with ``copy=True``.
    """

    def __init__(
        self,
        record_batch: pa.RecordBatch,
        schema: Schema,
        keys: list[str],
        fields: list[str],
        as_: str,
        copy: bool,
        flat: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        self.record_batch = record_batch
        self.schema = schema
        self.keys = keys
        self.fields = fields
        self._as = as_
        self._copy = copy
        self._columns: dict[str, Column] = {}
        #: What validation learned of the 1-D token and tensor columns (``Checked.flat``).
        self._flat = {} if flat is None else flat
        #: Jagged offsets handed out so far: the batch's token columns share them.
        self._ragged: list[Any] = []
        self._tags: list[dict[str, Any]] | None = None
        self._tag_values: _TagValues | None = None
        self._parts: list[Batch] | None = None
        #: Set on what a get or claim returns: see :class:`Received`.
        self.received: Received | None = None
        #: Set on what a claim returns: the lease its rows came under (:class:`Claim`).
        self.claim: Claim | None = None
        #: Set by the client that claimed the batch: called on leaving ``with batch:``.
        self._settle: Any = None

    def __len__(self) -> int:
        return len(self.keys)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Leaving ``with client.claim(...) as batch:`` acknowledges the rows; leaving it
        with an exception gives them back (a :class:`~flightq.errors.FlightqError` naming
        one of the batch's rows in ``key`` counts a failed delivery of that row), and the
        exception goes on. A batch that is not a claim's does nothing."""
        if self._settle is not None:
            settle, self._settle = self._settle, None
            settle(exc)

    def __getstate__(self) -> dict[str, Any]:
        # A batch sent to another process (a DataLoader worker's) keeps its claim, which
        # that process's client can ack; leaving ``with batch:`` there settles nothing.
        state = dict(self.__dict__)
        state["_settle"] = None
        return state

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __repr__(self) -> str:
        return f"Batch({len(self)} rows of {self.schema.ref}, fields={self.fields})"

    @property
    def as_(self) -> str:
        """What the tensors are: ``"torch"`` or ``"numpy"``."""
        return self._as

    def to_tensordict(self, meta: bool = True) -> Any:
        """The rows as a ``tensordict.TensorDict`` (see :func:`flightq.tensordicts.to_tensordict`;
        ``meta=False`` leaves out ``__key__`` and ``__tags__``).

        Raises
        ------
        DecodeError, MissingFieldError
            As :func:`flightq.tensordicts.to_tensordict`.
        """
        from .tensordicts import to_tensordict

        return to_tensordict(self, meta)

    @property
    def parts(self) -> tuple[Batch, ...]:
        """The answer as it arrived: one :class:`Batch` per record batch, in order
        (``(self,)`` for an answer of one record batch). Read-only."""
        return (self,) if self._parts is None else tuple(self._parts)

    def check_tags(self) -> None:
        """Decode and check the rows' tags now, so that malformed tags fail the read that
        brought them; each row's own map is made when :attr:`tags` is first read (a reader
        of whole columns may never ask for it).

        Raises
        ------
        DecodeError
            Naming the first row whose tags are not msgpack, or not a map.
        """
        if self._tags is not None or self._tag_values is not None or self._parts is not None:
            return
        if self.record_batch.num_rows > _FEW:
            self._tag_values = _TagValues(self.record_batch.column(TAGS), self.keys)
        else:
            _ = self.tags

    @property
    def tags(self) -> list[dict[str, Any]]:
        """Per-row tag dicts (empty where a row has none)."""
        if self._tags is None and self._parts is not None:
            self._tags = [t for p in self._parts for t in p.tags]
        if self._tags is None and self.record_batch.num_rows > _FEW:
            checked, self._tag_values = self._tag_values, None
            if checked is None:
                checked = _TagValues(self.record_batch.column(TAGS), self.keys)
            self._tags = checked.rows()
        if self._tags is None:
            out: list[dict[str, Any]] = []
            for i, b in enumerate(self.record_batch.column(TAGS).to_pylist()):
                if b is None:
                    out.append({})
                    continue
                try:
                    t = msgpack.unpackb(b, raw=False)
                except (
                    ValueError,
                    msgpack.ExtraData,
                    msgpack.FormatError,
                    msgpack.StackError,
                ) as e:
                    raise DecodeError(
                        f"tags of row {self.keys[i]!r} are not valid msgpack: {e}",
                        field=TAGS,
                        key=self.keys[i],
                    ) from e
                if not isinstance(t, dict):
                    raise DecodeError(
                        f"tags of row {self.keys[i]!r} are not a map",
                        field=TAGS,
                        key=self.keys[i],
                        actual=type(t).__name__,
                    )
                out.append(t)
            self._tags = out
        return self._tags

    def column(self, name: str) -> Column:
        """The column object of a field present in the batch.

        Raises
        ------
        MissingFieldError
            If the batch does not carry the field.
        DecodeError
            If the batch was read ``as_='torch'`` (a get's default) and torch is not
            installed: its keys and tags read, its columns need ``as_='numpy'``.
        """
        col = self._columns.get(name)
        if col is None:
            check_as(self._as)  # typed, before any column imports torch
            if name not in self.fields:
                raise MissingFieldError(
                    f"field {name!r} is not in this batch of {self.schema.ref}; present: "
                    f"{', '.join(self.fields)}",
                    field=name,
                    key=self.keys[0] if self.keys else None,
                )
            if self._parts is not None:
                col = ChunkedColumn([p.column(name) for p in self._parts])
            else:
                f = self.schema[name]
                if f.role == "scalar":
                    col = ScalarColumn(f, self.record_batch, self._as, self._copy)
                elif f.role == "media":
                    col = MediaColumn(f, self.record_batch, self._as, self._copy)
                elif f.role == "object":
                    col = ObjectColumn(f, self.record_batch, self._as, self._copy)
                else:
                    col = TensorColumn(
                        f, self.record_batch, self._as, self._copy, self._flat.get(name)
                    )
            if self.schema[name].role == "token":  # a row's token fields share its length
                col.ragged = self._ragged
            self._columns[name] = col
        return col

    def __getitem__(self, name: str) -> Any:
        rows = self.column(name).cached_rows()
        return list(rows) if isinstance(rows, list) else rows

    def prepare(self) -> None:
        """Build every field's per-row tensors now (and the tags), instead of on access."""
        for name in self.fields:
            self.column(name).cached_rows()
        _ = self.tags

    def to_dict(self) -> dict[str, Any]:
        """Every field present, as ``{name: batch[name]}``."""
        return {name: self[name] for name in self.fields}
