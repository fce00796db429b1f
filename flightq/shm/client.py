"""The client's side: the handshake, and a put whose batches travel in a segment."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import secrets
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..errors import ProtocolError
from ..protocol import MAX_FILLS, Health, PutCommand, ShmRef
from ..sink import Sink
from .gather import ShmGather
from .segments import SegmentPool

if TYPE_CHECKING:
    from ..client.transport import Acked, Transport

__all__ = ["ClientSegments", "handshake", "probe", "put_via_shm"]


class ClientSegments:
    """A client's segment pool, made on its first put through shared memory. Thread-safe."""

    def __init__(self, dirpath: str) -> None:
        self.dir = dirpath
        self._pool: SegmentPool | None = None
        self._lock = threading.Lock()
        #: Whether the server reads puts out of this process's memory
        #: (:mod:`flightq.shm.direct`); None until asked, on the first put.
        self.direct: bool | None = None
        #: Why not, as the server said.
        self.direct_why = ""
        #: The largest record batch the server takes in a put through shared memory, as
        #: its probe said (None: it did not say, or not yet asked).
        self.batch_bytes: int | None = None
        self._asked = False

    def direct_reads(self, transport: Transport) -> bool:
        """Whether puts leave their payloads for the server to read: asked once (a probe
        through the directory, see :func:`probe`), again after a refused direct put."""
        if self.direct is None:  # False stays: refused by the server, or turned off
            try:
                reply = probe(transport, self.dir, reader=True)
            except ProtocolError as e:
                self.direct, self.direct_why = False, str(e)
            else:
                self.direct = reply.get("direct") is True
                self.direct_why = str(reply.get("direct_why") or "")
                self.learn(reply)
        return self.direct

    def learn(self, reply: dict[str, Any]) -> None:
        """Keep what a probe's reply says of the server's limits (``batch_bytes``)."""
        said = reply.get("batch_bytes")
        if isinstance(said, int) and not isinstance(said, bool) and said > 0:
            self.batch_bytes = said
        self._asked = True

    def put_batch_bytes(self, transport: Transport) -> int | None:
        """The largest record batch the server takes in a put through shared memory, as
        it said (asked once; None: it does not say, as a server older than this)."""
        if not self._asked:
            if self.direct is None:
                self.direct_reads(transport)
            with contextlib.suppress(ProtocolError):
                if not self._asked:
                    self.learn(probe(transport, self.dir))
            self._asked = True
        return self.batch_bytes

    @property
    def pool(self) -> SegmentPool | None:
        """The pool, or None while no put has gone through shared memory."""
        return self._pool

    def get(self) -> SegmentPool:
        """The pool, made now if it is not yet."""
        with self._lock:
            if self._pool is None:
                self._pool = SegmentPool(self.dir)
            return self._pool

    def close(self) -> None:
        """Close the pool (its files are unlinked)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def handshake(transport: Transport, shm_dir: str) -> dict[str, Any]:
    """Check that the server serves shared memory and sees the client's directory.

    The client writes a file of random bytes in its directory; the server's health reply
    must echo them. Returns the reply's ``shm`` entry.

    Raises
    ------
    ProtocolError
        If the server has shared memory disabled or sees other files (another host,
        container or directory).
    """
    return probe(transport, shm_dir)


def probe(transport: Transport, shm_dir: str, reader: bool = False) -> dict[str, Any]:
    """The server's ``shm`` health entry for a probe file written to ``shm_dir``; with
    ``reader``, also whether it reads this process's memory (``direct``).

    Raises
    ------
    ProtocolError
        As :func:`handshake`.
    """
    token = secrets.token_bytes(32)
    kept = ctypes.create_string_buffer(token, len(token))  # where the server may read it
    name = f"flightq-{os.getpid()}-{secrets.token_hex(4)}-0"
    path = os.path.join(shm_dir, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    where = [os.getpid(), ctypes.addressof(kept)] if reader else None
    try:
        os.write(fd, token)
        os.close(fd)
        reply = transport.action(Health(shm_probe=path, shm_reader=where)).shm
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    del kept
    location = transport.location
    if not reply:
        raise ProtocolError(
            f"the server at {location} has shared memory disabled (Server(shm=False)); "
            "connect without shm"
        )
    if reply.get("probe") != token.hex():
        raise ProtocolError(
            f"the server at {location} does not see {shm_dir} (it uses "
            f"{reply.get('dir')!r}; another host or container?); connect without shm or "
            "pass shm=<a directory both share>"
        )
    return reply


def put_via_shm(
    transport: Transport,
    segments: ClientSegments,
    cmd: PutCommand,
    batches: Sequence[pa.RecordBatch],
    timeout: float | None,
    batch_bytes: int,
    sink: Sink | None = None,
) -> Acked:
    """One put whose batches travel in a segment; the DoPut carries only the command.
    Returns what :meth:`~flightq.client.transport.Transport.put` returns.

    ``batch_bytes`` is the record-batch size written into the segment. Batches encoded
    into a :class:`~flightq.shm.gather.ShmGather` ``sink`` have their large payloads
    copied from the caller's tensors straight into the segment.

    Raises
    ------
    FlightqError
        As a streamed put (the server validates the same way); nothing is stored.
    """
    from ..chunks import split_batch

    what = f"put to {cmd.partition!r}"
    pool = segments.get()
    chunks = [c for b in batches for c in split_batch(b, batch_bytes)]
    gather = sink if isinstance(sink, ShmGather) else None
    if gather is not None and gather.gathered:
        gather.direct = segments.direct_reads(transport)
    ref = pool.write(chunks[0].schema, chunks, what, gather)
    fills = gather.fills if gather is not None else None
    if gather is not None and fills is not None and len(fills) > 24 * MAX_FILLS:
        gather.copy_planned()  # too many ranges to name: copied as before
        fills = None
    plain = ShmRef(**ref)
    shm = plain if fills is None else dataclasses.replace(plain, pid=os.getpid(), fills=fills)

    def send(ref: ShmRef) -> Acked:
        return transport.put(
            dataclasses.replace(cmd, shm=ref),
            chunks[0].schema,
            (),
            max_batch_bytes=batch_bytes,
            timeout=timeout,
        )

    try:
        try:
            n = send(shm)
        except ProtocolError as e:
            if fills is None or gather is None or e.field != "fills":
                raise
            # The server did not read this memory (it refused, or the read failed or was
            # given up; nothing stored): copy, send again, ask again at the next put.
            segments.direct = None
            gather.copy_planned()
            n = send(plain)
    except BaseException:
        pool.abandon(ref)
        raise
    # The server stores its own copy (flightq.shm.mapping.store_copy): the segment is free.
    pool.release(ref)
    return n
