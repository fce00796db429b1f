"""Reference point: bare Flight carrying a tensor per row, with no checks.

``bare-flight-rows`` does, inside the timer, the least any design that takes and hands
out a tensor per row must do on Flight, and nothing else: the put gathers each field's
rows into one buffer with their offsets and shapes, packs the tags (msgpack) and sends
the record batches; the get receives them and builds every row's tensor over the
received buffers (a media row: a list of its segments). Nothing is checked, nothing is
stored beyond the table, and the reader knows every field's dtype in advance (a static
field list, which flightq's schemas replace). Against ``bare-flight-records`` (flightq's
record batches, built before the timer and never decoded) in the same run, it prices a
tensor per row on the transport alone; flightq's per-row put and get against it price
flightq's own checks, store and index.

Each shared image is sent with every row that uses it, as a per-row design without
content addressing does. Record batches carry at most :data:`BATCH_BYTES` of payload.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from .arrowflight import FlightConsumer, FlightProducer
from .endpoint import now_ns, timed
from .payload import check_rows

__all__ = ["BATCH_BYTES", "RowsProducer", "RowsConsumer"]

#: Most payload bytes per record batch (flightq's own default).
BATCH_BYTES = 16 * 2**20

_SHAPES = pa.list_(pa.int32())


def _bytes(t: Any) -> np.ndarray:
    """A contiguous tensor's bytes as uint8, without a copy."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def _binary(parts: list[np.ndarray]) -> pa.Array:
    """One ``large_binary`` element per part: the parts gathered into one buffer."""
    lengths = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(parts), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def _gathered(rows: list[Any]) -> pa.Array:
    """One ``large_binary`` element per row: the rows joined by one ``torch.cat``."""
    import torch

    flat = torch.cat([r.reshape(-1) for r in rows]) if rows else torch.empty(0)
    size = flat.element_size()
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((r.numel() for r in rows), np.int64, len(rows)) * size, out=offsets[1:])
    data = _bytes(flat)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def _shapes(shapes: list[Any]) -> pa.Array:
    """Each tensor's shape: its length where every tensor has one dim, else its dims."""
    if all(len(d) == 1 for d in shapes):
        return pa.array(np.fromiter((d[0] for d in shapes), np.int32, len(shapes)))
    return pa.array([list(d) for d in shapes], _SHAPES)


def _encode(step: Any, rows: range) -> pa.RecordBatch:
    """Rows ``rows`` of the torch step as a record batch (the put's timed work)."""
    cols: dict[str, pa.Array] = {
        "__key__": pa.array(step.keys[rows.start : rows.stop], pa.string()),
        "__tags__": pa.array(
            [msgpack.packb(t) for t in step.tags[rows.start : rows.stop]], pa.binary()
        ),
    }
    for name, col in step.columns.items():
        if not isinstance(col, list):  # a scalar per row
            cols[name] = pa.array(col[rows.start : rows.stop].numpy())
            continue
        part = col[rows.start : rows.stop]
        if part and isinstance(part[0], list):  # media: a row's segments
            segs = [s for r in part for s in r]
            cols[name] = _binary([_bytes(s) for s in segs])
            cols[name + "__n"] = pa.array([len(r) for r in part], pa.int32())
            cols[name + "__shape"] = _shapes([s.shape for s in segs])
        else:
            cols[name] = _gathered(part)
            cols[name + "__shape"] = _shapes([r.shape for r in part])
    return pa.RecordBatch.from_pydict(cols)


def _row_bytes(step: Any) -> list[int]:
    """Each row's payload bytes (shared media counted per row)."""
    out = [0] * len(step.keys)
    for col in step.columns.values():
        if not isinstance(col, list):
            continue
        for i, r in enumerate(col):
            segs = r if isinstance(r, list) else [r]
            out[i] += sum(s.numel() * s.element_size() for s in segs)
    return out


