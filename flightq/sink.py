"""Where the encoder puts a batch's payload bytes: copied now, copied later, or gathered.

:func:`flightq.encode.encode` checks every value and lays out every offset itself; it then
hands each payload column (the bytes of a ``large_binary`` array, end to end) to a sink,
which returns the column's data buffer. The sink decides only when and where the bytes are
copied:

- :class:`CopyNow` (the default) copies them into one new buffer at once;
- :class:`DeferredFills` returns the buffer unfilled and leaves the copy to a callable per
  batch, which a sender runs just before writing that batch (the socket put);
- :class:`flightq.shm.gather.ShmGather` returns a placeholder and copies the bytes straight
  from the caller's tensors into a shared-memory segment (the shm put).

Every sink yields the same bytes once its copies have run.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from .tensor import Bulk

#: Where a put's payload buffers come from (:func:`allocate`): Arrow's default pool (None)
#: until the process keeps freed memory, then the C library's malloc
#: (:func:`payloads_from_malloc`). Process-wide, as the allocator's own settings are.
_POOL: pa.MemoryPool | None = None

__all__ = [
    "Sink",
    "CopyNow",
    "DeferredFills",
    "COPY",
    "allocate",
    "payloads_from_malloc",
    "copy_payloads",
    "copy_bulk",
    "bulk_buffers",
]


class Sink(abc.ABC):
    """Receives the payload columns of the batches being encoded."""

    @abc.abstractmethod
    def column(self, payloads: list[Any], lengths: np.ndarray, offsets: np.ndarray) -> pa.Buffer:
        """The data buffer of a column whose row ``i`` is ``payloads[i]`` (``lengths[i]``
        bytes, from ``offsets[i]``; ``offsets[-1]`` is the total)."""

    @abc.abstractmethod
    def bulk(self, bulk: Bulk, present: list[int], offsets: np.ndarray) -> pa.Buffer:
        """The data buffer of a column converted in bulk: ``bulk.tensors[j]`` is row
        ``present[j]``; the other rows are empty."""

    def end_batch(self) -> None:  # noqa: B027 - a hook most sinks leave empty
        """Called once the batch whose columns were handed over is built."""


class CopyNow(Sink):
    """Copy each payload column into one new buffer as it is encoded (:func:`encode`)."""

    def column(self, payloads: list[Any], lengths: np.ndarray, offsets: np.ndarray) -> pa.Buffer:
        data, buf = allocate(int(offsets[-1]))
        copy_payloads(buf, payloads, offsets)
        return data

    def bulk(self, bulk: Bulk, present: list[int], offsets: np.ndarray) -> pa.Buffer:
        data, buf = allocate(int(offsets[-1]))
        copy_bulk(bulk, buf)
        return data


#: The default sink; it holds no state.
COPY = CopyNow()


class DeferredFills(Sink):
    """Leave every copy for later: ``fills[i]()`` completes batch ``i``.

    Every check has run by the time a batch is returned; only its payload bytes are
    missing. A column whose non-empty payloads already lie end to end in memory (a lone
    payload, views of one array) is referenced as it is, not copied: the batches must be
    sent while the tensors stay unchanged.

    Parameters
    ----------
    fills:
        The list each batch's fill is appended to (a new one when None).
    """

    def __init__(self, fills: list[Callable[[], None]] | None = None) -> None:
        self.fills: list[Callable[[], None]] = [] if fills is None else fills
        self._jobs: list[Callable[[], None]] = []

    def column(self, payloads: list[Any], lengths: np.ndarray, offsets: np.ndarray) -> pa.Buffer:
        data = _in_place(payloads, lengths)
        if data is not None:
            return data
        data, buf = allocate(int(offsets[-1]))
        self._jobs.append(functools.partial(copy_payloads, buf, payloads, offsets))
        return data

    def bulk(self, bulk: Bulk, present: list[int], offsets: np.ndarray) -> pa.Buffer:
        data, buf = allocate(int(offsets[-1]))
        self._jobs.append(functools.partial(copy_bulk, bulk, buf))
        return data

    def end_batch(self) -> None:
        self.fills.append(functools.partial(_run, self._jobs))
        self._jobs = []


def allocate(nbytes: int) -> tuple[pa.Buffer, np.ndarray]:
    """A new payload buffer of ``nbytes``, and a writable uint8 view of it.

    From Arrow's default pool (mimalloc in pyarrow's wheels), which keeps the pages a
    small put freed for the next one where untuned malloc hands them back to the kernel
    (a W3 put: 2.3 thousand page faults, 23 ms of client CPU from malloc, 13.5 ms from the
    pool, on the 2-core machine). Once the process keeps freed memory
    (:func:`flightq.keep_freed_memory`), from malloc instead: mimalloc hands back the pages
    of a put past about half a GB whatever the process asks, and every later put of that
    size faults them in again, zeroed (a full W2 put, 1.3 GB over four streams: 0.76
    GB/s from mimalloc, 1.70-1.86 GB/s from kept malloc, in the same benchmark runs).
    """
    data = pa.allocate_buffer(nbytes, memory_pool=_POOL)
    return data, np.frombuffer(data, dtype=np.uint8)


def payloads_from_malloc() -> None:
    """Take put payload buffers from the C library's malloc from now on (see
    :func:`allocate`); :func:`flightq.keep_freed_memory` calls it once malloc keeps freed
    memory."""
    global _POOL
    _POOL = pa.system_memory_pool()


def _run(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def copy_payloads(buf: np.ndarray, payloads: list[Any], offsets: np.ndarray) -> None:
    """Copy ``payloads[i]`` to ``buf[offsets[i]:offsets[i + 1]]``."""
    for p, lo, hi in zip(payloads, offsets[:-1], offsets[1:], strict=True):
        if hi > lo:
            buf[lo:hi] = np.frombuffer(p, dtype=np.uint8)


def copy_bulk(bulk: Bulk, out: np.ndarray) -> None:
    """Copy a bulk column's bytes into ``out`` (:meth:`flightq.tensor.Bulk.copy_into`);
    torch tensors straight from their memory, read now.

    Each tensor's memory as an Arrow buffer, written end to end by one C loop: a third of
    the cost of viewing each through numpy (``Tensor.numpy`` detaches and wraps it).

    Raises
    ------
    EncodeError
        If a tensor changed size since it was checked.
    """
    memory = bulk.memory() if len(out) else None
    if memory is None:
        bulk.copy_into(out)
        return
    writer = pa.FixedSizeBufferWriter(pa.py_buffer(out))
    writer.writelines(list(map(pa.foreign_buffer, *memory)))


def bulk_buffers(bulk: Bulk) -> list[Any] | None:
    """A bulk column's tensors as buffers over their memory, each holding its tensor
    (:meth:`flightq.tensor.Bulk.byte_views`, torch tensors as Arrow buffers); None where
    their memory is not their value."""
    memory = bulk.memory()
    if memory is None:
        return bulk.byte_views()
    return list(map(pa.foreign_buffer, *memory, bulk.tensors))


def _in_place(payloads: list[Any], lengths: np.ndarray) -> pa.Buffer | None:
    """The payloads' own memory as one buffer, if the non-empty ones lie end to end.

    That holds for a lone payload, and for views of one array placed back to back (rows
    split from a packed tensor, a pinned staging buffer). None otherwise: copy them.
    """
    parts = [p for p, n in zip(payloads, lengths.tolist(), strict=True) if n]
    if not parts:
        return None
    if len(parts) == 1:
        return pa.py_buffer(parts[0])
    if not all(type(p) is np.ndarray for p in parts):
        return None
    root = parts[0]
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    start = end = parts[0].ctypes.data
    for p in parts:
        if p.ctypes.data != end:
            return None
        end += p.nbytes
    base = root.ctypes.data
    if start < base or end > base + root.nbytes:
        return None
    return pa.py_buffer(root.reshape(-1).view(np.uint8)[start - base : end - base])
