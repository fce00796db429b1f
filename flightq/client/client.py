"""The client that generator, logprob and trainer processes embed.

:func:`connect` checks, before anything is written, that the server holds exactly the
schema versions this process was built for. Puts travel as one DoPut carrying data and
metadata (one round trip), reads as one DoGet, claims as one blocking DoGet: no polling.
No ``pyarrow.flight`` exception leaves this module: each becomes the flightq error it
stands for, with the server's message.

Examples
--------
>>> import flightq, numpy as np
>>> with flightq.Server() as srv, flightq.connect(srv.location, ["rollout_text@1"]) as c:
...     c.create_partition("rollouts", "rollout_text@1", tasks=["train"])
...     c.put("rollouts", ["g0_0"], {"input_ids": [np.arange(4)]})
...     c.claim("rollouts", "train", 1, as_="numpy")["input_ids"][0].tolist()
1
[0, 1, 2, 3]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from ..batch import Batch, PartDecoder, Received, join
from ..chunks import encode_chunks, split_batch
from ..cuda import PinnedPool, decode_to_device, resolve_device, stage
from ..errors import (
    FlightqError,
    ProtocolError,
    SchemaMismatchError,
    UnknownSchemaError,
)
from ..memory import keep_freed_memory as _keep_freed_memory
from ..protocol import from_flight_error, pack, unpack
from ..registry import SchemaRegistry
from ..schema import Schema
from ..sink import DeferredFills, Sink
from .streams import (
    DEFAULT_STREAMS,
    distinct_nbytes,
    filled,
    get_to_device,
    put_groups,
    put_parts,
    read_keys,
)

__all__ = ["Client", "connect", "DEFAULT_TIMEOUT", "SHM_MIN_BYTES"]

#: Seconds a call may take unless told otherwise.
DEFAULT_TIMEOUT = 60.0
#: With shm, transfers of fewer bytes take the socket (``Client.shm_min_bytes``).
SHM_MIN_BYTES = 2**20
#: Payload bytes per record batch sent by a put.
DEFAULT_MAX_BATCH_BYTES = 16 * 2**20


def _resolve(schemas: Iterable[str | Schema], registry: SchemaRegistry | None) -> list[Schema]:
    out: list[Schema] = []
    reg = registry
    for s in schemas:
        if isinstance(s, Schema):
            out.append(s)
            continue
        if reg is None:
            reg = SchemaRegistry.default()
        out.append(reg.get(s))
    return out


def connect(
    location: str,
    schemas: Iterable[str | Schema] = (),
    *,
    registry: SchemaRegistry | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    shm: bool | str = False,
    get_streams: int | None = None,
    put_streams: int | None = None,
    keep_freed_memory: bool = True,
    **flight_kwargs: Any,
) -> Client:
    """Connect to a server and check the schema versions this process was built for.

    Parameters
    ----------
    location:
        ``grpc://host:port``.
    schemas:
        Schemas this process reads or writes: ``"name@V"`` (resolved in ``registry``, or the
        shipped registry) or :class:`Schema` objects.
    registry:
        Where names are resolved.
    timeout:
        Default seconds for every call.
    max_batch_bytes:
        Payload bytes per record batch a put sends.
    shm:
        Same host only (a loopback location): move the bytes of puts, gets and claims
        through shared memory in this directory (True: ``/dev/shm``) instead of the
        socket; same API, same validation (:mod:`flightq.shm`). Transfers of less than
        ``Client.shm_min_bytes`` (1 MiB) still take the socket, where a segment's
        bookkeeping would cost more than the copy it saves.
    get_streams:
        Most parallel DoGet streams (each on its own connection) for one large get;
        default 4. 1 keeps every get on one stream.
    put_streams:
        Most parallel DoPut streams for one large put (at least 16 MiB each), stored
        together or not at all (:mod:`flightq.server.staging`); default 4. 1 keeps every put on
        one stream.
    keep_freed_memory:
        Tune this process's malloc to keep freed memory for the next step
        (:func:`flightq.keep_freed_memory`): received rows and put buffers then land in
        pages the process already has instead of fresh ones that fault in one by one.
        The setting is process-wide and stays once any client made it; the process keeps
        its high-water mark of memory (per malloc arena: see that function). False leaves
        malloc as it is; ``shm=True`` clients, whose payloads are mapped, do not touch it.
    **flight_kwargs:
        ``token="..."`` for a server that requires a bearer token; ``tls_root_certs``
        (PEM bytes) for a ``grpc+tls://`` server; anything else ``FlightClient`` takes.

    Returns
    -------
    Client

    Raises
    ------
    SchemaMismatchError
        If the server's version of a schema differs: the message lists each differing
        field with the expected and the actual declaration.
    UnknownSchemaError
        If the server does not know a schema.
    UnavailableError, FlightqTimeoutError
        If the server cannot be reached within ``timeout``.
    UnauthenticatedError
        If the server requires a token and none, or a wrong one, was given.
    ProtocolError
        With ``shm``: the location is not loopback, the server has shared memory
        disabled, or it does not see this process's shared-memory directory.
    """
    client = Client(
        location,
        timeout=timeout,
        max_batch_bytes=max_batch_bytes,
        shm=shm,
        get_streams=get_streams,
        put_streams=put_streams,
        keep_freed_memory=keep_freed_memory,
        **flight_kwargs,
    )
    try:
        client.health()
        if client.shm_dir is not None:
            from ..shm import handshake

            handshake(client)
        wanted = _resolve(schemas, registry)
        if wanted:
            client.check_schemas(wanted)
    except BaseException:
        client.close()
        raise
    return client


class Client:
    """A connection to one flightq server. Thread-safe; use one per process.

    Prefer :func:`connect`, which also checks schemas.
    """

    def __init__(
        self,
        location: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        token: str | None = None,
        shm: bool | str = False,
        get_streams: int | None = None,
        put_streams: int | None = None,
        keep_freed_memory: bool = True,
        **flight_kwargs: Any,
    ) -> None:
        self.get_streams = DEFAULT_STREAMS if get_streams is None else get_streams
        self.put_streams = DEFAULT_STREAMS if put_streams is None else put_streams
        if self.get_streams < 1 or self.put_streams < 1:
            raise ValueError(
                f"get_streams and put_streams must be at least 1, got {get_streams}, {put_streams}"
            )
        self.shm_dir: str | None = None
        self._shm_pool: Any = None
        #: With shm: puts (and reads, estimated from the partition's last answer) of fewer
        #: bytes travel over the socket.
        self.shm_min_bytes = SHM_MIN_BYTES
        if shm:
            from ..shm import directory, is_local

            if not is_local(location):
                raise ProtocolError(
                    f"shared memory needs a server on this host; {location} is not loopback "
                    "(127.0.0.0/8, ::1, localhost) or unix: connect without shm"
                )
            self.shm_dir = directory(shm)
        if token is not None:
            from ..auth import BearerTokenClientMiddlewareFactory

            flight_kwargs["middleware"] = [
                *(flight_kwargs.get("middleware") or []),
                BearerTokenClientMiddlewareFactory(token),
            ]
        self.location = location
        self.timeout = timeout
        self.max_batch_bytes = max_batch_bytes
        self._schemas: dict[str, Schema] = {}
        self._lock = threading.Lock()
        #: Pinned host buffers and copy streams for CUDA tensors (empty until first used).
        self._pinned = PinnedPool()
        self._flight_kwargs = flight_kwargs
        #: More connections to the server, opened on the first get split over streams.
        self._streams: list[fl.FlightClient] = []
        #: Per partition, payload bytes per row of the last get answer.
        self._row_bytes: dict[str, float] = {}
        try:
            self._flight = fl.FlightClient(location, **flight_kwargs)
        except (pa.ArrowException, fl.FlightError) as e:
            raise from_flight_error(e, f"connect to {location}") from e
        if keep_freed_memory and self.shm_dir is None:
            _keep_freed_memory()

    # ------------------------------------------------------------------ plumbing

    def _options(self, timeout: float | None) -> fl.FlightCallOptions:
        return fl.FlightCallOptions(timeout=self.timeout if timeout is None else timeout)

    def _action(self, kind: str, body: Mapping[str, Any], timeout: float | None = None) -> Any:
        try:
            results = list(
                self._flight.do_action(fl.Action(kind, pack(body)), options=self._options(timeout))
            )
        except (pa.ArrowException, fl.FlightError) as e:
            raise from_flight_error(e, f"{kind} on {self.location}") from e
        return unpack(results[0].body, f"{kind} result") if results else {}

    def _partition_schema(self, partition: str) -> Schema:
        with self._lock:
            s = self._schemas.get(partition)
        if s is None:
            d = self._action("describe", {"partition": partition})
            s = Schema.from_json(d["schema"])
            with self._lock:
                self._schemas[partition] = s
        return s

    # ------------------------------------------------------------------ control

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """Liveness: ``{"ok": True, "protocol": N, "partitions": N}``."""
        return self._action("health", {}, timeout)

    def check_schemas(self, schemas: Iterable[Schema]) -> None:
        """Check that the server holds these exact schema versions.

        Raises
        ------
        SchemaMismatchError, UnknownSchemaError
            With a readable diff (field, expected, actual).
        """
        schemas = list(schemas)
        try:
            self._action("check_schemas", {"schemas": [s.canonical_json for s in schemas]})
        except (SchemaMismatchError, UnknownSchemaError) as e:
            raise type(e)(f"startup schema check against {self.location} failed: {e}") from None

    def register_schema(self, schema: Schema) -> None:
        """Add a schema to the server's registry (evolution rules apply there too)."""
        self._action("register_schema", {"schema": schema.canonical_json})

    def create_partition(
        self,
        name: str,
        schema: str | Schema,
        tasks: Sequence[str] = (),
        group_size: int | None = None,
        *,
        max_rows: int | None = None,
        registry: SchemaRegistry | None = None,
    ) -> bool:
        """Declare a partition before any producer writes; idempotent for the same arguments.

        ``max_rows`` caps the rows it holds at once: a put that would create more waits up
        to its timeout for clears, then fails with ResourceExhaustedError.

        Returns whether it was created by this call.

        Raises
        ------
        ConflictError
            If it exists with another schema, tasks, group size or row limit.
        """
        s = _resolve([schema], registry)[0]
        d = self._action(
            "declare",
            {
                "partition": name,
                "schema": s.canonical_json,
                "tasks": list(tasks),
                "group_size": group_size,
                "max_rows": max_rows,
            },
        )
        with self._lock:
            self._schemas[name] = s
        return bool(d["created"])

    def describe(self, partition: str) -> dict[str, Any]:
        """A partition's declaration (schema JSON, fingerprint, tasks, group size)."""
        return self._action("describe", {"partition": partition})

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        """Remove rows (all when ``keys`` is None); returns how many."""
        d = self._action(
            "clear", {"partition": partition, "keys": None if keys is None else list(keys)}
        )
        return int(d["cleared"])

    def reset(self, partition: str, task: str, keys: Sequence[str] | None = None) -> int:
        """Make rows claimable again for ``task`` (all when ``keys`` is None)."""
        d = self._action(
            "reset",
            {"partition": partition, "task": task, "keys": None if keys is None else list(keys)},
        )
        return int(d["reset"])

    def drop(self, partition: str) -> None:
        """Remove a partition and its rows."""
        self._action("drop", {"partition": partition})
        with self._lock:
            self._schemas.pop(partition, None)

    def stats(self) -> dict[str, Any]:
        """Rows, bytes and per-task progress of every partition."""
        return self._action("stats", {})

    def inspect(self, partition: str) -> dict[str, Any]:
        """One partition: fields present, delivered and ready rows per task."""
        return self._action("inspect", {"partition": partition})

    # ------------------------------------------------------------------ data

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> int:
        """Write rows, all or nothing, in one DoPut. Returns the rows written.

        New rows must carry every required field; onto existing rows any subset of fields
        may be written. Writing a column a row already has needs ``overwrite=True``.
        Tags are merged into the rows' tags. Retrying a put after a timeout is safe: a
        put whose cells all equal what the rows hold already, or that repeats a recent
        ``put_id`` (any unique string), is acknowledged again without storing anything.

        Raises
        ------
        UndeclaredFieldError, DTypeError, ShapeError, MissingFieldError, ConflictError
            From the local encode or from the server; nothing is stored.

        Tensors may be on a CUDA device: they are copied into pinned host memory on a side
        stream, each record batch encoded as soon as its rows have arrived (see
        :mod:`flightq.cuda`); the bytes sent are the same as for CPU tensors.
        """
        schema = self._partition_schema(partition)
        # Through shared memory, payloads are copied once: from the tensors into the segment.
        # Over the socket, every check runs before anything is sent; then each batch's copy
        # is made while the previous batch is on the wire, and a payload alone in its column
        # (or already end to end with its neighbours) is sent from the tensor's memory.
        with stage(columns, self._pinned) as staged, _put_sink(self.shm_dir) as sink:
            batches = encode_chunks(
                schema,
                staged.columns,
                keys,
                tags,
                max_bytes=self._put_batch_bytes(),
                on_range=staged.on_range,
                sink=sink,
            )
            return self._put(partition, batches, sink, overwrite, timeout, put_id)

    def _put_batch_bytes(self) -> int:
        """Record-batch size of a put: bounded for the socket, large through a segment."""
        if self.shm_dir is None:
            return self.max_batch_bytes
        from ..shm import BATCH_BYTES

        return max(self.max_batch_bytes, BATCH_BYTES)

    def put_batch(
        self,
        partition: str,
        batch: pa.RecordBatch | Sequence[pa.RecordBatch],
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> int:
        """Write already encoded record batches (see :func:`flightq.encode`) as one put.

        Several batches (one schema) travel in one DoPut and are stored all or nothing.
        """
        batches = [batch] if isinstance(batch, pa.RecordBatch) else list(batch)
        return self._put(partition, batches, None, overwrite, timeout, put_id)

    def _put(
        self,
        partition: str,
        batches: list[pa.RecordBatch],
        sink: Sink | None,
        overwrite: bool,
        timeout: float | None,
        put_id: str | None,
    ) -> int:
        """One DoPut of ``batches``, encoded into ``sink`` (encode_chunks): deferred fills
        (``fills[i]()`` completes batch i) or a gather into a segment."""
        fills = sink.fills if isinstance(sink, DeferredFills) else None
        if not batches:
            raise ValueError(f"put to {partition!r}: no record batches")
        wait = self.timeout if timeout is None else timeout
        # The server may wait for space (memory budget) for most of the call's timeout.
        cmd = {"op": "put", "partition": partition, "overwrite": overwrite, "timeout": 0.8 * wait}
        # The row count lets the server refuse a stream cut short; the id makes retries safe.
        cmd["rows"] = sum(b.num_rows for b in batches)
        if put_id is not None:
            cmd["put_id"] = put_id
        if self.shm_dir is not None and not self._small_put(batches, sink):
            from ..shm import put_via_shm

            return put_via_shm(self, cmd, batches, timeout, sink)
        groups = put_groups(batches, self.put_streams)
        if len(groups) > 1:
            return put_parts(self, cmd, batches, fills, groups, timeout)
        return self._do_put(cmd, batches[0].schema, filled(batches, fills), timeout)

    def _do_put(
        self,
        cmd: Mapping[str, Any],
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        timeout: float | None,
        flight: fl.FlightClient | None = None,
    ) -> int:
        """One DoPut exchange: the command, ``batches`` cut at ``max_batch_bytes``, then the
        server's acknowledgement; returns the rows it acknowledged."""
        what = f"put to {cmd['partition']!r}"
        flight = self._flight if flight is None else flight
        desc = fl.FlightDescriptor.for_command(pack(cmd))
        try:
            writer, reader = flight.do_put(desc, schema, options=self._options(timeout))
            with writer:
                for b in batches:
                    for chunk in split_batch(b, self.max_batch_bytes):
                        writer.write_batch(chunk)
                writer.done_writing()
                ack = reader.read()
        except (pa.ArrowException, fl.FlightError) as e:
            raise from_flight_error(e, what) from e
        if ack is None:
            raise FlightqError(f"{what}: the server sent no acknowledgement")
        return int(unpack(ack, "put acknowledgement")["rows"])

    def _read(
        self,
        ticket: Mapping[str, Any],
        what: str,
        timeout: float | None,
        flight: fl.FlightClient | None = None,
        decoder: PartDecoder | None = None,
    ) -> list[pa.RecordBatch]:
        """One DoGet's record batches; given a ``decoder``, each is decoded as it arrives
        (while gRPC receives the next one)."""
        via_shm = self._shm_read(ticket)
        if via_shm:
            ticket = {**ticket, "shm": True}
        batches: list[pa.RecordBatch] = []
        for rb in self._chunks(ticket, what, timeout, flight):
            batches.append(rb)
            if decoder is not None and not via_shm:
                decoder.add(rb)
        if via_shm:
            assert self.shm_dir is not None
            from ..shm.table import take

            batches = take(batches, self.shm_dir, what)
            if decoder is not None:
                for b in batches:
                    decoder.add(b)
        return batches

    def _small_put(self, batches: list[pa.RecordBatch], sink: Sink | None) -> bool:
        """Whether a put encoded for shm is better sent over the socket: it is small, and no
        payload waits to be copied into a segment (:func:`flightq.shm.gathering`)."""
        from ..shm import gathered

        if gathered(sink):
            return False
        return sum(b.get_total_buffer_size() for b in batches) < self.shm_min_bytes

    def _shm_read(self, ticket: Mapping[str, Any]) -> bool:
        """Whether a read travels through shared memory: with shm, unless the partition's
        last answer says it is small (its rows times their bytes)."""
        if self.shm_dir is None:
            return False
        rows = ticket.get("keys") if ticket.get("op") == "get" else ticket.get("batch_size")
        per_row = self._row_bytes.get(ticket.get("partition", ""))
        if per_row is None or rows is None:
            return True  # nothing known yet: a first read, or a scan
        n = len(rows) if isinstance(rows, list) else int(rows)
        return n * per_row >= self.shm_min_bytes

    def _learn(self, partition: str, rows: int, batches: list[pa.RecordBatch]) -> None:
        """Remember the bytes per row a partition's answer carried (to split later gets)."""
        if rows:
            self._row_bytes[partition] = distinct_nbytes(batches) / rows

    def _learned(self, partition: str, decoders: list[PartDecoder]) -> Batch:
        """The decoded answer of a read: remembers its size for the partition's next read
        and says how it arrived (``batch.received``)."""
        parts = [p for d in decoders for p in d.parts]
        self._learn(partition, sum(len(p) for p in parts), [p.record_batch for p in parts])
        batch = join(parts)
        batch.received = Received.of(decoders)
        return batch

    def _stream_clients(self, n: int) -> list[fl.FlightClient]:
        with self._lock:
            try:
                while len(self._streams) < n:
                    self._streams.append(fl.FlightClient(self.location, **self._flight_kwargs))
            except (pa.ArrowException, fl.FlightError) as e:
                raise from_flight_error(e, f"connect to {self.location}") from e
            return self._streams[:n]

    def _read_to_device(
        self,
        device: Any,
        ticket: Mapping[str, Any],
        what: str,
        timeout: float | None,
        *,
        copy: bool,
        sync: bool,
    ) -> Batch:
        """A DoGet stream decoded into CUDA tensors as its record batches arrive."""
        chunks = self._chunks(ticket, what, timeout)
        return decode_to_device(chunks, device, self._pinned, copy=copy, sync=sync)

    def _chunks(
        self,
        ticket: Mapping[str, Any],
        what: str,
        timeout: float | None,
        flight: fl.FlightClient | None = None,
        got: list[pa.RecordBatch] | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """One DoGet stream's record batches as they arrive (also appended to ``got``);
        ends early once ``stop`` is set."""
        flight = self._flight if flight is None else flight
        try:
            reader = flight.do_get(fl.Ticket(pack(ticket)), options=self._options(timeout))
            for chunk in reader:
                if got is not None:
                    got.append(chunk.data)
                yield chunk.data
                if stop is not None and stop.is_set():
                    reader.cancel()
                    return
        except (pa.ArrowException, fl.FlightError) as e:
            raise from_flight_error(e, what) from e

    def get(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        as_: str = "torch",
        copy: bool = False,
        timeout: float | None = None,
        device: Any = None,
        sync: bool = True,
    ) -> Batch:
        """Rows by key, in the order asked, with any subset of fields.

        ``fields=None`` returns every column the rows have (``None`` where a row lacks one).
        ``device="cuda:N"`` returns a :class:`flightq.cuda.DeviceBatch` of CUDA tensors,
        copied from pinned buffers while later record batches arrive; ``sync=False``
        returns once the copies are queued (the device's current stream waits for them;
        other streams wait on ``batch.event``). ``None`` or ``"cpu"``: CPU tensors.

        Raises
        ------
        NotFoundError
            Naming unknown keys.
        MissingFieldError
            Naming a requested field and the rows that lack it.
        DeviceError
            If ``device`` cannot be used here (no CUDA, no such device, ``as_='numpy'``).
        """
        t: dict[str, Any] = {"op": "get", "partition": partition, "keys": list(keys)}
        t["fields"] = None if fields is None else list(fields)
        dev = resolve_device(device, as_)
        if dev is not None:
            what = f"get from {partition!r}"
            return get_to_device(self, dev, t, what, timeout, copy=copy, sync=sync)
        return read_keys(self, t, f"get from {partition!r}", timeout, as_, copy)

    def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        *,
        wait_for: Sequence[str] = (),
        timeout: float | None = None,
        as_: str = "torch",
        copy: bool = False,
        device: Any = None,
        sync: bool = True,
    ) -> Batch:
        """Block until ``batch_size`` rows are ready for ``task``, take them, return them.

        A row is ready when not yet delivered to the task and it has every field in
        ``fields`` (the schema's required ones when ``fields`` is None) and in
        ``wait_for``; whole groups when the partition has a group size. The rows come back
        with ``fields``, or with every column they have when ``fields`` is None: a trainer
        calls ``claim(p, "train", n, wait_for=["prev_logprobs"])``. Rows count as
        delivered once claimed; :meth:`reset` releases them. ``device`` and ``sync`` as
        for :meth:`get` (a bad device is refused before anything is claimed).

        Raises
        ------
        ClaimTimeoutError
            (also a ``TimeoutError``) if not enough rows are ready within ``timeout``.
        DeviceError
            If ``device`` cannot be used here; nothing is claimed.
        """
        dev = resolve_device(device, as_)
        wait = self.timeout if timeout is None else timeout
        t = {
            "op": "claim",
            "partition": partition,
            "task": task,
            "batch_size": batch_size,
            "fields": None if fields is None else list(fields),
            "wait_for": list(wait_for),
            "timeout": wait,
        }
        # The server answers within `wait`; the transport gets a margin on top.
        if dev is not None:
            what, limit = f"claim from {partition!r}", wait + max(5.0, 0.1 * wait)
            return self._read_to_device(dev, t, what, limit, copy=copy, sync=sync)
        d = PartDecoder(as_, copy)
        self._read(t, f"claim from {partition!r}", wait + max(5.0, 0.1 * wait), None, d)
        return self._learned(partition, [d])

    def snapshot(
        self, name: str, partition: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Make the server write a snapshot of one partition (all when None) to disk.

        The snapshot lands atomically in the server's snapshot directory under ``name``
        (a plain name, no path); ``flightq serve --restore DIR/NAME`` loads it.
        Returns ``{"path": where on the server, "partitions": {name: rows}}``.

        Raises
        ------
        ProtocolError
            If the server has no snapshot directory or ``name`` is not a plain name.
        ConflictError
            If a snapshot of that name exists.
        """
        return self._action("snapshot", {"name": name, "partition": partition}, timeout)

    def partitions(self) -> list[str]:
        """Names of the partitions the server holds (ListFlights)."""
        try:
            return [
                info.descriptor.path[0].decode()
                for info in self._flight.list_flights(options=self._options(None))
            ]
        except (pa.ArrowException, fl.FlightError) as e:
            raise from_flight_error(e, "list partitions") from e

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the connection."""
        if self._shm_pool is not None:
            self._shm_pool.close()
        for flight in [self._flight, *self._streams]:
            with contextlib.suppress(pa.ArrowException, fl.FlightError):
                flight.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _put_sink(shm_dir: str | None) -> contextlib.AbstractContextManager[Sink]:
    """Where a put's payloads go: gathered into a segment through shared memory; over the
    socket, each batch's copy left to be made while the previous batch is on the wire."""
    if shm_dir is None:
        return contextlib.nullcontext(DeferredFills())
    from ..shm import gathering

    return gathering()
