"""Readers' side of a segment: maps held under a shared lock, and where each lies.

Every file of the segment directory is opened without blocking and mapped only if it is a
regular file of this user (:func:`open_regular`). A consumer maps copy-on-write
(:func:`map_data`); a server copies a put out of the writer's file before storing it
(:func:`store_copy`).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..errors import ProtocolError
from ..ipccheck import check_stream
from .segments import (
    HEADER,
    HEADER_FORMAT,
    MAGIC,
    MAP_POPULATE_FLAG,
    STATE_AT,
    TAKEN,
    WRITTEN,
    SegmentPool,
    open_regular,
    segment_path,
)

# --------------------------------------------------------------------------- reader side


class _Mapped:
    """Address ranges of the segments this process maps, to name a buffer's segment.

    A server answering a read over shared memory names the stored bytes by segment and
    offset instead of copying them (:mod:`flightq.shm.table`).
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


def _unmap(fd: int, start: int) -> None:
    # Runs when the last view of the data dies: the reader's lock goes with the descriptor.
    MAPPED.remove(start)
    with contextlib.suppress(OSError):
        os.close(fd)


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


def _checked_path(ref: Any, dirpath: str, what: str) -> tuple[str, int, int]:
    path, gen, n = _check_ref(ref, what)
    real = segment_path(path, dirpath)
    if real is None:
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is not a flightq segment in {dirpath}"
        )
    return real, gen, n


def _lock_shared(fd: int, path: str, what: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is being filled again by its owner "
            "(the rows it held are gone); retry the call"
        ) from e


def _check_header(raw: bytes, path: str, gen: int, n: int, what: str) -> None:
    if len(raw) < HEADER_FORMAT.size:
        raise ProtocolError(f"{what}: shared-memory segment {path!r} has no header")
    magic, state, g, size, _pid, _at = HEADER_FORMAT.unpack_from(raw, 0)
    if magic != MAGIC or g != gen or size != n or state not in (WRITTEN, TAKEN):
        raise ProtocolError(
            f"{what}: shared-memory segment {path!r} is not generation {gen} of {n} "
            "bytes ready to read (reused or corrupted); retry the call"
        )


def _mark_taken(fd: int) -> None:
    # The state word tells the owner a reader came (its pool may then reuse the segment
    # once no reader holds it). The file was checked through ``fd``; reopening that very
    # file for this one word cannot block. Where this user may not write it (a server's
    # stored rows, mode 0400), the owner marks it itself.
    with contextlib.suppress(OSError):
        wfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.pwrite(wfd, struct.pack("<q", TAKEN), STATE_AT)
        finally:
            os.close(wfd)


#: madvise(MADV_POPULATE_READ) (Linux 5.14): page tables filled, the pages still shared.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else -1)


def _populate_read(body: mmap.mmap) -> None:
    # An older kernel refuses the advice (EINVAL): its pages then fill on first touch.
    if _MADV_POPULATE_READ >= 0:
        with contextlib.suppress(OSError):
            body.madvise(_MADV_POPULATE_READ)


