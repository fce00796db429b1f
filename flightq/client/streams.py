"""Parallel streams: a large get or put over several connections at once.

A get of many rows is split into up to ``get_streams`` DoGet streams, a large put into up
to ``put_streams`` DoPut streams (consecutive ranges of its record batches), each on its
own connection: receiving, reassembling and checking the messages then run on several
cores. Every stream of a get names all its keys and its part; the server cuts the rows
into runs of about equal bytes between prompt groups (:class:`~flightq.server.assemble.PartCuts`),
and the parts come back in key order; parts of a put are stored together or not at all
(:mod:`flightq.server.staging`). Streams are sized by the bytes that travel (a prompt group's
shared image counts once), never below :data:`MIN_STREAM_BYTES` each.

The functions take what they use explicitly: the client's :class:`~.reads.Reader` (its
transport, row sizes and settings). Where the server refuses a stream for want of call
slots ("server busy", ``max_calls``), the get or put runs again as one stream, and the
client's next ones travel as one for :data:`CROWDED_SECONDS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import pyarrow as pa

from ..batch import Batch, PartDecoder
from ..cuda import decode_streams_to_device, decode_to_device
from ..errors import (
    FlightqError,
    MissingFieldError,
    NotFoundError,
    ProtocolError,
    ResourceExhaustedError,
)
from ..layout import KEY, pylist
from ..protocol import MAX_GET_PARTS, AbortPut, GetTicket, PutCommand
from .reads import Reader, answers, bounded, received_on_device
from .transport import Acked, acknowledged

__all__ = [
    "CROWDED_SECONDS",
    "Crowded",
    "DEFAULT_STREAMS",
    "MIN_STREAM_BYTES",
    "crowded",
    "filled",
    "get_to_device",
    "put_groups",
    "put_parts",
    "read_keys",
    "split",
    "split_count",
]

#: Most parallel streams (one connection each) a large get or put is split over.
DEFAULT_STREAMS = 4
#: Fewest bytes per stream, estimated from the partition's last answer: smaller gets (and
#: a partition's first get) travel as one stream, where per-row work dominates.
MIN_STREAM_BYTES = 16 * 2**20


#: Seconds a client's gets travel as one stream after the server refused one of a
#: parallel get's streams for want of call slots.
CROWDED_SECONDS = 10.0


class Resplit(Exception):
    """The parts of a split get differ in their columns: read it again as one stream."""


class Crowded(ResourceExhaustedError):
    """A put over parallel streams found the server's call slots taken ("server busy")
    and stored nothing: :meth:`flightq.Client.put` sends it again as one stream."""


def crowded(reader: Reader) -> bool:
    """Whether the client's reads and puts travel as one stream for now (a parallel one
    found the server busy less than :data:`CROWDED_SECONDS` ago)."""
    return time.monotonic() < reader.crowded_until


def _crowded(reader: Reader, e: ResourceExhaustedError) -> bool:
    """Whether ``e`` refused a stream of a parallel get for want of call slots on the
    server (``max_calls``, "server busy"): the get then runs again as one stream, and the
    client's next gets for :data:`CROWDED_SECONDS` travel as one too, so that many
    consumers' parallel streams do not turn a busy server's slots into failed gets."""
    if not e.busy:
        return False
    reader.crowded_until = time.monotonic() + CROWDED_SECONDS
    return True


def put_parts(
    reader: Reader,
    cmd: PutCommand,
    batches: list[pa.RecordBatch],
    fills: list[Callable[[], None]] | None,
    groups: list[range],
    timeout: float | None,
    max_batch_bytes: int,
) -> Acked:
    """One put over parallel DoPut streams, one range of batches each, on their own
    connections; the server stores the parts together or not at all
    (:mod:`flightq.server.staging`). Each stream fills its batches just before sending them.

    Raises
    ------
    Crowded
        If the server refused a stream for want of call slots ("server busy"); the parts
        were aborted, nothing is stored.
    """
    transport = reader.transport
    stage = secrets.token_hex(8)
    total = sum(b.num_rows for b in batches)  # before the batches are let go as sent

    def send(i: int) -> Acked:
        part = groups[i]
        rows = sum(batches[j].num_rows for j in part)
        mine = dataclasses.replace(cmd, rows=rows, stage=stage, part=i, parts=len(groups))
        schema = batches[part[0]].schema
        return transport.put(
            mine,
            schema,
            sent(part),
            max_batch_bytes=max_batch_bytes,
            timeout=timeout,
            connection=i,
        )

    def sent(part: range) -> Iterator[pa.RecordBatch]:
        # Each batch filled just before it is sent, and let go once handed over.
        for j in part:
            if fills is not None:
                fills[j]()
                fills[j] = _done
            b, batches[j] = batches[j], None
            yield b

    with ThreadPoolExecutor(len(groups), thread_name_prefix="flightq-put") as pool:
        futures = [pool.submit(send, i) for i in range(len(groups))]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        first = next((e for e in (f.exception() for f in finished) if e is not None), None)
        if first is not None:
            # The parts still waiting on the server must not wait for this one.
            with contextlib.suppress(FlightqError):
                transport.action(AbortPut(partition=cmd.partition, stage=stage, parts=len(groups)))
            wait(futures)
            if isinstance(first, ResourceExhaustedError) and _crowded(reader, first):
                raise Crowded(str(first), **first.attributes()) from first
            raise first
    rows, created = futures[0].result()  # every part is answered alike
    return acknowledged(rows, cmd, f"put to {cmd.partition!r}", total), created


def read_keys(
    reader: Reader, ticket: GetTicket, what: str, timeout: float | None, as_: str, copy: bool
) -> Batch:
    """A get's rows, over parallel streams when it asks for many rows.

    Each stream has its own connection, so receiving and reassembling the messages
    (the receiver's copies) runs on several cores, and each stream's record batches
    are decoded on its thread as they arrive, while gRPC receives the next ones: little
    is left to do once the last one is in. The parts come back in key order. If a part
    finds a key or field missing, or the parts' columns differ (``fields`` None over
    rows holding different fields), or the server refuses a stream for want of call slots
    ("server busy", see :func:`_crowded`), the get runs again as one stream, whose answer
    or complete error is the reference.
    """
    n = split_count(reader, ticket)
    if n < 2:
        return reader.one(ticket, what, timeout, as_, copy)
    tickets = split(ticket, n)

    def part(i: int) -> PartDecoder:
        d = PartDecoder(as_, copy, most=len(ticket.keys))
        reader.read(tickets[i], what, timeout, connection=i, decoder=d)
        return d

    try:
        with ThreadPoolExecutor(n - 1, thread_name_prefix="flightq-get") as pool:
            rest = [pool.submit(part, i) for i in range(1, n)]
            parts = [part(0), *(f.result() for f in rest)]
    except (NotFoundError, MissingFieldError):
        return reader.one(ticket, what, timeout, as_, copy)
    except ProtocolError as e:
        _unsplit(reader, e)
        return reader.one(ticket, what, timeout, as_, copy)
    except ResourceExhaustedError as e:
        if not _crowded(reader, e):
            raise
        return reader.one(ticket, what, timeout, as_, copy)
    schema = parts[0].parts[0].record_batch.schema
    if any(
        not b.record_batch.schema.equals(schema, check_metadata=True)
        for d in parts
        for b in d.parts
    ) or not _answers(ticket, (k for d in parts for b in d.parts for k in b.keys)):
        return reader.one(ticket, what, timeout, as_, copy)
    reader.sizes.learn_parts(ticket.partition, [sum(len(b) for b in d.parts) for d in parts])
    return reader.decoded(ticket.partition, parts, f"streams={n}")


def _unsplit(reader: Reader, e: ProtocolError) -> None:
    """Where ``e`` is a server refusing a ticket's ``part`` (one older than gets in
    parts), the client's gets travel as one stream from now on. Either way the get runs
    again as one stream, whose answer or complete error is the reference."""
    if "'part'" in str(e) and "unknown key" in str(e):
        reader.parts_known = False


def split_count(reader: Reader, ticket: GetTicket) -> int:
    """How many streams a get travels over (1: one stream), from the partition's last
    answer: at least ``reader.min_stream_bytes`` estimated per stream."""
    if reader.shm_dir is not None or crowded(reader) or not reader.parts_known:
        return 1
    keys = ticket.keys
    guess = (reader.sizes.per_row(ticket.partition) or 0.0) * len(keys)
    most = min(
        reader.get_streams, MAX_GET_PARTS, len(keys) // reader.sizes.together(ticket.partition)
    )
    return max(1, min(most, int(guess // reader.min_stream_bytes)))


def split(ticket: GetTicket, n: int) -> list[GetTicket]:
    """The tickets of a get split over ``n`` streams (stream i travels on the transport's
    connection i): each names every key and its part; the server cuts the rows into runs
    of about equal bytes where they stop sharing media, so a prompt group's image travels
    on one stream (:class:`flightq.server.assemble.PartCuts`)."""
    return [dataclasses.replace(ticket, part=i, parts=n) for i in range(n)]


def _answers(ticket: GetTicket, keys: Iterator[str]) -> bool:
    """Whether the parts' keys, in order, are the ticket's: the rows changed between two
    streams' cuts otherwise (a write-back between them), and the get runs as one."""
    return list(keys) == list(ticket.keys)


