"""A put's one copy on Linux: the server reads the payloads out of the writer's memory.

A put through shared memory copies twice by default: the writer copies its tensors into
its segment, and the server copies the segment into one it owns (so that no writer can
change what was acknowledged). With direct reads the writer leaves the payloads where
they are: it writes the stream's small parts into its segment and names, per payload,
the range of its own memory to read (``fills``: segment offset, address, length). The
server copies those ranges with ``process_vm_readv`` straight into its own segment, and
the rest of the stream from the writer's file, so the bytes it stores are the same it
would have copied, read once.

The server reads the memory of the process that holds the put's connection, no other:

- at the shared-memory handshake the client names its pid and the address of the probe
  token it wrote to the probe file; the server finds the client end of the caller's TCP
  connection among that pid's descriptors (:mod:`flightq.shm.owner`) and reads the token
  back from that address. Only then does it offer direct reads;
- every put that names fills is checked the same way (the connection is the caller's,
  the pid holds it) before a byte is read.

A read that faults (a range the writer does not map) refuses the put: nothing is stored.
A read that stalls (memory backed by a file system that does not answer) is given up
after :func:`deadline` seconds; its segment is taken out of the pool until the read
returns, and once :data:`MAX_STUCK` reads are stuck the server offers no more direct
reads. At most :data:`MAX_READS` reads run at once, stuck ones included. Each refusal is
a :class:`~flightq.errors.ProtocolError` whose ``field`` is ``"fills"``: the client then
copies as before. Where the kernel, a security module or another PID namespace forbids
the read, the handshake says so and the client copies from the start.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..errors import ProtocolError
from ..protocol import MAX_FILLS
from . import owner
from .owner import refused

__all__ = [
    "MAX_READS",
    "MAX_STUCK",
    "GivenUp",
    "check_fills",
    "check_not_stuck",
    "deal",
    "deadline",
    "filled_bytes",
    "owner_check",
    "read_fills",
    "read_memory",
    "stuck",
]

#: Reads given up while still running, past which the server offers no direct reads.
MAX_STUCK = 4
#: Reads in flight at once (stuck ones included); a put past them is refused, and copied.
MAX_READS = 8
#: One ``process_vm_readv`` takes at most this many ranges (the kernel's ``IOV_MAX``).
_IOV_MAX = 1024
#: A read is cut into pieces of this size, dealt to threads.
_PIECE = 8 * 2**20
_THREADS = 8

_stuck_lock = threading.Lock()
_stuck = 0
T = TypeVar("T")


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _readv() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn  # a CDLL call lets go of the interpreter lock while it runs


_process_vm_readv = _readv()


def stuck() -> int:
    """Direct reads given up on that have not returned yet."""
    return _stuck


def deadline(nbytes: int) -> float:
    """Seconds a direct read of ``nbytes`` may take before it is given up: 10 s plus
    what 100 MB/s needs (a loaded host reads at several GB/s)."""
    return 10.0 + nbytes / 100e6


def check_not_stuck(what: str) -> None:
    """Refuse direct reads while :data:`MAX_STUCK` are stuck.

    Raises
    ------
    ProtocolError
        ``field`` "fills".
    """
    if _stuck >= MAX_STUCK:
        raise refused(f"{what}: direct reads are off, {_stuck} are stuck on this server")


def owner_check(peer: str, pid: int, what: str) -> None:
    """Check that process ``pid`` holds the client end of the connection ``peer``
    (:func:`flightq.shm.owner.owner_check`), and that this host can read it.

    Raises
    ------
    ProtocolError
        ``field`` "fills": if not, or without ``process_vm_readv``.
    """
    if _process_vm_readv is None:
        raise refused(f"{what}: direct reads need Linux's process_vm_readv")
    owner.owner_check(peer, pid, what)


# --------------------------------------------------------------------------- the read


def filled_bytes(raw: bytes) -> int:
    """The bytes a put's (checked) fills name."""
    return int(np.frombuffer(raw, dtype="<i8")[2::3].sum())


