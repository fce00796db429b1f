"""A client's reads: one DoGet over the socket or through shared memory, decoded as it
arrives, and what the answer teaches about the partition's rows.

:class:`Reader` holds what a client's gets and claims share: the :class:`Transport`, the
bytes per row each partition's last answer carried (:class:`RowSizes`, which size later
reads: shared memory or the socket, one stream or several), the shared-memory directory
and threshold, and the pinned pool of device reads. The parallel streams
(:mod:`flightq.client.streams`) split a get over it; the :class:`~flightq.Client` makes
one per connection.

Every decoded answer says how it travelled in ``batch.received.route``: ``"socket"``,
``"streams=N"`` (a get split over N parallel DoGet streams), ``"shm"`` (through a
shared-memory segment) or ``"device"`` (decoded into CUDA tensors).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from ..batch import Batch, PartDecoder, Received, join, past_asked
from ..cuda import PinnedPool, decode_to_device
from ..errors import FlightqError, ProtocolError
from ..frames import STREAM_MAX_BYTES, Frame
from ..protocol import CLAIM_METADATA, ClaimGrant, ClaimTicket, GetTicket, ScanTicket, Ticket
from .recent import Recent
from .requests import Requests
from .transport import Transport

#: A read the request stream gave back after more than this many seconds (it waited
#: there) goes per call with the rest of its timeout, at least :data:`_LEAST_S`.
_SPENT_S = 0.05
_LEAST_S = 0.05

__all__ = ["Reader", "RowSizes", "claim_grant", "distinct_nbytes", "received_on_device"]


def distinct_nbytes(batches: Iterable[pa.RecordBatch]) -> int:
    """Bytes the batches hold, each buffer once: slices of one stored batch share a media
    dictionary, which ``RecordBatch.nbytes`` would count in every slice."""
    batches = list(batches)
    if len(batches) == 1:  # Arrow counts a batch's shared buffers once itself
        return batches[0].get_total_buffer_size()
    seen: set[tuple[int, int]] = set()
    for b in batches:
        for col in b.columns:
            bufs = col.buffers()
            if pa.types.is_large_list(col.type) and pa.types.is_dictionary(col.type.value_type):
                bufs += col.values.dictionary.buffers()
            seen.update((x.address, x.size) for x in bufs if x is not None)
    return sum(size for _, size in seen)


#: Most rows of a get whose size is not known yet that tries the request stream.
UNKNOWN_STREAM_ROWS = 16


class RowSizes:
    """Per partition, the payload bytes per row of its last answer, and the fewest rows
    the server has kept in one part of a split get. Thread-safe."""

    def __init__(self) -> None:
        # The partitions used last (a run may name a partition per step).
        self._per_row: Recent[str, float] = Recent()
        self._together: Recent[str, int] = Recent()
        self._lock = threading.Lock()

    def learn_parts(self, partition: str, parts: list[int]) -> None:
        """Remember, from the rows of each part of a split get, how many rows the server
        keeps together: where some parts came back empty (the server would not cut a
        prompt group in two), the rows asked over the parts that had rows; where none did,
        the fewest rows of a part, if fewer than known."""
        rows, filled = sum(parts), sum(1 for n in parts if n)
        if not filled:
            return
        with self._lock:
            known = self._together.get(partition, 1)
            if filled < len(parts):
                self._together[partition] = max(known, -(-rows // filled))
            else:
                self._together[partition] = max(1, min(known, min(parts)))

    def together(self, partition: str) -> int:
        """Fewest rows a stream of a split get should carry (1 before any split get)."""
        with self._lock:
            return self._together.get(partition, 1)

    def learn(self, partition: str, rows: int, batches: Iterable[pa.RecordBatch]) -> None:
        """Remember the bytes per row an answer of ``rows`` rows carried."""
        if rows:
            per_row = distinct_nbytes(batches) / rows
            with self._lock:
                self._per_row[partition] = per_row

    def learn_bytes(self, partition: str, rows: int, nbytes: int) -> None:
        """Remember the bytes per row of an answer of ``rows`` rows and ``nbytes`` bytes."""
        if rows:
            with self._lock:
                self._per_row[partition] = nbytes / rows

    def per_row(self, partition: str) -> float | None:
        """Bytes per row of the partition's last answer; None before its first."""
        with self._lock:
            return self._per_row.get(partition)


def received_on_device(batch: Batch, record_batches: int, started: float) -> Batch:
    """``batch`` (decoded into device memory since ``started``) marked as such."""
    now = time.perf_counter()
    batch.received = Received(record_batches, now, now - started, route="device")
    return batch


