"""The client that generator, logprob and trainer processes embed.

:func:`connect` checks, before anything is written, that the server holds exactly the
schema versions this process was built for. Puts travel as one DoPut carrying data and
metadata (one round trip), reads as one DoGet, claims as one blocking DoGet: no polling.
Small ones (under ``Client.stream_max_bytes``) travel instead as messages on the client's
request stream, one DoExchange held open (:mod:`flightq.client.requests`), which saves
each a call's setup. No ``pyarrow.flight`` exception leaves this module: each becomes the
flightq error it stands for, with the server's message.

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
import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from .. import forks
from ..batch import Batch, Claim, check_as
from ..chunks import encode_chunks
from ..cuda import PinnedPool, resolve_device, stage
from ..digest import DigestCache, KnownMedia, MediaRefs
from ..errors import (
    ClaimCancelledError,
    DTypeError,
    FlightqError,
    LeaseExpiredError,
    MediaUnknownError,
    MissingFieldError,
    NotFoundError,
    ProtocolError,
    ResourceExhaustedError,
    SchemaMismatchError,
    ShapeError,
    UndeclaredFieldError,
    UnknownSchemaError,
)
from ..frames import STREAM_ACK_ROWS
from ..layout import DEFAULT_BATCH_BYTES
from ..memory import keep_freed_memory as _keep_freed_memory
from ..msgcheck import key_chunks
from ..protocol import (
    MAX_SECONDS,
    MIN_SILENCE,
    PROTOCOL_VERSION,
    Ack,
    CancelClaim,
    CheckSchemas,
    ClaimGrant,
    ClaimTicket,
    Clear,
    DeadLetters,
    Declare,
    Describe,
    Drop,
    GetTicket,
    Health,
    Inspect,
    ListKeys,
    Message,
    Nack,
    PutCommand,
    RegisterSchema,
    Reset,
    Snapshot,
    Stats,
)
from ..registry import SchemaRegistry
from ..rows import columns_of
from ..schema import Schema
from ..sink import DeferredFills, Sink
from ..tensordicts import tensordict_reads
from .interface import PutReceipt
from .reads import Reader, claimed
from .recent import Recent
from .requests import Requests
from .session import DEFAULT_SESSION_TIMEOUT, Session
from .streams import (
    DEFAULT_STREAMS,
    MIN_STREAM_BYTES,
    Crowded,
    crowded,
    filled,
    get_to_device,
    put_groups,
    put_parts,
    read_keys,
)
from .transport import Transport, with_scheme

if TYPE_CHECKING:
    from ..shm import SegmentPool

__all__ = [
    "Client",
    "connect",
    "resolve_schemas",
    "DEFAULT_TIMEOUT",
    "SHM_MIN_BYTES",
]

#: Seconds a call may take unless told otherwise.
DEFAULT_TIMEOUT = 60.0
#: With shm, transfers of fewer bytes take the socket (``Client.shm_min_bytes``).
SHM_MIN_BYTES = 2**20
#: Payload bytes per record batch sent by a put.
DEFAULT_MAX_BATCH_BYTES = DEFAULT_BATCH_BYTES


def resolve_schemas(
    schemas: Iterable[str | Schema], registry: SchemaRegistry | None = None
) -> list[Schema]:
    """Schemas by ``"name@V"`` (in ``registry``, or the shipped one) or as given."""
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


def _session_silence(seconds: Any) -> float | None:
    """``session_timeout`` checked: seconds in [MIN_SILENCE, MAX_SECONDS], or None (0: None)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"session_timeout must be seconds or None, got {seconds!r}")
    if seconds == 0:
        return None
    if not MIN_SILENCE <= seconds <= MAX_SECONDS:
        raise ValueError(
            f"session_timeout must be {MIN_SILENCE:g} to {MAX_SECONDS:g} seconds "
            f"(0 or None: off), got {seconds!r}"
        )
    return float(seconds)


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
    min_stream_bytes: int = MIN_STREAM_BYTES,
    keep_freed_memory: bool = False,
    session_timeout: float | None = DEFAULT_SESSION_TIMEOUT,
    **flight_kwargs: Any,
) -> Client:
    """Connect to a server and check the schema versions this process was built for.

    Parameters
    ----------
    location:
        ``grpc://host:port`` (a bare ``host:port`` means that), ``grpc+tls://``, ``grpc+unix://``.
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
    min_stream_bytes:
        Fewest bytes each parallel stream of a get or put carries (16 MiB); a get's bytes
        are estimated from the partition's last answer, so a partition's first get takes
        one stream.
    keep_freed_memory:
        Opt in to tuning this process's malloc to keep freed memory for the next step
        (:func:`flightq.keep_freed_memory`, which a process may also call itself):
        received rows and put buffers then land in pages the process already has instead
        of fresh ones that fault in one by one. Off by default: the setting is
        process-wide, stays, and makes the process keep its high-water mark of memory
        (per malloc arena: see that function). ``shm=True`` clients, whose payloads are
        mapped, never touch it. Worth it for a process that moves steps again and again:
        a W1 get (8.3 MB) took 1.15x less time with it (median of 10 fresh processes
        each), a full-size W2 get 1.2-1.5x (figures: :func:`flightq.keep_freed_memory`).
    session_timeout:
        Seconds after which the server ends this client's consumer session when it hears
        nothing from it (15 s), giving back the rows its claims hold: what brings rows
        back from a consumer whose host died or whose link was cut, which the server
        cannot see close. A daemon thread beats 10 times per timeout (at most every
        second; a few bytes each) while a session is open. At least 0.5 s: a process
        stopped (``SIGSTOP``) or frozen for longer loses its claims as a dead one would.
        None or 0: no beats, and such rows come back after their lease. A server whose
        idle watch is off (``idle_timeout=0``) asks for no beats.
    **flight_kwargs:
        ``token="..."`` for a server that requires a bearer token; ``tls_root_certs``
        (PEM bytes) for a ``grpc+tls://`` server; anything else ``FlightClient`` takes.
        Connections get gRPC keepalive scaled to ``timeout``, so that a put blocked on
        a dead link fails (:func:`flightq.client.transport.keepalive_options`); a key of
        your own ``generic_options`` wins over its default.

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
        If the server speaks another protocol version (its health says which). With
        ``shm``: the location is not loopback, the server has shared memory disabled, or
        it does not see this process's shared-memory directory.
    """
    client = Client(
        location,
        timeout=timeout,
        max_batch_bytes=max_batch_bytes,
        shm=shm,
        get_streams=get_streams,
        put_streams=put_streams,
        min_stream_bytes=min_stream_bytes,
        keep_freed_memory=keep_freed_memory,
        session_timeout=session_timeout,
        **flight_kwargs,
    )
    try:
        same_protocol(client.health(), location)
        if client.shm_dir is not None:
            from ..shm.client import handshake

            client._segments.learn(handshake(client.transport, client.shm_dir))
        wanted = resolve_schemas(schemas, registry)
        if wanted:
            client.check_schemas(wanted)
    except BaseException:
        client.close()
        raise
    return client