_I64 = 2**63 - 1


def check_fills(raw: bytes, nbytes: int, what: str) -> np.ndarray:
    """A put's fills as an ``(k, 3)`` int64 array (segment offset, address, length).

    Raises
    ------
    ProtocolError
        Unless they are whole triples, at most :data:`MAX_FILLS`, each non-empty, in
        order, not overlapping, inside the segment's ``nbytes`` and at addresses whose
        range does not pass the end of the address space.
    """
    if len(raw) % 24 or not raw:
        raise refused(f"{what}: fills must be whole (offset, address, length) triples")
    fills = np.frombuffer(raw, dtype="<i8").reshape(-1, 3)
    if len(fills) > MAX_FILLS:
        raise refused(f"{what}: {len(fills)} fills, at most {MAX_FILLS}")
    at, addr, n = fills[:, 0], fills[:, 1], fills[:, 2]
    # Each bound on its own first (``or`` stops there), so that no sum can pass int64.
    if (
        (n <= 0).any()
        or (n > nbytes).any()
        or (at < 0).any()
        or (at > nbytes - n).any()
        or ((at + n)[:-1] > at[1:]).any()
    ):
        raise refused(
            f"{what}: fills must be non-empty, in order, apart and inside the segment's "
            f"{nbytes} bytes"
        )
    if (addr <= 0).any() or (addr > _I64 - n).any():
        raise refused(f"{what}: a fill's address range passes the end of the address space")
    return fills.astype(np.int64)


