"""A put's one copy: large payloads go straight from the caller's tensors into a segment."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ..sink import CopyNow, bulk_buffers
from ..tensor import Bulk
from .direct import deal

# --------------------------------------------------------------------------- gathering

#: Payload columns smaller than this are gathered by the encoder as usual.
_GATHER_MIN = 256 * 2**10
#: Copies into a segment run on up to this many threads, one per this many bytes.
_COPY_THREADS = 4
_COPY_MIN = 8 * 2**20
_COPY_PIECE = 8 * 2**20


class ShmGather(CopyNow):
    """A sink (:mod:`flightq.sink`) whose large payload columns are copied straight into a
    segment; smaller ones are copied at once, as :class:`flightq.sink.CopyNow` does.

    Each large payload column gets a placeholder buffer (allocated, never filled: its
    pages are never touched) and the payloads are remembered; the segment writer
    (:meth:`flightq.shm.SegmentPool.write` given this gather) then copies each payload
    once, from the caller's tensor to its place in the segment. A placeholder starts with
    a unique stamp so that Arrow's IPC writer never takes two of them for equal
    dictionaries. Batches encoded into it are valid only for that writer.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: dict[int, tuple[int, list[Any], np.ndarray, pa.Buffer]] = {}
        self._stamp = itertools.count(1)
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []
        #: Leave the payloads where they are: :meth:`copy` names them in :attr:`fills`
        #: for the server to read (:mod:`flightq.shm.direct`) instead of copying them.
        self.direct = False
        #: After :meth:`copy` in direct mode: (segment offset, address, length) triples,
        #: little-endian int64, in segment order; None otherwise.
        self.fills: bytes | None = None
        self._named: list[list[int]] = []
        self._dst: np.ndarray | None = None

    @property
    def gathered(self) -> bool:
        """Whether a payload column was left to be copied into a segment (the batches then
        hold placeholders)."""
        return bool(self._spans)

    def column(self, payloads: list[Any], lengths: np.ndarray, offsets: np.ndarray) -> pa.Buffer:
        if int(offsets[-1]) < _GATHER_MIN:
            return super().column(payloads, lengths, offsets)
        return self._placeholder(payloads, offsets)

    def bulk(self, bulk: Bulk, present: list[int], offsets: np.ndarray) -> pa.Buffer:
        views = bulk_buffers(bulk) if int(offsets[-1]) >= _GATHER_MIN else None
        if views is None:
            return super().bulk(bulk, present, offsets)
        payloads: list[Any] = views
        n = len(offsets) - 1
        if len(present) < n:  # the rows' memory as it is; absent rows are empty
            payloads = [b""] * n
            for i, v in zip(present, views, strict=True):
                payloads[i] = v
        return self._placeholder(payloads, offsets)

    def _placeholder(self, payloads: list[Any], offsets: np.ndarray) -> pa.Buffer:
        n = int(offsets[-1])
        buf = pa.allocate_buffer(n)
        np.frombuffer(buf, dtype=np.uint64, count=1)[0] = next(self._stamp)
        bisect.insort(self._starts, buf.address)
        self._spans[buf.address] = (n, list(payloads), offsets, buf)
        return buf

    def stream(self, dst: np.ndarray) -> SegmentStream:
        """A write-only stream over a segment's data ``dst`` that fills this sink's
        placeholders (:meth:`flightq.shm.segments.SegmentPool.write`)."""
        self._dst = dst
        return SegmentStream(dst, self)

    def forget(self) -> None:
        """Let go of the payloads (the caller's tensors): the placeholders are spent."""
        self._starts, self._spans, self.copies, self._named = [], {}, [], []
        self.fills = None
        self._dst = None

    def fill(self, address: int, size: int, dst: np.ndarray, at: int = 0) -> bool:
        """Plan the copy of the bytes a placeholder stands for at ``[address, address + size)``
        into ``dst``, at byte ``at`` of the segment's data (run by :meth:`copy`; in direct
        mode named by :attr:`fills` instead)."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return False
        start = self._starts[i]
        n, payloads, offs, _ = self._spans[start]
        lo = address - start
        if lo + size > n:
            return False
        hi = lo + size
        named = self._named
        j = int(np.searchsorted(offs, lo, side="right")) - 1
        while j < len(payloads) and offs[j] < hi:
            a, b = max(int(offs[j]), lo), min(int(offs[j + 1]), hi)
            if b > a:
                if self.direct:
                    # (offset in the segment, address in this process, length), merged
                    # where both sides follow on (rows of one tensor, back to back).
                    pos, src = at + a - lo, _address(payloads[j]) + a - int(offs[j])
                    last = named[-1] if named else None
                    if last and last[0] + last[2] == pos and last[1] + last[2] == src:
                        last[2] += b - a
                    else:
                        named.append([pos, src, b - a])
                else:
                    src_view = np.frombuffer(payloads[j], dtype=np.uint8)
                    self.copies.append(
                        (dst[a - lo : b - lo], src_view[a - int(offs[j]) : b - int(offs[j])])
                    )
            j += 1
        return True

    def copy(self) -> None:
        """Run the planned copies, on several threads when they are large; in direct mode
        name them in :attr:`fills` instead.

        One thread copies well below what the memory system moves: on the 2-core reference
        machine two threads copy about 1.8 times as fast as one.
        """
        if self.direct:
            self.fills = np.array(self._named, dtype="<i8").tobytes() if self._named else None
            return
        copies, self.copies = self.copies, []
        self._run(copies)

    def copy_planned(self) -> None:
        """Run the copies direct mode left to the server (it refused to read them)."""
        assert self._dst is not None
        named, self._named = self._named, []
        self.fills = None
        dst = self._dst
        self._run(
            [
                (dst[at : at + n], np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(src)))
                for at, src, n in named
            ]
        )

    def _run(self, copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
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
        groups = deal(pieces, [len(d) for d, _ in pieces], n)
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


def _address(payload: Any) -> int:
    """Where a payload's bytes start in this process's memory."""
    if isinstance(payload, pa.Buffer):
        return int(payload.address)
    if not isinstance(payload, np.ndarray):
        payload = np.frombuffer(payload, dtype=np.uint8)
    return int(payload.__array_interface__["data"][0])


class SegmentStream:
    """A write-only stream over a segment's data: copies, or fills placeholders."""

    closed = False

    def __init__(self, dst: np.ndarray, gather: ShmGather) -> None:
        self.dst = dst
        self.gather = gather
        self.pos = 0

    def write(self, data: Any) -> int:
        if isinstance(data, pa.Buffer):
            n = data.size
            out = self.dst[self.pos : self.pos + n]
            if not self.gather.fill(data.address, n, out, self.pos):
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


def gathered(sink: object) -> bool:
    """Whether ``sink`` is a :class:`ShmGather` that left a payload column to be copied
    into a segment (its batches then hold placeholders, valid only there)."""
    return isinstance(sink, ShmGather) and sink.gathered


@contextlib.contextmanager
def gathering() -> Iterator[ShmGather]:
    """A sink for encoding (:func:`flightq.chunks.encode_chunks`) batches to write to a
    segment in this block.

    Large payload columns are then copied once, from the caller's tensors straight into
    the segment, instead of into an intermediate buffer first. The encoded batches hold
    placeholders: they are valid for :meth:`SegmentPool.write` given this sink, in the
    same block only; leaving it lets go of the caller's tensors.

    Examples
    --------
    >>> with gathering() as sink:  # doctest: +SKIP
    ...     batches = encode_chunks(schema, columns, keys, max_bytes=BATCH_BYTES, sink=sink)
    ...     ref = pool.write(batches[0].schema, batches, "put", gather=sink)
    """
    g = ShmGather()
    try:
        yield g
    finally:
        g.forget()
