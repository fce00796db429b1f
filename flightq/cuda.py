"""CUDA tensors in and out of the data plane: pinned staging, side streams, async copies.

Puts: the CUDA tensors of a put are copied device-to-host into one reusable pinned buffer
on a side stream (one async copy per distinct tensor, in row order), with an event every
few MiB; each record batch is encoded once the copies of its rows are done (one
synchronize per chunk), while later rows are still being copied. The wire format is the
CPU path's, byte for byte.

Gets and claims with ``device="cuda:N"``: the record batches of a DoGet stream are read on a
helper thread; as each arrives its payloads are copied into a pinned buffer (one host
copy) and from there to the device with one non-blocking copy on a side stream, while the
next batch is still arriving. The result is a :class:`DeviceBatch` whose columns yield CUDA
tensors (bf16 and fp8 included) viewing one device buffer per chunk.

torch is imported inside the functions that need it: a CPU-only process never loads it
through this module.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .batch import Batch, Column, MediaColumn, ScalarColumn, TensorColumn, validate_part
from .dtypes import DTYPES
from .errors import DecodeError, DeviceError

__all__ = [
    "PinnedPool",
    "DeviceBatch",
    "Staged",
    "resolve_device",
    "has_cuda",
    "stage",
    "decode_to_device",
    "decode_streams_to_device",
]

#: Byte alignment of every tensor inside a staging buffer (covers every dtype and
#: the vector loads of device kernels).
_ALIGN = 256
#: An event is recorded on the copy stream after this many staged bytes (puts).
_EVENT_BYTES = 4 * 2**20
#: Pinned buffers are allocated in multiples of this.
_GRAIN = 2**20
#: CUDA tensors below this are gathered on the device and cross in one copy per dtype.
_SMALL = 2**20


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _numpy_dtype(torch_dtype: Any) -> np.dtype | None:
    """The numpy dtype holding a torch dtype's values, None for bf16, fp8 and the unknown."""
    dt = DTYPES.get(str(torch_dtype).removeprefix("torch."))
    return dt.storage if dt is not None and dt.native_numpy else None