def same_protocol(health: dict[str, Any], where: str) -> None:
    """Check that a server's health reply names this client's protocol version.

    Raises
    ------
    ProtocolError
        Naming the server and both versions: a server of another version would take
        messages this client reads otherwise.
    """
    if health.get("protocol") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"server {where} speaks flightq protocol {str(health.get('protocol'))[:64]}; this "
            f"client speaks {PROTOCOL_VERSION}: use a flightq of the server's version"
        )


#: What a put refused for its columns or schema raises: where the partition's schema the
#: client keeps is stale (the partition declared again with another), the put goes again
#: with the schema described afresh.
SCHEMA_FAULTS = (
    SchemaMismatchError,
    UndeclaredFieldError,
    DTypeError,
    ShapeError,
    MissingFieldError,
)

_D = TypeVar("_D")


def redeclared(refused: FlightqError, describe: Callable[[], _D | None]) -> _D:
    """The partition's declaration as ``describe`` gives it afresh, for a put ``refused``
    for its columns or schema (one of :data:`SCHEMA_FAULTS`), where it changed since the
    client learned it; otherwise ``refused`` again: where ``describe`` finds it unchanged
    (None), or fails (its error the cause), but for a partition gone (``NotFoundError``,
    raised as the error that stands)."""
    try:
        fresh = describe()
    except NotFoundError:
        raise  # the partition is gone: that, not the columns, is the error
    except FlightqError as e:
        raise refused from e  # the describe failed: the put's own error stands
    if fresh is None:
        raise refused
    return fresh


#: ``Client._act``'s rows for a reply that may name every row of a partition.
_EVERY = 1 << 62


