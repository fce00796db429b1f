"""The Flight edge of the server: DoPut, DoGet, DoAction, ListFlights, GetFlightInfo.

The server validates every record batch against its partition's schema from Arrow offsets
and shape columns (:func:`flightq.validation.validate`), never rebuilding a tensor, and stores
the received batches as they are. Errors reach the client as the same typed flightq error
with the same message. See ``docs/protocol.md``.

Examples
--------
>>> import flightq
>>> with flightq.Server() as srv:          # grpc://127.0.0.1:<free port>, in the background
...     srv.location.startswith("grpc://127.0.0.1:")
True
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as fl

from .. import exiting, forks
from ..errors import (
    FlightqError,
    ProtocolError,
    ResourceExhaustedError,
    SchemaMismatchError,
    UnavailableError,
    UnknownSchemaError,
)
from ..layout import DEFAULT_BATCH_BYTES
from ..memory import cap_memory, collect_rarely, keep_freed_memory, memory_cap
from ..msgcheck import DEFAULT_MAX_REQUEST_BYTES, MIN_MAX_REQUEST_BYTES
from ..protocol import (
    ACTIONS,
    CLAIM_METADATA,
    ClaimGrant,
    ClaimTicket,
    GetTicket,
    PutAck,
    PutCommand,
    RequestsCommand,
    ScanTicket,
    SessionBeat,
    SessionCommand,
    SessionReply,
    Ticket,
    parse_ticket,
    to_flight_error,
    unpack,
)
from ..registry import SchemaRegistry
from ..schema import diff_schemas
from . import copied
from .actions import HANDLERS, ActionContext
from .assemble import PartCuts, assemble
from .budget import MAX_TAGS_BYTES, MAX_TAGS_LIMIT, DictionaryUse, check_batch, underlying_bytes
from .exchange import serve_requests
from .idle import DEFAULT_IDLE_TIMEOUT, MIDDLEWARE_KEY, IdleWatch
from .limits import DEFAULT_MAX_CALLS, DEFAULT_MAX_SESSIONS, LIMITS_KEY, CallLimits
from .media import Answered, media_piece, prepare_answer
from .metrics import Counters, call_kind, read_counter
from .partition import Block, Partition, Row
from .putplan import Stored
from .readings import Reading
from .replies import Held, ReplyRoom
from .staging import Staging
from .store import Advance, Store, suggest

if TYPE_CHECKING:
    from ..shm import SegmentPool

__all__ = [
    "Server",
    "serve_forever",
    "keep_freed_memory",
    "DEFAULT_MAX_BATCH_BYTES",
    "DEFAULT_MAX_PUT_BATCH_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
]

#: The server's log: start and stop at INFO, refused calls at INFO (a client's mistake,
#: named by class, partition and key), each request at DEBUG. flightq installs no handler:
#: the application configures logging (``flightq serve`` logs to stderr).
log = logging.getLogger("flightq.server")

#: Payload bytes per record batch served (batches are cut there; well below gRPC's 2 GiB).
DEFAULT_MAX_BATCH_BYTES = DEFAULT_BATCH_BYTES
#: Largest record batch a put may send (Arrow buffer bytes); the client cuts at 16 MiB.
DEFAULT_MAX_PUT_BATCH_BYTES = 2**30
#: Seconds between checks that a consumer session's client is still there.
_SESSION_POLL = 0.05
#: Largest beat a consumer session's client may send (bytes of app metadata).
_MAX_BEAT_BYTES = 64
#: Shortest gap (seconds) between two beats a session's stream is read at: a client
#: beats at most 20 times a second (``MIN_SILENCE`` / ``BEATS_PER_SILENCE``); one that
#: sends faster waits for its stream to be read (gRPC's flow control holds it back), and
#: costs the server at most 100 reads a second.
MIN_BEAT_GAP = 0.01
#: Without a memory budget, bytes of shared-memory answers that may wait for their reader
#: at once (under a budget they count in it); past it a read is answered over the socket.
MAX_UNREAD_ANSWER_BYTES = 4 * 2**30
#: Shared-memory answers that may wait for their reader at once (each is looked at when
#: the budget is counted).
MAX_UNREAD_ANSWERS = 1024
#: Largest action reply (one Flight ``Result``, one gRPC message, which gRPC cannot send
#: past 2 GiB and aborts the process instead): past it the action is refused.
MAX_ACTION_REPLY_BYTES = 1 << 30
#: Most record batches a read's answer through shared memory is made of (each is described
#: to its reader, and all of them are held at once while it is): past it, or past copies
#: of more than a quarter of the budget, the answer goes over the socket, one batch at a
#: time. A batch is a run of consecutive stored rows, so only a read of rows from
#: thousands of puts, or naming rows many times over, passes it.
MAX_SHM_ANSWER_BATCHES = 4096
#: A put through shared memory whose segment holds this many bytes more than its rows
#: count (payloads of media the partition holds already), and more than the rows
#: themselves, has its rows copied out, so that the segment does not outlive the put.
_COMPACT_MIN = 2**20


class Server(fl.FlightServerBase):
    """A flightq server: partitions of rollout rows in memory, served over Arrow Flight.

    Stop it with :meth:`stop` or a ``with`` block; one still serving when its process
    exits is stopped then (within :data:`flightq.exiting.EXIT_STOP_S` seconds).

    Parameters
    ----------
    location:
        Where to listen; the default binds loopback on a free port. Binding another
        address is an explicit choice.
    registry:
        Schemas the server knows; the shipped ones by default.
    max_batch_bytes:
        Payload bytes per record batch it sends (a prompt group stays in one record
        batch when it fits). Smaller batches let a reader decode one while the next
        arrives, larger ones cost less per byte: 16 MiB served W1 fastest on the 2-core
        machine, 8 MiB on the 16-core host.
    memory_budget:
        Payload bytes the store may hold; a put that does not fit waits (up to its
        timeout) for clears, then fails with ResourceExhaustedError. None: unbounded.
        Shared-memory answers waiting for their reader count in it, and each
        shared-memory pool keeps at most a quarter of it warm (:attr:`shm_keep_bytes`).
    max_put_batch_bytes:
        Largest record batch (Arrow buffer bytes) a put may send; a larger one is refused
        with ProtocolError and nothing of the put is stored. A put through shared memory
        may send up to :attr:`shm_put_batch_bytes` (at least ``flightq.shm.PUT_BATCH_BYTES``),
        which the server's health reply names.
    max_request_bytes:
        Largest control message a client may send (a ticket, an action body, a
        descriptor's command, a request-stream frame's header, a batch's media claims),
        in bytes and in the Python objects it decodes to (an upper bound read from its
        msgpack headers, :mod:`flightq.msgcheck`): a larger one is refused with
        ResourceExhaustedError before it is decoded. 16 MiB by default, at least 2 MiB:
        a flightq client cuts its key lists to stay within 1 MiB per message.
    max_tags_bytes:
        Longest tags a put may give one row, in msgpack bytes (64 KiB by default, at most
        16 MiB): a row past it is refused with ResourceExhaustedError and nothing of the
        put is stored. The health reply names it. Tags are decoded into Python objects on
        the server (counted in the memory budget) and listed whole by ``list_keys``: raise
        it for rows that carry large non-tensor values in their tags (the TransferQueue
        compat's message logs).
    tokens:
        Accepted bearer tokens; when given, every call without one is refused with
        UnauthenticatedError before it touches data (:mod:`flightq.auth`).
    snapshot_dir:
        Directory the ``snapshot`` action writes into; None: snapshots are refused.
    restore:
        A snapshot directory to load before serving (:mod:`flightq.server.snapshot`).
    peers:
        Every shard's location, this server's included, as clients reach them (see
        ``docs/sharding.md``); GetFlightInfo then lists one endpoint per peer. May be set
        after construction (``server.peers = [...]``) when ports come from the OS.
    shm:
        Serve same-host clients that ask for it through shared memory (:mod:`flightq.shm`)
        in this directory (True: ``/dev/shm``); False refuses such requests.
    max_calls:
        Calls (puts, reads, claims, actions) in flight at once; past it a call is refused
        at once with ResourceExhaustedError ("server busy"). Each holds a thread while it
        runs (:mod:`flightq.server.limits`).
    max_sessions:
        Consumer sessions (a client's DoExchange, held open for its lifetime) at once,
        counted apart from ``max_calls``; past it a session is refused the same way.
    idle_timeout:
        Seconds a put stream or an answer may wait on its client (no record batch
        arriving, or none taken) before the server cuts that client's connection, which
        ends every call on it (:mod:`flightq.server.idle`; Linux only). A consumer
        session is not timed out by it: one whose client beats ends after the silence its
        client asked for (``session_timeout``). None or 0: never, and sessions are not
        watched for beats.
    **kwargs:
        Passed to ``pyarrow.flight.FlightServerBase``, e.g. ``tls_certificates`` (see
        :func:`flightq.auth.tls_certificates`) with a ``grpc+tls://`` location.
    """

    def __init__(
        self,
        location: str = "grpc://127.0.0.1:0",
        registry: SchemaRegistry | None = None,
        *,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        memory_budget: int | None = None,
        max_put_batch_bytes: int = DEFAULT_MAX_PUT_BATCH_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        tokens: Iterable[str] | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        restore: str | os.PathLike[str] | None = None,
        peers: Iterable[str] | None = None,
        shm: bool | str = True,
        max_calls: int = DEFAULT_MAX_CALLS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        max_tags_bytes: int = MAX_TAGS_BYTES,
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(max_tags_bytes, bool)
            or not isinstance(max_tags_bytes, int)
            or not MAX_TAGS_BYTES <= max_tags_bytes <= MAX_TAGS_LIMIT
        ):
            raise ProtocolError(
                f"max_tags_bytes must be an int from {MAX_TAGS_BYTES} to {MAX_TAGS_LIMIT}, "
                f"got {max_tags_bytes!r}",
                actual=max_tags_bytes,
            )
        #: Longest tags a put may give one row, in msgpack bytes (health tells clients).
        self.max_tags_bytes = max_tags_bytes
        if (
            isinstance(max_request_bytes, bool)
            or not isinstance(max_request_bytes, int)
            or max_request_bytes < MIN_MAX_REQUEST_BYTES
        ):
            raise ProtocolError(
                f"max_request_bytes must be an int >= {MIN_MAX_REQUEST_BYTES} (2 MiB, what a "
                f"flightq client's messages may take), got {max_request_bytes!r}",
                actual=max_request_bytes,
            )
        #: Largest control message a client may send, and what it may decode to.
        self.max_request_bytes = max_request_bytes
        #: Where gets in parts are cut, kept for a get's later streams.
        self.part_cuts = PartCuts()
        self.counters = counters = Counters()
        self.limits = CallLimits(max_calls, max_sessions, on_refused=counters.refused)
        # The middleware lives in gRPC, out of the garbage collector's sight: nothing it
        # holds may lead back to the server, or a stopped server (its shared-memory copies
        # included) would live as long as the process.
        self.idle = IdleWatch(idle_timeout, on_cut=lambda peer: counters.add("idle_cuts"))
        if tokens is not None:
            from ..auth import BearerTokenServerMiddlewareFactory

            kwargs["middleware"] = {
                **kwargs.get("middleware", {}),
                "flightq.auth": BearerTokenServerMiddlewareFactory(tokens),
            }
        # In this order: a call refused by authentication never takes a slot, and the
        # watch follows only admitted calls (Flight tells no middleware started before a
        # refusing one that the call ended: it would follow a refused call for good).
        kwargs["middleware"] = {**kwargs.get("middleware", {}), LIMITS_KEY: self.limits}
        kwargs["middleware"] = {**kwargs.get("middleware", {}), MIDDLEWARE_KEY: self.idle}
        self.registry = registry if registry is not None else SchemaRegistry.default()
        self.store = Store(memory_budget)
        #: Large action replies being built and sent (:mod:`flightq.server.replies`).
        self.replies = ReplyRoom.for_budget(memory_budget)
        if restore is not None:
            self._restore(restore)
        forks.used()  # a server in a process forked after gRPC was used would hang too
        try:
            super().__init__(location, **kwargs)
        except pa.ArrowException as e:
            raise _listen_error(location, e) from e
        self.idle.port = self.port
        self.max_batch_bytes = max_batch_bytes
        self.max_put_batch_bytes = max_put_batch_bytes
        self.snapshot_dir = snapshot_dir
        if snapshot_dir is not None:
            from .snapshot import remove_stale

            remove_stale(snapshot_dir)  # of a snapshot a killed server left unfinished
        host = location.split("://", 1)[-1].rsplit(":", 1)[0]
        scheme = location.split("://", 1)[0]
        self._location = f"{scheme}://{host}:{self.port}"
        self._thread: threading.Thread | None = None
        self._stopper: threading.Thread | None = None
        self.peers: list[str] = list(peers or [])
        from .. import shm as _shm

        self.shm_dir = _shm.directory(shm) if shm else None
        # The pool a put's copy goes into stays warm while this server lives: each put then
        # reuses segments freed by cleared rows instead of faulting in fresh tmpfs pages.
        self._store_hold = (
            None if self.shm_dir is None else (self.shm_dir, _shm.STORES.hold(self.shm_dir))
        )
        #: Free shared memory each of this server's pools keeps warm for reuse, outside the
        #: memory budget: a quarter of the budget, at most 2 GiB.
        self.shm_keep_bytes = _shm.DEFAULT_KEEP_BYTES
        if memory_budget is not None:
            self.shm_keep_bytes = min(self.shm_keep_bytes, memory_budget // 4)
        if self._store_hold is not None:
            pool = self._store_hold[1]  # shared by the servers of this process: the least
            pool.keep_bytes = min(pool.keep_bytes, self.shm_keep_bytes)
        self._shm_pool: _shm.SegmentPool | None = None
        self._staging = Staging(idle=idle_timeout)
        self._shm_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        # Answers written into shared memory and not yet taken by their reader are held
        # by the server: the budget counts them (Store.held).
        self.store.unread = self._unread_answers
        exiting.server_serving(self)  # stopped at exit, before Arrow's own exit hook

    @property
    def location(self) -> str:
        """The bound address, e.g. ``grpc://127.0.0.1:40123``."""
        return self._location

    @property
    def shm_put_batch_bytes(self) -> int:
        """The largest record batch a put through shared memory may carry (and an answer
        through it): :data:`flightq.shm.PUT_BATCH_BYTES`, or ``max_put_batch_bytes`` where
        that is larger."""
        from ..shm import PUT_BATCH_BYTES

        return max(self.max_put_batch_bytes, PUT_BATCH_BYTES)

    @property
    def shm_pool(self) -> SegmentPool | None:
        """The shared-memory segments this server wrote answers into (read-only; for
        diagnostics: ``shm_pool.paths()``). None until an answer first needs one."""
        return self._shm_pool

    def start(self) -> Server:
        """Serve in a background thread (the server already listens once constructed).

        Signals stay the application's: Arrow's ``serve()`` would take SIGINT and SIGTERM
        and shut gRPC down first, which waits forever on an open consumer session (it
        ends only with :meth:`stop`).
        """
        if self._thread is None:
            log.info("flightq server listening on %s", self.location)
            self._thread = threading.Thread(target=self.wait, name="flightq-server", daemon=True)
            self._thread.start()
            self.idle.start()
        return self

    def stop(self, deadline: float = 10.0) -> bool:
        """Shut down gracefully within ``deadline`` seconds.

        New calls are refused; claims and puts waiting for rows or space fail at once
        with UnavailableError; requests being processed (a put streaming in, a read
        streaming out) finish, but the connection of a stream that waits on its client
        for half the deadline (or ``idle_timeout``, if shorter) is cut. Once every call has
        ended, the server lets go of its partitions, their rows and the shared-memory
        segments they lie in (``store`` is empty from then on). Returns whether everything
        finished within the deadline.
        """
        self.store.close()
        self.idle.hurry(deadline / 2)  # a stream its client stalled would hold shutdown
        with self._stop_lock:  # stop() from two threads (one at exit): one shutdown
            if self._stopper is None:
                log.info("flightq server on %s stopping", self.location)
                self._stopper = threading.Thread(
                    target=self.shutdown, name="flightq-shutdown", daemon=True
                )
                self._stopper.start()
        self._stopper.join(timeout=deadline)
        if self._stopper.is_alive():
            # Its segments and watchdog go once the last call has ended, not never.
            stopper = self._stopper

            def late() -> None:
                stopper.join()
                self._finish(deadline)

            threading.Thread(target=late, name="flightq-stop-late", daemon=True).start()
            return False
        self._finish(deadline)
        return True

    def _finish(self, deadline: float) -> None:
        # Once Flight's shutdown returned: no call runs that needs what goes here.
        exiting.server_stopped(self)
        thread = self._thread
        if thread is not None:
            thread.join(timeout=deadline)
            self._thread = None
        self.idle.stop()
        self.store.let_go()
        with self._shm_lock:  # stop() again and the late finisher: each goes once
            pool, self._shm_pool = self._shm_pool, None
            hold, self._store_hold = self._store_hold, None
        if pool is not None:
            pool.close()
        if hold is not None:
            from .. import shm as _shm

            _shm.STORES.let_go(*hold)

    def _restore(self, path: str | os.PathLike[str]) -> None:
        from .snapshot import read_snapshot

        parts = read_snapshot(path, self.max_request_bytes)
        for p in parts:
            try:
                mine = self.registry.get(p.schema.ref)
            except UnknownSchemaError:
                mine = self.registry.register(p.schema)
            if mine.fingerprint != p.schema.fingerprint:
                raise SchemaMismatchError(
                    f"snapshot partition {p.name!r} has schema {p.schema.ref} "
                    f"({p.schema.fingerprint}); the server's differs ({mine.fingerprint}): "
                    + "; ".join(diff_schemas(mine, p.schema))
                )
        self.store.restore(parts)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers

    def _send(
        self,
        context: fl.ServerCallContext | None,
        schema: pa.Schema,
        batches: Iterator[pa.RecordBatch],
    ) -> fl.FlightDataStream:
        """A DoGet's answer stream, watched for a client that stops reading."""
        return _stream(schema, self.idle.sends(context, batches))

    def _guard(self, fn: Any, *args: Any) -> Any:
        started = time.perf_counter()  # a DoGet's until its answer starts
        try:
            return fn(*args)
        except FlightqError as e:
            suggest(e)  # close names of an unknown one, now that no lock is held
            if any(isinstance(a, fl.ServerCallContext) and a.is_cancelled() for a in args):
                self.counters.add("cancelled")  # no one to refuse: its client is gone
            else:
                self.counters.refused(type(e).__name__)
            log.info(
                "refused %s (partition %s, key %s): %s",
                type(e).__name__,
                getattr(e, "partition", None),
                getattr(e, "key", None),
                e,
            )
            raise to_flight_error(e) from None
        except MemoryError as e:  # an allocation past the process's cap (flightq serve)
            self.counters.refused("ResourceExhaustedError")
            log.warning("refused a call that needed more memory than the cap: %s", e)
            raise to_flight_error(
                ResourceExhaustedError(
                    f"the server could not take the memory this call needs ({e})"
                )
            ) from None
        finally:
            self.counters.observe(call_kind(fn.__name__, args), time.perf_counter() - started)

    # ------------------------------------------------------------------ DoPut

    def do_put(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.FlightMetadataWriter,
    ) -> None:
        self.idle.entered(context)
        self._guard(self._do_put, descriptor, reader, writer, context)
        self.counters.add("puts")

    def _do_put(
        self,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.FlightMetadataWriter,
        context: fl.ServerCallContext | None = None,
    ) -> None:
        def source(cmd: PutCommand, what: str, advance: Advance) -> Iterator[Incoming]:
            return self._put_source(cmd, reader, context, what, advance)

        done = self._store_put(_command(descriptor, PutCommand.WHAT), source, context)
        # The acknowledgement, then what the put created: a message of its own, which a
        # client reading only the acknowledgement (an older one) never parses.
        writer.write(pa.py_buffer(PutAck(rows=done.rows).to_wire()))
        writer.write(pa.py_buffer(done.record().to_wire()))

    def _store_put(
        self,
        command: bytes,
        source: Callable[[PutCommand, str, Advance], Iterator[Incoming]],
        context: fl.ServerCallContext | None,
    ) -> Stored:
        """One put, all or nothing: ``command`` parsed, the batches ``source`` gives checked
        and stored (or its part staged); returns what it did. The one path of every put,
        per call (DoPut) or on the request stream (:mod:`flightq.server.exchange`)."""
        raw = unpack(command, PutCommand.WHAT, self.max_request_bytes)
        try:
            cmd = PutCommand.parse(raw)
            staged = self._staging.check(cmd)
        except ProtocolError as e:
            self._staging.refuse(raw, e)  # a refused part fails the put it belongs to
            raise
        name = cmd.partition
        pieces: list[Any] = []
        if staged is not None:  # the parts here wait while this one is on its way
            self._staging.arrive(name, *staged)
        advance: Any = None
        try:
            try:
                # Bytes held before the pieces exist (a shared-memory copy's segment).
                advance = self.store.advance(name, cmd.timeout)
                incoming = source(cmd, f"put to {name!r}", advance)
                self._put_pieces(cmd, incoming, context, pieces, advance)
            except BaseException as e:
                if staged is not None:  # the other parts fail with it
                    self._staging.fail(name, staged[0], staged[2], e)
                raise
            finally:
                if staged is not None:
                    self._staging.left(name, staged[0], staged[1])

            stored: list[Any] = []

            def store(every: list[Any]) -> Stored:
                put = self.store.put(name, every, cmd.overwrite, cmd.timeout, cmd.put_id)
                stored.extend(every)
                return put

            if staged is None:
                done = store(pieces)
            else:
                cancelled = None if context is None else context.is_cancelled
                done = self._staging.join(name, *staged, pieces, store, cmd.timeout, cancelled)
        finally:
            self.store.release(pieces)  # what was not stored counts no more
            if advance is not None:
                advance.release()
        self._prepare_answers(name, stored, cmd.shm is not None and self.shm_dir is not None)
        self.counters.add("rows_put", done.rows)
        log.debug("put of %d rows to %r (%d created)", done.rows, name, done.created)
        return done

    def _prepare_answers(self, name: str, pieces: list[Any], shm: bool) -> None:
        """The answer forms of a put's stored batches, made before it is acknowledged, where
        its partition has media fields (a claim of part of a batch is then its form's slice,
        :func:`~.assemble.assemble`) or the put came through shared memory (a same-host
        reader of the step comes next: its first get then costs the server what a later
        one does, the form described for it too; see docs/performance.md). Only what a
        piece keeps (:func:`~.media.prepare_answer`); a partition gone meanwhile, nothing."""
        from ..shm import table as shmtable

        try:
            p = self.store.partition(name)
        except FlightqError:
            return
        if not shm and not p.media_fields:
            return
        roles = {f.name: f.role for f in p.schema.fields}
        try:  # the put is stored: what fails here only leaves its first reader more to do
            made = [prepare_answer(pc, roles) if _homed(p, pc) else None for pc in pieces]
            if shm:
                for w in made:
                    if w is not None:
                        shmtable.prepare(w)
                if made and all(w is not None for w in made):
                    shmtable.prepare_reply(made)  # a get of the step, as the put left it
        except Exception:
            log.debug("put to %r: its answer forms were not prepared", name, exc_info=True)

    def _put_pieces(
        self,
        cmd: PutCommand,
        source: Iterator[Incoming],
        context: fl.ServerCallContext | None,
        pieces: list[Any],
        advance: Advance | None = None,
    ) -> None:
        """One put stream's record batches, each checked against the partition's schema
        and its caps (:mod:`flightq.server.budget`), appended to ``pieces`` as they come
        and counted against the memory budget from then on (reserved in the store)."""
        name, rows = cmd.partition, cmd.rows
        what = f"put to {name!r}"
        part = self.store.partition(name)
        budget = self.store.memory_budget
        # Through shared memory a step is one record batch up to PUT_BATCH_BYTES.
        limit = self.max_put_batch_bytes if cmd.shm is None else self.shm_put_batch_bytes
        media = DictionaryUse(what)
        got = reserved = 0
        last_block: Block | None = None  # a block's batches come one after another
        try:
            for data, claims, block in source:
                # All its buffers (cheap); exact referenced bytes only where that matters.
                size = data.get_total_buffer_size()
                if size > limit and data.nbytes > limit:
                    size = data.nbytes
                    raise ProtocolError(
                        f"put to {name!r}: a record batch of {size} bytes exceeds the "
                        f"server's limit of {limit} bytes per batch; "
                        "send smaller batches (Client(max_batch_bytes=...))"
                    )
                check_batch(data, what, self.max_tags_bytes)
                got += data.num_rows
                self.counters.add("bytes_received", size)
                piece = media_piece(
                    part, data, claims, what, budget, self._hashed, self.max_request_bytes
                )
                piece.epoch = part.epoch
                if block is not None:  # memory beyond the batch, freed with the last piece
                    piece.block = block
                    if block is not last_block:
                        piece.extra = block.cost  # reserved with the first of them
                    last_block = block
                media.add(data)
                self.store.reserve(name, piece, reserved, cmd.timeout, advance)
                reserved += piece.reserved
                pieces.append(piece)
            media.finish()
            if advance is not None:
                self._count_rest(name, pieces, reserved, cmd.timeout, advance)
        except MemoryError as e:  # Arrow's own allocation past the cap (flightq serve)
            raise ResourceExhaustedError(
                f"put to {name!r}: a record batch needs more memory than the server may "
                f"take ({e}); nothing was stored. Arrow inflates IPC-compressed bodies to "
                "the size they declare before any check: send uncompressed record batches"
            ) from e
        except pa.ArrowException as e:
            raise ProtocolError(
                f"put to {name!r}: the stream broke off or is malformed: {e}"
            ) from e
        # A writer that died mid-put may look like a clean end of stream: never store it.
        if context is not None and context.is_cancelled():
            raise ProtocolError(f"put to {name!r}: the client went away; nothing was stored")
        if rows is not None and got != rows:
            raise ProtocolError(
                f"put to {name!r}: the stream ended after {got} of the {rows} rows announced; "
                "nothing was stored"
            )

    # ------------------------------------------------------------------ DoGet

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.FlightDataStream:
        self.idle.entered(context)
        # Parsed apart, so that the call's latency is filed under the ticket's op.
        t = self._guard(parse_ticket, ticket.ticket, self.max_request_bytes)
        return self._guard(self._do_get, t, context)

    def _do_get(
        self, ticket: Ticket, context: fl.ServerCallContext | None = None
    ) -> fl.FlightDataStream:
        # The rows it reads stay counted until the call is over: its last batches may lie
        # in gRPC's buffers, as slices of the stored ones, after Flight took them all.
        defer = functools.partial(self.limits.at_end, context)
        schema, batches, undo, _ = self._answer(ticket, context, defer=defer)
        return self._send(context, schema, batches if undo is None else _undone(batches, undo))

    def _answer(
        self,
        t: Ticket,
        context: fl.ServerCallContext | None,
        count: bool = True,
        defer: Callable[[Callable[[], None]], bool] | None = None,
    ) -> tuple[pa.Schema, Iterator[pa.RecordBatch], Callable[..., None] | None, int]:
        """A read's answer: its schema, its batches, for a claim what gives the rows back
        should the answer not reach the client (None for a get or a scan), and how many
        rows it holds. The one path of every read, per call (DoGet) or on the request
        stream (which counts the read, its rows and its bytes itself once it sends them:
        ``count=False``). The rows it reads stay counted in the budget until its batches
        end, or until what ``defer`` is given runs (the call's end), where it takes it."""
        reading: list[Reading] = []
        try:
            if isinstance(t, GetTicket):
                t.check_parts()
                part, rows, names = self.store.rows_for_get(t.partition, t.keys, t.fields, reading)
                if t.parts is not None:
                    rows = self.part_cuts.rows(t, part, rows, names)
            elif isinstance(t, ScanTicket):
                part, rows, names = self.store.scan(t.partition, reading)
            else:
                assert isinstance(t, ClaimTicket)
                return self._claim_answer(t, context, count, reading, defer)
            wholes: list[Answered] = []
            schema, batches = self._assemble(t, part, rows, names, count, wholes)
            batches = self._reading(batches, reading, defer)
            return (*self._shm_reply(t, schema, batches, context, wholes), None, len(rows))
        except BaseException:
            self._end_reading(reading)
            raise

    def _reading(
        self,
        batches: Iterator[pa.RecordBatch],
        reading: list[Reading],
        defer: Callable[[Callable[[], None]], bool] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """``batches``, the rows they read kept counted (:mod:`flightq.server.readings`)
        until ``defer`` runs what it is given, where it takes it, else until the batches
        end: let go (sent, or never asked for), closed or failed."""
        end = functools.partial(self._end_reading, reading)
        if not reading or (defer is not None and defer(end)):
            return batches
        return _Ending(batches, end)

    def _end_reading(self, reading: list[Reading]) -> None:
        while reading:
            self.store.end_reading(reading.pop())

    def _claim_answer(
        self,
        t: ClaimTicket,
        context: fl.ServerCallContext | None,
        count: bool,
        reading: list[Reading],
        defer: Callable[[Callable[[], None]], bool] | None,
    ) -> tuple[pa.Schema, Iterator[pa.RecordBatch], Callable[..., None], int]:
        name, task = t.partition, t.task
        cancelled = context.is_cancelled if context is not None else None
        part, rows, names, lease = self.store.claim(
            name,
            task,
            t.batch_size,
            t.fields,
            t.timeout,
            t.wait_for,
            cancelled,
            t.lease,
            t.session,
            park=lambda: self.limits.park(context),
            call=t.call,
            reading=reading,
        )
        try:
            wholes: list[Answered] = []
            schema, batches = self._assemble(t, part, rows, names, count, wholes)
            batches = self._reading(batches, reading, defer)
            schema, batches = self._shm_reply(t, schema, batches, context, wholes)
            st = part.progress.tasks[task]
            grant = ClaimGrant(
                claim=lease.id,
                lease=lease.seconds,
                deliveries=[st.deliveries.get(k, 1) for k in lease.keys],
            )
            schema = schema.with_metadata(
                {**(schema.metadata or {}), CLAIM_METADATA: grant.to_wire()}
            )
        except BaseException:
            self.store.unclaim(name, lease, sent=False)
            raise
        # ``undo()``: the answer broke off on its way (a delivery, counted: a consumer that
        # dies reading a poison row must not get it for ever); ``undo(False)``: it never left.
        undo = lambda sent=True: self.store.unclaim(name, lease, sent)  # noqa: E731
        return schema, batches, undo, len(rows)

    def _assemble(
        self,
        t: Ticket,
        part: Partition,
        rows: list[Row],
        names: list[str],
        count: bool = True,
        wholes: list[Answered] | None = None,
    ) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """A read's answer: batches bounded for the socket (small slices copied together),
        large and as stored over shm, where the consumer maps them; ``count``: the read
        and its rows count now, its bytes as they go; ``wholes``: see
        :func:`~.assemble.assemble`."""
        if count:
            self.counters.add(read_counter(t.op))
            self.counters.add("rows_sent", len(rows))
        log.debug("%s of %d rows from %r", t.op, len(rows), t.partition)
        hide = t.hide_tag_values if isinstance(t, (GetTicket, ClaimTicket)) else None
        if not t.shm:
            schema, batches = assemble(
                part, rows, names, self.max_batch_bytes, coalesce=True, hide=hide
            )
        else:
            limit = max(self.max_batch_bytes, self.shm_put_batch_bytes)
            schema, batches = assemble(part, rows, names, limit, held=wholes, hide=hide)
        return schema, self._sent(batches) if count else batches

    def _sent(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``batches``, counting their bytes as they go out."""
        for b in batches:
            self.counters.add("bytes_sent", b.nbytes)
            yield b

    # ------------------------------------------------------------------ DoExchange

    def do_exchange(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.MetadataRecordBatchWriter,
    ) -> None:
        self.idle.entered(context)
        self._guard(self._do_exchange, context, descriptor, reader, writer)

    def _do_exchange(
        self,
        context: fl.ServerCallContext,
        descriptor: fl.FlightDescriptor,
        reader: fl.MetadataRecordBatchReader,
        writer: fl.MetadataRecordBatchWriter,
    ) -> None:
        """A request stream (:mod:`flightq.server.exchange`), or a consumer session: held
        open by the client while it lives. The leases of claims made under a session end
        the moment it ends (the client closed, crashed or lost its connection), or when
        the server shuts down."""
        raw = unpack(
            _command(descriptor, "DoExchange"), "DoExchange command", self.max_request_bytes
        )
        if raw.get("op") == "requests":
            RequestsCommand.parse(raw)
            serve_requests(
                context,
                reader,
                writer,
                put=self._stream_put,
                answer=self._answer,
                act=self._stream_act,
                counters=self.counters,
                closing=lambda: self.store.closing,
                watch=lambda writes: self.idle.reads(context, writes),
                patient=lambda: self.idle.patient(context),
                limit=self.max_request_bytes,
            )
            return
        cmd = SessionCommand.parse(raw)
        # Beats are watched only where a silent session can be ended: by the watchdog.
        silence = cmd.silence if cmd.silence is not None and self.idle.watching else None
        sid = self.store.open_session()
        try:
            reply = SessionReply(session=sid, silence=silence)
            writer.write_metadata(pa.py_buffer(reply.to_wire()))
            if silence is None and not self.idle.watching:
                # The client sends nothing: it cancels the call to end the session, or
                # its process or connection goes away, which cancels it too.
                self._until_cancelled(context)
            elif not self._beats(context, reader, sid, silence):
                self._until_cancelled(context)  # its side closed; its leases hold
        finally:
            self.store.end_session(sid)

    def _until_cancelled(self, context: fl.ServerCallContext) -> None:
        while not context.is_cancelled() and not self.store.closing:
            time.sleep(_SESSION_POLL)

    def _beats(
        self,
        context: fl.ServerCallContext,
        reader: fl.MetadataRecordBatchReader,
        sid: str,
        silence: float | None,
    ) -> bool:
        """Read a session's beats until its stream ends, the server stops, or the watch
        finds it silent for ``silence`` seconds (it then ends the session and cuts the
        connection, which ends the read). Returns False where a session without a silence
        saw its client close its side (the session lives on until the call ends).

        A session without a silence (``None``) asks for no beats, but its stream is read
        all the same, each read a wait by design (cut only once the server stops): beats
        sent anyway are taken as beats, and anything else is refused at once instead of
        piling up unread in the connection's buffers."""
        beats = None
        if silence is not None:
            beats = self.idle.heartbeats(context, silence, lambda: self.store.end_session(sid))
        what = "consumer session"
        last = -MIN_BEAT_GAP
        while not self.store.closing:
            try:
                if beats is None:
                    with self.idle.patient(context):
                        chunk = reader.read_chunk()
                else:
                    chunk = reader.read_chunk()
            except StopIteration:
                return beats is not None  # the client closed its side
            except fl.FlightError:
                return True  # cancelled, or its connection was cut
            except pa.ArrowException as e:
                raise ProtocolError(f"{what}: unreadable message: {e}") from e
            if chunk.data is not None:
                raise ProtocolError(f"{what}: a session carries beats only, not record batches")
            meta = chunk.app_metadata
            if meta is None or meta.size > _MAX_BEAT_BYTES:
                size = "none" if meta is None else f"{meta.size} bytes"
                raise ProtocolError(
                    f"{what}: a beat is app metadata of at most {_MAX_BEAT_BYTES} bytes, got {size}"
                )
            SessionBeat.parse(meta)
            early = last + MIN_BEAT_GAP - time.monotonic()
            if early > 0:  # too soon after the one before: the next read waits
                self.counters.add("beats_slowed")
                time.sleep(early)
            if beats is not None:
                beats.heard()
            self.counters.add("beats")
            last = time.monotonic()
        return True

    def _stream_put(
        self,
        command: bytes,
        batches: list[pa.RecordBatch],
        claims: list[bytes | None],
        blocks: list[int] | None,
        context: fl.ServerCallContext,
    ) -> Stored:
        """A put on the request stream: the DoPut path over the frame's batches, each with
        the media digests it claims (``claims``; None: its payloads are filed under their
        hints, as through shm) and, where each was read from a copy of its own, that copy's
        size (``blocks``: what it holds beyond its buffers is known without a walk)."""

        def source(cmd: PutCommand, what: str, advance: Advance) -> Iterator[Incoming]:
            if cmd.shm is not None:
                raise ProtocolError(
                    f"{what}: a put through shared memory goes per call (DoPut), not on "
                    "the request stream"
                )
            # Copies of their own bytes (frames.parse_frame).
            if blocks is None:
                return _first_holds(batches, claims)
            return (
                (b, None if c is None else pa.py_buffer(c), _block(n - b.get_total_buffer_size()))
                for b, c, n in zip(batches, claims, blocks, strict=True)
            )

        # No cancel check (grpc's costs a third of a millisecond): the frame arrived whole,
        # its lengths checked, so the stream cannot have been cut short mid-put.
        return self._store_put(command, source, None)

    def _count_rest(
        self, name: str, pieces: list[Any], reserved: int, timeout: float, advance: Advance
    ) -> None:
        """Count what the put's memory holds beyond what its rows count, then let go of
        ``advance``. The segment a put through shared memory was copied into lives as long
        as any of its rows, payloads of media the partition held already included: the
        rows use the stored copies, but their other columns keep the whole file alive.
        Where that is mostly such payloads (a row streamed with its group's image), the
        rows are copied out of the segment, which then goes; otherwise the rest is counted
        on the segment's block, as long as any of its rows is stored."""
        rest = advance.left
        if (
            rest > _COMPACT_MIN
            and not any(p.brings for p in pieces)
            and rest > sum(p.batch.get_total_buffer_size() for p in pieces)
        ):
            for p in pieces:
                p.batch = _own_copy(p.batch)
                p.block = None
        else:
            # The first piece of the segment's block: the one that reserves it.
            pc = next((p for p in pieces if p.block is not None), None)
            if rest and pc is not None and pc.block is not None:
                pc.block.cost += rest
                pc.extra += rest
                self.store.reserve(name, pc, reserved - pc.reserved, timeout, advance)
        advance.release()

    def _hashed(self, nbytes: int) -> None:
        """Count media bytes hashed to resolve a put (flightq.server.media)."""
        self.counters.add("media_hashed_bytes", nbytes)

    # ------------------------------------------------------------------ shared memory

    def _put_source(
        self,
        cmd: PutCommand,
        reader: fl.MetadataRecordBatchReader,
        context: fl.ServerCallContext | None,
        what: str,
        advance: Advance,
    ) -> Iterator[Incoming]:
        """A put's record batches and their app metadata (the media digests they claim):
        from the stream, or mapped from a shm segment (no digests: the server hashes).
        The segment the server copies a shm put into is counted in ``advance`` before the
        copy starts, and on the batches' rows once they are reserved."""
        ref = cmd.shm
        if ref is None:  # each read waits on the client: watched for a stall
            # A batch is a slice of its Flight message: what the message holds beyond it
            # (its header; any gaps a client left between buffers) lives as long as it does.
            chunks = self.idle.reads(context, (chunk for chunk in reader))
            return ((c.data, c.app_metadata, _block(_beyond([c.data]))) for c in chunks)
        from .. import shm

        if self.shm_dir is None:
            raise ProtocolError(f"{what}: this server has shared memory disabled")
        if context is not None:
            shm.check_peer(context.peer(), what)
        peer = context.peer() if context is not None else None
        batches, size = shm.read(ref.to_dict(), self.shm_dir, what, peer=peer, hold=advance)
        if ref.fills is not None:
            self.counters.add("shm_direct_bytes", shm.filled_bytes(ref.fills))
        return _first_holds(batches, size=size)  # the server's copy: the whole segment

    def _shm_reply(
        self,
        t: Ticket,
        schema: pa.Schema,
        batches: Iterator[pa.RecordBatch],
        context: fl.ServerCallContext | None,
        wholes: list[Answered] | None = None,
    ) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """A read's answer: the batches, or (ticket ``shm``) the segment holding them;
        ``wholes``: the stored batches answered whole, once the batches are made."""
        if not t.shm:
            return schema, batches
        from .. import shm
        from ..shm import table as shmtable

        what = f"{t.op} from {t.partition!r}"
        if self.shm_dir is None:
            raise ProtocolError(f"{what}: this server has shared memory disabled")
        if context is not None:
            shm.check_peer(context.peer(), what)
        with self._shm_lock:
            pool = self._shm_pool
            if pool is None or pool.dir != self.shm_dir:  # first use, or moved
                if pool is not None:
                    pool.close()
                pool = self._shm_pool = shm.SegmentPool(
                    self.shm_dir, keep_bytes=self.shm_keep_bytes
                )
        # Listed before any is sent, so held at once: at most MAX_SHM_ANSWER_BATCHES
        # batches, and copies (a prompt group's image out of two puts' dictionaries, once
        # per batch) of at most what the answer could take in shared memory. Past either,
        # the rest goes over the socket as it is made.
        room = self._answer_cap()
        start = copied.so_far()
        whole: list[pa.RecordBatch] = []
        for b in batches:
            whole.append(b)
            if len(whole) > MAX_SHM_ANSWER_BATCHES or copied.so_far() - start > room:
                self.counters.add("shm_answers_declined")
                return schema, itertools.chain(whole, batches)
        wrote: list[dict[str, Any]] = []
        got = shmtable.answer(pool, schema, whole, what, self._answer_room, wrote, wholes)
        if got is None:  # no room for it to wait for its reader: over the socket
            self.counters.add("shm_answers_declined")
            return schema, iter(whole)
        out_schema, out = got
        if not wrote:
            return out_schema, iter(out)

        def abandon() -> None:  # an answer that does not reach its client: its segment
            for ref in wrote:  # goes back to the pool (and out of the budget) at once
                pool.abandon(ref)

        return out_schema, _undone(iter(out), abandon)

    def _unread_answers(self) -> int:
        """Bytes of shared-memory answers written and not yet taken by their reader."""
        pool = self._shm_pool
        return 0 if pool is None else pool.unread_bytes()

    def _answer_cap(self) -> int:
        """Bytes of shared-memory answers that may wait for their readers at once."""
        budget = self.store.memory_budget
        return MAX_UNREAD_ANSWER_BYTES if budget is None else budget // 4

    @contextlib.contextmanager
    def _answer_room(self) -> Iterator[Callable[[int], bool]]:
        """Within it, ``admit(size)``: whether ``size`` more bytes of an answer's segment
        may be written into shared memory to wait for its reader. Such answers count in the
        memory budget until taken, and take at most a quarter of it (without one, at most
        :data:`MAX_UNREAD_ANSWER_BYTES` wait at once); at most :data:`MAX_UNREAD_ANSWERS`
        wait."""
        cap = self._answer_cap()
        counted = 0

        def admit(size: int) -> bool:
            nonlocal counted
            pool = self._shm_pool
            if pool is not None and pool.unread()[1] >= MAX_UNREAD_ANSWERS:
                return False
            ok = self.store.take_outside(size, cap)
            counted += size if ok else 0
            return ok

        try:
            yield admit
        finally:
            if counted:  # written (counted as unread from now on) or failed
                self.store.give_outside(counted)

    # ------------------------------------------------------------------ DoAction

    def list_actions(self, context: fl.ServerCallContext) -> list[tuple[str, str]]:
        self.idle.entered(context)
        return [(kind, spec.doc) for kind, spec in ACTIONS.items()]

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> Iterator[bytes]:
        self.idle.entered(context)
        held = Held(self.replies)
        try:
            reply = self._guard(self._do_action, action, context.peer(), held)
        except BaseException:
            held.release()
            raise
        return _sent_then(reply, held.release)

    def _stream_act(self, kind: str, body: bytes) -> bytes:
        """An action on a request stream: its reply built within the room for large
        replies, which it leaves once built (one past a frame is asked again per call)."""
        held = Held(self.replies)
        try:
            return self._do_action(fl.Action(kind, body), None, held)
        finally:
            held.release()

    def _do_action(
        self, action: fl.Action, peer: str | None = None, held: Held | None = None
    ) -> bytes:
        """One action: its body parsed with the action's request type, its handler's reply
        as msgpack bytes (one Flight ``Result``). A handler whose reply may be large holds
        its bytes in ``held`` (:mod:`flightq.server.replies`) until the caller lets go,
        once the reply is sent."""
        spec = ACTIONS.get(action.type)
        if spec is None:
            name = action.type if len(action.type) <= 64 else action.type[:64] + "..."
            raise ProtocolError(f"unknown action {name!r} (of {len(action.type)} characters)")
        body = action.body if action.body.size else {}
        request = spec.request.parse(body, limit=self.max_request_bytes)
        self.counters.add("actions")
        context = ActionContext(
            self.store,
            self.registry,
            self._staging,
            self.shm_dir,
            self.snapshot_dir,
            counters=self.counters,
            peer=peer,
            shm_batch_bytes=self.shm_put_batch_bytes,
            reply=held,
            max_tags_bytes=self.max_tags_bytes,
        )
        reply = HANDLERS[action.type](context, request).to_wire()
        if len(reply) > MAX_ACTION_REPLY_BYTES:  # one gRPC message: past 2 GiB gRPC aborts
            raise ResourceExhaustedError(
                f"{action.type}: a reply of {len(reply)} bytes passes what the server sends "
                f"as one Flight result ({MAX_ACTION_REPLY_BYTES}); ask for less per call "
                "(list_keys: name the keys, a part of the partition at a time)",
                expected=MAX_ACTION_REPLY_BYTES,
                actual=len(reply),
            )
        return reply

    # ------------------------------------------------------------------ descriptions

    def _info(self, name: str) -> fl.FlightInfo:
        part, rows, names = self.store.scan(name)
        from ..layout import arrow_schema

        schema = arrow_schema(part.schema, names)
        ticket = fl.Ticket(ScanTicket(partition=name).to_wire())
        # Sharded: one endpoint per peer, same scan ticket; totals of other shards unknown.
        where = self.peers or [self.location]
        endpoints = [fl.FlightEndpoint(ticket, [fl.Location(loc)]) for loc in where]
        descriptor = fl.FlightDescriptor.for_path(name)
        n, nbytes = (-1, -1) if self.peers else (len(rows), part.nbytes)
        return fl.FlightInfo(schema, descriptor, endpoints, n, nbytes)

    def list_flights(
        self, context: fl.ServerCallContext, criteria: bytes
    ) -> Iterator[fl.FlightInfo]:
        self.idle.entered(context)
        for p in self.store.partitions():
            try:
                yield self._info(p.name)
            except FlightqError:
                continue  # dropped meanwhile

    def get_flight_info(
        self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor
    ) -> fl.FlightInfo:
        self.idle.entered(context)
        if descriptor.descriptor_type == fl.DescriptorType.PATH and descriptor.path:
            name = self._guard(_path_name, descriptor.path[0])
        else:
            # A command names the partition as a scan ticket does: {"partition": name}.
            scan = self._guard(
                lambda: ScanTicket.parse(
                    _command(descriptor, "descriptor"), "descriptor", self.max_request_bytes
                )
            )
            name = scan.partition
        return self._guard(self._info, name)


#: A put's record batch as it comes in: the batch, the media digests it claims (its app
#: metadata), and the memory it lies in beyond its own buffers (None: none), shared with
#: the batches read from the same place.
Incoming = tuple[pa.RecordBatch, Any, Block | None]


def _block(extra: int) -> Block | None:
    """A block of ``extra`` bytes beyond one batch's buffers (None for none)."""
    return Block(extra) if extra > 0 else None


def _homed(p: Partition, pc: Any) -> bool:
    """Whether ``pc``'s first row is stored as it wrote it (its home): not a write-back's
    columns added to rows stored before, whose answers never read a piece whole."""
    keys = pc.checked.keys
    row = p.rows.get(keys[0]) if keys else None
    return row is not None and row.home is not None and row.home[0] is pc


def _own_copy(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with every buffer copied (only the rows it spans): it holds nothing of
    the memory it was read from."""
    cols = [pa.concat_arrays([c]) for c in batch.columns]
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def _beyond(batches: list[pa.RecordBatch]) -> int:
    """Bytes the memory blocks under ``batches`` hold beyond their buffers (a Flight
    message's header, a frame's schema, a shared-memory copy's stream framing, and
    whatever gaps a client left): counted on their rows, for as long as they hold it."""
    return max(underlying_bytes(batches) - sum(b.get_total_buffer_size() for b in batches), 0)


def _first_holds(
    batches: list[pa.RecordBatch],
    claims: list[bytes | None] | None = None,
    size: int | None = None,
) -> Iterator[Incoming]:
    """``batches`` read from one block of memory (of ``size`` bytes; None: as their
    buffers tell), each with the block, which holds what they do not (freed with the last
    of them, so counted while any is used), and with its claims (``claims[i]``, the media
    digests of batch i; None: none)."""
    if size is None:
        extra = _beyond(batches)
    else:
        extra = max(size - sum(b.get_total_buffer_size() for b in batches), 0)
    block = Block(extra)
    for i, b in enumerate(batches):
        c = None if claims is None else claims[i]
        yield b, None if c is None else pa.py_buffer(c), block


def _sent_then(reply: bytes, done: Callable[[], None]) -> Iterator[bytes]:
    """An action's one result, then ``done()``: once gRPC has taken the result and asks
    for the next, or when the call ends before (the generator closed)."""
    try:
        yield reply
    finally:
        done()


#: How answers are written: Arrow's defaults, made once (left out, pyarrow reads two
#: environment variables per answer to make them).
_IPC = pa.ipc.IpcWriteOptions()


def _stream(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> fl.FlightDataStream:
    # A reader-backed stream writes media dictionaries (and replaces them between stored
    # batches); a dictionary shared by consecutive batches is sent once. A batch serving
    # part of a stored batch carries a dictionary already cut to its rows (assemble).
    return fl.RecordBatchStream(pa.RecordBatchReader.from_batches(schema, batches), _IPC)


def _undone(
    batches: Iterator[pa.RecordBatch], undo: Callable[[], None]
) -> Iterator[pa.RecordBatch]:
    """Yield an answer's batches; if the stream ends before the last, whether it started or
    not (Flight writes the schema first, and a client gone by then asks for no batch),
    run ``undo`` once (a claim gives its rows back, a shared-memory answer its segment)."""
    return _Ending(batches, undo, only_unsent=True)


class _Ending:
    """An answer's batches, ``end`` run once when Flight lets go of them (the call over:
    the last batches may lie in gRPC's buffers until then), when they are closed, or when
    one fails; with ``only_unsent``, not once they were all taken."""

    def __init__(
        self, batches: Iterator[pa.RecordBatch], end: Callable[[], None], only_unsent: bool = False
    ) -> None:
        self._batches = batches
        self._end: Callable[[], None] | None = end
        self._only_unsent = only_unsent

    def __iter__(self) -> _Ending:
        return self

    def __next__(self) -> pa.RecordBatch:
        try:
            return next(self._batches)
        except StopIteration:
            if self._only_unsent:
                self._end = None  # all of it went out
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _path_name(segment: bytes) -> str:
    """The partition a descriptor path names (its first segment, UTF-8)."""
    try:
        return segment.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(
            f"descriptor: the path {segment[:64]!r} is not UTF-8 ({e.reason} at byte "
            f"{e.start}); name the partition in UTF-8"
        ) from e


def _command(descriptor: fl.FlightDescriptor, what: str) -> bytes:
    if descriptor.descriptor_type != fl.DescriptorType.CMD:
        raise ProtocolError(f"{what}: expected a command descriptor")
    return bytes(descriptor.command)


def _listen_error(location: str, e: Exception) -> FlightqError:
    """Why a server could not listen on ``location``: a port in use named as such."""
    import socket

    host, _, port = location.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    busy = False
    if port.isdigit() and int(port):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, int(port)))
            except OSError:
                busy = True
    if busy:
        return UnavailableError(
            f"cannot listen on {host}:{port}: the port is in use (another flightq serve?); "
            "stop that process, or pick another port (--port N, or --port 0 for a free one)"
        )
    return UnavailableError(f"cannot listen on {location}: {e}")


def _malloc_report(kept: bool) -> dict[str, Any]:
    """What this process's allocator runs with, as ``flightq serve`` announces it.

    ``arena_max``: ``MALLOC_ARENA_MAX`` as glibc read it at startup (``flightq serve`` sets
    ``"1"`` and restarts itself where the environment does not set it; None: glibc's
    default). ``keep_freed_memory``: whether :func:`flightq.memory.keep_freed_memory` took
    (freed blocks kept for the next transfer instead of returned to the kernel).
    """
    return {"arena_max": os.environ.get("MALLOC_ARENA_MAX"), "keep_freed_memory": kept}


def cap_own_memory(server: Server, asked: int | None) -> int | None:
    """Cap the data segment of this process, which is ``server``'s own (``flightq serve``,
    a shard actor), at ``asked`` bytes (None: the default of
    :func:`flightq.memory.memory_cap`, from its budget and call limits; 0: no cap);
    returns the cap set, or None."""
    if asked == 0:
        return None
    if asked is None:
        limits = server.limits
        asked = memory_cap(server.store.memory_budget, 2 * (limits.max_calls + limits.max_sessions))
    return None if asked is None else cap_memory(asked)


def serve_forever(args: argparse.Namespace) -> int:
    """``flightq serve``: run a server in the foreground until SIGINT or SIGTERM.

    The process tunes its own allocator (:mod:`flightq.memory`) and says so on its JSON
    startup line: ``"malloc": {"arena_max": ..., "keep_freed_memory": ...}``, and runs the
    cyclic garbage collector rarely (:func:`flightq.memory.collect_rarely`; ``"gc"``: its
    thresholds). Once it listens it caps its own data segment (``--memory-cap``; by default
    :func:`flightq.memory.memory_cap`), so that no message can make it allocate past the
    cap (``"memory_cap"``: the bytes, or null).
    """
    malloc = _malloc_report(keep_freed_memory())
    gc_thresholds = collect_rarely()
    level = str(getattr(args, "log_level", None) or "warning").upper()
    logging.basicConfig(
        level=getattr(logging, level), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    stop_s = getattr(args, "stop_timeout", None)
    stop_s = 10.0 if stop_s is None else stop_s
    if not 0 <= stop_s < float("inf"):
        raise ProtocolError(f"--stop-timeout must be seconds >= 0, got {stop_s!r}", actual=stop_s)
    registry = SchemaRegistry.from_dir(args.schemas) if args.schemas else None
    host = args.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    extra: dict[str, Any] = {}
    scheme = "grpc"
    if getattr(args, "tls_cert", None) or getattr(args, "tls_key", None):
        from ..auth import tls_certificates

        if not (args.tls_cert and args.tls_key):
            raise ProtocolError("TLS needs both --tls-cert and --tls-key")
        extra["tls_certificates"] = tls_certificates(args.tls_cert, args.tls_key)
        scheme = "grpc+tls"
    if getattr(args, "token_file", None) or getattr(args, "tokens_from_env", False):
        from ..auth import read_tokens

        extra["tokens"] = read_tokens(args.token_file)
        if scheme == "grpc":
            print(
                "flightq serve: warning: bearer tokens without TLS travel in clear text; "
                "anyone on the network path can read and replay them. Serve over TLS "
                "(--tls-cert and --tls-key) unless every client is on this host.",
                file=sys.stderr,
                flush=True,
            )
    server = Server(
        f"{scheme}://{host}:{args.port}",
        registry=registry,
        memory_budget=args.memory_budget,
        max_batch_bytes=getattr(args, "max_batch_bytes", None) or DEFAULT_MAX_BATCH_BYTES,
        max_request_bytes=getattr(args, "max_request_bytes", None) or DEFAULT_MAX_REQUEST_BYTES,
        max_tags_bytes=getattr(args, "max_tags_bytes", None) or MAX_TAGS_BYTES,
        snapshot_dir=getattr(args, "snapshot_dir", None),
        restore=getattr(args, "restore", None),
        peers=[p for p in (getattr(args, "peers", None) or "").split(",") if p],
        max_calls=getattr(args, "max_calls", None) or DEFAULT_MAX_CALLS,
        max_sessions=getattr(args, "max_sessions", None) or DEFAULT_MAX_SESSIONS,
        idle_timeout=getattr(args, "idle_timeout", DEFAULT_IDLE_TIMEOUT),
        **extra,
    )
    stop = threading.Event()

    def _handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    server.start()
    started: dict[str, Any] = {
        "listening": server.location,
        "schemas": [s.ref for s in server.registry],
        "memory_cap": cap_own_memory(server, getattr(args, "memory_cap", None)),
    }
    if getattr(args, "metrics_port", None) is not None:
        from .exporter import serve_metrics

        exporter = serve_metrics(server, args.metrics_port, args.metrics_host)
        started["metrics"] = exporter.url
    print(json.dumps({**started, "malloc": malloc, "gc": list(gc_thresholds)}), flush=True)
    # Waking often lets this thread run the handler, else it would wait forever.
    while not stop.wait(0.2):
        pass
    if not server.stop(stop_s):
        # Waiting again at exit would only add the exit hook's bound to what was waited.
        log.error(
            "flightq serve: the server on %s did not stop within %gs (a call that does not "
            "end by itself: a stream its client stalled with --idle-timeout 0); exiting "
            "without waiting for it",
            server.location,
            stop_s,
        )
        exiting.server_left(server)
    return 0
