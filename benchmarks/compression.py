"""Where zstd pays: each workload encoded raw and with zstd, and the link speed that evens them.

Compression is opt-in per field (``Field(codec=Zstd(level))``). This measures, in one
process, what it costs and what it saves on each workload step: the bytes a step puts on
the wire raw and compressed (payload buffers, a shared image counted once), and the CPU
time of ``encode`` and of ``decode`` with every field's rows built, raw and compressed
(median of ``--reps``). A transfer at link speed L takes ``bytes / L`` raw and
``zbytes / L + extra`` compressed (``extra``: the added encode and decode time, not
overlapped with the wire), so compression wins on links slower than

    L* = (bytes - zbytes) / extra

printed for each workload. On loopback (a few GB/s) every step here stays raw; across a
link slower than L* the compressed schema moves the step sooner. The token fields of the
reference steps compress well (small integers in int64); their pixels are seeded random
floats, which hardly do, so L* for media steps is a floor for real images.

Run::

    .venv/bin/python benchmarks/compression.py --workloads W1,W2,W3 --level 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

import flightq
from flightq import workloads
from flightq.codecs import RAW, Zstd
from flightq.schema import Schema

__all__ = ["compressed", "measure", "main"]


def compressed(schema: Schema, level: int) -> Schema:
    """``schema`` with every token, tensor and media field compressed by zstd at ``level``
    (scalars stay raw), under the name ``<name>_zstd``."""
    fields = [
        f if f.role == "scalar" else dataclasses.replace(f, codec=Zstd(level))
        for f in schema.fields
    ]
    return Schema(f"{schema.name}_zstd", schema.version, fields, schema.doc)


def _wire_bytes(rb: pa.RecordBatch) -> int:
    # Every buffer once (a group's image is one dictionary entry however many rows view it).
    return int(rb.get_total_buffer_size())


def _timed(fn: Any, reps: int) -> tuple[float, Any]:
    out, times = fn(), []  # one untimed call first: imports, first-touch pages
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def measure(name: str, level: int = 3, reps: int = 3, quick: bool = False) -> dict[str, Any]:
    """One workload raw and compressed: bytes, encode and decode seconds, break-even GB/s.

    Both record batches are decoded to every field's rows and checked equal (bit for bit)
    before anything is reported.
    """
    step = workloads.make(name)
    if quick:
        step = step.group(0)
    raw_schema = flightq.SchemaRegistry.default().get(step.schema)
    zstd_schema = compressed(raw_schema, level)
    out: dict[str, Any] = {"workload": name, "rows": step.rows, "level": level}
    batches = {}
    for label, schema in (("raw", raw_schema), ("zstd", zstd_schema)):
        enc_s, rb = _timed(lambda s=schema: flightq.encode(s, step.columns, step.keys), reps)

        def dec(rb: pa.RecordBatch = rb) -> dict[str, Any]:
            b = flightq.decode(rb, as_="numpy")
            return {f: b[f] for f in b.fields}

        dec_s, rows = _timed(dec, reps)
        batches[label] = rows
        out[label] = {"bytes": _wire_bytes(rb), "encode_s": enc_s, "decode_s": dec_s}
    _check_equal(batches["raw"], batches["zstd"], name)
    saved = out["raw"]["bytes"] - out["zstd"]["bytes"]
    extra = (out["zstd"]["encode_s"] + out["zstd"]["decode_s"]) - (
        out["raw"]["encode_s"] + out["raw"]["decode_s"]
    )
    out["ratio"] = out["raw"]["bytes"] / max(1, out["zstd"]["bytes"])
    # None: compression never wins (saves nothing); inf: it wins on any link (costs no CPU).
    if saved <= 0:
        out["breakeven_gbps"] = None
    else:
        out["breakeven_gbps"] = saved / extra / 1e9 if extra > 0 else float("inf")
    return out


def _check_equal(a: dict[str, Any], b: dict[str, Any], name: str) -> None:
    import numpy as np

    def flat(x: Any) -> list[Any]:
        if isinstance(x, list):
            return [y for v in x for y in flat(v)]
        return [x]

    for field, rows in a.items():
        for x, y in zip(flat(rows), flat(b[field]), strict=True):
            if (x is None) != (y is None) or (
                x is not None and not np.array_equal(np.asarray(x), np.asarray(y))
            ):
                raise AssertionError(f"{name}: field {field!r} differs once compressed")


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | rows | raw MB | zstd MB | ratio | raw enc+dec ms | zstd enc+dec ms "
        "| zstd wins below |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        be = r["breakeven_gbps"]
        lines.append(
            f"| {r['workload']} | {r['rows']} | {r['raw']['bytes'] / 1e6:.1f} | "
            f"{r['zstd']['bytes'] / 1e6:.1f} | {r['ratio']:.2f}x | "
            f"{(r['raw']['encode_s'] + r['raw']['decode_s']) * 1e3:.1f} | "
            f"{(r['zstd']['encode_s'] + r['zstd']['decode_s']) * 1e3:.1f} | "
            + ("never" if be is None else "always" if be == float("inf") else f"{be:.2f} GB/s")
            + " |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one prompt group per workload")
    args = p.parse_args(argv)
    assert RAW is not None  # raw is every shipped schema's codec: the baseline
    results = [
        measure(w, args.level, args.reps, args.quick) for w in args.workloads.split(",") if w
    ]
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