class NamedClaims:
    """The claims a client has waiting, each under its name (its caller's ``call_id``, or
    one the client made), so that closing the client stops them on the server instead of
    leaving their threads waiting for their whole timeout (an asyncio program leaving
    ``async with`` with a claim pending took that claim's timeout to exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[str, str]] = {}  # one entry per claim in flight
        self._next = itertools.count()
        self._closed = False
        self._stopped = threading.Event()  # the first stop's cancels ended
        #: Names cancel_claim was called for while a claim of them was held (a claim
        #: asked again under a new session is then refused here: the server keeps a
        #: cancel per session).
        self._cancelled: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def held(self, partition: str, call: str | None) -> Iterator[None]:
        """Around a claim named ``call`` (nothing when None). Refused once :meth:`stop`
        began: a claim named after it looked would wait on, never cancelled.

        Raises
        ------
        FlightqError
            The client is closed.
        """
        if call is None:
            yield
            return
        with self._lock:
            if self._closed:
                raise FlightqError(f"claim from {partition!r}: the client is closed")
            n = next(self._next)
            self._held[n] = (partition, call)
        try:
            yield
        finally:
            with self._lock:
                del self._held[n]
                if (partition, call) not in self._held.values():
                    self._cancelled.discard((partition, call))

    def cancelled(self, partition: str, call: str) -> None:
        """``cancel_claim`` was called for ``call``: a claim of it held now is not asked
        again (:meth:`check`)."""
        with self._lock:
            if (partition, call) in self._held.values():
                self._cancelled.add((partition, call))

    def check(self, partition: str, call: str | None) -> None:
        """Before a held claim is asked again.

        Raises
        ------
        ClaimCancelledError
            ``cancel_claim`` named it meanwhile.
        """
        with self._lock:
            if call is not None and (partition, call) in self._cancelled:
                raise ClaimCancelledError.of(partition)

    def stop(self, transport: Transport, session: str | None, deadline: float) -> None:
        """Cancel every claim held now, under ``session`` (the client's), through
        ``transport``: side by side, each within ``deadline`` (``time.monotonic()``),
        errors ignored (a server gone stops nothing, and the claim fails with it); later
        named claims are refused. A second caller waits for the first one's cancels."""
        with self._lock:
            first, self._closed = not self._closed, True
            named = set(self._held.values())
        if not first:
            self._stopped.wait(max(0.0, deadline - time.monotonic()))
            return

        def cancel(partition: str, call: str) -> None:
            left = deadline - time.monotonic()
            if left > 0:
                with contextlib.suppress(FlightqError):
                    transport.action(
                        CancelClaim(partition=partition, call=call, session=session),
                        timeout=left,
                    )

        # Threads of their own, not daemons (one inside a Flight call when the
        # interpreter finalizes can crash it): each ends within the deadline.
        threads = [threading.Thread(target=cancel, args=k, name="flightq-cancel") for k in named]
        for t, k in zip(threads, named, strict=True):
            try:
                t.start()
            except RuntimeError:  # no new threads (the interpreter is shutting down)
                cancel(*k)
        for t in threads:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        self._stopped.set()


#: Seconds the cancels of a client's named claims may take in all when it closes.
STOP_S = 5.0


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
        min_stream_bytes: int = MIN_STREAM_BYTES,
        keep_freed_memory: bool = False,
        session_timeout: float | None = DEFAULT_SESSION_TIMEOUT,
        **flight_kwargs: Any,
    ) -> None:
        silence = _session_silence(session_timeout)
        gets = DEFAULT_STREAMS if get_streams is None else get_streams
        self.put_streams = DEFAULT_STREAMS if put_streams is None else put_streams
        if gets < 1 or self.put_streams < 1:
            raise ValueError(
                f"get_streams and put_streams must be at least 1, got {get_streams}, {put_streams}"
            )
        if min_stream_bytes < 1:
            raise ValueError(f"min_stream_bytes must be at least 1, got {min_stream_bytes}")
        location = with_scheme(location)  # a bare host:port means grpc://host:port
        self.shm_dir: str | None = None
        if shm:
            from ..shm import directory, is_local

            if not is_local(location):
                raise ProtocolError(
                    f"shared memory needs a server on this host; {location} is not loopback "
                    "(127.0.0.0/8, ::1, localhost) or unix: connect without shm"
                )
            self.shm_dir = directory(shm)
        self.location = location
        self.max_batch_bytes = max_batch_bytes
        # Per partition (the partitions used last: a run may name one per step).
        self._schemas: Recent[str, Schema] = Recent()
        self._lock = threading.Lock()
        #: Claims waiting under a name (``call_id``), stopped when the client closes.
        self.named = NamedClaims()
        #: Pinned host buffers and copy streams for CUDA tensors (empty until first used).
        self._pinned = PinnedPool()
        #: Hints and digests of media tensors put, and per partition the media sent to it.
        self._digests = DigestCache()
        self._media: Recent[str, KnownMedia] = Recent()
        self._transport = Transport(location, timeout=timeout, token=token, **flight_kwargs)
        #: Small puts, gets and claims travel on one held stream (opened on first use).
        self._requests = Requests(self._transport)
        self._reader = Reader(
            self._transport,
            shm_dir=self.shm_dir,
            shm_min_bytes=SHM_MIN_BYTES,
            get_streams=gets,
            min_stream_bytes=min_stream_bytes,
            pinned=self._pinned,
            requests=self._requests,
        )
        #: Ends this client's leases when it goes (opened by the first claim).
        self._session = Session(self._transport, silence)
        self._segments: Any = None
        if self.shm_dir is not None:
            from ..shm.client import ClientSegments

            self._segments = ClientSegments(self.shm_dir)
        if keep_freed_memory and self.shm_dir is None:
            _keep_freed_memory()

    # ------------------------------------------------------------------ settings

    @property
    def transport(self) -> Transport:
        """The connections to the server (internal: :mod:`flightq.client.transport`)."""
        return self._transport

    @property
    def timeout(self) -> float:
        """Default seconds for every call."""
        return self._transport.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._transport.timeout = value

    @property
    def get_streams(self) -> int:
        """Most parallel DoGet streams for one large get."""
        return self._reader.get_streams

    @get_streams.setter
    def get_streams(self, value: int) -> None:
        self._reader.get_streams = value

    @property
    def min_stream_bytes(self) -> int:
        """Fewest bytes each parallel stream of a get or put carries."""
        return self._reader.min_stream_bytes

    @min_stream_bytes.setter
    def min_stream_bytes(self, value: int) -> None:
        self._reader.min_stream_bytes = value

    @property
    def shm_min_bytes(self) -> int:
        """With shm: puts (and reads, estimated from the partition's last answer) of fewer
        bytes travel over the socket."""
        return self._reader.shm_min_bytes

    @shm_min_bytes.setter
    def shm_min_bytes(self, value: int) -> None:
        self._reader.shm_min_bytes = value

    @property
    def stream_max_bytes(self) -> int:
        """Puts of fewer payload bytes, and gets and claims the partition's last answer
        predicts that small, travel on the client's request stream (one held DoExchange,
        :mod:`flightq.client.requests`) instead of a call each; 0: every operation per call."""
        return self._reader.stream_max_bytes

    @stream_max_bytes.setter
    def stream_max_bytes(self, value: int) -> None:
        self._reader.stream_max_bytes = value

    @property
    def requests(self) -> Requests:
        """This client's request stream (internal: :mod:`flightq.client.requests`)."""
        return self._requests

    @property
    def shm_pool(self) -> SegmentPool | None:
        """The shared-memory segments this client's puts were written into (read-only; for
        diagnostics: ``shm_pool.paths()``). None without shm or before the first such put."""
        return None if self._segments is None else self._segments.pool

    @property
    def shm_direct(self) -> tuple[bool | None, str]:
        """Whether the server reads this client's puts through shared memory straight out
        of its memory (one copy instead of two, :mod:`flightq.shm.direct`), and why not:
        ``(None, "")`` without shm or before the first such put (the server is asked
        then), ``(False, reason)`` where it does not (another PID namespace, a host that
        forbids ``process_vm_readv``)."""
        if self._segments is None:
            return None, ""
        return self._segments.direct, self._segments.direct_why

    @shm_direct.setter
    def shm_direct(self, on: bool) -> None:
        """``False``: copy every put into the segment, never let the server read this
        process's memory; ``True``: ask the server again at the next put."""
        if self._segments is not None:
            self._segments.direct = None if on else False
            self._segments.direct_why = "" if on else "turned off (Client.shm_direct = False)"

    @property
    def session(self) -> Session:
        """This client's consumer session, which claims name (internal:
        :mod:`flightq.client.session`)."""
        return self._session

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory this client allocated for CUDA transfers so far, in bytes
        (buffers reused do not count again; 0 before the first device get or put)."""
        return self._pinned.allocated_bytes

    # ------------------------------------------------------------------ plumbing

    def partition_schema(self, partition: str) -> Schema:
        """The schema ``partition`` is declared with (asked of the server once, then kept;
        a put that finds it declared again asks afresh).

        Raises
        ------
        NotFoundError
            If there is no partition ``partition``.
        """
        with self._lock:
            s = self._schemas.get(partition)
        if s is None:
            d = self._act(Describe(partition=partition))
            s = Schema.from_json(d.schema)
            with self._lock:
                self._schemas[partition] = s
        return s

    # ------------------------------------------------------------------ control

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """Liveness: ``{"ok": True, "protocol": N, "partitions": N}``."""
        return self._transport.action(Health(), timeout).to_dict()

    def check_schemas(self, schemas: Iterable[Schema]) -> None:
        """Check that the server holds these exact schema versions.

        Raises
        ------
        SchemaMismatchError, UnknownSchemaError
            With a readable diff (field, expected, actual).
        """
        schemas = list(schemas)
        try:
            self._transport.action(CheckSchemas(schemas=[s.canonical_json for s in schemas]))
        except (SchemaMismatchError, UnknownSchemaError) as e:
            raise type(e)(
                f"startup schema check against {self.location} failed: {e}", **e.attributes()
            ) from None

    def register_schema(self, schema: Schema) -> None:
        """Add a schema to the server's registry (evolution rules apply there too)."""
        self._transport.action(RegisterSchema(schema=schema.canonical_json))

    def create_partition(
        self,
        name: str,
        schema: str | Schema,
        tasks: Sequence[str] = (),
        group_size: int | None = None,
        *,
        max_rows: int | None = None,
        lease: float | None = None,
        max_failures: int | None = None,
        registry: SchemaRegistry | None = None,
    ) -> bool:
        """Declare a partition before any producer writes; idempotent for the same arguments.

        ``max_rows`` caps the rows it holds at once: a put that would create more waits up
        to its timeout for clears, then fails with ResourceExhaustedError. ``lease`` is
        the seconds a claim's rows stay leased without an ack (None: 600; ``inf``: until
        acked, given back or the consumer goes away); ``max_failures`` the failed
        deliveries after which a row goes to the dead letters (None: 3). See
        ``docs/reliability.md``.

        Returns whether it was created by this call.

        Raises
        ------
        ConflictError
            If it exists with another schema, tasks, group size, row limit, lease or
            failure limit.
        """
        s = resolve_schemas([schema], registry)[0]
        d = self._transport.action(
            Declare(
                partition=name,
                schema=s.canonical_json,
                tasks=list(tasks),
                group_size=group_size,
                max_rows=max_rows,
                lease=lease,
                max_failures=max_failures,
            )
        )
        with self._lock:
            self._schemas[name] = s
        return bool(d.created)

    def describe(self, partition: str) -> dict[str, Any]:
        """A partition's declaration (schema JSON, fingerprint, tasks, group size)."""
        return self._act(Describe(partition=partition)).to_dict()

    def clear(
        self, partition: str, keys: Sequence[str] | None = None, *, missing_ok: bool = False
    ) -> int:
        """Remove rows (all when ``keys`` is None); returns how many.

        An unknown key refuses the clear (``NotFoundError`` naming it, nothing removed);
        with ``missing_ok`` keys not held are skipped and the others removed, in one call
        however many are missing (the ranks of a data-parallel group clearing one step's
        keys together).

        Keys that one message cannot carry (past about 1 MiB of keys: a server refuses a
        message past its ``max_request_bytes``) go in several calls, in order, each key
        named once; so do those of :meth:`reset`, :meth:`ack`, :meth:`nack` and
        :meth:`list_keys`. Each call is all or nothing: an error in one (an unknown key)
        leaves the calls before it done.
        """
        ks = None if keys is None else list(keys)
        n = sum(
            int(self._act(Clear(partition=partition, keys=p, missing_ok=missing_ok)).cleared)
            for p in _parts(ks)
        )
        if ks is None:
            self._forget_media(partition)  # it holds none now: send the next put's bare
        return n

    def reset(self, partition: str, task: str, keys: Sequence[str] | None = None) -> int:
        """Make rows claimable again for ``task`` (all when ``keys`` is None)."""
        ks = None if keys is None else list(keys)
        return sum(
            int(self._act(Reset(partition=partition, task=task, keys=p)).reset) for p in _parts(ks)
        )

    def _act(self, request: Message, rows: int = 0) -> Any:
        """A small action of a training loop (ack, nack, clear, reset, and the reads
        list_keys, inspect, stats, describe, dead_letters): on the request stream where
        it is free and the request small (its body under ``stream_max_bytes``, and the
        rows its reply may name, ``rows``, up to :data:`~flightq.frames.STREAM_ACK_ROWS`:
        an ack's lost keys or the keys listed, so that the reply fits in a frame), else
        per call."""
        limit = self._reader.stream_max_bytes
        if limit and rows <= STREAM_ACK_ROWS:
            wire = request.to_wire()
            if len(wire) < limit:
                got = self._requests.action(request, wire)
                if got is not None:
                    return got
        return self._transport.action(request)

    def drop(self, partition: str) -> None:
        """Remove a partition and its rows."""
        self._transport.action(Drop(partition=partition))
        with self._lock:
            self._schemas.pop(partition, None)
        self._forget_media(partition)

    def _forget_media(self, partition: str) -> None:
        """Forget the media sent to ``partition`` (references to them would be refused)."""
        known = self._media.get(partition)
        if known is not None:
            known.clear()

    def stats(self) -> dict[str, Any]:
        """Rows, bytes and per-task progress of every partition."""
        return self._act(Stats()).to_dict()

    def inspect(self, partition: str) -> dict[str, Any]:
        """One partition: fields present, delivered and ready rows per task."""
        return self._act(Inspect(partition=partition)).to_dict()

    def list_keys(
        self,
        partition: str,
        keys: Sequence[str] | None = None,
        *,
        hide_tag_values: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Rows without their data: ``{key: {"tags": {...}, "fields": [...]}}``.

        Every row in insertion order when ``keys`` is None, else the rows asked for, in
        that order; ``fields`` are the fields each row has, in schema order. Tags whose
        key starts with ``hide_tag_values`` come with their value left out (None): their
        names alone, where their values are large and not needed.

        Raises
        ------
        NotFoundError
            Naming unknown keys (or the partition).
        """
        # Every row's keys and tags may be more than a frame holds: per call.
        ks = _keys(keys)
        out: dict[str, dict[str, Any]] = {}
        for p in _parts(ks):
            r = self._act(
                ListKeys(partition=partition, keys=p, hide_tag_values=hide_tag_values),
                rows=_EVERY if p is None else len(p),
            )
            out.update(_rows_listed(r))
        if ks is not None and list(out) != list(dict.fromkeys(ks)):
            raise ProtocolError(
                f"list_keys of {partition!r}: the reply lists {len(out)} rows, not the "
                f"{len(set(ks))} keys asked for in their order"
            )
        return out

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
    ) -> PutReceipt:
        """Write rows, all or nothing, in one DoPut (a small put: one message on the
        request stream). Returns the rows written.

        The count is a :class:`~flightq.PutReceipt` (an ``int``) that also says the route
        the rows took: ``"socket"``, ``"streams=N"`` (N parallel DoPut streams) or
        ``"shm"`` (a shared-memory segment).

        New rows must carry every required field; onto existing rows any subset of fields
        may be written. Writing a column a row already has needs ``overwrite=True``.
        Tags are merged into the rows' tags. Retrying a put after a timeout is safe: a
        put whose cells all equal what the rows hold already, or that repeats a recent
        ``put_id`` (any unique string), is acknowledged again without storing anything.

        Raises
        ------
        UndeclaredFieldError, DTypeError, ShapeError, MissingFieldError, ConflictError
            From the local encode or from the server; nothing is stored. Refused for its
            columns or schema, the put first describes the partition again: where another
            client dropped it and declared it with another schema since this client
            learned it, the put goes once more under the new one.
        NotFoundError
            If the partition does not exist (or was dropped since).

        Tensors may be on a CUDA device: they are copied into pinned host memory on a side
        stream, each record batch encoded as soon as its rows have arrived (see
        :mod:`flightq.cuda`); the bytes sent are the same as for CPU tensors.

        A token or tensor column whose rows lie end to end in one CPU tensor (a
        :class:`flightq.Packed` ``(flat, cu_seqlens)``, a jagged nested tensor, a dense
        C-contiguous tensor whose first dim is the rows) is checked a column at a time and
        sent from that tensor's memory: leave it unchanged until ``put`` returns.
        """
        schema = self.partition_schema(partition)
        try:
            return self._put_as(partition, schema, keys, columns, tags, overwrite, timeout, put_id)
        except SCHEMA_FAULTS as refused:
            # The schema this client keeps for the partition may be stale: another client
            # dropped the partition and declared it again with another schema. Described
            # afresh; where it changed, the put (which stored nothing) goes once more.
            fresh = redeclared(refused, lambda: self._schema_changed(partition, schema))
        return self._put_as(partition, fresh, keys, columns, tags, overwrite, timeout, put_id)

    def _schema_changed(self, partition: str, kept: Schema) -> Schema | None:
        """The partition's schema as the server declares it now, where it differs from
        ``kept`` (the media sent to it are forgotten then); None where it does not.

        Raises
        ------
        NotFoundError
            If the partition no longer exists.
        """
        self._schemas.pop(partition)
        fresh = self.partition_schema(partition)
        if fresh.fingerprint == kept.fingerprint:
            return None
        self._forget_media(partition)
        return fresh

    def _put_as(
        self,
        partition: str,
        schema: Schema,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        tags: Sequence[Mapping[str, Any] | None] | None,
        overwrite: bool,
        timeout: float | None,
        put_id: str | None,
    ) -> PutReceipt:
        """:meth:`put` of ``columns`` encoded for ``schema``."""
        columns = columns_of(columns, schema, keys)  # a TensorDict, nested tensors: per row
        # Through shared memory, payloads are copied once: from the tensors into the segment.
        # Over the socket, every check runs before anything is sent; then each batch's copy
        # is made while the previous batch is on the wire, and a payload alone in its column
        # (or already end to end with its neighbours) is sent from the tensor's memory.
        # Media go by content: what this client put to the partition before (by hint)
        # travels as a reference, its digest and hint. A server that holds none of that
        # digest says so; the put goes again, every payload with it (one more round trip,
        # never a loss), the digests worked out already beside them.
        known = self._known_media(partition, schema)
        try:
            return self._put_columns(
                partition, schema, keys, columns, tags, known, overwrite, timeout, put_id
            )
        except Crowded:
            # Its parallel streams found the server's call slots taken, and nothing was
            # stored (the parts were aborted): once more, as one stream.
            return self._put_columns(
                partition, schema, keys, columns, tags, known, overwrite, timeout, put_id
            )
        except _NoSharedRoom:
            # The segment directory (this host's /dev/shm, shared by every process) had no
            # room for the put or the server's copy of it; nothing was stored: encoded
            # again for the socket, and sent there.
            return self._put_columns(
                partition, schema, keys, columns, tags, known, overwrite, timeout, put_id, False
            )

    def _put_columns(
        self,
        partition: str,
        schema: Schema,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        tags: Sequence[Mapping[str, Any] | None] | None,
        known: KnownMedia | None,
        overwrite: bool,
        timeout: float | None,
        put_id: str | None,
        shm: bool = True,
    ) -> PutReceipt:
        """Encode and send a put (:meth:`put`), once more with every payload where the
        server lacks a media digest it was sent; ``shm=False``: over the socket even
        where the client has shared memory."""
        for again in (False, True):
            media = (
                None
                if known is None
                else MediaRefs(self._digests, () if again else known, claim=again)
            )
            try:
                shm_dir = self.shm_dir if shm else None
                with (
                    stage(columns, self._pinned, _joinable(schema)) as staged,
                    _put_sink(shm_dir) as sink,
                ):
                    batches = encode_chunks(
                        schema,
                        staged.columns,
                        keys,
                        tags,
                        max_bytes=self._put_batch_bytes() if shm else self.max_batch_bytes,
                        on_range=staged.on_range,
                        sink=sink,
                        media=media,
                    )
                    receipt = self._put(partition, batches, sink, overwrite, timeout, put_id, shm)
            except MediaUnknownError:
                if known is None or again:
                    raise
                known.clear()
                continue
            if known is not None and media is not None:
                known.update(media.sent)
            return receipt
        raise AssertionError("unreachable")  # pragma: no cover

    def _known_media(self, partition: str, schema: Schema) -> KnownMedia | None:
        """The media this client sent the partition (by hint); None where media do not
        go by content (no media fields, or puts through shared memory, where payloads
        cost no socket bytes: the server files them under their hints, unhashed)."""
        if self.shm_dir is not None or not any(f.role == "media" for f in schema.fields):
            return None
        known = self._media.get(partition)
        if known is None:
            known = self._media[partition] = KnownMedia()
        return known

    def _put_batch_bytes(self) -> int:
        """Record-batch size of a put: bounded for the socket, large through a segment (as
        large as the server takes there, as its probe said, up to ``PUT_BATCH_BYTES``;
        :data:`~flightq.shm.BATCH_BYTES` where it did not say)."""
        if self.shm_dir is None:
            return self.max_batch_bytes
        from ..shm import BATCH_BYTES, PUT_BATCH_BYTES

        said = self._segments.put_batch_bytes(self._transport)
        return max(
            self.max_batch_bytes, BATCH_BYTES if said is None else min(said, PUT_BATCH_BYTES)
        )

    def put_batch(
        self,
        partition: str,
        batch: pa.RecordBatch | Sequence[pa.RecordBatch],
        *,
        overwrite: bool = False,
        timeout: float | None = None,
        put_id: str | None = None,
    ) -> PutReceipt:
        """Write already encoded record batches (see :func:`flightq.encode`) as one put.

        Several batches (one schema) travel in one DoPut and are stored all or nothing.
        """
        batches = [batch] if isinstance(batch, pa.RecordBatch) else list(batch)
        try:  # a copy of the list: a put in parts lets go of each batch once sent
            return self._put(partition, list(batches), None, overwrite, timeout, put_id)
        except Crowded:
            # As put(): its parallel streams found the server's call slots taken and
            # nothing was stored; once more, as one stream.
            return self._put(partition, batches, None, overwrite, timeout, put_id)

    def _put(
        self,
        partition: str,
        batches: list[pa.RecordBatch],
        sink: Sink | None,
        overwrite: bool,
        timeout: float | None,
        put_id: str | None,
        shm: bool = True,
    ) -> PutReceipt:
        """One DoPut of ``batches``, encoded into ``sink`` (encode_chunks): deferred fills
        (``fills[i]()`` completes batch i) or a gather into a segment. Through shared
        memory where the client has it, ``shm`` and the put is not small; where the
        directory has no room, whole batches go over the socket instead, and batches
        gathered for a segment raise :class:`_NoSharedRoom` (encode them again)."""
        fills = sink.fills if isinstance(sink, DeferredFills) else None
        if not batches:
            raise ValueError(f"put to {partition!r}: no record batches")
        wait = self.timeout if timeout is None else timeout
        # The server may wait for space (memory budget) for most of the call's timeout.
        # The row count lets the server refuse a stream cut short; the id makes retries safe.
        cmd = PutCommand(
            partition=partition,
            overwrite=overwrite,
            timeout=0.8 * wait,
            rows=sum(b.num_rows for b in batches),
            put_id=put_id,
        )
        if shm and self._segments is not None and not self._small_put(batches, sink):
            from ..shm.client import put_via_shm
            from ..shm.gather import ShmGather
            from ..shm.segments import SHARED_ROOM

            batch_bytes = self._put_batch_bytes()
            try:
                rows, made = put_via_shm(
                    self._transport, self._segments, cmd, batches, timeout, batch_bytes, sink
                )
                return PutReceipt(rows, "shm", creation=made)
            except ResourceExhaustedError as e:
                if SHARED_ROOM not in str(e):
                    raise  # the memory budget's refusal, the same over the socket
                if isinstance(sink, ShmGather) and sink.gathered:
                    raise _NoSharedRoom from e  # placeholders: encoded again for the socket
                # Whole record batches: over the socket, below.
        streams = 1 if crowded(self._reader) else self.put_streams
        groups = put_groups(batches, streams, self.min_stream_bytes)
        if len(groups) > 1:
            rows, made = put_parts(
                self._reader, cmd, batches, fills, groups, timeout, self.max_batch_bytes
            )
            return PutReceipt(rows, f"streams={len(groups)}", creation=made)
        if self._small(batches):
            ready = list(filled(batches, fills))
            took = self._requests.put(cmd, ready[0].schema, ready, f"put to {partition!r}", timeout)
            if took is not None:
                return PutReceipt(took[0], "socket", creation=took[1])
            batches, fills = ready, None
        rows, made = self._transport.put(
            cmd,
            batches[0].schema,
            filled(batches, fills),
            max_batch_bytes=self.max_batch_bytes,
            timeout=timeout,
        )
        return PutReceipt(rows, "socket", creation=made)

    def _small(self, batches: list[pa.RecordBatch]) -> bool:
        """Whether a put over the socket takes the request stream: it is small (its media
        references, where it claims any, travel in the frame's header)."""
        limit = self._reader.stream_max_bytes
        return bool(limit) and sum(b.get_total_buffer_size() for b in batches) < limit

    def _small_put(self, batches: list[pa.RecordBatch], sink: Sink | None) -> bool:
        """Whether a put encoded for shm is better sent over the socket: it is small, and no
        payload waits to be copied into a segment (:func:`flightq.shm.gathering`)."""
        from ..shm import gathered

        if gathered(sink):
            return False
        return sum(b.get_total_buffer_size() for b in batches) < self.shm_min_bytes

    @tensordict_reads
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
        hide_tag_values: str | None = None,
    ) -> Batch:
        """Rows by key, in the order asked, with any subset of fields.

        ``fields=None`` returns every column the rows have (``None`` where a row lacks one).
        ``device="cuda:N"`` returns a :class:`flightq.cuda.DeviceBatch` of CUDA tensors
        (each record batch checked as it arrives, then the payloads copied through pinned
        buffers once the streams ended); ``sync=False``
        returns once the copies are queued (the device's current stream waits for them;
        other streams wait on ``batch.event``). ``None`` or ``"cpu"``: CPU tensors.
        ``as_="tensordict"`` returns a ``tensordict.TensorDict`` instead (token fields as
        jagged nested tensors over the received buffers, the keys in ``"__key__"``; see
        :mod:`flightq.tensordicts`); :meth:`claim` takes it too.
        Tags whose key starts with ``hide_tag_values`` come with their value left out
        (None), by name alone: large values (documents, a reward model's inputs) a reader
        of other fields need neither receive nor decode.

        Raises
        ------
        NotFoundError
            Naming unknown keys.
        MissingFieldError
            Naming a requested field and the rows that lack it.
        DeviceError
            If ``device`` cannot be used here (no CUDA, no such device, ``as_='numpy'``).
        """
        f = None if fields is None else list(fields)
        t = GetTicket(
            partition=partition, keys=list(keys), fields=f, hide_tag_values=hide_tag_values
        )
        dev = resolve_device(device, as_)
        what = f"get from {partition!r}"
        if dev is not None:
            return get_to_device(self._reader, dev, t, what, timeout, copy=copy, sync=sync)
        return read_keys(self._reader, t, what, timeout, as_, copy)

    @tensordict_reads
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
        lease: float | None = None,
        call_id: str | None = None,
        hide_tag_values: str | None = None,
    ) -> Batch:
        """Block until ``batch_size`` rows are ready for ``task``, lease them, return them.

        A row is ready when no claim of the task holds it, it is neither acknowledged nor
        dead, and it has every field in ``fields`` (the schema's required ones when
        ``fields`` is None) and in ``wait_for``; whole groups when the partition has a
        group size (then the rest of a group acked in part comes after the whole ones,
        and a claim holding it may be short of ``batch_size``). The rows come back with
        ``fields``, or with every column they have when ``fields`` is None: a trainer
        calls ``claim(p, "train", n, wait_for=["prev_logprobs"])``.

        The rows are leased (``batch.claim``, a :class:`~flightq.Claim`): :meth:`ack`
        them when done, or :meth:`nack` them to give them back; ``with client.claim(...)
        as batch:`` acks on leaving the block and gives back on an exception. Rows not
        acked go back to ready when the lease runs out (``lease`` seconds, the
        partition's when None), and at once when this client closes or its process or
        connection goes away. If anything fails between the server's answer and the
        batch (decoding, the transport), the rows are given back before the error is
        raised. ``device`` and ``sync`` as for :meth:`get` (a bad device, or
        ``as_='torch'`` without torch, is refused before anything is claimed).

        ``hide_tag_values`` as for :meth:`get`: tags under that prefix come by name alone.

        ``call_id`` names this claim (1 to 64 characters, one of its own per claim:
        ``uuid.uuid4().hex``) so that another thread can stop it while it waits,
        :meth:`cancel_claim`. A claim given no name gets one of the client's own, so that
        :meth:`close` stops it too.

        Raises
        ------
        ClaimTimeoutError
            (also a ``TimeoutError``) if not enough rows are ready within ``timeout``.
        ClaimCancelledError
            If :meth:`cancel_claim` named ``call_id`` before rows were taken.
        DeviceError
            If ``device`` cannot be used here; nothing is claimed.
        DecodeError
            ``as_='torch'`` without torch; nothing is claimed.
        """
        dev = resolve_device(device, as_)
        if dev is None:
            check_as(as_)
        wait = self.timeout if timeout is None else timeout
        # Every claim is named (unguessably where its caller gave no name), so that closing
        # the client stops it on the server whatever thread waits in it.
        call = uuid.uuid4().hex if call_id is None else call_id
        t = ClaimTicket(
            partition=partition,
            task=task,
            batch_size=batch_size,
            fields=None if fields is None else list(fields),
            wait_for=list(wait_for),
            timeout=wait,
            lease=lease,
            session=self._session.id(),
            call=call,
            hide_tag_values=hide_tag_values,
        )
        started = time.monotonic()
        with self.named.held(partition, call):
            try:
                return self._claim(t, wait, as_, copy, dev, sync)
            except NotFoundError as e:
                if e.key is None or e.key != t.session:
                    raise
                # The server no longer knows the session (it restarted, or the link
                # dropped and it ended the session): open another, claim with the wait left.
                left = max(wait - (time.monotonic() - started), 0.0)
                self.named.check(partition, call)  # not asked again once cancelled
                t = dataclasses.replace(t, session=self._session.reopen(e.key), timeout=left)
                return self._claim(t, left, as_, copy, dev, sync)

    def _claim(
        self, t: ClaimTicket, wait: float, as_: str, copy: bool, dev: Any, sync: bool
    ) -> Batch:
        # The server answers within `wait`; the transport gets a margin on top.
        what, limit = f"claim from {t.partition!r}", wait + max(5.0, 0.1 * wait)
        grant: list[ClaimGrant] = []
        started = time.monotonic()
        try:
            if dev is not None:
                batch = self._reader.to_device(
                    dev, t, what, limit, copy=copy, sync=sync, grant=grant
                )
            else:
                batch = self._reader.one(t, what, limit, as_, copy, grant=grant)
            claimed(batch.keys, grant[0].deliveries, t.batch_size, what)
        except BaseException as e:
            if grant:  # the rows were taken: give them back before raising
                self._give_back(t.partition, grant[0].claim, e)
            raise
        g = grant[0]
        claim = Claim(
            t.partition,
            t.task,
            g.claim,
            tuple(batch.keys),
            tuple(g.deliveries),
            g.lease,
            started + g.lease,
        )
        batch.claim = claim
        batch._settle = lambda exc: self._settle(claim, exc)
        return batch

    def _give_back(self, partition: str, claim: str, error: BaseException | None) -> None:
        """Release a claim after ``error``: a row the error names counts a failed
        delivery. Errors on the way are dropped (the lease ends anyway)."""
        key = getattr(error, "key", None)
        with contextlib.suppress(FlightqError):
            if isinstance(error, FlightqError) and key is not None:
                with contextlib.suppress(NotFoundError):  # not one of the claim's rows
                    self._act(Nack(partition=partition, claim=claim, keys=[key], failed=True))
            self._act(Nack(partition=partition, claim=claim))

    def _settle(self, claim: Claim, error: BaseException | None) -> None:
        if error is None:
            self.ack(claim)
        else:
            self._give_back(claim.partition, claim.id, error)

    def ack(self, claim: Claim | Batch, keys: Sequence[str] | None = None) -> int:
        """Acknowledge rows of a claim (all of them when ``keys`` is None): they are done
        for the claim's task and are never delivered to it again. Acking again is
        harmless; rows given back with :meth:`nack`, or cleared since, are not the
        claim's any more and are left alone. Returns the rows acknowledged now.

        Raises
        ------
        LeaseExpiredError
            (a ``ConflictError``) naming rows the ack came too late for: the lease had
            run out and another claim took them, or they went to the dead letters. The
            other rows are acknowledged.
        NotFoundError
            If ``keys`` names a row the claim did not take, or the server does not know
            the claim (it restarted, or thousands of claims ended since).
        """
        c = _claim_of(claim)
        ks = None if keys is None else list(keys)
        acked, lost = 0, []
        for p in _parts(ks):
            reply = self._act(Ack(partition=c.partition, claim=c.id, keys=p), rows=len(c.keys))
            acked += reply.acked
            lost += reply.lost
        if lost:
            shown = ", ".join(repr(k) for k in lost[:10])
            more = f" and {len(lost) - 10} more" if len(lost) > 10 else ""
            raise LeaseExpiredError(
                f"ack of claim {c.id} from {c.partition!r}: the lease had run out and rows "
                f"{shown}{more} were claimed again or went to the dead letters; "
                f"{acked} rows were acknowledged",
                key=lost[0],
                actual=len(lost),
                partition=c.partition,
            )
        return acked

    def nack(
        self, claim: Claim | Batch, keys: Sequence[str] | None = None, *, failed: bool = False
    ) -> int:
        """Give rows of a claim back (all it still holds when ``keys`` is None): ready to
        be claimed again, behind the rows ready already. ``failed=True`` counts a failed
        delivery of each; a row whose failures reach the partition's ``max_failures``
        goes to the dead letters instead (:meth:`dead_letters`). Returns the rows given
        back.

        Raises
        ------
        NotFoundError
            If ``keys`` names a row the claim did not take, or the server does not know
            the claim.
        """
        c = _claim_of(claim)
        ks = None if keys is None else list(keys)
        given = 0
        for p in _parts(ks):
            reply = self._act(Nack(partition=c.partition, claim=c.id, keys=p, failed=failed))
            given += int(reply.released) + int(reply.dead)
        return given

    def cancel_claim(self, partition: str, call_id: str) -> int:
        """Stop this client's claim from ``partition`` that was given ``call_id``
        (:meth:`claim`; claims of other clients under that name are left alone) while it
        waits: it fails :class:`~flightq.ClaimCancelledError` in its thread at
        once, taking no rows; one whose request has not reached the server yet (or is
        asked again after a broken stream) is refused when it does, within a minute.
        Returns 1 where a waiting claim stopped, 0 where none waited (its rows may be
        taken already: give them back with :meth:`nack`). Sent per call, never behind
        the claim on its stream.

        Raises
        ------
        NotFoundError
            If there is no partition ``partition``.
        """
        self.named.cancelled(partition, call_id)
        request = CancelClaim(partition=partition, call=call_id, session=self._session.id())
        return int(self._transport.action(request).cancelled)

    def dead_letters(self, partition: str, task: str, limit: int = 1000) -> dict[str, Any]:
        """The rows of ``task`` given up on: ``{"keys", "why", "deliveries", "total"}``,
        the first ``limit`` of ``total``. They stay stored (:meth:`get` reads them) and
        :meth:`reset` makes them claimable again."""
        return self._act(DeadLetters(partition=partition, task=task, limit=limit)).to_dict()

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
        return self._transport.action(Snapshot(name=name, partition=partition), timeout).to_dict()

    def partitions(self) -> list[str]:
        """Names of the partitions the server holds (ListFlights)."""
        return self._transport.list_flights()

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the connection. Rows this client claimed and did not acknowledge are
        ready again for other consumers; a claim of this client still waiting in another
        thread is stopped and fails :class:`~flightq.ClaimCancelledError`."""
        if forks.forked():
            # Its connections are the parent's: closing them would break the parent's
            # calls on them (its request stream timed out). Refused from now on.
            self._transport.close()
            return
        stop_named(self, time.monotonic() + STOP_S)
        self._requests.close()
        self._session.close()
        if self._segments is not None:
            self._segments.close()
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop_named(client: Client, deadline: float) -> None:
    """Cancel ``client``'s named claims still waiting (within ``deadline``,
    ``time.monotonic()``), and refuse its named claims from then on: the first step of
    :meth:`Client.close` (a sharded client takes it on every shard at once)."""
    client.named.stop(client._transport, client._session.current(), deadline)


def _keys(keys: Sequence[str] | None) -> list[str] | None:
    return None if keys is None else list(keys)


def _parts(keys: list[str] | None) -> list[list[str] | None]:
    """The key lists of the calls that name ``keys`` (None: every row, one call), each
    within what one message carries to any server (:func:`flightq.msgcheck.key_chunks`).
    Cut in parts, a key is named once: a later part naming a row an earlier one cleared
    would find it unknown."""
    if keys is None:
        return [None]
    parts = key_chunks(keys)
    if len(parts) > 1:
        parts = key_chunks(list(dict.fromkeys(keys)))
    return list(parts)


def _rows_listed(r: Any) -> dict[str, dict[str, Any]]:
    """A ``list_keys`` reply as ``{key: {"tags": ..., "fields": [...]}}``.

    Raises
    ------
    ProtocolError
        If the reply's lists disagree in length or name a field it does not list.
    """
    n, fields = len(r.keys), len(r.fields)
    if len(r.tags) != n or len(r.present) != n:
        raise ProtocolError(
            f"list_keys: the reply lists {n} keys, {len(r.tags)} tags and "
            f"{len(r.present)} rows' fields"
        )
    if any(not 0 <= i < fields for present in r.present for i in present):
        raise ProtocolError(f"list_keys: the reply names a field past its {fields} fields")
    return {
        k: {"tags": t, "fields": [r.fields[i] for i in present]}
        for k, t, present in zip(r.keys, r.tags, r.present, strict=True)
    }


class _NoSharedRoom(Exception):
    """A put gathered for a segment found no room in the segment directory (for its own
    segment, or the server's copy); nothing was stored."""


def _joinable(schema: Schema) -> frozenset[str]:
    """The fields whose CUDA rows a put may join on the device (:func:`flightq.cuda.stage`):
    token and tensor fields, whose rows are never deduplicated."""
    return frozenset(f.name for f in schema.fields if f.role in ("token", "tensor"))


def _put_sink(shm_dir: str | None) -> contextlib.AbstractContextManager[Sink]:
    """Where a put's payloads go: gathered into a segment through shared memory; over the
    socket, each batch's copy left to be made while the previous batch is on the wire."""
    if shm_dir is None:
        return contextlib.nullcontext(DeferredFills())
    from ..shm import gathering

    return gathering()


def _claim_of(claim: Claim | Batch) -> Claim:
    """The claim a batch came under, or ``claim`` itself.

    Raises
    ------
    ProtocolError
        If the batch is not a claim's (a get's answer).
    """
    if isinstance(claim, Batch):
        c = claim.claim
    elif isinstance(claim, Claim):
        c = claim
    else:  # a claim's TensorDict (as_="tensordict")
        c = getattr(claim, "_flightq_claim", None)
    if c is None:
        raise ProtocolError("ack/nack: this batch was not claimed (a get's answer has no lease)")
    return c
