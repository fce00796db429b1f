"""CUDA tensors in and out of the data plane: pinned staging, side streams, async copies.

Puts: the CUDA tensors of a put are copied device-to-host into one reusable pinned buffer
on a side stream (one async copy per distinct tensor, in row order), with an event every
few MiB; each record batch is encoded once the copies of its rows are done (one
synchronize per chunk), while later rows are still being copied. The wire format is the
CPU path's, byte for byte.

Gets and claims with ``device="cuda:N"``: the DoGet streams are read to their end as the CPU
get reads them, then every payload is copied once into pinned memory (on a few threads)
and crosses to the device in one non-blocking copy per window of pinned memory on a side
stream. The result is a :class:`DeviceBatch` whose columns yield CUDA tensors (bf16 and fp8
included) viewing one device buffer per get.

torch is imported inside the functions that need it: a CPU-only process never loads it
through this module.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from .batch import (
    Batch,
    Column,
    MediaColumn,
    PartDecoder,
    ScalarColumn,
    TensorColumn,
    join,
)
from .dtypes import DTYPES
from .errors import DeviceError

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
#: A get's bytes cross to the device through pinned windows of at most this size.
_WINDOW = 64 * 2**20
#: Threads copying a window's large payloads into pinned memory, each given at least
#: ``_THREAD_BYTES``; payloads under ``_LARGE`` bytes are copied by the calling thread.
_COPY_THREADS = 4
_THREAD_BYTES = 4 * 2**20
_LARGE = 2**18


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

    Token, tensor and media rows and scalar columns are views over one device buffer per
    get; keys and tags stay on the host.

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
            return _align(at + self.nbytes)
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
        return _align(pos)

    def source(self) -> np.ndarray:
        """The host bytes the pieces are cut from."""
        return self.base.reshape(-1).view(_torch().uint8).numpy()

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
            if isinstance(col, ScalarColumn):
                if not col.valid.all():
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
    with ThreadPoolExecutor(k, thread_name_prefix="flightq-cuda-copy") as ex:
        done = [ex.submit(run, g) for g in groups if g]
        run([c for c in copies if c[3] < _LARGE])
        meanwhile()
        for f in done:
            f.result()


def _to_device(
    parts: list[DeviceBatch], device: Any, side: Any, consumer: Any, pool: PinnedPool
) -> None:
    """Copy the parts' payloads into one new device buffer and point their columns at it.

    The bytes go through pinned windows (two taking turns when the get is larger than
    one), each copied to the device with one non-blocking copy on ``side``.
    """
    torch = _torch()
    regions, total = _plan(parts)
    with torch.cuda.stream(side):
        dev = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=device)
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


def _validated(batches: list[pa.RecordBatch], copy: bool) -> list[DeviceBatch]:
    """One stream's record batches, validated as host-side parts (nothing copied yet)."""
    d = PartDecoder("torch", copy, prepare=False, part=DeviceBatch)
    for rb in batches:
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

    The stream is read to its end first, as the CPU get reads it (a thread copying while
    the stream arrives slows the reader down: they share the GIL). Then every payload is
    copied once into pinned memory, on several threads, and crosses to the device in one
    non-blocking copy per :data:`_WINDOW` bytes on the pool's side stream.

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
    return _assemble(_validated(list(chunks), copy), device, pool, sync)


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

    Each stream is read on its own thread, as the CPU get reads a split get; once all are
    in, their parts are validated and copied to the device together (media entries are
    shared within a stream). If a stream raises, ``stop`` is set (the other streams may end
    early) and the error of the first failing stream, in stream order, is raised once
    every thread finished.
    """
    results: list[list[pa.RecordBatch]] = [[] for _ in streams]
    errors: list[BaseException | None] = [None] * len(streams)

    def work(i: int) -> None:
        try:
            results[i] = list(streams[i])
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
    parts = [p for r in results for p in _validated(r, copy)]
    return _assemble(parts, device, pool, sync)


def _assemble(parts: list[DeviceBatch], device: Any, pool: PinnedPool, sync: bool) -> DeviceBatch:
    """The parts, copied to ``device``, as one DeviceBatch with an event after the copies."""
    torch = _torch()
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
