"""Shared-memory segments: the files, the pool that owns and reuses them, request checks."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import ipaddress
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..errors import ProtocolError, ResourceExhaustedError

#: Where segments live unless told otherwise.
DEFAULT_DIR = "/dev/shm"
#: The column of the one-row answer that carries a segment reference instead of rows.
MARKER = "__shm__"
#: Bytes before the data: one page, so the IPC stream starts page-aligned.
HEADER = 4096
#: Segment sizes are multiples of this (huge-page friendly, few distinct sizes).
GRANULE = 2 * 2**20
#: Record batches through a segment are cut at about this many bytes: no transport limit
#: applies, and every batch costs a fixed amount to encode, check and decode (a full W2
#: get in 6 batches of 256 MiB took 2-3x as long as in 2). Below the server's default
#: limit per put batch (``Server(max_put_batch_bytes=2**30)``).
BATCH_BYTES = 768 * 2**20
#: Largest record batch a server takes in a put through shared memory, and answers with,
#: whatever its limit per put batch over the socket (a step of up to this many bytes is
#: one record batch, which a reader decodes once): each binary column of such a batch
#: stays well under the 2 GiB its 32-bit offsets can name. A server says it in its
#: health reply (``batch_bytes``); a client cuts puts at :data:`BATCH_BYTES` for one
#: that does not.
PUT_BATCH_BYTES = 3 << 29
#: Free segments a pool keeps warm for reuse; beyond this they are unlinked.
DEFAULT_KEEP_BYTES = 2 * 2**30
#: Seconds a written segment may wait for its reader before the owner gives it up.
DEFAULT_LEASE_S = 300.0

MAGIC = b"FQSHM001"
# magic, state, generation, payload bytes, owner pid, written at (monotonic seconds)
HEADER_FORMAT = struct.Struct("<8sqqqqd")
STATE_AT = 8
FREE, WRITTEN, TAKEN = 0, 1, 2
#: The words of the refusal of a segment the directory has no room for: a client that
#: reads them in a put's refusal (its own pool's or the server's) sends the put over the
#: socket instead.
SHARED_ROOM = "bytes of shared memory in"
#: What :meth:`Segment.state` says of a file shorter than its segment (never on disk).
GONE = -1
#: A segment's file name, matched whole (``fullmatch``: ``$`` would let a newline end it).
SEGMENT_NAME = re.compile(r"flightq-([0-9]+)-[0-9a-f]{8}-[0-9]+")
MAP_POPULATE_FLAG = getattr(mmap, "MAP_POPULATE", 0)


class Declined(Exception):
    """A segment its writer's ``admit`` refused (:meth:`SegmentPool.write`)."""


class Gather(Protocol):
    """What writes a put's batches gathered by the encoder (:class:`flightq.shm.gather.ShmGather`):
    a stream over the segment's data that fills the placeholders, then the copies."""

    def stream(self, dst: np.ndarray) -> Any:
        """A write-only file object over ``dst`` whose ``pos`` counts the bytes written."""

    def copy(self) -> None:
        """Copy the payloads the stream left to be copied."""


# --------------------------------------------------------------------------- checks


def is_local(location: str) -> bool:
    """Whether a Flight location is on this host: loopback (127.0.0.0/8, ::1) or unix.

    ``localhost`` counts when every address it resolves to is loopback.
    """
    scheme, _, rest = location.partition("://")
    if scheme.endswith("unix"):
        return True
    host = rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host != "localhost":
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


