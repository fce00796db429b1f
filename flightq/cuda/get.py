"""Gets and claims into CUDA tensors: the streams read and checked, then one device
buffer per get, filled through pinned windows.

With ``device="cuda:N"`` the DoGet streams are read as the CPU get reads them, each
record batch checked as it arrives (while gRPC receives the next); once every stream is
in, every payload is copied once into pinned memory (on a few threads) and crosses to
the device in one non-blocking copy per window of pinned memory on a side stream. The
result is a :class:`DeviceBatch` whose columns yield CUDA tensors (bf16 and fp8
included) viewing one device buffer per get.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from ..batch import (
    Batch,
    Column,
    MediaColumn,
    ObjectColumn,
    PartDecoder,
    ScalarColumn,
    TensorColumn,
    join,
)
from .device import ALIGN, align, torch_module
from .pinned import PinnedPool

#: A get's bytes cross to the device through pinned windows of at most this size.
_WINDOW = 64 * 2**20
#: Threads copying a window's large payloads into pinned memory, each given at least
#: ``_THREAD_BYTES``; payloads under ``_LARGE`` bytes are copied by the calling thread.
_COPY_THREADS = 4
_THREAD_BYTES = 4 * 2**20
_LARGE = 2**18

_copiers_lock = threading.Lock()
#: The process's copy threads and the process they were made in (a forked child makes
#: its own: threads do not survive a fork).
_copiers_of: tuple[int, ThreadPoolExecutor] | None = None


def _copiers() -> ThreadPoolExecutor:
    """The :data:`_COPY_THREADS` threads that copy large payloads into pinned memory,
    made on first use and kept: starting them for every get cost about 0.3 ms."""
    global _copiers_of
    with _copiers_lock:
        if _copiers_of is None or _copiers_of[0] != os.getpid():
            ex = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="flightq-cuda-copy")
            _copiers_of = (os.getpid(), ex)
        return _copiers_of[1]


class DeviceBatch(Batch):
    """A :class:`~flightq.batch.Batch` whose tensors live on a CUDA device.

    Token, tensor and media rows and scalar columns are views over one device buffer per
    get; keys, tags and object fields' values stay on the host.

    Attributes
    ----------
    device:
        The ``torch.device`` the tensors are on.
    event:
        A ``torch.cuda.Event`` recorded after the last host-to-device copy: wait on it from
        another stream (``event.wait(stream)``) or the host (``event.synchronize()``).
    stream:
        The side stream the copies ran on.
    """

    device: Any = None
    event: Any = None
    stream: Any = None

    def synchronize(self) -> None:
        """Block the host until every copy of this batch reached the device."""
        if self.event is not None:
            self.event.synchronize()


class _DeviceScalarColumn(ScalarColumn):
    """A scalar column whose values are one device tensor."""

    def __init__(self, host: ScalarColumn, values: Any) -> None:
        self.__dict__.update(host.__dict__)
        self._values = values

    def tensor(self) -> Any:
        if not self.complete:
            return super().tensor()  # raises MissingFieldError, naming the column
        return self._values.clone() if self.copy else self._values


def rebase(col: Column, base: Any, elem: np.ndarray | None = None) -> None:
    """Point a token, tensor or media column's rows at ``base`` (a flat tensor, any device).

    ``base`` holds the column's elements; ``elem`` gives, per payload (per dictionary entry
    for media), its element offset in ``base`` (unchanged when None: ``base`` then holds
    the same elements as the column's own flat view, in the same order).
    """
    if not isinstance(col, (TensorColumn, MediaColumn)):
        raise TypeError(f"rebase: {type(col).__name__} has no flat base")
    col._base = base
    if elem is not None:
        col._elem = elem


class _Region:
    """One column of one part inside a get's device buffer: what to copy, how to rebase."""

    __slots__ = ("base", "col", "elem", "name", "nbytes", "offset", "part", "pieces")

    def __init__(self, part: DeviceBatch, name: str, col: Column, base: Any) -> None:
        self.part, self.name, self.col, self.base = part, name, col, base
        self.offset = 0
        self.nbytes = 0
        #: (source byte offset in ``base``, bytes, destination byte offset in the buffer)
        self.pieces: list[tuple[int, int, int]] = []
        #: Media: per dictionary entry, its element offset in the whole buffer.
        self.elem: np.ndarray | None = None

    def place(self, at: int, seen: dict[tuple[int, int], int]) -> int:
        """Lay the column out from byte ``at``; returns where the next column starts.

        ``seen`` maps the host bytes of media entries placed earlier in this get,
        ``(address, size)``, to their byte offset: the chunks of one prompt group carry
        the same dictionary, and its image crosses once.
        """
        base, col = self.base, self.col
        self.offset = at
        if not isinstance(col, MediaColumn):
            self.nbytes = base.nbytes
            if self.nbytes:
                self.pieces.append((0, self.nbytes, at))
            return align(at + self.nbytes)
        # Python lists: a prompt group's few entries cost less than numpy calls on them.
        isz = base.element_size()
        elem = col._elem.tolist()
        ends = [*elem[1:], base.numel()]
        addr = base.data_ptr()
        starts = [0] * len(elem)
        pos = at
        for e in dict.fromkeys(col.entry.tolist()):  # the entries some row uses, once
            a, n = elem[e] * isz, (ends[e] - elem[e]) * isz
            hit = seen.get((addr + a, n))
            if hit is None:
                hit = seen[addr + a, n] = pos
                if n:
                    self.pieces.append((a, n, pos))
                pos += n
            starts[e] = hit // isz
        self.elem = np.array(starts, dtype=np.int64)
        self.nbytes = pos - at
        return align(pos)

    def source(self) -> np.ndarray:
        """The host bytes the pieces are cut from."""
        return self.base.reshape(-1).view(torch_module().uint8).numpy()

    def finish(self, dev: Any) -> None:
        """Point the column at its bytes in ``dev``, the get's device buffer."""
        dt, col = self.base.dtype, self.col
        if self.elem is not None:
            rebase(col, dev.view(dt), self.elem)
            return
        view = dev[self.offset : self.offset + self.nbytes].view(dt)
        if isinstance(col, ScalarColumn):
            self.part._columns[self.name] = _DeviceScalarColumn(col, view)
        else:
            rebase(col, view)


#: A host copy: (destination byte offset, source bytes, source byte offset, bytes).
_Copy = tuple[int, np.ndarray, int, int]


def _plan(parts: list[DeviceBatch]) -> tuple[list[_Region], int]:
    """Where every column of every part lands in one device buffer, and its size."""
    seen: dict[tuple[int, int], int] = {}
    regions: list[_Region] = []
    total = 0
    for part in parts:
        for name in part.fields:
            col = part.column(name)
            if isinstance(col, ObjectColumn):
                continue  # Python values: they stay on the host
            if isinstance(col, ScalarColumn):
                if not col.complete:
                    continue  # rows with gaps come back as a Python list, as on the CPU path
                r = _Region(part, name, col, col.tensor())
            else:
                assert isinstance(col, (TensorColumn, MediaColumn))
                r = _Region(part, name, col, col._base)
            total = r.place(total, seen)
            regions.append(r)
    return regions, total


def _windows(regions: list[_Region], total: int) -> Iterator[tuple[int, int, list[_Copy]]]:
    """The host copies of ``regions`` cut into windows of at most :data:`_WINDOW` bytes:
    ``(start, stop, copies)``, destination offsets relative to ``start``."""
    todo: list[_Copy] = []
    for r in regions:
        if r.pieces:
            src = r.source()
            todo += [(to, src, a, n) for a, n, to in r.pieces]
    k = 0
    for start in range(0, total, _WINDOW):
        stop = min(total, start + _WINDOW)
        copies: list[_Copy] = []
        while k < len(todo) and todo[k][0] < stop:
            to, src, a, n = todo[k]
            m = min(n, stop - to)
            copies.append((to - start, src, a, m))
            if m < n:
                todo[k] = (to + m, src, a + m, n - m)
                break
            k += 1
        yield start, stop, copies


def _copy(copies: list[_Copy], dst: np.ndarray, meanwhile: Callable[[], None]) -> None:
    """Run the host copies into ``dst``: the large ones shared among up to
    :data:`_COPY_THREADS` threads, the small ones and then ``meanwhile()`` on this thread
    in the meantime.

    numpy's copy is a plain memcpy that releases the GIL, so the threads copy side by side
    (one core fills pinned memory at a fraction of the memory bandwidth); every copy holds
    the GIL a moment, so the many small ones stay on one thread rather than queue for it.
    """

    def run(group: list[_Copy]) -> None:
        for to, src, a, n in group:
            np.copyto(dst[to : to + n], src[a : a + n])

    large = [c for c in copies if c[3] >= _LARGE]
    nbytes = sum(c[3] for c in large)
    k = min(_COPY_THREADS, nbytes // _THREAD_BYTES)
    if k < 2:
        run(copies)
        meanwhile()
        return
    share = -(-nbytes // k)
    groups: list[list[_Copy]] = [[]]
    room = share
    for to, src, a, n in large:
        while n:
            m = min(n, room)
            groups[-1].append((to, src, a, m))
            to, a, n, room = to + m, a + m, n - m, room - m
            if not room:
                groups.append([])
                room = share
    ex = _copiers()
    done = [ex.submit(run, g) for g in groups if g]
    try:
        run([c for c in copies if c[3] < _LARGE])
        meanwhile()
    finally:
        for f in done:  # the pinned buffer is in use until every copy into it ended
            f.result()


def _to_device(
    parts: list[DeviceBatch], device: Any, side: Any, consumer: Any, pool: PinnedPool
) -> None:
    """Copy the parts' payloads into one new device buffer and point their columns at it.

    The bytes go through pinned windows (two taking turns when the get is larger than
    one), each copied to the device with one non-blocking copy on ``side``.
    """
    torch = torch_module()
    regions, total = _plan(parts)
    with torch.cuda.stream(side):
        dev = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=device)
    # Allocated on the side stream, used on the caller's: tell the caching allocator.
    dev.record_stream(consumer)

    def finish() -> None:
        for r in regions:
            r.finish(dev)

    if not total:
        finish()
        return
    size = min(total, _WINDOW)
    bufs = [pool.take(size) for _ in range(1 if total <= _WINDOW else 2)]
    events: list[Any] = [None] * len(bufs)
    for i, (start, stop, copies) in enumerate(_windows(regions, total)):
        j = i % len(bufs)
        if events[j] is not None:
            events[j].synchronize()  # its previous window reached the device
        # The columns are pointed at the device buffer while the first copies run.
        _copy(copies, bufs[j].numpy(), finish if i == 0 else lambda: None)
        with torch.cuda.stream(side):
            dev[start:stop].copy_(bufs[j][: stop - start], non_blocking=True)
        events[j] = torch.cuda.Event()
        events[j].record(side)
    for buf, event in zip(bufs, events, strict=True):
        pool.give(buf, [event])


def _validated(chunks: Iterable[pa.RecordBatch], copy: bool) -> list[DeviceBatch]:
    """One stream's record batches as host-side parts (nothing copied yet), each checked
    as it arrives, while gRPC receives the next, as the CPU get decodes them."""
    d = PartDecoder("torch", copy, prepare=False, part=DeviceBatch)
    for rb in chunks:
        d.add(rb)
    return d.parts  # type: ignore[return-value]


def decode_to_device(
    chunks: Iterable[pa.RecordBatch],
    device: Any,
    pool: PinnedPool,
    *,
    copy: bool = False,
    sync: bool = True,
) -> DeviceBatch:
    """Decode a stream of record batches into CUDA tensors.

    Each record batch is checked as it arrives, as the CPU get decodes it; nothing is
    copied until the stream ended (a thread copying while the stream arrives slows the
    reader down: they share the GIL). Then every payload is copied once into pinned
    memory, on several threads, and crosses to the device in one non-blocking copy per
    :data:`_WINDOW` bytes on the pool's side stream.

    Parameters
    ----------
    chunks:
        The record batches of one stream (same schema and fields), e.g. a DoGet reader's.
    device:
        A ``torch.device`` of type cuda (see :func:`resolve_device`).
    pool:
        Pinned buffers and the copy stream.
    copy:
        Give every row its own device allocation instead of a view of the get's buffer.
    sync:
        Wait (host) until every copy reached the device before returning. When False, the
        call returns once the last copy is queued, and the current stream of ``device``
        is made to wait for the copies, so work queued on it afterwards sees the data;
        other streams wait on :attr:`DeviceBatch.event`.

    Returns
    -------
    DeviceBatch

    Raises
    ------
    DecodeError, ShapeError, UndeclaredFieldError
        As :func:`flightq.batch.decode`.
    """
    return _assemble(_validated(chunks, copy), device, pool, sync)


def decode_streams_to_device(
    streams: Sequence[Iterable[pa.RecordBatch]],
    device: Any,
    pool: PinnedPool,
    *,
    copy: bool = False,
    sync: bool = True,
    stop: threading.Event | None = None,
) -> DeviceBatch:
    """:func:`decode_to_device` over several streams read in parallel, parts in order.

    Each stream is read and checked on its own thread, as the CPU get reads a split get;
    once all are in, their parts are copied to the device together (media entries are
    shared within a stream). If a stream raises (its transport or a check of its record
    batches), ``stop`` is set (the other streams may end early) and the error of the first
    failing stream, in stream order, is raised once every thread finished.
    """
    results: list[list[DeviceBatch]] = [[] for _ in streams]
    errors: list[BaseException | None] = [None] * len(streams)

    def work(i: int) -> None:
        try:
            results[i] = _validated(streams[i], copy)
        except BaseException as e:
            errors[i] = e
            if stop is not None:
                stop.set()

    threads = [
        threading.Thread(target=work, args=(i,), name=f"flightq-cuda-get-{i}", daemon=True)
        for i in range(1, len(streams))
    ]
    for t in threads:
        t.start()
    if streams:
        work(0)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return _assemble([p for r in results for p in r], device, pool, sync)


def _assemble(parts: list[DeviceBatch], device: Any, pool: PinnedPool, sync: bool) -> DeviceBatch:
    """The parts, copied to ``device``, as one DeviceBatch with an event after the copies."""
    torch = torch_module()
    whole = join(parts)  # refuses no parts, or parts of other schemas or fields
    assert isinstance(whole, DeviceBatch)
    side = pool.stream(device)
    # The device buffer is allocated on the side stream and handed to the caller's stream
    # with record_stream, so the copies need not wait for work queued on the caller's.
    consumer = torch.cuda.current_stream(device)
    _to_device(parts, device, side, consumer, pool)
    event = torch.cuda.Event()
    event.record(side)
    whole.device, whole.event, whole.stream = device, event, side
    if sync:
        event.synchronize()
    else:
        consumer.wait_event(event)
    return whole
