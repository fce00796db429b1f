"""Puts of CUDA tensors: device-to-host copies into one pinned buffer, while encoding.

The CUDA tensors of a put are copied device-to-host into one reusable pinned buffer on a
side stream (one async copy per distinct tensor, in row order), with an event every few
MiB; each record batch is encoded once the copies of its rows are done (one synchronize
per chunk), while later rows are still being copied. The wire format is the CPU path's,
byte for byte.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

import numpy as np

from ..rows import PackedRows
from ..tensor import MemoryIndex
from .device import align, numpy_dtype, torch_module
from .pinned import PinnedPool

#: An event is recorded on the copy stream after this many staged bytes (puts).
_EVENT_BYTES = 4 * 2**20
#: CUDA tensors below this are gathered on the device and cross in one copy per dtype.
_SMALL = 2**20


def _flatten(tensors: list[Any]) -> Any:
    """The tensors' elements, one after another, in one new 1-D tensor (one kernel)."""
    import torch

    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    flatten = getattr(torch._C._nn, "flatten_dense_tensors", None)
    if flatten is not None:
        return flatten(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def _joined(rows: list[Any], torch: Any) -> tuple[Any, np.ndarray] | None:
    """Rows that are all small CUDA tensors of one device and dtype, each at least 1-D and
    alike past dim 0, joined end to end on their device (one kernel), with their offsets
    along dim 0; None for anything else (a ``None`` row, a CPU row, a scalar per row, a row
    of ``_SMALL`` bytes or more, which crosses from its own memory with no device copy)."""
    if len(rows) < 2:
        return None
    T = torch.Tensor
    first = rows[0]
    if not isinstance(first, T) or not first.is_cuda or first.dim() == 0:
        return None
    device, dtype, tail = first.device, first.dtype, first.shape[1:]
    for x in rows:
        if (
            not isinstance(x, T)
            or x.device != device
            or x.dtype != dtype
            or x.dim() == 0
            or x.shape[1:] != tail
            or x.nbytes >= _SMALL
        ):
            return None
    with torch.no_grad():
        flat = torch.cat(rows)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([x.shape[0] for x in rows], out=offsets[1:])
    return flat, offsets


def has_cuda(columns: Mapping[str, Any]) -> bool:
    """Whether a put's columns hold CUDA tensors (judged by each column's first tensor).

    Cheap for CPU puts: torch is never imported here, and a column is looked at only up to
    its first tensor. A column whose first tensor is on the CPU but a later one on a GPU
    still encodes correctly, through a blocking ``.cpu()`` in :func:`flightq.tensor.to_bytes`.
    """
    if "torch" not in sys.modules:
        return False
    import torch

    if not torch.cuda.is_initialized():
        return False  # a process holds no CUDA tensor before torch initialises CUDA in it
    T = torch.Tensor
    for v in columns.values():
        if isinstance(v, T):
            if v.is_cuda:
                return True
            continue
        if isinstance(v, PackedRows):  # one tensor: never a row to look at
            if isinstance(v.values, T) and v.values.is_cuda:
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


def stage(columns: Mapping[str, Any], pool: PinnedPool, pack: Container[str] = ()) -> Staged:
    """Start the device-to-host copies of a put's CUDA tensors into one pinned buffer.

    Every distinct CUDA tensor is copied once (tensors sharing memory, such as a prompt
    group's image, stay shared, so the encoder still sends them once). Small tensors
    (token rows, scalars) are first gathered on the device, one kernel per dtype, and cross
    in one copy each; large ones get one copy each, in row order. The copies run on the
    pool's side stream of their device, which first waits for the work already queued on
    the current stream. The host copies are numpy views where numpy has the dtype (the
    encoder's fast path; bf16 and fp8 stay torch views). A column whose rows lie end to end
    in one CUDA tensor (:class:`~flightq.rows.PackedRows`: a ``Packed`` or jagged column)
    crosses as one tensor and stays packed. So does a column named in ``pack`` whose rows
    are all CUDA tensors of one dtype, alike past dim 0 (a token column as a generator
    holds it, a tensor per row): joined on the device in one kernel, it crosses in one copy
    and reaches the encoder as one :class:`~flightq.rows.PackedRows`, checked a column at a
    time. Columns without CUDA tensors pass through as they are.

    Parameters
    ----------
    columns:
        A put's columns, in any structure :func:`flightq.batch.encode` accepts.
    pool:
        Where the pinned buffer comes from and goes back to.
    pack:
        Columns whose rows may be joined: fields none of whose rows is deduplicated by
        memory (token and tensor fields; never media, where a prompt group's rows share
        one image).

    Returns
    -------
    Staged
        Use it as a context manager; pass ``staged.columns`` and ``staged.on_range`` to
        :func:`flightq.batch.encode_chunks`.
    """
    if not has_cuda(columns):
        return Staged(columns)
    torch = torch_module()
    T = torch.Tensor
    plan: list[tuple[int, Any]] = []  # (row, normalised source); -1: a whole column
    # The encoder's own test of shared memory (a prompt group's image is one tensor); the
    # index holds every tensor it was asked about, so no address is reused meanwhile.
    same: MemoryIndex[int] = MemoryIndex()

    def slot(x: Any, row: int) -> int | None:
        if not isinstance(x, T) or not x.is_cuda:
            return None
        hit = same.get(x)
        if hit is None:
            t = x.detach() if x.requires_grad else x
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()
            hit = len(plan)
            same.put(x, hit)
            plan.append((row, t))
        return hit

    whole: dict[str, int | None] = {}
    # A column whose rows lie end to end in one CUDA tensor crosses as one tensor.
    packed: dict[str, tuple[int | None, np.ndarray]] = {}
    rows: dict[str, list[Any]] = {}
    for name, v in columns.items():
        if isinstance(v, T):
            whole[name] = slot(v, -1)
        elif isinstance(v, PackedRows):
            if isinstance(v.values, T) and v.values.is_cuda:
                lo, hi = int(v.offsets[0]), int(v.offsets[-1])
                packed[name] = (slot(v.values[lo:hi], -1), v.offsets - lo)
        elif not isinstance(v, (str, bytes, Mapping, np.ndarray)) and isinstance(v, Iterable):
            rs = list(v)
            joined = _joined(rs, torch) if name in pack else None
            if joined is None:
                rows[name] = rs
            else:
                packed[name] = (slot(joined[0], -1), joined[1])
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
        total = align(total + size)
    large_at: list[int] = []
    for k in large:
        large_at.append(total)
        total = align(total + nbytes[k])
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
        npd = numpy_dtype(dtype)
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
        npd = numpy_dtype(t.dtype)
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
    for name, (w, offsets) in packed.items():
        if w is not None:
            staged[name] = PackedRows(views[w], offsets)
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
