"""The least a get returning per-row tensors can spend decoding, beside what flightq spends.

A flightq get hands the trainer one torch tensor per row and field (a list of segment
tensors per media row), views of the received buffers. Whatever checks a decoder makes,
it must at least create those views. This measures, in one process, on each workload step
as the server answers it (record batches of ``--batch-mib``, passed through Arrow IPC as
over the wire):

- ``views``: only that: per token or tensor field one ``split`` of the column's buffer,
  per media segment one ``view``, per scalar field one tensor; no check of any kind;
- ``flightq``: :class:`flightq.batch.PartDecoder`, what a get runs as record batches
  arrive (validation of every offset and shape, then the per-row tensors).

Both are medians of ``--reps`` timings. Divided by a get's time (``flightq bench`` reports
it), ``views`` is a floor on the decode's share of the get for any design that returns
per-row tensors.

Run::

    .venv/bin/python benchmarks/decode_floor.py --workloads W1,W3,W4
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from flightq import workloads
from flightq.batch import PartDecoder, encode_chunks
from flightq.layout import SHAPE_SUFFIX
from flightq.registry import SchemaRegistry
from flightq.schema import Schema

__all__ = ["answer_batches", "views_only", "measure", "main"]


def answer_batches(name: str, batch_bytes: int) -> tuple[Schema, list[pa.RecordBatch]]:
    """A workload step's record batches as received: encoded, then read back from IPC."""
    step = workloads.to_torch(workloads.make(name))
    schema = SchemaRegistry.default().get(step.schema)
    out = []
    for b in encode_chunks(schema, step.columns, step.keys, step.tags, max_bytes=batch_bytes):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, b.schema) as w:
            w.write_batch(b)
        out.append(pa.ipc.open_stream(sink.getvalue()).read_next_batch())
    return schema, out


def _bytes_tensor(buf: pa.Buffer | None, start: int, stop: int) -> Any:
    import torch

    if buf is None or stop == start:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=stop - start, offset=start))


def views_only(schema: Schema, batches: Sequence[pa.RecordBatch]) -> int:
    """Create every per-row tensor a get returns, with no check; returns how many."""
    import torch

    n = 0
    for rb in batches:
        for f in schema.fields:
            if f.name not in rb.schema.names:
                continue
            col = rb.column(f.name)
            if f.role == "scalar":
                torch.from_numpy(col.to_numpy(zero_copy_only=False))
                continue
            if f.role == "media":
                entries = col.values.dictionary
                eoffs = np.frombuffer(entries.buffers()[1], np.int64, len(entries) + 1)
                base = _bytes_tensor(entries.buffers()[2], int(eoffs[0]), int(eoffs[-1]))
                piece = base[:0]
                for _ in range(len(col.values)):
                    piece.view(0, 1)  # one view per segment, as a get returns
                    n += 1
                continue
            offs = np.frombuffer(col.buffers()[1], np.int64, len(col) + 1, col.offset * 8)
            base = _bytes_tensor(col.buffers()[2], int(offs[0]), int(offs[-1]))
            n += len(base.split(np.diff(offs).tolist()))
            rb.column(f.name + SHAPE_SUFFIX)  # the shapes are read, not checked
    return n


def _median_s(fn: Callable[[], object], reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(name: str, batch_bytes: int = 16 * 2**20, reps: int = 200) -> dict[str, Any]:
    """Median seconds of ``views`` and of flightq's decode over one step's answer."""
    schema, batches = answer_batches(name, batch_bytes)

    def flightq_decode() -> None:
        d = PartDecoder("torch", False)
        for rb in batches:
            d.add(rb)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        tensors = views_only(schema, batches)
        return {
            "workload": name,
            "record_batches": len(batches),
            "tensors": tensors,
            "views_s": _median_s(lambda: views_only(schema, batches), reps),
            "flightq_s": _median_s(flightq_decode, reps),
        }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W1,W3,W4")
    ap.add_argument("--batch-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    print("workload  batches  tensors  views ms  flightq ms  flightq / views")
    for name in args.workloads.split(","):
        r = measure(name, args.batch_mib * 2**20, args.reps)
        print(
            f"{name:8s} {r['record_batches']:8d} {r['tensors']:8d} {r['views_s'] * 1e3:9.3f} "
            f"{r['flightq_s'] * 1e3:11.3f} {r['flightq_s'] / r['views_s']:15.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