def map_data(
    ref: Any,
    dirpath: str,
    what: str,
    lo: int = 0,
    hi: int | None = None,
    populate: bool = True,
    private: bool = True,
) -> np.ndarray:
    """Map bytes ``[lo, hi)`` of a segment's data; returns them as uint8.

    The reader holds a shared lock on the segment while any view of the returned array
    lives, so its owner cannot fill it again under the reader; the segment's header must
    name the generation the reference names. ``populate`` fills the page tables at
    once (a reader about to touch all the bytes); otherwise each first touch fills them
    (the kernel maps the neighbouring pages of the file with it). ``private`` (a
    consumer) maps copy-on-write: a write through a view (``add_`` on a returned tensor)
    changes this process's pages only, never the file, the server's rows or another
    consumer's; nothing is copied until such a write. Otherwise (a server mapping the
    rows it stores in its own segment) the mapping is shared and read-only.

    Raises
    ------
    ProtocolError
        If the reference is malformed, names a file outside ``dirpath``, the file is gone,
        not a regular file of this user, being filled again or not a flightq segment of
        that generation and size.
    """
    path, gen, n = _checked_path(ref, dirpath, what)
    hi = n if hi is None else hi
    if not 0 <= lo <= hi <= n:
        raise ProtocolError(
            f"{what}: bytes [{lo}, {hi}) lie outside the {n} bytes of segment {path!r}"
        )
    fd, st = open_regular(path, what, HEADER + n)
    try:
        _lock_shared(fd, path, what)
        _check_header(os.pread(fd, HEADER_FORMAT.size, 0), path, gen, n, what)
        start = lo - lo % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if private else 0)
        # MAP_POPULATE on a writable private mapping faults every page in for writing:
        # it breaks copy-on-write up front, copying the whole span (1.8 GB/s on the
        # 2-core machine). Such a mapping is populated for reading instead.
        body = mmap.mmap(
            fd,
            max(hi - start, 1),
            flags=flags | (MAP_POPULATE_FLAG if populate and not private else 0),
            prot=prot,
            offset=HEADER + start,
        )
        if populate and private:
            _populate_read(body)
    except BaseException:
        os.close(fd)
        raise
    _mark_taken(fd)
    data = np.frombuffer(body, dtype=np.uint8, count=hi - lo, offset=lo - start)
    addr = int(data.ctypes.data)
    MAPPED.add(addr, hi - lo, {"path": path, "gen": gen, "nbytes": n, "ino": st.st_ino}, lo)
    weakref.finalize(data, _unmap, fd, addr)
    return data


def still_there(ref: Mapping[str, Any]) -> bool:
    """Whether a mapped segment's file is still in its directory (its owner may have
    unlinked it, e.g. by exiting: the mapping stays valid, but no one else can open it)."""
    try:
        return os.stat(ref["path"]).st_ino == ref["ino"]
    except OSError:
        return False


class _Stores:
    """The segments a server copies puts into, one pool per directory, made on first use.

    One per process, as :data:`MAPPED`: a server's stored rows are named by the table of
    what this process maps. Their files are mode 0400, so no process opens them for
    writing by mistake; the pool reuses one only once no reader holds it. A pool lives
    while it holds rows: when the last stored copy is gone (the rows cleared, or the
    server stopped) its files are unlinked.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, tuple[SegmentPool, int]] = {}

    def hold(self, dirpath: str) -> SegmentPool:
        """The directory's pool, counted as holding one more copy until :meth:`let_go`."""
        with self._lock:
            pool, n = self._pools.get(dirpath, (None, 0))
            if pool is None:
                pool = SegmentPool(dirpath, mode=0o400)
            self._pools[dirpath] = (pool, n + 1)
            return pool

    def let_go(self, dirpath: str, pool: SegmentPool) -> None:
        """One copy of ``pool`` is gone; the last one closes the pool."""
        with self._lock:
            held, n = self._pools.get(dirpath, (None, 0))
            if held is not pool:
                return
            if n > 1:
                self._pools[dirpath] = (pool, n - 1)
                return
            del self._pools[dirpath]
        pool.close()

    def paths(self) -> list[str]:
        """The files of every store pool (for tests and diagnostics)."""
        with self._lock:
            pools = [p for p, _ in self._pools.values()]
        return [path for pool in pools for path in pool.paths()]


#: Where a server keeps the bytes of puts that came through shared memory.
STORES = _Stores()


#: A server's copy of a put is split over threads in pieces of at least this many bytes
#: (as a writer's copy into its segment, :mod:`flightq.shm.gather`). A full W1 put (33 MB
#: through the segment) on the 2-core machine: 19.3 ms with one thread (pieces of 32 MiB),
#: 17.2 with two (8 MiB).
COPY_PIECE_BYTES = 8 * 2**20
#: Most threads one copy uses (``preadv`` lets go of the interpreter lock); never more
#: than the host's cores. A full W2 put on the 16-core host: 2.8 GB/s on one thread,
#: 5.8 on 4, 7.4 on 8.
COPY_THREADS = 8


