"""What verifying zstd payloads costs the server: ``validate`` of one put, with and without
decoding each frame.

The server checks every zstd cell's frame header against its shape, then decodes the
frame once, bounded by that size, and discards the bytes (:meth:`flightq.codecs.Zstd.check`).
This times :func:`flightq.validation.validate` on a workload step whose token, tensor and
media fields are compressed (``compression.compressed``): ``with`` is the server's check,
``without`` the same call with the decode step replaced by a no-op (headers only, as
before). Both run in this process, interleaved, ``--reps`` times; the report is the median
and the spread (min..max) of each, the ratio of the medians, and the decoded bytes/s of
the check. Every timed call is checked to accept the batch, and a crafted bad frame to be
refused by ``with`` alone. Bounded by ``--budget-s``.

Run::

    .venv/bin/python benchmarks/zstd_check_cost.py --workloads W3,W1 --reps 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from compression import compressed

import flightq
from flightq import workloads
from flightq.codecs import Zstd
from flightq.layout import binary_offsets
from flightq.validation import validate

__all__ = ["measure", "main"]


def _decoded_bytes(rb: pa.RecordBatch, checked: Any) -> int:
    """Bytes the check decodes: each zstd frame's declared size (a media entry once)."""
    total = 0
    for f in checked.schema.fields:
        if f.name not in checked.fields or f.role == "scalar" or not isinstance(f.codec, Zstd):
            continue
        col = rb.column(f.name)
        cells = col.values.dictionary if f.role == "media" else col
        offs, data = binary_offsets(cells), cells.buffers()[2]
        mv = memoryview(data)
        total += sum(
            f.codec.decoded_size(mv[offs[i] : offs[i + 1]]) or 0 for i in range(len(cells))
        )
    return total


def _with_a_lie(rb: pa.RecordBatch, name: str) -> pa.RecordBatch:
    """``rb`` with its first row's ``name`` cell a frame that says its size but decodes short."""
    col = rb.column(name)
    cells = col.to_pylist()
    need = Zstd().decoded_size(cells[0])
    assert need is not None and need >= 8
    frame = bytearray(Zstd().encode(bytes(need)))
    frame[-3:] = b"\xff\xff\xff"  # the header stays true; the blocks no longer add up
    cells[0] = bytes(frame)
    i = rb.schema.get_field_index(name)
    arrays = list(rb.columns)
    arrays[i] = pa.array(cells, type=pa.large_binary())
    return pa.RecordBatch.from_arrays(arrays, schema=rb.schema)


def measure(name: str, reps: int, level: int = 3, budget_s: float = 60.0) -> dict[str, Any]:
    """``validate`` of workload ``name`` (zstd at ``level``) with and without the decode check."""
    step = workloads.make(name)
    schema = compressed(flightq.SchemaRegistry.default().get(step.schema), level)
    rb = flightq.encode(schema, step.columns, step.keys)
    real_check = Zstd.check

    def without(self: Zstd, data: Any, nbytes: int, ctx: Any = None) -> None:
        return None

    times: dict[str, list[float]] = {"with": [], "without": []}
    checked = validate(rb)  # untimed: the plan is cached, pages touched
    token = next(f.name for f in schema.fields if f.role == "token")
    try:
        Zstd.check = without  # type: ignore[method-assign]
        validate(_with_a_lie(rb, token))  # headers alone accept it
    finally:
        Zstd.check = real_check  # type: ignore[method-assign]
    try:
        validate(_with_a_lie(rb, token))
        raise AssertionError("the check accepted a frame that decodes short")
    except flightq.DecodeError:
        pass
    start = time.perf_counter()
    for r in range(reps):
        order = ("with", "without") if r % 2 == 0 else ("without", "with")
        for label in order:
            try:
                if label == "without":
                    Zstd.check = without  # type: ignore[method-assign]
                t = time.perf_counter()
                got = validate(rb)
                times[label].append(time.perf_counter() - t)
            finally:
                Zstd.check = real_check  # type: ignore[method-assign]
            assert got.keys == checked.keys and np.array_equal(got.nbytes, checked.nbytes)
        if time.perf_counter() - start > budget_s:
            break
    decoded = _decoded_bytes(rb, checked)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "workload": name,
        "rows": rb.num_rows,
        "wire_bytes": int(checked.nbytes.sum()),
        "decoded_bytes": decoded,
        "reps": len(times["with"]),
        "with_ms": (med["with"] * 1e3, min(times["with"]) * 1e3, max(times["with"]) * 1e3),
        "without_ms": (
            med["without"] * 1e3,
            min(times["without"]) * 1e3,
            max(times["without"]) * 1e3,
        ),
        "ratio": med["with"] / med["without"],
        "check_gbps": decoded / max(1e-12, med["with"] - med["without"]) / 1e9,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W3,W1")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=60.0, help="per workload")
    a = p.parse_args(argv)
    print(
        "workload  rows  wire MB  decoded MB  reps  with ms (min..max)  "
        "without ms (min..max)  ratio  check GB/s"
    )
    for name in a.workloads.split(","):
        m = measure(name, a.reps, a.level, a.budget_s)
        w, wo = m["with_ms"], m["without_ms"]
        print(
            f"{m['workload']:<8} {m['rows']:>5} {m['wire_bytes'] / 1e6:>8.1f} "
            f"{m['decoded_bytes'] / 1e6:>11.1f} {m['reps']:>5}  "
            f"{w[0]:>7.2f} ({w[1]:.2f}..{w[2]:.2f})  {wo[0]:>8.2f} ({wo[1]:.2f}..{wo[2]:.2f})"
            f"  {m['ratio']:>5.1f}x  {m['check_gbps']:>9.2f}"
        )


if __name__ == "__main__":
    main()
