"""The least a get returning per-row tensors can spend decoding, beside what flightq spends.

A flightq get hands the trainer one torch tensor per row and field (a list of segment
tensors per media row), views of the received buffers. Whatever checks a decoder makes,
it must at least create those views. This measures, in one process, on each workload step
as the server answers it (record batches of ``--batch-mib``, passed through Arrow IPC as
over the wire):

- ``views``: only that: per token or tensor field one ``split`` of the column's buffer
  (reshaped where rows have more than one dim), per media segment one ``view`` of its
  image in its shape (one slice per distinct image), per scalar field one tensor, and the
  keys and msgpack tags a get also returns; no check of any kind;
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
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import torch
from flightq_bench.stats import median_seconds

from flightq import workloads
from flightq.batch import PartDecoder, encode_chunks
from flightq.layout import KEY, SHAPE_SUFFIX, TAGS, binary_offsets
from flightq.registry import SchemaRegistry
from flightq.schema import Field, Schema
from flightq.tensor import column_base

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


def _base(f: Field, arr: pa.Array) -> tuple[Any, np.ndarray]:
    """A binary array's payloads as one flat tensor of the field's dtype, and each
    payload's element offset in it (no check: the least any decoder does)."""
    offs = binary_offsets(arr)
    base = column_base(arr.buffers()[2] or b"", int(offs[0]), int(offs[-1]), f.dt, "torch")
    return base, (offs - offs[0]) // f.dt.itemsize


def _shapes(col: pa.Array) -> list[Any]:
    """Each row's (or media segment's) shape, read from a shape column: one reshape when
    all have the same rank, else one slice each."""
    offs = col.offsets.to_numpy()
    dims = col.values.to_numpy()
    ranks = np.diff(offs)
    if len(ranks) and (ranks == ranks[0]).all():
        return dims[offs[0] : offs[-1]].reshape(len(ranks), int(ranks[0])).tolist()
    flat = dims.tolist()
    return [flat[a:b] for a, b in itertools.pairwise(offs.tolist())]


def views_only(schema: Schema, batches: Sequence[pa.RecordBatch]) -> dict[str, list[Any]]:
    """Every per-row tensor a get returns, made with no check, per field (rows in order;
    media: each row's list of segments); with the keys and tags a get also returns."""
    out: dict[str, list[Any]] = {}
    for rb in batches:
        rb.column(KEY).to_pylist()
        for t in rb.column(TAGS).to_pylist():
            if t is not None:
                msgpack.unpackb(t, raw=False)
        for f in schema.fields:
            if f.name not in rb.schema.names:
                continue
            col = rb.column(f.name)
            rows = out.setdefault(f.name, [])
            if f.role == "scalar":
                rows.append(torch.from_numpy(col.to_numpy(zero_copy_only=False)))
                continue
            if f.role == "media":
                segs = col.values  # every row present, as in the reference steps
                base, elem = _base(f, segs.dictionary)
                shapes = _shapes(rb.column(f.name + SHAPE_SUFFIX).values)
                idx = segs.indices.to_numpy().tolist()
                bounds_e = elem.tolist()
                # One slice per distinct image, one view per segment.
                pieces = {e: base[bounds_e[e] : bounds_e[e + 1]] for e in set(idx)}
                views = [pieces[e].view(*shape) for e, shape in zip(idx, shapes, strict=True)]
                bounds = col.offsets.to_numpy().tolist()
                rows.extend(views[a:b] for a, b in itertools.pairwise(bounds))
                continue
            base, elem = _base(f, col)
            parts = base.split(np.diff(elem).tolist())
            shape_col = rb.column(f.name + SHAPE_SUFFIX)
            if (np.diff(shape_col.offsets.to_numpy()) == 1).all():
                rows.extend(parts)  # rows of one dim: the split is their shape
            else:
                shapes = _shapes(shape_col)
                rows.extend(p.view(s) for p, s in zip(parts, shapes, strict=True))
    return out


def measure(name: str, batch_bytes: int = 16 * 2**20, reps: int = 200) -> dict[str, Any]:
    """Median seconds of ``views`` and of flightq's decode over one step's answer."""
    schema, batches = answer_batches(name, batch_bytes)

    def flightq_decode() -> None:
        d = PartDecoder("torch", False)
        for rb in batches:
            d.add(rb)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        made = views_only(schema, batches)
        tensors = sum(
            sum(len(r) for r in rows) if schema[name_].role == "media" else len(rows)
            for name_, rows in made.items()
            if schema[name_].role != "scalar"
        )
        return {
            "workload": name,
            "record_batches": len(batches),
            "tensors": tensors,
            "views_s": median_seconds(lambda: views_only(schema, batches), reps),
            "flightq_s": median_seconds(flightq_decode, reps),
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