def _read_ranges(pid: int, ranges: list[tuple[int, int, int]], what: str) -> None:
    """Copy each (local address, remote address, length) of ``pid``'s memory."""
    assert _process_vm_readv is not None
    for lo in range(0, len(ranges), _IOV_MAX):
        part = ranges[lo : lo + _IOV_MAX]
        k = len(part)
        local = (_Iovec * k)(*[_Iovec(a, n) for a, _, n in part])
        remote = (_Iovec * k)(*[_Iovec(r, n) for _, r, n in part])
        want = sum(n for _, _, n in part)
        got = _process_vm_readv(pid, local, k, remote, k, 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            why = os.strerror(err) if err else f"{got} of {want} bytes"
            raise refused(f"{what}: reading the writer's memory (pid {pid}) failed: {why}")


def deal(pieces: list[T], sizes: list[int], k: int) -> list[list[T]]:
    """``pieces`` in order, cut into at most ``k`` runs of about equal bytes (``sizes``):
    one run per thread of a copy."""
    share = -(-sum(sizes) // k)
    groups: list[list[T]] = [[]]
    acc = 0
    for p, n in zip(pieces, sizes, strict=True):
        if acc >= share and len(groups) < k:
            groups.append([])
            acc = 0
        groups[-1].append(p)
        acc += n
    return groups


# Reads run on daemon threads kept between puts (starting threads for each put cost a
# W1 put 0.7 ms on two cores): the threads a read needs are started before any of its
# work is queued, so a read never queues behind a stuck one. Daemons: a stuck read does
# not hold up the exit. At most MAX_READS reads are in flight (stuck ones included), so
# the threads, and the segments being filled, stay bounded.
_pool_lock = threading.Lock()
_pool_queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_pool_threads = 0
_pool_busy = 0
_slots = threading.BoundedSemaphore(MAX_READS)


def _start(jobs: list[Callable[[], None]]) -> None:
    """Queue ``jobs``, each on a thread of its own, or none of them (raises)."""
    global _pool_threads, _pool_busy
    with _pool_lock:
        missing = _pool_busy + len(jobs) - _pool_threads
        started = 0
        try:
            for _ in range(missing):
                threading.Thread(target=_work, name="flightq-shm-direct", daemon=True).start()
                started += 1
        finally:
            _pool_threads += started
        _pool_busy += len(jobs)
    for job in jobs:
        _pool_queue.put(job)


def _work() -> None:
    global _pool_busy
    while True:
        job = _pool_queue.get()
        try:
            job()
        except BaseException:  # a job reports its own errors; the thread stays
            pass
        finally:
            del job  # an idle worker keeps nothing of the last read alive
            with _pool_lock:
                _pool_busy -= 1


class GivenUp(ProtocolError):
    """A direct read that did not return in time (:func:`read_fills`)."""


def read_fills(
    pid: int,
    fills: np.ndarray,
    dst: Any,
    what: str,
    later: Callable[[], None],
    limit: float | None = None,
) -> Callable[[], None]:
    """Start copying ``fills`` of ``pid``'s memory into ``dst`` (a writable buffer over the
    segment's data, offsets relative to it) on a few threads; returns ``wait()``, which
    joins them and raises the first error, or :class:`GivenUp` once ``limit`` seconds
    (:func:`deadline` by default) pass. The threads are then left to finish:
    :func:`stuck` counts the read until they do, ``dst`` must stay mapped until then, and
    ``later()`` runs once they have.

    Raises
    ------
    ProtocolError
        ``field`` "fills": if :data:`MAX_READS` reads are in flight and none ends within
        a second.
    """
    if not _slots.acquire(timeout=1.0):
        raise refused(f"{what}: as many direct reads as this server runs at once are in flight")
    try:
        base = np.frombuffer(dst, dtype=np.uint8).ctypes.data
        pieces: list[tuple[int, int, int]] = []
        for at, addr, n in fills.tolist():
            for o in range(0, n, _PIECE):
                pieces.append((base + at + o, addr + o, min(_PIECE, n - o)))
        total = int(fills[:, 2].sum())
        k = max(1, min(_THREADS, os.cpu_count() or 1, total // _PIECE))
        groups = deal(pieces, [p[2] for p in pieces], k)
        errors: list[BaseException] = []
        left = [len(groups)]
        done = threading.Event()
        given_up = [False]

        def run(group: list[tuple[int, int, int]]) -> None:
            global _stuck
            try:
                _read_ranges(pid, group, what)
            except BaseException as e:  # raised by wait()
                errors.append(e)
            with _stuck_lock:
                left[0] -= 1
                last = left[0] == 0
                late = last and given_up[0]
            if last:
                _slots.release()
                done.set()
            if late:
                errors.clear()  # no wait() raises them now (it raised GivenUp)
                try:
                    later()  # counted as stuck until its segment is let go
                finally:
                    with _stuck_lock:
                        _stuck -= 1

        _start([functools.partial(run, g) for g in groups])
    except BaseException:
        _slots.release()
        raise
    wait_s = deadline(total) if limit is None else limit

    def wait() -> None:
        global _stuck
        if not done.wait(wait_s):
            with _stuck_lock:
                if left[0]:
                    given_up[0] = True
                    _stuck += 1
            if given_up[0]:
                raise GivenUp(
                    f"{what}: reading the writer's memory (pid {pid}) took over {wait_s:.1f} s; "
                    "nothing is stored",
                    field="fills",
                )
        if errors:
            try:
                raise errors[0]
            finally:
                # Kept, the list would close a reference cycle (the error, its traceback,
                # the frames holding the list and ``later``), freed by a cyclic collection.
                errors.clear()

    return wait


def read_memory(pid: int, address: int, n: int, what: str, limit: float = 2.0) -> bytes:
    """``n`` bytes of process ``pid``'s memory at ``address`` (the handshake's token),
    read as a put's fills are: bounded in time, counted while stuck.

    Raises
    ------
    ProtocolError
        As :func:`read_fills`.
    """
    out = np.zeros(n, dtype=np.uint8)
    fills = np.array([[0, address, n]], dtype=np.int64)
    read_fills(pid, fills, out, what, lambda: None, limit=limit)()
    return out.tobytes()
