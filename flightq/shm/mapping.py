"""Readers' side of a segment: maps held under a shared lock, and where each lies."""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import stat
import struct
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import ProtocolError
from .segments import (
    HEADER,
    HEADER_FORMAT,
    MAGIC,
    MAP_POPULATE_FLAG,
    SEGMENT_NAME,
    STATE_AT,
    TAKEN,
    WRITTEN,
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
    if os.path.dirname(real) != dirpath or not SEGMENT_NAME.match(os.path.basename(real)):
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
        magic, state, g, size, _pid, _at = HEADER_FORMAT.unpack_from(head, 0)
        if magic != MAGIC or g != gen or size != n or state not in (WRITTEN, TAKEN):
            raise ProtocolError(
                f"{what}: shared-memory segment {path!r} is not generation {gen} of {n} "
                "bytes ready to read (reused or corrupted); retry the call"
            )
        # The data is mapped read-only: views handed out can never write the owner's pages.
        start = lo - lo % mmap.ALLOCATIONGRANULARITY
        body = mmap.mmap(
            fd,
            max(hi - start, 1),
            flags=mmap.MAP_SHARED | (MAP_POPULATE_FLAG if populate else 0),
            prot=mmap.PROT_READ,
            offset=HEADER + start,
        )
    except BaseException:
        os.close(fd)
        if head is not None:
            head.close()
        raise
    struct.pack_into("<q", head, STATE_AT, TAKEN)
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
