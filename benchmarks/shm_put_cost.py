"""What the server's copy of a put through shared memory costs, against mapping it in place.

A put through shared memory used to be stored as views of the writer's segment: the
writer could then shrink it (the server died of SIGBUS) or rewrite it (acknowledged rows
changed). The server now copies the segment into one it owns before checking and
acknowledging (:func:`flightq.shm.store_copy`). This times a W1 and a W2 step's put
through shared memory, client and server in one process, both ways in the same run,
alternating:

- ``copy``: as flightq stores puts now;
- ``in place``: the old way, the batches mapped straight from the writer's segment (for
  measurement only: the unsafe path, patched in for the baseline).

Each rep puts the step, checks the row count, then clears it. It prints medians, the
spread (interquartile range over median) and the ratio copy / in place, with bytes/s::

    .venv/bin/python benchmarks/shm_put_cost.py --reps 15
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

import flightq
from flightq import shm, workloads
from flightq.shm import mapping

__all__ = ["main", "measure"]


def _in_place(
    ref: Any, dirpath: str, what: str, peer: str | None = None, hold: Any = None
) -> tuple[list[pa.RecordBatch], int]:
    """The old server side: the writer's segment mapped and stored as it is."""
    data = mapping.map_data(ref, dirpath, what, populate=False, private=False)
    return mapping._stream(data, what), int(ref["nbytes"])


def _spread(ts: list[float]) -> float:
    q = statistics.quantiles(ts, n=4)
    return (q[2] - q[0]) / statistics.median(ts)


def _timed(put: Callable[[], int], rows: int) -> float:
    gc.collect()
    t = time.perf_counter()
    n = put()
    dt = time.perf_counter() - t
    if n != rows:
        raise AssertionError(f"put stored {n} rows, {rows} expected")
    return dt


def measure(reps: int) -> Iterator[dict[str, Any]]:
    """Per workload: median seconds, spread and bytes/s of each way, and their ratio."""
    original = shm.read
    for step in (workloads.w1(groups=2), workloads.w2(groups=1)):
        nbytes = step.nbytes()
        with (
            flightq.Server() as srv,
            flightq.connect(srv.location, [step.schema], shm=True) as c,
        ):
            c.shm_min_bytes = 0
            c.create_partition("b", step.schema, group_size=step.group_size)
            times: dict[str, list[float]] = {"copy": [], "in place": []}

            def put(c: flightq.Client = c, step: workloads.Step = step) -> int:
                return int(c.put("b", step.keys, step.columns, tags=step.tags))

            for i in range(reps + 2):
                for way in ("copy", "in place"):
                    shm.read = original if way == "copy" else _in_place  # type: ignore[assignment]
                    try:
                        dt = _timed(put, step.rows)
                    finally:
                        shm.read = original  # type: ignore[assignment]
                    c.clear("b")
                    if i >= 2:  # two warm-up rounds: segments made, pages faulted once
                        times[way].append(dt)
        med = {w: statistics.median(ts) for w, ts in times.items()}
        yield {
            "workload": step.name,
            "rows": step.rows,
            "bytes": nbytes,
            **{f"{w} ms": round(m * 1e3, 2) for w, m in med.items()},
            **{f"{w} spread": round(_spread(ts), 3) for w, ts in times.items()},
            **{f"{w} GB/s": round(nbytes / m / 1e9, 2) for w, m in med.items()},
            "ratio copy/in place": round(med["copy"] / med["in place"], 3),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for row in measure(args.reps):
        print(json.dumps(row) if args.json else "  ".join(f"{k}: {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
