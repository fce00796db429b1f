"""Parallel streams: a large get or put over several connections at once.

A get of many rows is split by key into up to ``get_streams`` DoGet streams, a large put
into up to ``put_streams`` DoPut streams (consecutive ranges of its record batches), each on
its own connection: receiving, reassembling and checking the messages then run on several
cores. Parts of a get come back in key order; parts of a put are stored together or not at
all (:mod:`flightq.server.staging`). Streams are sized by the bytes that travel (a prompt group's
shared image counts once), never below :data:`MIN_STREAM_BYTES` each.

These functions are the :class:`flightq.client.client.Client`'s own machinery; they use its
connections and options.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as fl

from ..batch import Batch, PartDecoder
from ..cuda import decode_streams_to_device, decode_to_device
from ..errors import FlightqError, MissingFieldError, NotFoundError

if TYPE_CHECKING:
    from .client import Client

__all__ = [
    "DEFAULT_STREAMS",
    "MIN_STREAM_BYTES",
    "distinct_nbytes",
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


def distinct_nbytes(batches: list[pa.RecordBatch]) -> int:
    """Bytes the batches hold, each buffer once: slices of one stored batch share a media
    dictionary, which ``RecordBatch.nbytes`` would count in every slice."""
    seen: set[tuple[int, int]] = set()
    for b in batches:
        for col in b.columns:
            bufs = col.buffers()
            if pa.types.is_large_list(col.type) and pa.types.is_dictionary(col.type.value_type):
                bufs += col.values.dictionary.buffers()
            seen.update((x.address, x.size) for x in bufs if x is not None)
    return sum(size for _, size in seen)


class Resplit(Exception):
    """The parts of a split get differ in their columns: read it again as one stream."""


def put_parts(
    client: Client,
    cmd: dict[str, Any],
    batches: list[pa.RecordBatch],
    fills: list[Callable[[], None]] | None,
    groups: list[range],
    timeout: float | None,
) -> int:
    """One put over parallel DoPut streams, one range of batches each, on their own
    connections; the server stores the parts together or not at all
    (:mod:`flightq.server.staging`). Each stream fills its batches just before sending them."""
    stage = secrets.token_hex(8)
    flights = [client._flight, *client._stream_clients(len(groups) - 1)]

    def send(i: int) -> int:
        part = groups[i]
        mine = {
            **cmd,
            "rows": sum(batches[j].num_rows for j in part),
            "stage": stage,
            "part": i,
            "parts": len(groups),
        }
        schema = batches[part[0]].schema
        return client._do_put(mine, schema, sent(part), timeout, flights[i])

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
                client._action(
                    "abort_put",
                    {"partition": cmd["partition"], "stage": stage, "parts": len(groups)},
                )
            wait(futures)
            raise first
    return int(futures[0].result())


def read_keys(
    client: Client, ticket: dict[str, Any], what: str, timeout: float | None, as_: str, copy: bool
) -> Batch:
    """A get's rows, over parallel streams when it asks for many rows.

    Each stream has its own connection, so receiving and reassembling the messages
    (the receiver's copies) runs on several cores, and each stream's record batches
    are decoded on its thread as they arrive, while gRPC receives the next ones: little
    is left to do once the last one is in. The parts come back in key order. If a part
    finds a key or field missing, or the parts' columns differ (``fields`` None over
    rows holding different fields), the get runs again as one stream, whose answer or
    complete error is the reference.
    """
    partition = ticket["partition"]

    def one(t: dict[str, Any], flight: fl.FlightClient | None = None) -> PartDecoder:
        d = PartDecoder(as_, copy)
        client._read(t, what, timeout, flight, d)
        return d

    n = split_count(client, ticket)
    if n < 2:
        return client._learned(partition, [one(ticket)])
    flights, tickets = split(client, ticket, n)
    try:
        with ThreadPoolExecutor(n - 1, thread_name_prefix="flightq-get") as pool:
            rest = [pool.submit(one, tickets[i], flights[i]) for i in range(1, n)]
            parts = [one(tickets[0]), *(f.result() for f in rest)]
    except (NotFoundError, MissingFieldError):
        return client._learned(partition, [one(ticket)])
    schema = parts[0].parts[0].record_batch.schema
    if any(
        not b.record_batch.schema.equals(schema, check_metadata=True)
        for d in parts
        for b in d.parts
    ):
        return client._learned(partition, [one(ticket)])
    return client._learned(partition, parts)


def split_count(client: Client, ticket: Mapping[str, Any]) -> int:
    """How many streams a get travels over (1: one stream), from the partition's last
    answer: at least ``MIN_STREAM_BYTES`` estimated per stream."""
    if client.shm_dir is not None:
        return 1
    keys = ticket["keys"]
    guess = client._row_bytes.get(ticket["partition"], 0.0) * len(keys)
    return max(1, min(client.get_streams, len(keys), int(guess // MIN_STREAM_BYTES)))


def split(
    client: Client, ticket: Mapping[str, Any], n: int
) -> tuple[list[fl.FlightClient], list[dict[str, Any]]]:
    """The connections and tickets of a get split over ``n`` streams, keys in order."""
    keys = ticket["keys"]
    flights = [client._flight, *client._stream_clients(n - 1)]
    cuts = [len(keys) * i // n for i in range(n + 1)]
    tickets = [{**ticket, "keys": keys[a:b]} for a, b in itertools.pairwise(cuts)]
    return flights, tickets


def get_to_device(
    client: Client,
    device: Any,
    ticket: Mapping[str, Any],
    what: str,
    timeout: float | None,
    *,
    copy: bool,
    sync: bool,
) -> Batch:
    """A get into CUDA tensors, split over parallel streams as :func:`read_keys` splits
    it; each stream is read on its own thread, then the parts are copied to the device
    together, in key order (:func:`flightq.cuda.decode_streams_to_device`). On an unknown
    key, a missing field or parts whose columns differ, the get runs again as one stream,
    whose answer or complete error is the reference."""
    rows, partition = len(ticket["keys"]), ticket["partition"]
    n = split_count(client, ticket)
    got: list[pa.RecordBatch] = []
    if n >= 2:
        flights, tickets = split(client, ticket, n)
        gots: list[list[pa.RecordBatch]] = [[] for _ in range(n)]
        stop = threading.Event()
        first: list[pa.Schema] = []
        lock = threading.Lock()

        def checked(i: int) -> Iterator[pa.RecordBatch]:
            # Stream i's record batches; Resplit where one's columns differ.
            for rb in client._chunks(tickets[i], what, timeout, flights[i], gots[i], stop):
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
                client._pinned,
                copy=copy,
                sync=sync,
                stop=stop,
            )
        except (NotFoundError, MissingFieldError, Resplit):
            pass
        else:
            client._learn(partition, rows, [b for g in gots for b in g])
            return out
    chunks = client._chunks(ticket, what, timeout, got=got)
    out = decode_to_device(chunks, device, client._pinned, copy=copy, sync=sync)
    client._learn(partition, rows, got)
    return out


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


def put_groups(batches: list[pa.RecordBatch], streams: int) -> list[range]:
    """Consecutive ranges of ``batches`` for a put's parallel streams, about equal in
    bytes, each at least ``MIN_STREAM_BYTES``; one range for a small put."""
    if len(batches) < 2:
        return [range(len(batches))]
    sizes = [b.nbytes for b in batches]
    n = max(1, min(streams, len(batches), sum(sizes) // MIN_STREAM_BYTES))
    if n < 2:
        return [range(len(batches))]
    total, acc, cuts = sum(sizes), 0, [0]
    for i, size in enumerate(sizes):
        acc += size
        if len(cuts) < n and acc >= total * len(cuts) / n and i + 1 < len(batches):
            cuts.append(i + 1)
    cuts.append(len(batches))
    return [range(a, b) for a, b in itertools.pairwise(cuts) if b > a]