@functools.lru_cache(maxsize=256)
def _peer_is_local(peer: str) -> bool:
    # gRPC peers read "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000" or "unix:..."; asked on
    # every call through shared memory (a few microseconds of parsing each time).
    kind, _, addr = peer.partition(":")
    if kind == "unix":
        return True
    host = addr.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def directory(option: bool | str | os.PathLike[str]) -> str:
    """The segment directory an ``shm=`` option names (``True``: ``/dev/shm``).

    Raises
    ------
    ProtocolError
        If it is not a writable directory.
    """
    path = DEFAULT_DIR if option is True else os.fspath(option)  # type: ignore[arg-type]
    path = os.path.realpath(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ProtocolError(
            f"shared memory: {path!r} is not a writable directory; pass shm=<a tmpfs "
            "directory both processes can reach> or leave shm off"
        )
    return path


#: Flags every open in the segment directory uses: a FIFO or device named like a segment
#: cannot block the opener, a terminal does not become its controlling one, a symlink is
#: not followed, children do not inherit it.
OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def open_regular(path: str, what: str, min_size: int = 0) -> tuple[int, os.stat_result]:
    """Open a file of the segment directory read-only, never blocking; returns (fd, stat).

    Only a regular file of this process's user, of at least ``min_size`` bytes, is
    accepted: a FIFO, a device, a directory or a symlink named like a segment is refused
    at once, without being opened (opening one can act: a FIFO's writer waiting in its
    own open is let through). The file opened is checked again, in case another took its
    name meanwhile.

    Raises
    ------
    ProtocolError
        If the file is gone, a symlink, not a regular file, another user's, or too small.
    """
    try:
        _check_regular(os.lstat(path), path, what, min_size)
        fd = os.open(path, OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink put in its place since the lstat
            raise _symlink(path, what) from e
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is gone: {e}; retry the call"
        ) from e
    try:
        st = os.fstat(fd)
        _check_regular(st, path, what, min_size)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _check_regular(st: os.stat_result, path: str, what: str, min_size: int) -> None:
    """Refuse all but a regular file of this process's user of ``min_size`` bytes."""
    if stat.S_ISLNK(st.st_mode):
        raise _symlink(path, what)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is not a regular file "
            f"(mode {stat.filemode(st.st_mode)}); only flightq's own segment files "
            "are mapped"
        )
    if st.st_uid != os.getuid():
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} belongs to uid {st.st_uid}, "
            f"expected {os.getuid()} (this process's user)"
        )
    if st.st_size < min_size:
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} holds {st.st_size} bytes, {min_size} announced"
        )


def _symlink(path: str, what: str) -> ProtocolError:
    return ProtocolError(
        f"{what}: shared-memory segment {path!r} is a symlink, not a regular file; "
        "only flightq's own segment files are mapped"
    )


def segment_path(path: str, dirpath: str) -> str | None:
    """``path`` with its directory's symlinks resolved (never its own name), if that names
    a flightq segment in ``dirpath``; else None (also for a path no file can have, such as
    one with a NUL byte)."""
    try:
        real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    except (OSError, ValueError):  # ValueError: a NUL byte
        return None
    if os.path.dirname(real) != dirpath or not SEGMENT_NAME.fullmatch(os.path.basename(real)):
        return None
    return real


# --------------------------------------------------------------------------- checks (server)


def probe_reply(
    dirpath: str | None,
    body: Mapping[str, Any],
    peer: str | None = None,
    batch_bytes: int | None = None,
) -> dict[str, Any] | None:
    """The ``shm`` entry of a health reply: the directory, the probe file's contents, and
    whether the server reads puts straight out of the client's memory (``direct``).

    A client proves both sides see the same directory by naming a file it wrote there.
    Naming also where it keeps the file's token (``shm_reader``: pid, address), it gets
    direct reads where the server finds that pid holding the caller's connection and
    reads the token back (:mod:`flightq.shm.direct`); ``direct_why`` says why not.
    ``batch_bytes``: the largest record batch the server takes in a put through shared
    memory (:data:`PUT_BATCH_BYTES`), said where given.
    """
    if dirpath is None:
        return None
    out: dict[str, Any] = {"dir": dirpath, "probe": None}
    if batch_bytes is not None:
        out["batch_bytes"] = batch_bytes
    path = body.get("shm_probe")
    real = segment_path(path, dirpath) if isinstance(path, str) else None
    if real is not None:
        # A FIFO or symlink named like a probe gets no echo, at once.
        with contextlib.suppress(OSError, ProtocolError):
            fd, _ = open_regular(real, "health")
            try:
                out["probe"] = os.pread(fd, 64, 0).hex()
            finally:
                os.close(fd)
    reader = body.get("shm_reader")
    if out["probe"] and isinstance(reader, list) and len(reader) == 2:
        out["direct"], out["direct_why"] = _direct_offer(peer, reader, bytes.fromhex(out["probe"]))
    return out