def get_to_device(
    reader: Reader,
    device: Any,
    ticket: GetTicket,
    what: str,
    timeout: float | None,
    *,
    copy: bool,
    sync: bool,
) -> Batch:
    """A get into CUDA tensors, split over parallel streams as :func:`read_keys` splits
    it; each stream is read on its own thread, then the parts are copied to the device
    together, in key order (:func:`flightq.cuda.decode_streams_to_device`). On an unknown
    key, a missing field, parts whose columns differ or a stream refused "server busy",
    the get runs again as one stream, whose answer or complete error is the reference."""
    rows, partition = len(ticket.keys), ticket.partition
    transport = reader.transport
    started = time.perf_counter()
    n = split_count(reader, ticket)
    got: list[pa.RecordBatch] = []
    if n >= 2:
        tickets = split(ticket, n)
        gots: list[list[pa.RecordBatch]] = [[] for _ in range(n)]
        stop = threading.Event()
        first: list[pa.Schema] = []
        lock = threading.Lock()

        def checked(i: int) -> Iterator[pa.RecordBatch]:
            # Stream i's record batches; Resplit where one's columns differ.
            chunks = transport.get(
                tickets[i], what, timeout=timeout, connection=i, got=gots[i], stop=stop
            )
            for rb in chunks:
                with lock:
                    if not first:
                        first.append(rb.schema)
                    same = rb.schema.equals(first[0], check_metadata=True)
                if not same:
                    raise Resplit
                yield rb

        try:
            # Each stream is copied to the device on its own thread, in parallel.
            out = decode_streams_to_device(
                [checked(i) for i in range(n)],
                device,
                reader.pinned,
                copy=copy,
                sync=sync,
                stop=stop,
            )
        except (NotFoundError, MissingFieldError, Resplit):
            pass
        except ProtocolError as e:
            _unsplit(reader, e)
        except ResourceExhaustedError as e:
            if not _crowded(reader, e):
                raise
        else:
            every = [b for g in gots for b in g]
            if _answers(ticket, (k for b in every for k in pylist(b.column(KEY)))):
                reader.sizes.learn(partition, rows, every)
                reader.sizes.learn_parts(partition, [sum(b.num_rows for b in g) for g in gots])
                return received_on_device(out, len(every), started)
    chunks = bounded(transport.get(ticket, what, timeout=timeout, got=got), rows, what)
    out = decode_to_device(chunks, device, reader.pinned, copy=copy, sync=sync)
    answers(ticket, out, what)
    reader.sizes.learn(partition, rows, got)
    return received_on_device(out, len(got), started)


