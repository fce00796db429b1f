"""The CPU each end spends on a step, per path, in one process: for A/B between revisions.

A transfer's wall time on a small machine is set by the CPU its ends spend, and the
socket's share of that is the same for every revision of flightq. This times flightq's
own work on each workload step, without a socket, so a change can be measured before and
after on a noisy machine:

- ``encode``: the put's :func:`flightq.encode_chunks` (payload copies left to the fills,
  as a put over the socket defers them);
- ``decode``: the get's :class:`flightq.batch.PartDecoder` over the answer's record
  batches (validation and per-row tensors);
- ``server put``: validation of the put's record batches, the store's put, then clear;
- ``server get``: the store's lookup of every key and the answer's record batches.

Medians in ms. To compare two revisions, run each from its own tree, alternating::

    git archive REV flightq schemas | tar -x -C /tmp/old
    for i in 1 2 3; do
        PYTHONPATH=/tmp/old .venv/bin/python benchmarks/cpu_paths.py --json > old.$i.json
        .venv/bin/python benchmarks/cpu_paths.py --json > new.$i.json
    done

(``PYTHONPATH`` must name the tree: a script's own folder comes first on the path, and the
editable install would answer otherwise; the first line printed says which was loaded.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

import flightq
from flightq import workloads
from flightq.batch import PartDecoder, encode_chunks
from flightq.registry import SchemaRegistry
from flightq.validation import validate

try:
    from flightq.server.assemble import assemble
    from flightq.server.partition import make_piece
    from flightq.server.store import Store
except ImportError:  # a tree from before the server moved into flightq/server/
    from flightq.assemble import assemble  # type: ignore[no-redef]
    from flightq.store import Store  # type: ignore[no-redef]

    from flightq.rows import make_piece  # type: ignore[no-redef]

__all__ = ["measure", "main"]

#: Record-batch size of puts and answers (the client's and server's default).
BATCH_BYTES = 16 * 2**20


def _received(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch as a reader gets it: through Arrow IPC."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


def _ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms of ``fn()``. Local, not ``flightq_bench.stats``: the script runs against
    older trees too, and uses only what they all have."""
    for _ in range(max(3, reps // 10)):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def measure(name: str, reps: int = 100) -> dict[str, float]:
    """Median ms of each path on workload ``name`` (see the module docstring)."""
    step = workloads.to_torch(workloads.make(name))
    schema = SchemaRegistry.default().get(step.schema)

    def encode() -> list[pa.RecordBatch]:
        fills: list[Callable[[], None]] = []
        return encode_chunks(
            schema, step.columns, step.keys, step.tags, max_bytes=BATCH_BYTES, fills=fills
        )

    full = encode_chunks(schema, step.columns, step.keys, step.tags, max_bytes=BATCH_BYTES)
    batches = [_received(b) for b in full]

    def decode() -> None:
        d = PartDecoder("torch", False)
        for rb in batches:
            d.add(rb)

    store = Store()
    store.declare("p", schema, ["train"], step.group_size)

    def server_put() -> None:
        store.put("p", [make_piece(b, validate(b, schema)) for b in batches], False)
        store.clear("p", None)

    def server_get() -> None:
        part, rows, names = store.rows_for_get("p", step.keys, None)
        list(assemble(part, rows, names, BATCH_BYTES, coalesce=True)[1])

    out = {"encode": _ms(encode, reps), "decode": _ms(decode, reps)}
    out["server put"] = _ms(server_put, reps)
    store.put("p", [make_piece(b, validate(b, schema)) for b in batches], False)
    out["server get"] = _ms(server_get, reps)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W1,W3,W4")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    print(f"flightq from {flightq.__file__}", file=sys.stderr)
    res: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for name in args.workloads.split(","):
            res[name] = measure(name, args.reps)
    if args.json:
        print(json.dumps(res))
        return 0
    print("workload  " + "  ".join(f"{k:>10s}" for k in next(iter(res.values()))) + "   (ms)")
    for name, r in res.items():
        print(f"{name:8s}  " + "  ".join(f"{v:10.3f}" for v in r.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