def _chunks(step: Any) -> list[range]:
    """Runs of consecutive rows of at most :data:`BATCH_BYTES` each (one row at least)."""
    out, start, size = [], 0, 0
    for i, n in enumerate(_row_bytes(step)):
        if i > start and size + n > BATCH_BYTES:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    out.append(range(start, len(step.keys)))
    return out


def _tensors(arr: pa.Array, shapes: pa.Array, dtype: Any) -> list[Any]:
    """One tensor per element of ``arr``, over its buffer, in the shape ``shapes`` gives."""
    import torch

    warnings.filterwarnings("ignore", "The given NumPy array is not writable")

    offs = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = arr.buffers()[2]
    if data is None or len(arr) == 0:
        return [torch.empty(0, dtype=dtype) for _ in range(len(arr))]
    flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))[int(offs[0]) : int(offs[-1])]
    size = torch.empty(0, dtype=dtype).element_size()
    pieces = flat.view(dtype).split((np.diff(offs) // size).tolist())
    if shapes.type != _SHAPES:  # one dim each: the pieces as they are
        return list(pieces)
    return [p.reshape(d) for p, d in zip(pieces, shapes.to_pylist(), strict=True)]


def _decode(
    batches: list[pa.RecordBatch], dtypes: dict[str, Any]
) -> tuple[list[str], list[Any], dict[str, Any]]:
    """Keys, tags and per-row columns of the received batches (the get's timed work)."""
    import torch

    keys: list[str] = []
    tags: list[Any] = []
    cols: dict[str, Any] = {}
    for b in batches:
        keys += b.column("__key__").to_pylist()
        tags += [msgpack.unpackb(t, raw=False) for t in b.column("__tags__").to_pylist()]
        for name, dtype in dtypes.items():
            arr = b.column(name)
            if arr.type != pa.large_binary():  # a scalar per row
                part: Any = torch.from_numpy(arr.to_numpy(zero_copy_only=False))
                cols[name] = part if name not in cols else torch.cat([cols[name], part])
                continue
            got = _tensors(arr, b.column(name + "__shape"), dtype)
            if name + "__n" in b.schema.names:  # media: each row's segments
                ns = b.column(name + "__n").to_pylist()
                at = list(itertools.accumulate(ns, initial=0))
                got = [got[a:z] for a, z in itertools.pairwise(at)]
            cols.setdefault(name, []).extend(got)
    return keys, tags, cols


class RowsProducer(FlightProducer):
    """DoPut of the step's rows, gathered and framed inside the timer."""

    tag = "rows"

    def prepare(self) -> None:
        if getattr(self, "_torch", None) is None:
            from flightq.workloads import to_torch

            self._torch = to_torch(self.step)
            self._runs = _chunks(self._torch)

    def put(self) -> dict[str, Any]:
        t0 = now_ns()
        batches = [_encode(self._torch, r) for r in self._runs]
        self.send(batches[0].schema, batches)
        return timed(t0)


class RowsConsumer(FlightConsumer):
    """DoGet of the rows, then every row's tensor over the received buffers."""

    tag = "rows"

    def setup(self) -> dict[str, Any]:
        out = super().setup()
        from flightq.workloads import to_torch

        ref = to_torch(self.ref)
        self._dtypes = {}
        for name, col in ref.columns.items():
            if isinstance(col, list):
                first = next(
                    (r for r in col if r is not None and not (isinstance(r, list) and not r)), None
                )
                first = first[0] if isinstance(first, list) else first
                self._dtypes[name] = first.dtype if first is not None else None
            else:
                self._dtypes[name] = col.dtype
        self._rows: tuple[list[str], list[Any], dict[str, Any]] | None = None
        return out

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        batches = self.client.do_get(fl.Ticket(self.path)).read_all().to_batches()
        self._rows = _decode(batches, self._dtypes)
        return timed(t0)

    def verify(self) -> None:
        assert self._rows is not None
        keys, tags, cols = self._rows
        check_rows(self.ref, keys, cols, tags, "bare-flight-rows")

    def release(self) -> None:
        self._rows = None
        super().release()