def filled(
    batches: list[pa.RecordBatch], fills: list[Callable[[], None]] | None
) -> Iterator[pa.RecordBatch]:
    """The batches in order, each filled first; the next one fills while one is written.

    A batch is dropped from ``batches`` once handed out, so its buffers go as soon as the
    transport is done with them. The fills copy with the GIL released (numpy), as does
    the writer: on two cores, the copy for batch i+1 overlaps sending batch i.
    """
    if fills is None:
        yield from batches
        return
    if len(batches) == 1:
        fills.pop()()
        yield batches.pop()
        return
    with ThreadPoolExecutor(1, thread_name_prefix="flightq-fill") as pool:
        pending = pool.submit(fills[0])
        for i in range(len(batches)):
            pending.result()
            fills[i] = _done  # its closure holds the batch's buffer
            if i + 1 < len(batches):
                pending = pool.submit(fills[i + 1])
            b, batches[i] = batches[i], None  # let the transport free it once sent
            yield b


def _done() -> None:
    pass


def put_groups(
    batches: list[pa.RecordBatch], streams: int, min_bytes: int = MIN_STREAM_BYTES
) -> list[range]:
    """Consecutive ranges of ``batches`` for a put's parallel streams, about equal in
    bytes, each at least ``min_bytes``; one range for a small put."""
    if len(batches) < 2:
        return [range(len(batches))]
    sizes = [b.nbytes for b in batches]
    n = max(1, min(streams, len(batches), sum(sizes) // min_bytes))
    if n < 2:
        return [range(len(batches))]
    total, acc, cuts = sum(sizes), 0, [0]
    for i, size in enumerate(sizes):
        acc += size
        if len(cuts) < n and acc >= total * len(cuts) / n and i + 1 < len(batches):
            cuts.append(i + 1)
    cuts.append(len(batches))
    return [range(a, b) for a, b in itertools.pairwise(cuts) if b > a]
