"""Aggregate put and get throughput of W1 over 1, 2, 4, ... shard processes on loopback.

Each shard is a ``flightq serve --port 0`` child process on 127.0.0.1. ``--writers``
threads of one :class:`flightq.ShardedClient` each put a whole W1 step (8 groups of 16,
one 748x1176 float32 image per row, shared by its group) under their own keys, then each
gets its rows back by key (every field, decoded as numpy views); every row's
``input_ids`` and pixels are then checked against a checksum (outside the timed part)
and the rows cleared. Put and get are timed separately (the wall time of all writers
together); the median of ``--reps`` rounds is reported, with the ratio to the first
shard count measured in the same run. Timing decides nothing here: it is printed.

Run::

    .venv/bin/python benchmarks/shard_scaling.py --shards 1,2,4 --reps 3

``flightq bench --shards 1,2,4`` (owned by flightq/bench) can call :func:`measure` for
each shard count and add its rows to the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import flightq
from flightq import workloads

__all__ = ["measure", "shard_processes", "main"]

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def shard_processes(n: int, timeout: float = 60.0) -> Iterator[list[str]]:
    """``n`` ``flightq serve --port 0`` processes on loopback; yields their locations."""
    procs: list[subprocess.Popen[str]] = []
    try:
        locations = []
        for _ in range(n):
            p = subprocess.Popen(
                [sys.executable, "-m", "flightq.cli", "serve", "--port", "0"],
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(ROOT),
            )
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"a shard did not start (exit {p.poll()})")
            locations.append(json.loads(line)["listening"])
        yield locations
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _checksums(step: workloads.Step, keys: Sequence[str]) -> dict[str, int]:
    out = {}
    for k, ids, px in zip(
        keys, step.columns["input_ids"], step.columns["pixel_values"], strict=True
    ):
        out[k] = zlib.crc32(px[0].tobytes(), zlib.crc32(ids.tobytes()))
    return out


def measure(
    shards: int, *, groups: int = 8, writers: int = 2, reps: int = 3, seed: int = 0
) -> dict[str, Any]:
    """Median put and get throughput of ``writers`` W1 steps over ``shards`` processes.

    Returns
    -------
    dict
        ``shards``, ``rows``, ``bytes`` (payload per round, a group's shared image once),
        ``put_s``, ``get_s`` (medians), ``put_Bps``, ``get_Bps``.
    """
    step = workloads.w1(seed, groups=groups)
    keysets = [[f"w{j}x{k}" for k in step.keys] for j in range(writers)]
    sums = [_checksums(step, ks) for ks in keysets]
    # Bytes that travel: a group's shared image once (it is one dictionary entry).
    nbytes = step.nbytes(distinct_media=True) * writers
    put_times: list[float] = []
    get_times: list[float] = []
    with shard_processes(shards) as locations:
        c = flightq.connect_sharded(locations, [step.schema], timeout=120)
        try:
            c.create_partition("w1", step.schema, group_size=step.group_size)
            got: list[Any] = [None] * writers

            def get(j: int) -> None:
                got[j] = c.get("w1", keysets[j], as_="numpy")

            for _ in range(reps):
                put_times.append(_phase(writers, lambda j: _put(c, step, keysets[j])))
                get_times.append(_phase(writers, get))
                for j in range(writers):  # checked outside the timed phase
                    _check(got[j], keysets[j], sums[j])
                c.clear("w1")
        finally:
            c.close()
    put_s, get_s = statistics.median(put_times), statistics.median(get_times)
    return {
        "shards": shards,
        "rows": step.rows * writers,
        "bytes": nbytes,
        "put_s": put_s,
        "get_s": get_s,
        "put_Bps": nbytes / put_s,
        "get_Bps": nbytes / get_s,
    }


def _put(c: flightq.ShardedClient, step: workloads.Step, keys: list[str]) -> None:
    assert c.put("w1", keys, step.columns, step.tags) == len(keys)


def _check(b: flightq.Batch, keys: list[str], sums: dict[str, int]) -> None:
    assert b.keys == keys
    for k, ids, px in zip(b.keys, b["input_ids"], b["pixel_values"], strict=True):
        got = zlib.crc32(np.ascontiguousarray(px[0]).tobytes(), zlib.crc32(ids.tobytes()))
        assert got == sums[k], f"row {k!r} came back different"


def _phase(writers: int, fn: Any) -> float:
    errors: list[BaseException] = []

    def run(j: int) -> None:
        try:
            fn(j)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(writers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each shard count and print one JSON line each, then a table of ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="1,2,4", help="comma-separated shard counts")
    p.add_argument("--groups", type=int, default=8, help="W1 groups per writer per round")
    p.add_argument("--writers", type=int, default=2, help="concurrent writer threads")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    counts = [int(s) for s in args.shards.split(",")]
    rows = []
    for n in counts:
        r = measure(n, groups=args.groups, writers=args.writers, reps=args.reps)
        print(json.dumps(r), flush=True)
        rows.append(r)
    base = rows[0]
    print(f"\n{'shards':>6} {'put GB/s':>9} {'x':>5} {'get GB/s':>9} {'x':>5}")
    for r in rows:
        print(
            f"{r['shards']:>6} {r['put_Bps'] / 1e9:>9.2f} {r['put_Bps'] / base['put_Bps']:>5.2f}"
            f" {r['get_Bps'] / 1e9:>9.2f} {r['get_Bps'] / base['get_Bps']:>5.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