def _direct_offer(peer: str | None, reader: list[int], token: bytes) -> tuple[bool, str]:
    """Whether to read this client's puts out of its memory, and why not."""
    from . import direct

    if peer is None:
        return False, "the caller's address is unknown"
    pid, address = reader
    try:
        direct.check_not_stuck("direct reads")
        direct.owner_check(peer, pid, "direct reads")
        if direct.read_memory(pid, address, len(token), "direct reads") != token:
            return False, f"process {pid} does not hold the token at {address:#x}"
    except ProtocolError as e:
        return False, str(e)
    return True, ""


def check_peer(peer: str, what: str) -> None:
    """Refuse a shared-memory request that did not come from this host.

    Raises
    ------
    ProtocolError
        If the peer address is not loopback or a unix socket.
    """
    if not _peer_is_local(peer):
        raise ProtocolError(
            f"{what}: shared memory is for clients on this host (loopback); peer {peer!r}"
        )


# --------------------------------------------------------------------------- owner side


@dataclass(eq=False)
class Segment:
    """One shared-memory file its owner fills: path, descriptor, mapping, capacity, the
    generation last written; ``state()`` reads the header's state word, ``lock()`` /
    ``unlock()`` take and release the owner's exclusive lock."""

    path: str
    fd: int
    mm: mmap.mmap
    capacity: int
    gen: int = 0
    written_at: float = 0.0

    # The header is read and written through the descriptor, never the mapping: a reader
    # (whose answer segments are writable, to mark them taken) may truncate the file, and
    # a page of a mapping past the file's end is SIGBUS, where pread and pwrite are not.

    def state(self, whole: bool = False) -> int:
        """The header's state word; :data:`GONE` where the file no longer holds it, or
        (``whole``: before filling it again) is shorter than the segment: truncated
        under its owner, never to be filled again."""
        if self.fd < 0:
            raise ValueError(f"segment {self.path} is closed")
        raw = os.pread(self.fd, 8, STATE_AT)
        if len(raw) < 8 or (whole and os.fstat(self.fd).st_size < HEADER + self.capacity):
            return GONE
        return int(struct.unpack("<q", raw)[0])

    def set_state(self, state: int) -> None:
        os.pwrite(self.fd, struct.pack("<q", state), STATE_AT)

    def set_header(self, state: int, gen: int, n: int, at: float) -> None:
        os.pwrite(self.fd, HEADER_FORMAT.pack(MAGIC, state, gen, n, os.getpid(), at), 0)

    def lock(self) -> bool:
        """Take the exclusive lock if no reader holds the segment (kept while writing)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    def unlock(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()  # views still exported (a writer mid-flight): dropped at GC
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1  # its number may name another file from now on


def _reserve(fd: int, size: int) -> None:
    """Give the file's first ``size`` bytes their pages now. ``ftruncate`` leaves a sparse
    file, and on a full tmpfs (``/dev/shm`` is shared by every process of the host, and
    small in containers) the first write into a page that cannot be had kills the process
    with SIGBUS; reserved here, a full directory is an ``OSError`` (ENOSPC) instead,
    which callers turn into a refusal or an answer over the socket.

    Raises
    ------
    OSError
        If the directory's filesystem has no room for them.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # a filesystem that reserves nothing ahead (not tmpfs): as before
        raise


