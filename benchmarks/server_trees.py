"""Reads of a stored step from the servers of several source trees, interleaved.

An A/B of a change in the server's read path: one ``flightq serve --port 0`` process on
127.0.0.1 per source tree (``--trees``, checkouts made with ``git archive REV | tar -x -C
DIR``; ``.`` is this one), each holding the same workload step, and one client process of
this tree reading from each in turn, ``--gets`` reads a round, the servers' order
reversed every other round so that load drifts hit all alike. ``--mode``:

- ``get``: ``Client.get`` of every row by key, every field's per-row tensors built
  (``--fields``: only those fields asked for and built, a reader of some columns);
- ``claim``: every prompt group claimed once (``batch_size`` = the group size) and acked,
  fields built, as a trainer takes microbatches; the time of all of a step's claims is
  one read, and the step is put again after it.

``--fresh`` (a get): the step is cleared and put again after each read, so that every read
is a step's first, as in ``flightq bench``. Where the step is put again, the puts are
timed too and reported the same way.

``--shm``: the client reads through shared memory (``connect(..., shm=True)``). Every
answer is checked against the step once before the timed reads. Prints per tree the
median ms of a read and, against the first tree, the ratio of its median to the others'
per round: median [min-max] over rounds (above 1x: that tree is faster).

Run::

    .venv/bin/python benchmarks/server_trees.py --trees OLD,. --workload W2 --mode claim --shm
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from flightq_bench.flightq_system import server_argv
from flightq_bench.procs import ServerProcess

__all__ = ["main", "measure"]


def _server(tree: str) -> ServerProcess:
    """A ``flightq serve`` process importing ``tree``'s flightq (run from its root)."""
    root = os.path.abspath(tree)
    here = os.path.abspath(".")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = [root, *(p for p in rest if os.path.abspath(p) != here)]
    return ServerProcess(
        server_argv(), f"flightq ({tree})", env={"PYTHONPATH": os.pathsep.join(path)}, cwd=root
    )


def _reader(
    c: Any, step: Any, mode: str, as_: str, fields: list[str] | None = None
) -> Callable[[], list[Any]]:
    """One read of the step from client ``c``: the batches it took (their rows built);
    a get asks for ``fields`` (None: all)."""
    groups = step.rows // step.group_size

    def built(b: Any) -> Any:
        for f in b.fields:
            _ = b[f]
        _ = b.tags
        return b

    def get() -> list[Any]:
        return [built(c.get("p", step.keys, fields, as_=as_))]

    def claims() -> list[Any]:
        out = []
        for _ in range(groups):
            b = built(c.claim("p", "train", step.group_size, as_=as_, timeout=60))
            c.ack(b)
            out.append(b)
        return out

    return get if mode == "get" else claims


def measure(
    trees: Sequence[str],
    workload: str,
    mode: str = "get",
    shm: bool = False,
    as_: str = "numpy",
    rounds: int = 8,
    gets: int = 20,
    fresh: bool = False,
    fields: list[str] | None = None,
) -> list[tuple[str, list[list[float]], list[list[float]]]]:
    """Per tree (in order, a tree named twice is two servers), per round, the seconds of
    each timed read and of each put made again after one (``fresh``, or a claim)."""
    import flightq
    from flightq.workloads import make

    if mode not in ("get", "claim"):
        raise ValueError(f"mode must be 'get' or 'claim', got {mode!r}")
    step = make(workload)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_server(t)) for t in trees]
        clients: list[Any] = []
        for server in servers:
            c = stack.enter_context(
                flightq.connect(server.info["listening"], [step.schema], timeout=60, shm=shm)
            )
            clients.append(c)
            c.create_partition("p", step.schema, tasks=["train"], group_size=step.group_size)
            c.put("p", step.keys, step.columns, tags=step.tags)
        reads = [_reader(c, step, mode, as_, fields) for c in clients]
        again = fresh or mode == "claim"
        asked = step
        if fields is not None:  # the step of only the fields read
            asked = dataclasses.replace(step, columns={f: step.columns[f] for f in fields})
        for c, read in zip(clients, reads, strict=True):
            _check(asked, read(), mode)  # once, before anything is timed
            _again(c, step, again)
        out: list[tuple[str, list[list[float]], list[list[float]]]] = [(t, [], []) for t in trees]
        order = list(range(len(trees)))
        for r in range(rounds):
            for k in order if r % 2 == 0 else order[::-1]:
                times, puts = [], []
                for _ in range(gets):
                    t0 = time.perf_counter()
                    reads[k]()
                    times.append(time.perf_counter() - t0)
                    puts.append(_again(clients[k], step, again))
                out[k][1].append(times)
                out[k][2].append(puts)
        return out


def _again(c: Any, step: Any, again: bool) -> float:
    """After a read, the step stored afresh for the next (``again``): the put's seconds."""
    if not again:
        return 0.0
    c.clear("p")
    t0 = time.perf_counter()
    c.put("p", step.keys, step.columns, tags=step.tags)
    return time.perf_counter() - t0


def _check(step: Any, batches: list[Any], mode: str) -> None:
    """Each batch against the step (a get) or the prompt group it holds (a claim), bit
    for bit."""
    from flightq_bench.payload import check_rows

    at = {k: i for i, k in enumerate(step.keys)}
    for b in batches:
        ref = step if mode == "get" else step.group(at[b.keys[0]] // step.group_size)
        check_rows(ref, list(b.keys), {f: b[f] for f in b.fields}, b.tags, mode)
    if sorted(k for b in batches for k in b.keys) != sorted(step.keys):
        raise AssertionError(f"{mode}: the reads did not take every row of the step once")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default=".", help="checkouts whose servers are compared")
    p.add_argument("--workload", default="W2")
    p.add_argument("--mode", default="get", choices=["get", "claim"])
    p.add_argument("--shm", action="store_true", help="read through shared memory")
    p.add_argument("--as", dest="as_", default="numpy", choices=["numpy", "torch"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--gets", type=int, default=20, help="timed reads per server a round")
    p.add_argument("--fresh", action="store_true", help="put the step again before each get")
    p.add_argument("--fields", help="a get of these fields only, comma-separated")
    a = p.parse_args(argv)
    trees = [t for t in a.trees.split(",") if t]
    fields = None if a.fields is None else [f for f in a.fields.split(",") if f]
    if fields is not None and a.mode != "get":
        p.error("--fields takes --mode get")
    got = measure(trees, a.workload, a.mode, a.shm, a.as_, a.rounds, a.gets, a.fresh, fields)
    route = "shm" if a.shm else "socket"
    first = " (each a fresh step's first)" if a.fresh and a.mode == "get" else ""
    print(f"{a.workload} {a.mode} as {a.as_} over {route}: ms per read{first}, median of rounds")
    _report([(t, reads) for t, reads, _ in got])
    if a.fresh or a.mode == "claim":
        print(f"{a.workload} put over {route}: ms per put, median of all rounds")
        _report([(t, puts) for t, _, puts in got])
    return 0


def _report(got: list[tuple[str, list[list[float]]]]) -> None:
    """Per tree its median, and the first tree's median over this one's per round."""
    base, first = got[0]
    for k, (t, rounds) in enumerate(got):
        flat = [x for xs in rounds for x in xs]
        line = f"  {t:<24} {statistics.median(flat) * 1e3:9.2f}"
        if k:
            ratios = [
                statistics.median(b) / statistics.median(x)
                for b, x in zip(first, rounds, strict=True)
            ]
            line += (
                f"   {base} / this per round: {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}-{max(ratios):.2f}]"
            )
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
