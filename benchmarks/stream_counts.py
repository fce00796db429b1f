"""A large get and put by the number of parallel streams they travel over.

One ``flightq serve --port 0`` process on 127.0.0.1 holds a workload step (W2 by default);
one client per stream count (``connect(..., get_streams=N, put_streams=N)``) gets every
row of it by key, then puts it again, the counts interleaved so that load drifts hit all
alike. Prints GB/s of logical payload per count, median [min-max]. Timing decides nothing
here: it shows where the client's default (4) stands on this machine.

Run::

    .venv/bin/python benchmarks/stream_counts.py --streams 1,2,4,6,8 --workload W2 --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

from flightq_bench import procs
from flightq_bench.flightq_system import server_argv

import flightq
from flightq import workloads

__all__ = ["main", "measure"]


def measure(
    name: str, counts: Sequence[int], reps: int, as_: str = "torch"
) -> dict[int, tuple[list[float], list[float]]]:
    """Per stream count, the seconds of each get and each put of step ``name``."""
    step = workloads.make(name)
    out: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in counts}
    with procs.ServerProcess(server_argv(), "flightq") as server:
        location = server.info["listening"]
        clients = {
            n: flightq.connect(location, [step.schema], timeout=300, get_streams=n, put_streams=n)
            for n in counts
        }
        try:
            first = clients[counts[0]]
            first.create_partition("p", step.schema, tasks=["t"], group_size=step.group_size)
            first.put("p", step.keys, step.columns, step.tags)
            for c in clients.values():
                c.get("p", step.keys, as_="numpy")  # each learns the rows' sizes
            for _ in range(reps):
                for n, c in clients.items():
                    t0 = time.perf_counter()
                    c.get("p", step.keys, as_=as_).to_dict()
                    out[n][0].append(time.perf_counter() - t0)
            for _ in range(reps):
                for n, c in clients.items():
                    first.clear("p")
                    t0 = time.perf_counter()
                    c.put("p", step.keys, step.columns, step.tags)
                    out[n][1].append(time.perf_counter() - t0)
        finally:
            for c in clients.values():
                c.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one line per stream count."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,2,4,6,8")
    p.add_argument("--workload", default="W2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--as", dest="as_", default="torch", choices=["torch", "numpy"])
    args = p.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    step = workloads.make(args.workload)
    got = measure(args.workload, counts, args.reps, args.as_)
    gb = step.nbytes() / 1e9
    print(
        f"{args.workload}: {step.nbytes() / 2**20:.0f} MiB, {os.cpu_count()} CPUs, as_={args.as_}"
    )
    print(f"{'streams':>7} {'get GB/s':>9} {'min-max':>13} {'put GB/s':>9} {'min-max':>13}")
    for n in counts:
        gets, puts = got[n]
        g, q = gb / statistics.median(gets), gb / statistics.median(puts)
        print(
            f"{n:>7} {g:>9.2f} {gb / max(gets):>6.2f}-{gb / min(gets):<6.2f} "
            f"{q:>9.2f} {gb / max(puts):>6.2f}-{gb / min(puts):<6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