def _flatten(tensors: list[Any]) -> Any:
    """The tensors' elements, one after another, in one new 1-D tensor (one kernel)."""
    import torch

    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    flatten = getattr(torch._C._nn, "flatten_dense_tensors", None)
    if flatten is not None:
        return flatten(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise DeviceError(
            "CUDA tensors need torch with CUDA (pip install 'flightq[torch]'); "
            "pass device=None to read CPU tensors"
        ) from e
    return torch


# --------------------------------------------------------------------------- devices


def resolve_device(device: Any, as_: str = "torch") -> Any:
    """The CUDA device a read should land on, or None for the CPU paths.

    Parameters
    ----------
    device:
        None or ``"cpu"`` (the CPU path), ``"cuda"``, ``"cuda:N"``, an int ``N`` or a
        ``torch.device``.
    as_:
        The read's ``as_``: CUDA tensors exist only as torch.

    Returns
    -------
    torch.device or None
        ``cuda:N`` with an explicit index, or None for the CPU.

    Raises
    ------
    DeviceError
        (also a ``RuntimeError``) if the string names no device, the device is not CUDA,
        torch or CUDA is missing here, the index is out of range, or ``as_='numpy'``.

    Examples
    --------
    >>> resolve_device(None) is None and resolve_device("cpu") is None
    True
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "cpu"):
        return None
    torch = _torch()
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceError(
            f"device={device!r} names no device; expected None, 'cpu', 'cuda' or 'cuda:N'"
        ) from e
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise DeviceError(
            f"device={device!r}: flightq reads into 'cpu' or 'cuda[:N]', not {d.type!r}"
        )
    if as_ != "torch":
        raise DeviceError(
            f"device={device!r} returns torch tensors; as_={as_!r} is for CPU reads, "
            "pass as_='torch' or device=None"
        )
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device={device!r} asked for, but CUDA is not available here (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); pass device=None "
            "for CPU tensors, or install a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if d.index is None else d.index
    if not 0 <= index < count:
        raise DeviceError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


# --------------------------------------------------------------------------- pinned pool


class PinnedPool:
    """Reusable pinned host buffers and one copy stream per device, owned by one client.

    A buffer handed back with :meth:`give` may still be the source or target of copies in
    flight: it carries their events and is only handed out again once they completed.
    Thread-safe. Nothing is allocated (and torch is not imported) before the first use.

    Parameters
    ----------
    max_cached_bytes:
        Free buffers kept beyond this are released to torch's host allocator.
    """

    def __init__(self, max_cached_bytes: int = 2**30) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[Any, list[Any]]] = []
        self._streams: dict[int, Any] = {}
        #: Pinned bytes allocated so far (new buffers only; reuse does not count).
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> Any:
        """A pinned 1-D uint8 CPU tensor of at least ``nbytes`` bytes, idle."""
        torch = _torch()
        with self._lock:
            fits = [(b, ev) for b, ev in self._free if b.numel() >= nbytes]
            # Prefer an idle buffer, then the smallest: large ones stay for large puts.
            fits.sort(key=lambda x: (not all(e.query() for e in x[1]), x[0].numel()))
            if fits:
                buf, events = fits[0]
                self._free = [x for x in self._free if x[0] is not buf]
            else:
                buf, events = None, []
        for e in events:
            e.synchronize()
        if buf is None:
            size = max(_GRAIN, (nbytes + _GRAIN - 1) // _GRAIN * _GRAIN)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            with self._lock:
                self.allocated_bytes += size
        return buf

    def give(self, buf: Any, events: Iterable[Any] = ()) -> None:
        """Hand ``buf`` back; it is reused once every event in ``events`` has completed."""
        with self._lock:
            self._free.append((buf, list(events)))
            while sum(b.numel() for b, _ in self._free) > self.max_cached_bytes:
                self._free.sort(key=lambda x: x[0].numel())
                old, evs = self._free.pop(0)
                for e in evs:
                    e.synchronize()
                del old

    def stream(self, device: Any) -> Any:
        """The side stream this pool copies on for ``device`` (a ``torch.device``)."""
        torch = _torch()
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = torch.cuda.Stream(device=device)
                self._streams[device.index] = s
        return s

    def clear(self) -> None:
        """Release every free buffer (those in use stay with their holders)."""
        with self._lock:
            free, self._free = self._free, []
        for _, evs in free:
            for e in evs:
                e.synchronize()


# --------------------------------------------------------------------------- puts


def has_cuda(columns: Mapping[str, Any]) -> bool:
    """Whether a put's columns hold CUDA tensors (judged by each column's first tensor).

    Cheap for CPU puts: torch is never imported here, and a column is looked at only up to
    its first tensor. A column whose first tensor is on the CPU but a later one on a GPU
    still encodes correctly, through a blocking ``.cpu()`` in :func:`flightq.tensor.to_bytes`.
    """
    if "torch" not in sys.modules:
        return False
    import torch

    T = torch.Tensor
    for v in columns.values():
        if isinstance(v, T):
            if v.is_cuda:
                return True
            continue
        if isinstance(v, (str, bytes, Mapping, np.ndarray)) or not isinstance(v, Iterable):
            continue
        for row in v:
            if isinstance(row, (list, tuple)):
                row = next((x for x in row if x is not None), None)
            if isinstance(row, T):
                if row.is_cuda:
                    return True
                break
            if isinstance(row, np.ndarray):
                break
    return False


class Staged:
    """A put's columns with every CUDA tensor replaced by a pinned CPU view being filled.

    Use as a context manager around the encode and the send: leaving it waits for the
    copies still in flight and hands the pinned buffer back to the pool.

    Attributes
    ----------
    columns:
        The columns to encode: the caller's structure, CUDA tensors swapped for CPU views.
    """

    def __init__(self, columns: Mapping[str, Any]) -> None:
        self.columns: Mapping[str, Any] = columns
        self._pool: PinnedPool | None = None
        self._buf: Any = None
        self._sources: list[Any] = []
        #: (last row covered, events recorded then on every stream used so far)
        self._flushes: list[tuple[int, list[Any]]] = []

    def wait_rows(self, start: int, stop: int) -> None:
        """Block until the staged tensors of rows ``[start, stop)`` are in host memory."""
        last = stop - 1
        for upto, events in self._flushes:
            if upto >= last:
                for e in events:
                    e.synchronize()
                return
        for e in self._flushes[-1][1] if self._flushes else ():
            e.synchronize()

    @property
    def on_range(self) -> Callable[[int, int], None] | None:
        """The hook for :func:`flightq.batch.encode_chunks`; None when nothing was staged."""
        return self.wait_rows if self._flushes else None

    def release(self) -> None:
        """Wait for every copy, then hand the pinned buffer back to the pool."""
        events = self._flushes[-1][1] if self._flushes else []
        for e in events:
            e.synchronize()
        if self._buf is not None and self._pool is not None:
            self._pool.give(self._buf)
        self._buf = None
        self._sources = []

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def stage(columns: Mapping[str, Any], pool: PinnedPool) -> Staged:
    """Start the device-to-host copies of a put's CUDA tensors into one pinned buffer.

    Every distinct CUDA tensor is copied once (tensors sharing memory, such as a prompt
    group's image, stay shared, so the encoder still sends them once). Small tensors
    (token rows, scalars) are first gathered on the device, one kernel per dtype, and cross
    in one copy each; large ones get one copy each, in row order. The copies run on the
    pool's side stream of their device, which first waits for the work already queued on
    the current stream. The host copies are numpy views where numpy has the dtype (the
    encoder's fast path; bf16 and fp8 stay torch views). Columns without CUDA tensors pass
    through as they are.

    Parameters
    ----------
    columns:
        A put's columns, in any structure :func:`flightq.batch.encode` accepts.
    pool:
        Where the pinned buffer comes from and goes back to.

    Returns
    -------
    Staged
        Use it as a context manager; pass ``staged.columns`` and ``staged.on_range`` to
        :func:`flightq.batch.encode_chunks`.
    """
    if not has_cuda(columns):
        return Staged(columns)
    torch = _torch()
    T = torch.Tensor
    plan: list[tuple[int, Any]] = []  # (row, normalised source); -1: a whole column
    memo: dict[tuple[Any, ...], int] = {}

    def slot(x: Any, row: int) -> int | None:
        if not isinstance(x, T) or not x.is_cuda:
            return None
        # Device addresses are unique across devices (unified virtual addressing).
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype)
        hit = memo.get(key)
        if hit is None:
            t = x.detach() if x.requires_grad else x
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()
            hit = memo[key] = len(plan)
            plan.append((row, t))
        return hit

    whole: dict[str, int | None] = {}
    rows: dict[str, list[Any]] = {}
    for name, v in columns.items():
        if isinstance(v, T):
            whole[name] = slot(v, -1)
        elif not isinstance(v, (str, bytes, Mapping, np.ndarray)) and isinstance(v, Iterable):
            rows[name] = list(v)
    # Row by row; a cell is a slot for a tensor, [slots] for a segment list, None as is.
    cells: dict[str, list[Any]] = {name: [] for name in rows}
    n = max((len(r) for r in rows.values()), default=0)
    for i in range(n):
        for name, rs in rows.items():
            if i >= len(rs):
                continue
            x = rs[i]
            if isinstance(x, (list, tuple)):
                cells[name].append([slot(s, i) for s in x])
            else:
                cells[name].append(slot(x, i))
    out = Staged(columns)
    if not plan:
        return out
    # Layout: the small tensors of each (device, dtype) side by side, then the large ones.
    nbytes = [t.numel() * t.element_size() for _, t in plan]
    groups: dict[tuple[int, Any], list[int]] = {}
    large: list[int] = []
    for k, (_, t) in enumerate(plan):
        if 0 < nbytes[k] < _SMALL:
            groups.setdefault((t.device.index, t.dtype), []).append(k)
        elif nbytes[k]:
            large.append(k)
    total = 0
    spans: list[tuple[list[int], int, int]] = []  # (members, byte offset, bytes)
    for members in groups.values():
        size = sum(nbytes[k] for k in members)
        spans.append((members, total, size))
        total = _align(total + size)
    large_at: list[int] = []
    for k in large:
        large_at.append(total)
        total = _align(total + nbytes[k])
    buf = pool.take(total)
    out._pool, out._buf = pool, buf
    views: list[Any] = [None] * len(plan)
    for k, (_, t) in enumerate(plan):
        if not nbytes[k]:
            views[k] = torch.empty(t.shape, dtype=t.dtype)
    buf_np = buf.numpy()
    hosts: list[Any] = []
    for members, at, size in spans:
        dtype = plan[members[0]][1].dtype
        h = buf[at : at + size].view(dtype)
        hosts.append(h)
        npd = _numpy_dtype(dtype)
        o = 0
        if npd is not None:
            hn = buf_np[at : at + size].view(npd)
            for k in members:
                t = plan[k][1]
                views[k] = hn[o : o + t.numel()].reshape(t.shape)
                o += t.numel()
        else:
            for k in members:
                t = plan[k][1]
                views[k] = h[o : o + t.numel()].view(t.shape)
                o += t.numel()
    for k, at in zip(large, large_at, strict=True):
        t = plan[k][1]
        npd = _numpy_dtype(t.dtype)
        if npd is not None:
            views[k] = buf_np[at : at + nbytes[k]].view(npd).reshape(t.shape)
        else:
            views[k] = buf[at : at + nbytes[k]].view(t.dtype).view(t.shape)
    # Gathers on the current stream (after the work that produced the tensors) ...
    keep: list[Any] = [t for _, t in plan]
    gathered: list[Any] = []
    for members, _, _ in spans:
        g = _flatten([plan[k][1] for k in members])
        gathered.append(g)
        keep.append(g)
    # ... then the copies on the side streams, which wait for both.
    streams: dict[int, Any] = {}

    def stream_for(device: Any) -> Any:
        s = streams.get(device.index)
        if s is None:
            s = streams[device.index] = pool.stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
        return s

    for h, g in zip(hosts, gathered, strict=True):
        with torch.cuda.stream(stream_for(g.device)):
            h.copy_(g, non_blocking=True)

    def flush(upto: int) -> None:
        events = []
        for st in streams.values():
            e = torch.cuda.Event()
            e.record(st)
            events.append(e)
        out._flushes.append((upto, events))

    pending = 0
    for j, k in enumerate(large):
        row, t = plan[k]
        at = large_at[j]
        with torch.cuda.stream(stream_for(t.device)):
            buf[at : at + nbytes[k]].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        pending += nbytes[k]
        nxt = plan[large[j + 1]][0] if j + 1 < len(large) else None
        if nxt is not None and pending >= _EVENT_BYTES and nxt != row:
            flush(row)
            pending = 0
    if streams:
        flush(n)
    out._sources = keep  # alive until the copies are done
    staged: dict[str, Any] = dict(columns)
    for name, w in whole.items():
        if w is not None:
            staged[name] = views[w]
    for name, rs in rows.items():
        new: list[Any] = []
        for x, c in zip(rs, cells[name], strict=True):
            if isinstance(c, list):
                new.append([x_ if s is None else views[s] for x_, s in zip(x, c, strict=True)])
            else:
                new.append(x if c is None else views[c])
        staged[name] = new
    out.columns = staged
    return out


# --------------------------------------------------------------------------- gets


class DeviceBatch(Batch):
    """A :class:`~flightq.batch.Batch` whose tensors live on a CUDA device.

    Token, tensor and media rows are views over one device buffer per received record
    batch; scalar columns are device tensors; keys and tags stay on the host.

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
        if not self.valid.all():
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


#: Where a host payload already sits on the device during one read:
#: (host address, bytes) -> (device buffer, byte offset in it).
_Seen = dict[tuple[int, int], tuple[Any, int]]


class _Region:
    """One column's bytes inside a chunk's staging buffer: what to copy, how to rebase."""

    def __init__(self, name: str, col: Column, base: Any) -> None:
        self.name, self.col, self.base = name, col, base
        self.offset = 0
        #: (source byte range in ``base``, destination offset in the region) per piece.
        self.pieces: list[tuple[int, int, int]] = []
        self.nbytes = 0
        self.elem: np.ndarray | None = None  # media: per entry, byte offset in the region
        self.reuse: Any = None  # media: an earlier chunk's device buffer holding it all

    def plan(self, seen: _Seen) -> None:
        base, col = self.base, self.col
        isz = base.element_size()
        if not isinstance(col, MediaColumn):
            self.nbytes = base.numel() * isz
            self.pieces = [(0, self.nbytes, 0)] if self.nbytes else []
            return
        # Media: only the dictionary entries some row refers to, each once per read (the
        # chunks of one prompt group carry the same dictionary; the rows use one entry).
        elem = np.asarray(col._elem, dtype=np.int64)
        ends = np.append(elem[1:], base.numel()) if len(elem) else elem
        used = np.unique(col.entry)
        addr = base.data_ptr()
        keys = [(addr + int(elem[e]) * isz, int(ends[e] - elem[e]) * isz) for e in used]
        hits = [seen.get(k) for k in keys]
        if used.size and all(h is not None for h in hits):
            bufs = {id(h[0]) for h in hits if h is not None}
            if len(bufs) == 1:
                self.reuse = hits[0][0] if hits[0] is not None else None
                self.elem = np.zeros(len(elem), dtype=np.int64)
                for e, h in zip(used, hits, strict=True):
                    self.elem[e] = h[1] if h is not None else 0
                return
        self.elem = np.zeros(len(elem), dtype=np.int64)
        pos = 0
        for e, (_, n) in zip(used, keys, strict=True):
            if n:
                self.pieces.append((int(elem[e]) * isz, n, pos))
            self.elem[e] = pos
            pos += n
        self.nbytes = pos
        self._keys = list(zip(used, keys, strict=True))

    def finish(self, part: DeviceBatch, dev: Any, seen: _Seen) -> None:
        dt = self.base.dtype
        isz = self.base.element_size()
        col = self.col
        if isinstance(col, ScalarColumn):
            view = dev[self.offset : self.offset + self.nbytes].view(dt)
            part._columns[self.name] = _DeviceScalarColumn(col, view)
        elif self.elem is None:
            rebase(col, dev[self.offset : self.offset + self.nbytes].view(dt))
        elif self.reuse is not None:
            rebase(col, self.reuse.view(dt), self.elem // isz)
        else:
            for e, key in self._keys:
                seen[key] = (dev, self.offset + int(self.elem[e]))
            rebase(col, dev.view(dt), (self.elem + self.offset) // isz)


def _to_device(
    part: DeviceBatch, device: Any, side: Any, consumer: Any, pool: PinnedPool, seen: _Seen
) -> Any:
    """Copy one decoded chunk's payloads to the device; returns the chunk's event."""
    torch = _torch()
    regions: list[_Region] = []
    total = 0
    for name in part.fields:
        col = part.column(name)
        if isinstance(col, ScalarColumn):
            if not col.valid.all():
                continue  # rows with gaps come back as a Python list, as on the CPU path
            r = _Region(name, col, col.tensor())
        else:
            assert isinstance(col, (TensorColumn, MediaColumn))
            r = _Region(name, col, col._base)
        r.plan(seen)
        r.offset = total
        total = _align(total + r.nbytes)
        regions.append(r)
    with torch.cuda.stream(side):
        dev = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=device)
    if total:
        pinned = pool.take(total)
        # numpy's copy: a plain memcpy that releases the GIL (the next record batch keeps
        # arriving on the reader thread), without torch's per-call thread-pool start.
        dst = pinned.numpy()
        for r in regions:
            if not r.pieces:
                continue
            src = r.base.reshape(-1).view(torch.uint8).numpy()
            for a, n, to in r.pieces:
                at = r.offset + to
                np.copyto(dst[at : at + n], src[a : a + n])
        with torch.cuda.stream(side):
            dev[:total].copy_(pinned[:total], non_blocking=True)
    event = torch.cuda.Event()
    event.record(side)
    if total:
        pool.give(pinned, [event])
    # Allocated on the side stream, used on the caller's: tell the caching allocator.
    dev.record_stream(consumer)
    for r in regions:
        r.finish(part, dev, seen)
    return event


def _prefetched(items: Iterable[Any], depth: int) -> Generator[Any, None, None]:
    """``items``, produced on a helper thread up to ``depth`` ahead of the consumer."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(msg: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for x in items:
                if not offer(("item", x)):
                    return
            offer(("end", None))
        except BaseException as e:
            offer(("error", e))

    t = threading.Thread(target=pump, name="flightq-cuda-read", daemon=True)
    t.start()
    try:
        while True:
            kind, x = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise x
            yield x
    finally:
        stop.set()


def decode_to_device(
    chunks: Iterable[pa.RecordBatch],
    device: Any,
    pool: PinnedPool,
    *,
    copy: bool = False,
    sync: bool = True,
    prefetch: int = 2,
) -> DeviceBatch:
    """Decode a stream of record batches into CUDA tensors, chunk by chunk as they arrive.

    Parameters
    ----------
    chunks:
        The record batches of one stream (same schema and fields), e.g. a DoGet reader's.
        They are pulled on a helper thread, so the next one arrives while this one is
        copied.
    device:
        A ``torch.device`` of type cuda (see :func:`resolve_device`).
    pool:
        Pinned buffers and the copy stream.
    copy:
        Give every row its own device allocation instead of a view of the chunk's buffer.
    sync:
        Wait (host) until every copy reached the device before returning. When False, the
        call returns once the last copy is queued, and the current stream of ``device``
        is made to wait for the copies, so work queued on it afterwards sees the data;
        other streams wait on :attr:`DeviceBatch.event`.
    prefetch:
        Record batches read ahead of the copies.

    Returns
    -------
    DeviceBatch

    Raises
    ------
    DecodeError, ShapeError, UndeclaredFieldError
        As :func:`flightq.batch.decode`.
    """
    torch = _torch()
    side = pool.stream(device)
    # The device buffers are allocated on the side stream and handed to the caller's stream
    # with record_stream, so the copies need not wait for work queued on the caller's.
    consumer = torch.cuda.current_stream(device)
    parts = _decode_parts(chunks, device, side, consumer, pool, copy, prefetch)
    return _assemble(parts, device, side, consumer, copy, sync)


def decode_streams_to_device(
    streams: Sequence[Iterable[pa.RecordBatch]],
    device: Any,
    pool: PinnedPool,
    *,
    copy: bool = False,
    sync: bool = True,
    prefetch: int = 2,
    stop: threading.Event | None = None,
) -> DeviceBatch:
    """:func:`decode_to_device` over several streams read in parallel, parts in order.

    Each stream is pulled and copied (pinned host copy, then the host-to-device copy) on
    its own thread, so the host copies of the streams run side by side; every copy goes on
    the pool's side stream, and one event recorded there once every thread queued its
    copies covers them all. Media dictionaries are shared only within a stream. If a
    stream raises, ``stop`` is set (the other streams may end early) and the error of the
    first failing stream, in stream order, is raised once every thread finished.
    """
    torch = _torch()
    side = pool.stream(device)
    consumer = torch.cuda.current_stream(device)
    results: list[list[DeviceBatch]] = [[] for _ in streams]
    errors: list[BaseException | None] = [None] * len(streams)

    def work(i: int) -> None:
        try:
            results[i] = _decode_parts(streams[i], device, side, consumer, pool, copy, prefetch)
        except BaseException as e:
            errors[i] = e
            if stop is not None:
                stop.set()

    threads = [
        threading.Thread(target=work, args=(i,), name=f"flightq-cuda-get-{i}", daemon=True)
        for i in range(len(streams))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return _assemble([p for r in results for p in r], device, side, consumer, copy, sync)


def _decode_parts(
    chunks: Iterable[pa.RecordBatch],
    device: Any,
    side: Any,
    consumer: Any,
    pool: PinnedPool,
    copy: bool,
    prefetch: int,
) -> list[DeviceBatch]:
    """One stream's record batches, each queued for the device on ``side`` as it arrives."""
    parts: list[DeviceBatch] = []
    seen: _Seen = {}
    items = _prefetched(chunks, prefetch)
    try:
        for rb in items:
            c = validate_part(rb, parts[0] if parts else None)
            part = DeviceBatch(rb, c.schema, c.keys, c.fields, "torch", copy)
            _to_device(part, device, side, consumer, pool, seen)
            parts.append(part)
    finally:
        items.close()
    return parts


def _assemble(
    parts: list[DeviceBatch], device: Any, side: Any, consumer: Any, copy: bool, sync: bool
) -> DeviceBatch:
    """The parts as one DeviceBatch, with an event after every copy queued on ``side``."""
    torch = _torch()
    odd = next(
        (p for p in parts[1:] if p.schema != parts[0].schema or p.fields != parts[0].fields),
        None,
    )
    if odd is not None:
        raise DecodeError(
            f"record batches of one get differ: {parts[0].schema.ref} "
            f"{parts[0].fields} then {odd.schema.ref} {odd.fields}"
        )
    if not parts:
        raise DecodeError("nothing to decode: no record batches")
    if len(parts) == 1:
        whole = parts[0]
    else:
        p0 = parts[0]
        whole = DeviceBatch(
            p0.record_batch, p0.schema, [k for p in parts for k in p.keys], p0.fields, "torch", copy
        )
        whole._parts = list(parts)
    event = torch.cuda.Event()
    event.record(side)
    whole.device, whole.event, whole.stream = device, event, side
    if sync:
        event.synchronize()
    else:
        consumer.wait_event(event)
    return whole