class Reader:
    """The reads of one client: the transport, the row sizes, shm, the pinned pool.

    Parameters
    ----------
    transport:
        The client's connections.
    shm_dir:
        The shared-memory directory (None: every read takes the socket).
    shm_min_bytes:
        With shm, reads estimated at fewer bytes take the socket.
    get_streams:
        Most parallel DoGet streams one get is split over.
    min_stream_bytes:
        Fewest bytes per stream, estimated from the partition's last answer.
    pinned:
        Pinned host buffers and copy streams of reads into CUDA tensors.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        shm_dir: str | None,
        shm_min_bytes: int,
        get_streams: int,
        min_stream_bytes: int,
        pinned: PinnedPool,
        requests: Requests | None = None,
        stream_max_bytes: int = STREAM_MAX_BYTES,
    ) -> None:
        self.transport = transport
        self.requests = requests
        self.stream_max_bytes = stream_max_bytes
        self.shm_dir = shm_dir
        self.shm_min_bytes = shm_min_bytes
        self.get_streams = get_streams
        self.min_stream_bytes = min_stream_bytes
        self.pinned = pinned
        self.sizes = RowSizes()
        #: ``time.monotonic()`` until which gets travel as one stream: the server refused
        #: a parallel one's streams for want of call slots ("server busy").
        self.crowded_until = 0.0
        #: False once the server refused a get in parts (a server older than
        #: ``GetTicket.parts``): every get then travels as one stream.
        self.parts_known = True

    def routed(self, ticket: Ticket) -> Ticket:
        """``ticket``, asking for an answer through shared memory where one applies: with
        shm, unless the partition's last answer says this one is small (its rows times
        their bytes)."""
        if self.shm_dir is None:
            return ticket
        if isinstance(ticket, GetTicket):
            rows: int | None = len(ticket.keys)
        elif isinstance(ticket, ClaimTicket):
            rows = ticket.batch_size
        else:
            rows = None
        per_row = self.sizes.per_row(ticket.partition)
        # Nothing known yet (a first read, or a scan): through shared memory.
        if per_row is None or rows is None or rows * per_row >= self.shm_min_bytes:
            return dataclasses.replace(ticket, shm=True)
        return ticket

    def read(
        self,
        ticket: Ticket,
        what: str,
        timeout: float | None,
        *,
        connection: int = 0,
        decoder: PartDecoder | None = None,
        grant: list[ClaimGrant] | None = None,
        route: list[str] | None = None,
    ) -> list[pa.RecordBatch]:
        """One DoGet's record batches (rebuilt over the mapped segments when the ticket
        asks for shared memory); given a ``decoder``, each is decoded as it arrives (while
        gRPC receives the next one). A claim's :class:`ClaimGrant` is appended to
        ``grant`` as soon as its first record batch arrives. ``route[0]`` becomes
        ``"socket"`` where shared memory was asked for and the server sent the rows."""
        batches: list[pa.RecordBatch] = []
        stream = self.transport.get(ticket, what, timeout=timeout, connection=connection)
        for rb in stream:
            batches.append(rb)
            if grant is not None and not grant:
                grant.append(claim_grant(rb, what))
            if decoder is not None and not ticket.shm:
                decoder.add(rb)
        if ticket.shm:
            assert self.shm_dir is not None
            from ..shm.table import take

            answered = batches
            batches = take(batches, self.shm_dir, what)
            if route is not None and batches is answered:  # the server sent the rows
                route[0] = "socket"
            if decoder is not None:
                for b in batches:
                    decoder.add(b)
        return batches

    def decoded(
        self, partition: str, decoders: list[PartDecoder], route: str, nbytes: int | None = None
    ) -> Batch:
        """The decoded answer of a read: remembers its size (``nbytes``, or counted from
        its batches) for the partition's next read and says how it arrived
        (``batch.received``)."""
        parts = [p for d in decoders for p in d.parts]
        rows = sum(len(p) for p in parts)
        if nbytes is None:
            self.sizes.learn(partition, rows, [p.record_batch for p in parts])
        else:
            self.sizes.learn_bytes(partition, rows, nbytes)
        batch = join(parts)
        batch.received = Received.of(decoders, route)
        return batch

    def one(
        self,
        ticket: Ticket,
        what: str,
        timeout: float | None,
        as_: str,
        copy: bool,
        grant: list[ClaimGrant] | None = None,
    ) -> Batch:
        """A read as one stream, decoded (through shared memory where it applies), held
        to what it asked for (:func:`answers`).

        Where the request stream gives the read back (busy, too large, or broken while
        it waited: the server restarted, the link dropped), it goes per call with what
        is left of ``timeout`` (and of a claim's wait), so that it still ends near its
        deadline."""
        t = self.routed(ticket)
        d = PartDecoder(as_, copy, most=asked_rows(ticket))
        started = time.monotonic()
        answered = self._ask(t, what, timeout, grant) if self._small(t) else None
        if answered is not None:
            try:
                if t.shm:
                    # Its answer only names where the rows lie (a message of a few hundred
                    # bytes, which the stream carries for less than a call costs), or
                    # holds them where the server had no room to answer through memory.
                    assert self.shm_dir is not None
                    from ..shm.table import take

                    batches = take(answered, self.shm_dir, what)
                    for b in batches:
                        d.add(b)
                    came = self.decoded(
                        ticket.partition, [d], "socket" if batches is answered else "shm"
                    )
                else:  # its batches own their buffers: no slices to tell apart
                    for rb in answered:
                        d.add(rb)
                    nbytes = sum(rb.get_total_buffer_size() for rb in answered)
                    came = self.decoded(ticket.partition, [d], "socket", nbytes)
                return answers(ticket, came, what)
            except FlightqError:
                # Answers on the stream are taken in turn: after one that is not what was
                # asked, nothing on it is trusted.
                assert self.requests is not None
                self.requests.abandon()
                raise
        spent = time.monotonic() - started
        if spent > _SPENT_S:
            left = (self.transport.timeout if timeout is None else timeout) - spent
            timeout = max(left, _LEAST_S)
            if isinstance(t, ClaimTicket):
                t = dataclasses.replace(t, timeout=max(t.timeout - spent, 0.0))
        route = ["shm" if t.shm else "socket"]
        self.read(t, what, timeout, decoder=d, grant=grant, route=route)
        return answers(ticket, self.decoded(ticket.partition, [d], route[0]), what)

    def _small(self, ticket: Ticket) -> bool:
        """Whether a read goes on the request stream (where the stream is free): any read
        through shared memory, a get or claim the partition's last answer predicts
        smaller than ``stream_max_bytes``, a partition's first get of a few rows."""
        if self.requests is None or not self.stream_max_bytes:
            return False
        if ticket.shm:
            return True
        if isinstance(ticket, GetTicket):
            rows = len(ticket.keys)
        elif isinstance(ticket, ClaimTicket):
            rows = ticket.batch_size
        else:
            return False
        per_row = self.sizes.per_row(ticket.partition)
        if per_row is None:
            # A partition's first get of a few rows tries the stream too: it is answered
            # there if it fits in stream_max_bytes, else the server says so at once and the
            # get goes per call (a consumer never blocked by data calls that fill
            # max_calls). A claim's rows would be taken and given back: it waits to learn.
            return isinstance(ticket, GetTicket) and rows <= UNKNOWN_STREAM_ROWS
        return rows * per_row < self.stream_max_bytes

    def _ask(
        self,
        ticket: Ticket,
        what: str,
        timeout: float | None,
        grant: list[ClaimGrant] | None,
    ) -> list[pa.RecordBatch] | None:
        """A read's record batches as the request stream answered it (a claim's grant
        appended to ``grant``); None where it goes per call. Only where :meth:`_small`
        says the read goes on the stream."""
        assert self.requests is not None

        def with_grant(got: Frame) -> list[pa.RecordBatch]:
            if grant is not None and not grant:
                if got.schema is None:
                    raise ProtocolError(f"{what}: the claim's answer carries no rows, so no grant")
                grant.append(_grant_of(got.schema, what))
            return got.batches

        return self.requests.read(ticket, what, timeout, with_grant, self.stream_max_bytes)

    def to_device(
        self,
        device: Any,
        ticket: ClaimTicket | ScanTicket,
        what: str,
        timeout: float | None,
        *,
        copy: bool,
        sync: bool,
        grant: list[ClaimGrant] | None = None,
    ) -> Batch:
        """A DoGet stream decoded into CUDA tensors as its record batches arrive."""
        got: list[pa.RecordBatch] = []
        started = time.perf_counter()
        chunks: Iterator[pa.RecordBatch] = self.transport.get(
            ticket, what, timeout=timeout, got=got
        )
        if grant is not None:
            chunks = granted(chunks, grant, what)
        most = asked_rows(ticket)
        if most is not None:
            chunks = bounded(chunks, most, what)
        out = decode_to_device(chunks, device, self.pinned, copy=copy, sync=sync)
        return received_on_device(answers(ticket, out, what), len(got), started)


def claim_grant(rb: pa.RecordBatch, what: str) -> ClaimGrant:
    """The :class:`ClaimGrant` in a claim answer's schema metadata.

    Raises
    ------
    ProtocolError
        If the answer carries none (a server that predates leases) or a malformed one.
    """
    return _grant_of(rb.schema, what)


def _grant_of(schema: pa.Schema, what: str) -> ClaimGrant:
    raw = (schema.metadata or {}).get(CLAIM_METADATA)
    if raw is None:
        raise ProtocolError(f"{what}: the answer carries no claim grant (a server too old?)")
    return ClaimGrant.parse(raw)


def granted(
    chunks: Iterator[pa.RecordBatch], grant: list[ClaimGrant], what: str
) -> Iterator[pa.RecordBatch]:
    """``chunks``, the claim's :class:`ClaimGrant` appended to ``grant`` as its first record
    batch arrives (the rows are then taken, whatever follows)."""
    for rb in chunks:
        if not grant:
            grant.append(claim_grant(rb, what))
        yield rb


def asked_rows(ticket: Ticket) -> int | None:
    """The most rows a read's answer may hold: a get's keys, a claim's batch size; None
    for a scan."""
    if isinstance(ticket, GetTicket):
        return len(ticket.keys)
    if isinstance(ticket, ClaimTicket):
        return ticket.batch_size
    return None


def answers(ticket: Ticket, batch: Batch, what: str) -> Batch:
    """``batch`` where it is an answer to ``ticket``: a get's rows are its keys, in order;
    a claim's are at most its batch size, each once.

    Raises
    ------
    ProtocolError
        Naming what was asked and what came (a server that is not flightq's, or a bug).
    """
    keys = batch.keys
    if isinstance(ticket, GetTicket) and ticket.parts is None:
        in_order(list(ticket.keys), keys, what)
    if isinstance(ticket, ClaimTicket):
        claimed(keys, None, ticket.batch_size, what)
    return batch


def in_order(asked: list[str], keys: list[str], what: str) -> None:
    """Check that a get's rows are ``keys``, the keys ``asked`` for, in order.

    Raises
    ------
    ProtocolError
        Naming the first position where they differ.
    """
    if keys == asked:
        return
    i = next(
        (j for j, (a, b) in enumerate(zip(asked, keys, strict=False)) if a != b),
        min(len(asked), len(keys)),
    )
    raise ProtocolError(
        f"{what}: the answer's rows are not the keys asked for: {len(keys)} rows for "
        f"{len(asked)} keys, the first difference at position {i} "
        f"({asked[i][:64] if i < len(asked) else None!r} asked, "
        f"{keys[i][:64] if i < len(keys) else None!r} came)"
    )


def claimed(
    keys: list[str],
    deliveries: list[int] | None,
    batch_size: int,
    what: str,
    taken: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Check a claim's answer: at most ``batch_size`` rows, each once and none of
    ``taken`` (rows an earlier answer gave the same claim: a sharded claim asks several),
    with one delivery count of at least 1 per row where the grant's ``deliveries`` are
    given.

    Raises
    ------
    ProtocolError
        Naming what came against what was asked.
    """
    distinct = set(keys)
    if len(keys) > batch_size or len(distinct) != len(keys):
        raise ProtocolError(
            f"{what}: the answer holds {len(keys)} rows ({len(distinct)} distinct) for a "
            f"claim of at most {batch_size}"
        )
    twice = distinct & taken
    if twice:
        raise ProtocolError(f"{what}: row {min(twice)[:64]!r} came in two answers of one claim")
    if deliveries is not None and (len(deliveries) != len(keys) or min(deliveries, default=1) < 1):
        raise ProtocolError(
            f"{what}: the claim's grant counts {len(deliveries)} deliveries (least "
            f"{min(deliveries, default=None)}) for {len(keys)} rows; each row is delivered "
            "at least once"
        )


def bounded(chunks: Iterable[pa.RecordBatch], most: int, what: str) -> Iterator[pa.RecordBatch]:
    """``chunks``, refused at the record batch that takes them past ``most`` rows (what a
    read asked for): a stream that goes on is not read to its end.

    Raises
    ------
    ProtocolError
        Naming the rows asked for and the rows come so far.
    """
    rows = 0
    for rb in chunks:
        rows += rb.num_rows
        if rows > most:
            raise past_asked(most, rows, what)
        yield rb