@dataclass
class SegmentPool:
    """The shared-memory segments one process writes, kept warm for reuse.

    Parameters
    ----------
    dir:
        Directory of the segments (a tmpfs such as ``/dev/shm``).
    keep_bytes:
        Capacity of free segments kept for reuse; the rest are unlinked.
    lease_s:
        Seconds a written segment may wait for its reader before it is given up.
    mode:
        Permissions of the files (0400: a server's stored rows, written only through the
        descriptor that created them).
    """

    dir: str = DEFAULT_DIR
    keep_bytes: int = DEFAULT_KEEP_BYTES
    lease_s: float = DEFAULT_LEASE_S
    mode: int = 0o600
    _segs: list[Segment] = field(default_factory=list)
    #: Segments written and maybe not yet taken by their reader, by path.
    _waiting: dict[str, Segment] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _token: str = field(default_factory=lambda: secrets.token_hex(4))
    _count: int = 0
    _closed: bool = False

    def __post_init__(self) -> None:
        _sweep(self.dir)
        # A pool that is never closed still removes its files when the process exits.
        atexit.register(_close_at_exit, weakref.ref(self))

    def write(
        self,
        schema: pa.Schema,
        batches: Sequence[pa.RecordBatch],
        what: str,
        gather: Gather | None = None,
        admit: Callable[[int], bool] | None = None,
    ) -> dict[str, Any]:
        """Write ``batches`` as one IPC stream into a segment; returns its reference.

        Batches encoded into a ``gather`` sink are written with it: their placeholders are
        filled from the caller's tensors. ``admit(size)`` says whether ``size`` more bytes
        of file may be taken: first the least file that holds the stream, before any is
        allocated, then what a larger free one reused adds (:class:`Declined` if not).

        Raises
        ------
        ResourceExhaustedError
            If the directory has no room.
        Declined
            If ``admit`` refuses the segment (it goes back to the pool unwritten).
        """
        sink = pa.MockOutputStream()
        write_stream(sink, schema, batches)
        n = int(sink.size())
        seg = self._admitted(n, what, admit)
        try:
            view = memoryview(seg.mm)[HEADER : HEADER + n]
            if gather is None:
                out = pa.FixedSizeBufferWriter(pa.py_buffer(view))
                write_stream(out, schema, batches)
                out.close()
            else:
                dest = gather.stream(np.frombuffer(view, dtype=np.uint8))
                write_stream(pa.PythonFile(dest, mode="w"), schema, batches)
                if dest.pos != n:
                    raise ProtocolError(f"{what}: wrote {dest.pos} bytes of a {n}-byte stream")
                gather.copy()
                del dest
            del view
            return self.written(seg, n)
        except BaseException:
            self.drop(seg)
            raise

    def write_bytes(
        self,
        parts: Sequence[tuple[int, Any]],
        n: int,
        what: str,
        admit: Callable[[int], bool] | None = None,
    ) -> dict[str, Any]:
        """Write raw bytes into a segment: each ``(offset, buffer)`` at its offset
        (``admit`` as for :meth:`write`).

        Raises
        ------
        ResourceExhaustedError
            If the directory has no room.
        Declined
            If ``admit`` refuses the segment.
        """
        seg = self._admitted(n, what, admit)
        try:
            dst = np.frombuffer(seg.mm, dtype=np.uint8, count=n, offset=HEADER)
            for at, buf in parts:
                src = np.frombuffer(buf, dtype=np.uint8)
                dst[at : at + len(src)] = src
            del dst
            return self.written(seg, n)
        except BaseException:
            self.drop(seg)
            raise

    def _admitted(self, n: int, what: str, admit: Callable[[int], bool] | None) -> Segment:
        """:meth:`room` for ``n`` bytes, once ``admit`` took the least file that holds
        them (nothing is allocated for a refusal), and what a reused larger one adds."""
        if admit is None:
            return self.room(n, what)
        least = HEADER + -(-n // GRANULE) * GRANULE
        if not admit(least):
            raise Declined(f"{what}: no room for {least} bytes")
        seg = self.room(n, what)
        more = HEADER + seg.capacity - least
        if more > 0 and not admit(more):  # a free one reused: back to the pool, unwritten
            seg.set_state(FREE)
            seg.unlock()
            raise Declined(f"{what}: no room for {HEADER + seg.capacity} bytes")
        return seg

    def room(self, n: int, what: str) -> Segment:
        """:meth:`acquire`, with no room in the directory a typed refusal.

        Raises
        ------
        ResourceExhaustedError
            If the directory has no room.
        """
        try:
            return self.acquire(n)
        except OSError as e:
            raise ResourceExhaustedError(
                f"{what}: no room for {n} {SHARED_ROOM} {self.dir}: {e}; "
                "free space there or connect without shm"
            ) from e

    def written(self, seg: Segment, n: int) -> dict[str, Any]:
        """Publish ``n`` bytes of ``seg`` as a new generation, release its lock, and return
        the reference a reader maps (``{"path", "gen", "nbytes"}``)."""
        # A new generation, then the exclusive lock goes: readers may come.
        seg.gen += 1
        seg.written_at = time.monotonic()
        seg.set_header(WRITTEN, seg.gen, n, seg.written_at)
        with self._lock:
            self._waiting[seg.path] = seg
        seg.unlock()
        return {"path": seg.path, "gen": seg.gen, "nbytes": n}

    def set_aside(self, seg: Segment) -> None:
        """Take ``seg`` out of the pool, open and mapped: it is never handed out again,
        nor closed with the pool; its holder closes it (``seg.close()``)."""
        with self._lock:
            if seg in self._segs:
                self._segs.remove(seg)
            self._waiting.pop(seg.path, None)

    def drop(self, seg: Segment) -> None:
        """Unlink a segment whose writing failed."""
        with self._lock:
            if seg in self._segs:
                self._segs.remove(seg)
            self._waiting.pop(seg.path, None)
        seg.close()

    def abandon(self, ref: Mapping[str, Any]) -> None:
        """After a failed call: the segment may be filled again once no reader holds it.

        A reader that comes later finds another generation (or the writer's lock) and
        refuses the reference.
        """
        with self._lock:
            seg = next((s for s in self._segs if s.path == ref.get("path")), None)
            if seg is not None and seg.gen == ref.get("gen") and seg.state() == WRITTEN:
                seg.set_state(FREE)
                self._waiting.pop(seg.path, None)

    def acquire(self, n: int) -> Segment:
        """A free segment of at least ``n`` bytes (grown, or created), returned with its
        exclusive lock held.

        Raises
        ------
        OSError
            When the directory has no room.
        ProtocolError
            When the pool is closed.
        """
        need = -(-n // GRANULE) * GRANULE
        drop: list[Segment] = []
        with self._lock:
            if self._closed:
                raise ProtocolError("shared memory: the segment pool is closed")
            now = time.monotonic()
            states = {s.path: s.state(whole=True) for s in self._segs}
            for s in [s for s in self._segs if states[s.path] == GONE]:
                # Truncated under its owner (by a reader): writing into it would be SIGBUS.
                self._segs.remove(s)
                self._waiting.pop(s.path, None)
                drop.append(s)
            # Free: not waiting for its reader (unless the lease ran out) and no reader holds
            # it (the exclusive lock is free; it stays taken on the one chosen).
            free = [
                s
                for s in self._segs
                if (states[s.path] != WRITTEN or now - s.written_at > self.lease_s) and s.lock()
            ]
            # Best fit that does not waste more than the request; else grow a small one.
            fits = [s for s in free if need <= s.capacity <= 2 * need + GRANULE]
            grow = [s for s in free if s.capacity < need]
            seg = None
            if fits:
                seg = min(fits, key=lambda s: s.capacity)
            elif grow:
                seg = max(grow, key=lambda s: s.capacity)
                self._segs.remove(seg)
            if seg is not None:
                free.remove(seg)
                self._waiting.pop(seg.path, None)  # being written: no longer waiting
                seg.set_header(WRITTEN, seg.gen, 0, now)
                seg.written_at = now
            self._count += 1
            name = f"flightq-{os.getpid()}-{self._token}-{self._count}"
            # Keep the warmest free capacity up to keep_bytes; unlink the rest.
            kept = 0
            for s in sorted(free, key=lambda s: -s.capacity):
                if kept + s.capacity > self.keep_bytes:
                    self._segs.remove(s)
                    self._waiting.pop(s.path, None)
                    drop.append(s)
                else:
                    kept += s.capacity
                    s.unlock()
        for s in drop:
            s.close()
        if seg is not None and seg.capacity >= need:
            return seg
        if seg is not None:
            seg = self._grow(seg, need)
        else:
            seg = self._create(os.path.join(self.dir, name), need, self.mode)
        with self._lock:
            self._segs.append(seg)
        return seg

    @staticmethod
    def _create(path: str, capacity: int, mode: int = 0o600) -> Segment:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, HEADER + capacity)
            _reserve(fd, HEADER + capacity)
            mm = mmap.mmap(fd, HEADER + capacity, flags=mmap.MAP_SHARED | MAP_POPULATE_FLAG)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        now = time.monotonic()
        seg = Segment(path, fd, mm, capacity, written_at=now)
        seg.set_header(WRITTEN, 0, 0, now)
        seg.lock()
        return seg

    @staticmethod
    def _grow(seg: Segment, capacity: int) -> Segment:
        try:
            os.ftruncate(seg.fd, HEADER + capacity)
            _reserve(seg.fd, HEADER + capacity)
            mm = mmap.mmap(seg.fd, HEADER + capacity, flags=mmap.MAP_SHARED | MAP_POPULATE_FLAG)
        except BaseException:
            seg.close()
            raise
        with contextlib.suppress(BufferError):
            seg.mm.close()
        return Segment(seg.path, seg.fd, mm, capacity, seg.gen, seg.written_at)

    def paths(self) -> list[str]:
        """The files of this pool (for tests and diagnostics)."""
        with self._lock:
            return [s.path for s in self._segs]

    def segments(self) -> list[Segment]:
        """The pool's segments now (a snapshot, for tests and diagnostics)."""
        with self._lock:
            return list(self._segs)

    def unread_bytes(self) -> int:
        """Bytes of the segments written and still waiting for their reader (until it
        takes them, or their lease runs out): files no one else holds yet."""
        return self.unread()[0]

    def unread(self) -> tuple[int, int]:
        """Bytes and number of the segments written and still waiting for their reader.
        Costs one look per such segment (those found taken are forgotten)."""
        now = time.monotonic()
        with self._lock:
            nbytes = 0
            for path, s in list(self._waiting.items()):
                try:
                    waiting = now - s.written_at <= self.lease_s and s.state() == WRITTEN
                except (ValueError, OSError):  # closed: unlinked since
                    waiting = False
                if waiting:
                    nbytes += HEADER + s.capacity
                else:
                    del self._waiting[path]
            return nbytes, len(self._waiting)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def release(self, ref: Mapping[str, Any]) -> None:
        """After the server acknowledged a put it copied: the segment is free again.

        Its reader read it (the server keeps its own copy); once no reader holds its lock
        the pool may fill it again.
        """
        with self._lock:
            seg = next((s for s in self._segs if s.path == ref.get("path")), None)
            if seg is not None and seg.gen == ref.get("gen"):
                seg.set_state(FREE)

    def close(self) -> None:
        """Unlink every segment; readers that mapped one keep valid pages."""
        with self._lock:
            segs, self._segs, self._closed = self._segs, [], True
            self._waiting.clear()
        for s in segs:
            s.close()


def _close_at_exit(ref: weakref.ref[SegmentPool]) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


def write_stream(sink: Any, schema: pa.Schema, batches: Sequence[pa.RecordBatch]) -> None:
    """``batches`` as one Arrow IPC stream into ``sink``."""
    with pa.ipc.new_stream(sink, schema) as w:
        for b in batches:
            w.write_batch(b)


def _sweep(dirpath: str) -> None:
    """Unlink segments of this user whose owner process no longer runs.

    Only regular files are touched, and none is opened: a FIFO, a symlink or a directory
    named like a segment is left alone.
    """
    uid = os.getuid()
    with contextlib.suppress(OSError), os.scandir(dirpath) as it:
        for e in it:
            m = SEGMENT_NAME.fullmatch(e.name)
            if m is None:
                continue
            with contextlib.suppress(OSError):
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or _alive(int(m.group(1))):
                    continue
                os.unlink(e.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
