"""A trainer's small-call loop, on the request stream and per call, in one run.

One ``flightq serve --port 0`` process on 127.0.0.1. A producer client puts one W4 row;
a trainer client claims it and acks it: the loop of a trainer that takes rows as they come.
Each repetition times ``--loops`` such loops twice, interleaved: with the default clients
(small operations on each client's request stream) and with ``stream_max_bytes = 0``
(every operation its own Flight call: DoPut, DoGet, DoAction). It prints the p50 of each
operation and of the loop, the loop's p99, and the ratio of the stream's loop p50 to the
per-call one per repetition (median [min-max]). Every loop is bounded in count; timing
decides nothing here.

Run::

    .venv/bin/python benchmarks/trainer_loop.py --loops 500 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flightq_bench import procs
from flightq_bench.flightq_system import server_argv

import flightq
from flightq import workloads

__all__ = ["main", "measure", "OPS"]

#: The operations of one loop, in order.
OPS = ("put", "claim", "ack")


def measure(location: str, loops: int, per_call: bool, partition: str) -> dict[str, Any]:
    """``loops`` put + claim + ack loops of one W4 row: per operation and per loop, the
    seconds of each loop, and how many requests the clients' streams answered."""
    step = workloads.w4(0)
    with (
        flightq.connect(location, [step.schema], timeout=60) as producer,
        flightq.connect(location, [step.schema], timeout=60) as trainer,
    ):
        if per_call:
            producer.stream_max_bytes = trainer.stream_max_bytes = 0
        producer.create_partition(partition, step.schema, tasks=["train"])
        times: dict[str, list[float]] = {op: [] for op in (*OPS, "loop")}
        try:
            for i in range(loops):
                key = f"r{i}"
                t0 = time.perf_counter()
                producer.put(partition, [key], step.columns, tags=step.tags)
                t1 = time.perf_counter()
                b = trainer.claim(partition, "train", 1, timeout=30, as_="numpy")
                t2 = time.perf_counter()
                trainer.ack(b)
                t3 = time.perf_counter()
                if b.keys != [key]:
                    raise AssertionError(f"claimed {b.keys}, expected [{key!r}]")
                for op, a, z in (("put", t0, t1), ("claim", t1, t2), ("ack", t2, t3)):
                    times[op].append(z - a)
                times["loop"].append(t3 - t0)
        finally:
            producer.drop(partition)
        served = producer.requests.served + trainer.requests.served
    return {"times": times, "served": served}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the interleaved repetitions and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", type=int, default=500, help="loops per repetition and mode")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=50, help="untimed loops first, per mode")
    args = p.parse_args(argv)
    if not 1 <= args.loops <= 100_000 or not 1 <= args.reps <= 50:
        p.error("--loops must be 1..100000 and --reps 1..50")
    modes = {"stream": False, "per call": True}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with procs.ServerProcess(server_argv(), "flightq") as server:
        location = server.info["listening"]
        for mode, per_call in modes.items():  # warm both paths (imports, first calls)
            measure(location, args.warmup, per_call, f"warm-{mode.replace(' ', '-')}")
        for r in range(args.reps):  # interleaved, so that load drifts hit both alike
            for mode, per_call in modes.items():
                name = f"loop-{r}-{mode.replace(' ', '-')}"
                runs[mode].append(measure(location, args.loops, per_call, name))
    print(f"trainer loop: put + claim + ack of one W4 row, {os.cpu_count()} CPUs")
    print(f"{'mode':>9} " + " ".join(f"{op + ' p50':>10}" for op in (*OPS, "loop")) + "  loop p99")
    for mode, rs in runs.items():
        p50 = {
            op: statistics.median(float(np.median(r["times"][op])) for r in rs)
            for op in (*OPS, "loop")
        }
        p99 = statistics.median(float(np.percentile(r["times"]["loop"], 99)) for r in rs)
        cells = " ".join(f"{p50[op] * 1e3:>7.3f} ms" for op in (*OPS, "loop"))
        print(f"{mode:>9} {cells}  {p99 * 1e3:.3f} ms")
    ratios = [
        float(np.median(s["times"]["loop"]) / np.median(c["times"]["loop"]))
        for s, c in zip(runs["stream"], runs["per call"], strict=True)
    ]
    print(
        f"stream loop p50 / per-call loop p50: {statistics.median(ratios):.2f}x "
        f"[{min(ratios):.2f}-{max(ratios):.2f}] over {args.reps} repetitions"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
