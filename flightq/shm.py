"""Same-host transfers through shared memory: Flight carries a ticket, the bytes are mapped.

When client and server share a host, a put or a read may move its record batches through a
file under ``/dev/shm`` instead of the socket (``flightq.connect(..., shm=True)``). A put's
writer serialises the batches as one Arrow IPC stream into a *segment* (a shared-memory
file it owns), copying each large tensor once, straight from the caller's memory, on
several threads; it sends a small reference ``{"path", "gen", "nbytes"}`` over Flight, and
the server maps the file and stores the batches as zero-copy views of the mapping, after
the same checks as a streamed put. A read is answered with the segments and offsets where
its bytes already lie (:mod:`flightq.shmtable`): the reader maps the producer's pages, and
nothing is copied on the way.

Why segments are reused. Allocating fresh tmpfs pages costs more than copying into them
(on the 2-core reference machine about 1.6 GB/s to allocate, 8 GB/s to copy), so each
writer keeps a :class:`SegmentPool` of warm segments. Who may touch a segment is settled
by two things:

- a state word in the header (its first page): ``WRITTEN`` once the owner filled it and
  sent the reference, ``TAKEN`` once a reader mapped it;
- ``flock`` on the file: every reader holds a shared lock while any view of its mapping
  lives (the lock goes with the process, should it die); the owner fills a segment again
  only under the exclusive lock, which it gets only when no reader holds one, and keeps
  while writing. Readers check the generation in the header under their lock, so a stale
  reference is refused, never read half-written.

The owner never fills a segment that is ``WRITTEN`` and not yet taken, unless its reader
has not come within the lease. Every file is mode 0600, named
``flightq-<owner pid>-<random>-<n>``; the pool unlinks its files when closed, at exit,
and a new pool removes those of owners that no longer run. A reader that mapped a file
keeps valid pages after it is unlinked.

Examples
--------
>>> import flightq
>>> with flightq.Server() as srv, flightq.connect(srv.location, shm=True) as c:
...     c.health()["shm"]["dir"]
'/dev/shm'
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import fcntl
import ipaddress
import itertools
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import FlightqError, ProtocolError, ResourceExhaustedError

__all__ = [
    "DEFAULT_DIR",
    "MARKER",
    "SegmentPool",
    "directory",
    "is_local",
    "read",
    "map_data",
    "MAPPED",
    "still_there",
    "probe_reply",
    "check_peer",
    "handshake",
    "put_via_shm",
    "gathering",
]

#: Where segments live unless told otherwise.
DEFAULT_DIR = "/dev/shm"
#: The column of the one-row answer that carries a segment reference instead of rows.
MARKER = "__shm__"
#: Bytes before the data: one page, so the IPC stream starts page-aligned.
HEADER = 4096
#: Segment sizes are multiples of this (huge-page friendly, few distinct sizes).
GRANULE = 2 * 2**20
#: Record batches through a segment are cut at about this many bytes: no transport limit
#: applies, and every batch costs a fixed amount to encode, check and decode.
BATCH_BYTES = 256 * 2**20
#: Free segments a pool keeps warm for reuse; beyond this they are unlinked.
DEFAULT_KEEP_BYTES = 2 * 2**30
#: Seconds a written segment may wait for its reader before the owner gives it up.
DEFAULT_LEASE_S = 300.0

_MAGIC = b"FQSHM001"
# magic, state, generation, payload bytes, owner pid, written at (monotonic seconds)
_HDR = struct.Struct("<8sqqqqd")
_STATE_AT = 8
FREE, WRITTEN, TAKEN = 0, 1, 2
_NAME = re.compile(r"^flightq-(\d+)-[0-9a-f]{8}-\d+$")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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


def _peer_is_local(peer: str) -> bool:
    # gRPC peers read "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000" or "unix:..."
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


# --------------------------------------------------------------------------- owner side


@dataclass(eq=False)
class _Segment:
    path: str
    fd: int
    mm: mmap.mmap
    capacity: int
    gen: int = 0
    written_at: float = 0.0

    def state(self) -> int:
        return int(struct.unpack_from("<q", self.mm, _STATE_AT)[0])

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
    """

    dir: str = DEFAULT_DIR
    keep_bytes: int = DEFAULT_KEEP_BYTES
    lease_s: float = DEFAULT_LEASE_S
    _segs: list[_Segment] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _token: str = field(default_factory=lambda: secrets.token_hex(4))
    _count: int = 0
    _closed: bool = False

    def __post_init__(self) -> None:
        _sweep(self.dir)
        # A pool that is never closed still removes its files when the process exits.
        atexit.register(_close_at_exit, weakref.ref(self))

    def write(
        self, schema: pa.Schema, batches: Sequence[pa.RecordBatch], what: str
    ) -> dict[str, Any]:
        """Write ``batches`` as one IPC stream into a segment; returns its reference.

        Raises
        ------
        ResourceExhaustedError
            If the directory has no room.
        """
        sink = pa.MockOutputStream()
        _write_stream(sink, schema, batches)
        n = int(sink.size())
        gather = _current_gather()
        seg = self._room(n, what)
        try:
            view = memoryview(seg.mm)[HEADER : HEADER + n]
            if gather is None:
                out = pa.FixedSizeBufferWriter(pa.py_buffer(view))
                _write_stream(out, schema, batches)
                out.close()
            else:
                dest = _Sink(np.frombuffer(view, dtype=np.uint8), gather)
                _write_stream(pa.PythonFile(dest, mode="w"), schema, batches)
                if dest.pos != n:
                    raise ProtocolError(f"{what}: wrote {dest.pos} bytes of a {n}-byte stream")
                gather.copy()
                del dest
            del view
            return self._written(seg, n)
        except BaseException:
            self._drop(seg)
            raise

    def write_bytes(self, parts: Sequence[tuple[int, Any]], n: int, what: str) -> dict[str, Any]:
        """Write raw bytes into a segment: each ``(offset, buffer)`` at its offset.

        Raises
        ------
        ResourceExhaustedError
            If the directory has no room.
        """
        seg = self._room(n, what)
        try:
            dst = np.frombuffer(seg.mm, dtype=np.uint8, count=n, offset=HEADER)
            for at, buf in parts:
                src = np.frombuffer(buf, dtype=np.uint8)
                dst[at : at + len(src)] = src
            del dst
            return self._written(seg, n)
        except BaseException:
            self._drop(seg)
            raise

    def _room(self, n: int, what: str) -> _Segment:
        try:
            return self._acquire(n)
        except OSError as e:
            raise ResourceExhaustedError(
                f"{what}: no room for {n} bytes of shared memory in {self.dir}: {e}; "
                "free space there or connect without shm"
            ) from e

    @staticmethod
    def _written(seg: _Segment, n: int) -> dict[str, Any]:
        # A new generation, then the exclusive lock goes: readers may come.
        seg.gen += 1
        seg.written_at = time.monotonic()
        _HDR.pack_into(seg.mm, 0, _MAGIC, WRITTEN, seg.gen, n, os.getpid(), seg.written_at)
        seg.unlock()
        return {"path": seg.path, "gen": seg.gen, "nbytes": n}

    def _drop(self, seg: _Segment) -> None:
        with self._lock:
            if seg in self._segs:
                self._segs.remove(seg)
        seg.close()

    def abandon(self, ref: Mapping[str, Any]) -> None:
        """After a failed call: the segment may be filled again once no reader holds it.

        A reader that comes later finds another generation (or the writer's lock) and
        refuses the reference.
        """
        with self._lock:
            seg = next((s for s in self._segs if s.path == ref.get("path")), None)
            if seg is not None and seg.gen == ref.get("gen") and seg.state() == WRITTEN:
                struct.pack_into("<q", seg.mm, _STATE_AT, FREE)

    def _acquire(self, n: int) -> _Segment:
        need = -(-n // GRANULE) * GRANULE
        drop: list[_Segment] = []
        with self._lock:
            if self._closed:
                raise ProtocolError("shared memory: the segment pool is closed")
            now = time.monotonic()
            # Free: not waiting for its reader (unless the lease ran out) and no reader holds
            # it (the exclusive lock is free; it stays taken on the one chosen).
            free = [
                s
                for s in self._segs
                if (s.state() != WRITTEN or now - s.written_at > self.lease_s) and s.lock()
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
                _HDR.pack_into(seg.mm, 0, _MAGIC, WRITTEN, seg.gen, 0, os.getpid(), now)
                seg.written_at = now
            self._count += 1
            name = f"flightq-{os.getpid()}-{self._token}-{self._count}"
            # Keep the warmest free capacity up to keep_bytes; unlink the rest.
            kept = 0
            for s in sorted(free, key=lambda s: -s.capacity):
                if kept + s.capacity > self.keep_bytes:
                    self._segs.remove(s)
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
            seg = self._create(os.path.join(self.dir, name), need)
        with self._lock:
            self._segs.append(seg)
        return seg

    @staticmethod
    def _create(path: str, capacity: int) -> _Segment:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER + capacity)
            mm = mmap.mmap(fd, HEADER + capacity, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        now = time.monotonic()
        _HDR.pack_into(mm, 0, _MAGIC, WRITTEN, 0, 0, os.getpid(), now)
        seg = _Segment(path, fd, mm, capacity, written_at=now)
        seg.lock()
        return seg

    @staticmethod
    def _grow(seg: _Segment, capacity: int) -> _Segment:
        try:
            os.ftruncate(seg.fd, HEADER + capacity)
            mm = mmap.mmap(seg.fd, HEADER + capacity, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            seg.close()
            raise
        with contextlib.suppress(BufferError):
            seg.mm.close()
        return _Segment(seg.path, seg.fd, mm, capacity, seg.gen, seg.written_at)

    def paths(self) -> list[str]:
        """The files of this pool (for tests and diagnostics)."""
        with self._lock:
            return [s.path for s in self._segs]

    def close(self) -> None:
        """Unlink every segment; readers that mapped one keep valid pages."""
        with self._lock:
            segs, self._segs, self._closed = self._segs, [], True
        for s in segs:
            s.close()


# --------------------------------------------------------------------------- gathering

#: Payload columns smaller than this are gathered by the encoder as usual.
_GATHER_MIN = 256 * 2**10
#: Copies into a segment run on up to this many threads, one per this many bytes.
_COPY_THREADS = 4
_COPY_MIN = 8 * 2**20
_COPY_PIECE = 8 * 2**20


class _Gather:
    """Placeholders for payload columns whose bytes are copied straight into a segment.

    Encoding under :func:`gathering` hands each large payload column a placeholder buffer
    (allocated, never filled: its pages are never touched) and remembers the payloads;
    the segment writer then copies each payload once, from the caller's tensor to its
    place in the segment. A placeholder starts with a unique stamp so that Arrow's IPC
    writer never takes two of them for equal dictionaries.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: dict[int, tuple[int, list[Any], np.ndarray, pa.Buffer]] = {}
        self._stamp = itertools.count(1)
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []

    def __call__(self, payloads: list[Any], offsets: np.ndarray) -> pa.Buffer | None:
        n = int(offsets[-1])
        if n < _GATHER_MIN:
            return None
        buf = pa.allocate_buffer(n)
        np.frombuffer(buf, dtype=np.uint64, count=1)[0] = next(self._stamp)
        bisect.insort(self._starts, buf.address)
        self._spans[buf.address] = (n, list(payloads), offsets, buf)
        return buf

    def fill(self, address: int, size: int, dst: np.ndarray) -> bool:
        """Plan the copy of the bytes a placeholder stands for at ``[address, address + size)``
        into ``dst`` (run by :meth:`copy`)."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return False
        start = self._starts[i]
        n, payloads, offs, _ = self._spans[start]
        lo = address - start
        if lo + size > n:
            return False
        hi = lo + size
        j = int(np.searchsorted(offs, lo, side="right")) - 1
        while j < len(payloads) and offs[j] < hi:
            a, b = max(int(offs[j]), lo), min(int(offs[j + 1]), hi)
            if b > a:
                src = np.frombuffer(payloads[j], dtype=np.uint8)
                self.copies.append((dst[a - lo : b - lo], src[a - int(offs[j]) : b - int(offs[j])]))
            j += 1
        return True

    def copy(self) -> None:
        """Run the planned copies, on several threads when they are large.

        One thread copies well below what the memory system moves: on the 2-core reference
        machine two threads copy about 1.8 times as fast as one.
        """
        copies, self.copies = self.copies, []
        total = sum(len(d) for d, _ in copies)
        n = min(_COPY_THREADS, os.cpu_count() or 1, max(1, total // _COPY_MIN))
        if n < 2:
            for d, src in copies:
                np.copyto(d, src)
            return
        # Cut every copy into pieces, then deal the pieces to n threads in equal bytes.
        pieces = [
            (d[i : i + _COPY_PIECE], src[i : i + _COPY_PIECE])
            for d, src in copies
            for i in range(0, len(d), _COPY_PIECE)
        ]
        share = -(-total // n)
        groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
        acc = 0
        for p in pieces:
            if acc >= share and len(groups) < n:
                groups.append([])
                acc = 0
            groups[-1].append(p)
            acc += len(p[0])
        errors: list[BaseException] = []

        def run(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
            try:
                for d, src in group:
                    np.copyto(d, src)  # releases the GIL
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=(g,), name="flightq-shm-copy") for g in groups[1:]
        ]
        for t in threads:
            t.start()
        run(groups[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


class _Sink:
    """A write-only stream over a segment's data: copies, or fills placeholders."""

    closed = False

    def __init__(self, dst: np.ndarray, gather: _Gather) -> None:
        self.dst = dst
        self.gather = gather
        self.pos = 0

    def write(self, data: Any) -> int:
        if isinstance(data, pa.Buffer):
            n = data.size
            out = self.dst[self.pos : self.pos + n]
            if not self.gather.fill(data.address, n, out):
                out[:] = np.frombuffer(data, dtype=np.uint8)
        else:
            src = np.frombuffer(data, dtype=np.uint8)
            n = len(src)
            self.dst[self.pos : self.pos + n] = src
        self.pos += n
        return n

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _current_gather() -> _Gather | None:
    from .encode import GATHER

    g = GATHER.get()
    return g if isinstance(g, _Gather) else None


@contextlib.contextmanager
def gathering() -> Iterator[None]:
    """Encode (:func:`flightq.batch.encode_chunks`) and write to a segment in this block.

    Large payload columns are then copied once, from the caller's tensors straight into
    the segment, instead of into an intermediate buffer first. The encoded batches hold
    placeholders: they are valid for :meth:`SegmentPool.write` in the same block only.
    """
    from .encode import GATHER

    token = GATHER.set(_Gather())
    try:
        yield
    finally:
        GATHER.reset(token)


def _close_at_exit(ref: weakref.ref[SegmentPool]) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


def _write_stream(sink: Any, schema: pa.Schema, batches: Sequence[pa.RecordBatch]) -> None:
    with pa.ipc.new_stream(sink, schema) as w:
        for b in batches:
            w.write_batch(b)


def _sweep(dirpath: str) -> None:
    """Unlink segments of this user whose owner process no longer runs."""
    uid = os.getuid()
    with contextlib.suppress(OSError), os.scandir(dirpath) as it:
        for e in it:
            m = _NAME.match(e.name)
            if m is None:
                continue
            with contextlib.suppress(OSError):
                if e.stat(follow_symlinks=False).st_uid != uid or _alive(int(m.group(1))):
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


# --------------------------------------------------------------------------- reader side


class _Mapped:
    """Address ranges of the segments this process maps, to name a buffer's segment.

    A server answering a read over shared memory names the stored bytes by segment and
    offset instead of copying them (:mod:`flightq.shmtable`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._spans: dict[int, tuple[int, dict[str, Any], int]] = {}

    def add(self, start: int, size: int, ref: dict[str, Any], offset: int) -> None:
        with self._lock:
            bisect.insort(self._starts, start)
            self._spans[start] = (size, ref, offset)

    def remove(self, start: int) -> None:
        with self._lock:
            if self._spans.pop(start, None) is not None:
                self._starts.pop(bisect.bisect_left(self._starts, start))

    def locate(self, address: int, size: int) -> tuple[dict[str, Any], int] | None:
        """The reference of the mapped segment holding a buffer, and its offset there.

        The reference carries the file's inode (``"ino"``): see :func:`still_there`.
        """
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            start = self._starts[i]
            n, ref, offset = self._spans[start]
        if address + size > start + n:
            return None
        return ref, offset + address - start


#: The segments this process maps for reading (one table per process: mappings are).
MAPPED = _Mapped()


def _unmap(fd: int, head: mmap.mmap, start: int) -> None:
    # Runs when the last view of the data dies: the reader's lock goes with the descriptor.
    MAPPED.remove(start)
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(BufferError, ValueError):
        head.close()


def _check_ref(ref: Any, what: str) -> tuple[str, int, int]:
    if not isinstance(ref, dict):
        raise ProtocolError(f"{what}: 'shm' must be a map {{path, gen, nbytes}}")
    path, gen, n = ref.get("path"), ref.get("gen"), ref.get("nbytes")
    if (
        not isinstance(path, str)
        or not isinstance(gen, int)
        or not isinstance(n, int)
        or isinstance(gen, bool)
        or isinstance(n, bool)
        or n <= 0
    ):
        raise ProtocolError(f"{what}: 'shm' needs path (str), gen (int), nbytes (int > 0)")
    return path, gen, n


def map_data(
    ref: Any, dirpath: str, what: str, lo: int = 0, hi: int | None = None, populate: bool = True
) -> np.ndarray:
    """Map bytes ``[lo, hi)`` of a segment's data read-only; returns them as uint8.

    The reader holds a shared lock on the segment while any view of the returned array
    lives, so its owner cannot fill it again under the reader; the segment's header must
    name the generation the reference names. ``populate`` maps every page at once (a
    reader about to touch all the bytes); a server storing a put touches only offsets and
    shapes, and maps the rest lazily.

    Raises
    ------
    ProtocolError
        If the reference is malformed, names a file outside ``dirpath``, the file is gone,
        being filled again or not a flightq segment of that generation and size.
    """
    path, gen, n = _check_ref(ref, what)
    hi = n if hi is None else hi
    if not 0 <= lo <= hi <= n:
        raise ProtocolError(
            f"{what}: bytes [{lo}, {hi}) lie outside the {n} bytes of segment {path!r}"
        )
    real = os.path.realpath(path)
    if os.path.dirname(real) != dirpath or not _NAME.match(os.path.basename(real)):
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is not a flightq segment in {dirpath}"
        )
    try:
        fd = os.open(real, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is gone: {e}; retry the call"
        ) from e
    head = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            raise ProtocolError(
                f"{what}: shared-memory segment {path!r} is being filled again by its owner "
                "(the rows it held are gone); retry the call"
            ) from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER + n:
            raise ProtocolError(
                f"{what}: shared-memory segment {path!r} holds {st.st_size} bytes, "
                f"{HEADER + n} announced"
            )
        head = mmap.mmap(fd, HEADER, flags=mmap.MAP_SHARED)
        magic, state, g, size, _pid, _at = _HDR.unpack_from(head, 0)
        if magic != _MAGIC or g != gen or size != n or state not in (WRITTEN, TAKEN):
            raise ProtocolError(
                f"{what}: shared-memory segment {path!r} is not generation {gen} of {n} "
                "bytes ready to read (reused or corrupted); retry the call"
            )
        # The data is mapped read-only: views handed out can never write the owner's pages.
        start = lo - lo % mmap.ALLOCATIONGRANULARITY
        body = mmap.mmap(
            fd,
            max(hi - start, 1),
            flags=mmap.MAP_SHARED | (_POPULATE if populate else 0),
            prot=mmap.PROT_READ,
            offset=HEADER + start,
        )
    except BaseException:
        os.close(fd)
        if head is not None:
            head.close()
        raise
    struct.pack_into("<q", head, _STATE_AT, TAKEN)
    data = np.frombuffer(body, dtype=np.uint8, count=hi - lo, offset=lo - start)
    addr = int(data.ctypes.data)
    MAPPED.add(addr, hi - lo, {"path": real, "gen": gen, "nbytes": n, "ino": st.st_ino}, lo)
    weakref.finalize(data, _unmap, fd, head, addr)
    return data


def still_there(ref: Mapping[str, Any]) -> bool:
    """Whether a mapped segment's file is still in its directory (its owner may have
    unlinked it, e.g. by exiting: the mapping stays valid, but no one else can open it)."""
    try:
        return os.stat(ref["path"]).st_ino == ref["ino"]
    except OSError:
        return False


def read(ref: Any, dirpath: str, what: str, populate: bool = True) -> list[pa.RecordBatch]:
    """Map a segment and return its record batches, zero-copy views into the mapping.

    The segment goes back to its owner once every returned buffer is gone (see
    :func:`map_data`).

    Raises
    ------
    ProtocolError
        As :func:`map_data`, or if the stream in the segment is malformed.
    """
    data = map_data(ref, dirpath, what, populate=populate)
    try:
        return list(pa.ipc.open_stream(pa.py_buffer(data)))
    except pa.ArrowException as e:
        raise ProtocolError(f"{what}: the stream in shared memory is malformed: {e}") from e


# --------------------------------------------------------------------------- checks (server)


def probe_reply(dirpath: str | None, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``shm`` entry of a health reply: the directory, and the probe file's contents.

    A client proves both sides see the same directory by naming a file it wrote there.
    """
    if dirpath is None:
        return None
    out: dict[str, Any] = {"dir": dirpath, "probe": None}
    path = body.get("shm_probe")
    if isinstance(path, str):
        real = os.path.realpath(path)
        if os.path.dirname(real) == dirpath and _NAME.match(os.path.basename(real)):
            with contextlib.suppress(OSError), open(real, "rb") as f:
                out["probe"] = f.read(64).hex()
    return out


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


# --------------------------------------------------------------------------- client side


def handshake(client: Any) -> None:
    """Check that the server serves shared memory and sees the client's directory.

    The client writes a file of random bytes in its directory; the server's health reply
    must echo them.

    Raises
    ------
    ProtocolError
        If the server has shared memory disabled or sees other files (another host,
        container or directory).
    """
    token = secrets.token_bytes(32)
    name = f"flightq-{os.getpid()}-{secrets.token_hex(4)}-0"
    path = os.path.join(client.shm_dir, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token)
        os.close(fd)
        reply = client._action("health", {"shm_probe": path}).get("shm")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if not reply:
        raise ProtocolError(
            f"the server at {client.location} has shared memory disabled (Server(shm=False)); "
            "connect without shm"
        )
    if reply.get("probe") != token.hex():
        raise ProtocolError(
            f"the server at {client.location} does not see {client.shm_dir} (it uses "
            f"{reply.get('dir')!r}; another host or container?); connect without shm or "
            "pass shm=<a directory both share>"
        )


def put_via_shm(
    client: Any, cmd: dict[str, Any], batches: Sequence[pa.RecordBatch], timeout: float | None
) -> int:
    """One put whose batches travel in a segment; the DoPut carries only the command.

    Raises
    ------
    FlightqError
        As a streamed put (the server validates the same way); nothing is stored.
    """
    import pyarrow.flight as fl

    from .encode import split_batch
    from .protocol import from_flight_error, pack, unpack

    what = f"put to {cmd['partition']!r}"
    with client._lock:
        if client._shm_pool is None:
            client._shm_pool = SegmentPool(client.shm_dir)
        pool = client._shm_pool
    chunks = [c for b in batches for c in split_batch(b, client._put_batch_bytes())]
    ref = pool.write(chunks[0].schema, chunks, what)
    desc = fl.FlightDescriptor.for_command(pack({**cmd, "shm": ref}))
    ack = None
    try:
        writer, reader = client._flight.do_put(
            desc, chunks[0].schema, options=client._options(timeout)
        )
        with writer:
            writer.done_writing()
            ack = reader.read()
    except (pa.ArrowException, fl.FlightError) as e:
        raise from_flight_error(e, what) from e
    finally:
        if ack is None:
            pool.abandon(ref)
    if ack is None:
        raise FlightqError(f"{what}: the server sent no acknowledgement")
    return int(unpack(ack, "put acknowledgement")["rows"])