def _copy_piece(fd: int, dst: memoryview, at: int, path: str, what: str) -> None:
    # pread, not a mapping of the writer's file: a writer that shrinks its file meanwhile
    # makes the read come up short (refused), never a SIGBUS in the server. A refusal's
    # traceback keeps this frame: ``dst`` goes first, or the view in it would keep the
    # server's segment mapped, unlinked, after the put is refused.
    done = 0
    while done < len(dst):
        try:
            got = os.preadv(fd, [dst[done:]], HEADER + at + done)
        except OSError as e:
            del dst
            raise ProtocolError(f"{what}: shared-memory segment {path!r}: {e}") from e
        if got == 0:
            del dst
            raise ProtocolError(
                f"{what}: shared-memory segment {path!r} shrank to {HEADER + at + done} "
                f"bytes while the server read it; nothing is stored"
            )
        done += got


def _copy_in(fd: int, dst: memoryview, path: str, what: str) -> None:
    # One thread copies out of tmpfs at about half the speed of memcpy (6 against 13 GB/s
    # on the 2-core machine): a large put is read in pieces on several threads.
    n = len(dst)
    k = max(1, min(COPY_THREADS, os.cpu_count() or 1, n // COPY_PIECE_BYTES))
    step = -(-n // k)
    errors: list[BaseException] = []

    def piece(lo: int) -> None:
        try:
            _copy_piece(fd, dst[lo : lo + step], lo, path, what)
        except BaseException as e:  # raised in the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=piece, args=(lo,)) for lo in range(step, n, step)]
    for t in threads:
        t.start()
    piece(0)
    for t in threads:
        t.join()
    if errors:
        try:
            raise errors[0]
        finally:
            # Kept, the list would close a reference cycle (the error, its traceback, the
            # frames holding the list), freed by a cyclic collection only.
            errors.clear()


def _copy_gaps(fd: int, dst: memoryview, fills: np.ndarray, path: str, what: str) -> None:
    """Read what lies between the fills from the writer's file."""
    starts = [0, *(fills[:, 0] + fills[:, 2]).tolist()]
    stops = [*fills[:, 0].tolist(), len(dst)]
    for a, b in zip(starts, stops, strict=True):
        if b > a:
            _copy_piece(fd, dst[a:b], a, path, what)


class Hold(Protocol):
    """Where a server counts the segment it copies a put into, against its memory budget
    (:class:`flightq.server.store.Advance`)."""

    def hold(self, total: int) -> None:
        """Count ``total`` bytes in all from now on (waits for room; raises if none)."""

    def share(self) -> Callable[[], None]:
        """Keep the bytes counted until the returned ``let_go()`` runs, even past the put."""


def store_copy(
    ref: Any,
    dirpath: str,
    what: str,
    peer: str | None = None,
    hold: Hold | None = None,
) -> tuple[np.ndarray, int]:
    """Copy a writer's segment into a segment the server owns; returns the copy's bytes
    and the size of the file holding them.

    The writer's file is opened without blocking, checked (a regular file of this user,
    of the announced size and generation, not being filled again), read once with
    ``pread`` and let go: what the server then checks, acknowledges and serves is its own
    copy, which no writer can shrink or change. A reference with ``fills`` has the
    payloads read from the writer's memory instead (:mod:`flightq.shm.direct`), once the
    writer is found to hold the caller's connection ``peer``.

    The server's segment is counted in ``hold`` before it is chosen (the announced size)
    and again once it is (its whole file), so the copy holds nothing uncounted; a read of
    the writer's memory given up on keeps it counted until the read returns.

    Raises
    ------
    ProtocolError
        As :func:`map_data`, or if the file shrinks during the copy.
    ResourceExhaustedError
        If the directory has no room for the copy, or ``hold`` none under the budget.
    """
    path, gen, n = _checked_path(ref, dirpath, what)
    fills = None
    if ref.get("fills") is not None:
        from . import direct

        pid = ref.get("pid")
        if not isinstance(pid, int):
            raise ProtocolError(f"{what}: fills without the writer's pid", field="fills")
        fills = direct.check_fills(ref["fills"], n, what)
        direct.check_not_stuck(what)
        direct.owner_check(peer or "", pid, what)
    fd, _ = open_regular(path, what, HEADER + n)
    try:
        _lock_shared(fd, path, what)
        _check_header(os.pread(fd, HEADER_FORMAT.size, 0), path, gen, n, what)
        if hold is not None:
            hold.hold(HEADER + n)  # before any segment is taken: may wait, or refuse
        pool = STORES.hold(dirpath)
        try:
            seg = pool.room(n, what)
            try:
                size = HEADER + seg.capacity
                if hold is not None:
                    hold.hold(size)  # a reused segment may be larger
                view = memoryview(seg.mm)[HEADER : HEADER + n]
                try:
                    if fills is None:
                        _copy_in(fd, view, path, what)
                    else:
                        let_go = hold.share() if hold is not None else _nothing
                        _copy_direct(
                            fd, view, fills, ref["pid"], pool, seg, dirpath, path, what, let_go
                        )
                finally:
                    view.release()
                own = pool.written(seg, n)
                data = map_data(own, dirpath, what, populate=False, private=False)
            except _LeftRunning:
                raise  # the segment stays the read's until it returns
            except BaseException:
                pool.drop(seg)
                raise
        except _LeftRunning as e:
            raise ProtocolError(str(e), field="fills") from None  # pool: later() lets go
        except BaseException:
            STORES.let_go(dirpath, pool)
            raise
        weakref.finalize(data, STORES.let_go, dirpath, pool)
        # The owner marks its own segment taken: no reader may write a 0400 file.
        seg.set_state(TAKEN)
        return data, size
    finally:
        os.close(fd)


def _nothing() -> None:
    pass


class _LeftRunning(Exception):
    """A direct read given up on: its segment is the read's until it returns."""


def _copy_direct(
    fd: int,
    view: memoryview,
    fills: np.ndarray,
    pid: int,
    pool: Any,
    seg: Any,
    dirpath: str,
    path: str,
    what: str,
    let_go: Callable[[], None],
) -> None:
    """The payloads from the writer's memory (on threads), the rest from its file.
    ``let_go()`` runs once the read is over: at once, or when a read given up on returns
    (its segment counted against the budget until then)."""
    from . import direct

    def later() -> None:  # the read given up on returned: its segment may go
        seg.close()
        STORES.let_go(dirpath, pool)
        let_go()

    try:
        wait = direct.read_fills(pid, fills, view, what, later)
    except BaseException:
        let_go()
        raise
    try:
        _copy_gaps(fd, view, fills, path, what)
    finally:
        try:
            wait()
        except direct.GivenUp as e:
            # The read may still write into the segment: out of the pool, never reused,
            # until it returns (later()).
            pool.set_aside(seg)
            raise _LeftRunning(str(e)) from None
        except BaseException:
            let_go()
            raise
        let_go()


def read(
    ref: Any,
    dirpath: str,
    what: str,
    peer: str | None = None,
    hold: Hold | None = None,
) -> tuple[list[pa.RecordBatch], int]:
    """A put's record batches through shared memory, as the server stores them, and the
    bytes the file holding them takes.

    The writer's segment is copied into one the server owns (:func:`store_copy`, which
    counts it in ``hold``); the batches are zero-copy views of that copy, which goes back
    to the server's pool once every returned buffer is gone.

    Raises
    ------
    ProtocolError
        As :func:`store_copy`, or if the stream in the segment is malformed.
    """
    data, size = store_copy(ref, dirpath, what, peer, hold)
    return _stream(data, what), size


def read_private(ref: Any, dirpath: str, what: str) -> list[pa.RecordBatch]:
    """A consumer's record batches from a segment: views of a copy-on-write mapping.

    Raises
    ------
    ProtocolError
        As :func:`map_data`, or if the stream in the segment is malformed.
    """
    return _stream(map_data(ref, dirpath, what, populate=False), what)


def _stream(data: np.ndarray, what: str) -> list[pa.RecordBatch]:
    buf = pa.py_buffer(data)
    check_stream(buf, what)  # a compressed body would be inflated to what it declares
    try:
        return list(pa.ipc.open_stream(buf))
    except pa.ArrowException as e:
        raise ProtocolError(f"{what}: the stream in shared memory is malformed: {e}") from e
