"""How much one client's load slows another client's 1-row put and get.

One ``flightq serve --port 0`` process on 127.0.0.1. While each load below runs (in its own
process, started and stopped by this script), this process times a probe: put one row to
partition ``probe``, then get it back by key, again and again. The same probe with no load
is the baseline, measured in the same run. Printed per load: probe calls timed, and their
latency's median, 25th..75th percentile (the spread), 99th percentile and maximum.

Loads, each bounded in time (``--seconds``) or by the one put it makes:

- ``claims``: 40 claims of 2**20 rows (the most a ticket may ask) waiting on ``probe``
  itself, which gains a row with every probe put;
- ``wait-for``: 40 claims of 1024 rows waiting for ``prev_logprobs`` on a partition of up
  to 200 000 rows that lack it, while a worker writes it back to one row again and again;
- ``put``: one put of ``--rows`` rows (1e6) to a fresh partition;
- ``put-more``: the same put to a partition that holds 1 000 rows already (merged into
  its row table, where ``put`` adopts the table its plan built);
- ``replay``: the same put again, identical (acknowledged, stores nothing);
- ``stalled``: 300 DoPut streams that send their schema and then nothing;
- ``flood``: 8 clients putting 1-row puts as fast as they can;
- ``inspect``: ``inspect`` of a partition of ``--rows`` rows (counted over every row), again
  and again.

Timing decides nothing here; the aim is a probe p99 under 50 ms on 2 cores.

Run::

    .venv/bin/python benchmarks/isolation.py --seconds 4
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["LOADS", "Probe", "main", "measure"]

TEXT = "rollout_text@1"
LOADS = ("claims", "wait-for", "put", "put-more", "replay", "stalled", "flood", "inspect")
#: Seconds any one call of a load may take before it is given up.
_CALL_TIMEOUT = 120.0


class Probe(NamedTuple):
    """Latencies (seconds) of one load's probe calls."""

    load: str
    latencies: list[float]
    note: str

    def row(self) -> str:
        ms = np.asarray(self.latencies) * 1e3
        if not len(ms):
            return f"| {self.load} | 0 | - | - | - | - | {self.note} |"
        p25, p50, p75, p99 = np.percentile(ms, [25, 50, 75, 99])
        return (
            f"| {self.load} | {len(ms)} | {p50:.1f} | {p25:.1f}..{p75:.1f} | {p99:.1f} "
            f"| {ms.max():.1f} | {self.note} |"
        )


def _batch(rows: int, seed: int = 0, prefix: str = "big") -> Any:
    import flightq

    schema = flightq.SchemaRegistry.default().get(TEXT)
    flat = np.random.default_rng(seed).integers(0, 1000, size=4 * rows, dtype=np.int64)
    ids = [flat[4 * i : 4 * i + 4] for i in range(rows)]
    lens = np.full(rows, 4, np.int32)
    return flightq.encode(
        schema, {"input_ids": ids, "input_lengths": lens}, [f"{prefix}{i}" for i in range(rows)]
    )


# --------------------------------------------------------------------------- loads


def _load(location: str, load: str, seconds: float, rows: int, started: Any, done: Any) -> None:
    """Run one load in this (child) process; set ``started`` once it is in effect and
    ``done`` when it ends."""
    import flightq

    try:
        if load == "claims":
            _claims(location, seconds, started)
        elif load in ("put", "put-more", "replay"):
            batch = _batch(rows)
            with flightq.connect(location, timeout=_CALL_TIMEOUT) as c:
                name = f"big-{load}"
                c.create_partition(name, TEXT, tasks=["t"])
                held = 0
                if load == "replay":
                    c.put_batch(name, batch, timeout=_CALL_TIMEOUT)
                elif load == "put-more":  # the put's rows merge into rows already there
                    held = 1000
                    c.put_batch(name, _batch(held, 1, "old"), timeout=_CALL_TIMEOUT)
                started.set()
                got = c.put_batch(name, batch, timeout=_CALL_TIMEOUT)
                assert int(got) == rows, got
                assert c.stats()["partitions"][name]["rows"] == rows + held
        elif load == "stalled":
            _stalled(location, seconds, started)
        elif load == "flood":
            _flood(location, seconds, started)
        elif load == "wait-for":
            _wait_for(location, seconds, min(rows, 200_000), started)
        elif load == "inspect":
            with flightq.connect(location, timeout=_CALL_TIMEOUT) as c:
                c.create_partition("big-inspect", TEXT, tasks=["t"])
                c.put_batch("big-inspect", _batch(rows), timeout=_CALL_TIMEOUT)
                started.set()
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    assert c.inspect("big-inspect")["ready"] == {"t": rows}
        else:
            raise ValueError(f"unknown load {load!r}")
    finally:
        started.set()
        done.set()


def _claims(location: str, seconds: float, started: Any) -> None:
    with _waiting(location, seconds, "probe", 2**20, ()):
        started.set()


def _wait_for(location: str, seconds: float, rows: int, started: Any) -> None:
    """40 claims of 1024 rows wait for a column that none of ``rows`` ready rows carries
    yet, while a logprob worker writes it back to one row over and over."""
    import flightq

    with flightq.connect(location, timeout=_CALL_TIMEOUT) as c:
        c.create_partition("big-wait", TEXT, tasks=["t"])
        c.put_batch("big-wait", _batch(rows), timeout=_CALL_TIMEOUT)
        with _waiting(location, seconds, "big-wait", 1024, ("prev_logprobs",)):
            started.set()
            lp = {"prev_logprobs": [np.zeros(4, np.float32)]}
            end = time.monotonic() + seconds
            while time.monotonic() < end:  # each write-back may serve every waiting claim
                c.put("big-wait", ["big0"], lp, overwrite=True)


@contextlib.contextmanager
def _waiting(
    location: str, seconds: float, partition: str, rows: int, wait_for: tuple[str, ...]
) -> Iterator[None]:
    """40 claims of ``rows`` rows of ``partition`` (task ``t``), each in a thread of its
    own, waiting up to ``seconds`` (a timeout is expected): the block runs once all wait
    (or after 30 s); the claims' other errors are raised after it."""
    import flightq

    errors: list[BaseException] = []

    def wait() -> None:
        with flightq.connect(location, timeout=seconds + 30) as c:
            try:
                c.claim(partition, "t", rows, wait_for=wait_for, timeout=seconds, as_="numpy")
            except flightq.ClaimTimeoutError:
                pass
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(40)]
    for t in threads:
        t.start()
    with flightq.connect(location, timeout=30) as c:
        deadline = time.monotonic() + 30
        while c.stats()["waiting_claims"] < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
    yield
    for t in threads:
        t.join(seconds + 60)
    if errors:
        raise errors[0]


def _stalled(location: str, seconds: float, started: Any) -> None:
    import msgpack
    import pyarrow.flight as fl

    schema = _batch(1).schema
    cmd = msgpack.packb({"op": "put", "partition": "stalled", "timeout": 1.0})
    clients = [fl.connect(location) for _ in range(10)]
    streams = []
    for i in range(300):
        try:
            w, r = clients[i % 10].do_put(fl.FlightDescriptor.for_command(cmd), schema)
            streams.append((w, r))
        except fl.FlightError:
            pass
    time.sleep(1.0)  # the streams' calls reach the server (or are refused)
    started.set()
    time.sleep(seconds)
    for w, _ in streams:
        with contextlib.suppress(Exception):
            w.close()
    for c in clients:
        c.close()


def _flood(location: str, seconds: float, started: Any) -> None:
    import flightq

    stop = time.monotonic() + seconds
    counts: list[int] = []

    def flood(j: int) -> None:
        n = 0
        with flightq.connect(location, timeout=30) as c:
            ids = [np.arange(4, dtype=np.int64)]
            while time.monotonic() < stop:
                c.put("flood", [f"f{j}_{n}"], {"input_ids": ids})
                n += 1
        counts.append(n)

    threads = [threading.Thread(target=flood, args=(j,), daemon=True) for j in range(8)]
    for t in threads:
        t.start()
    started.set()
    for t in threads:
        t.join(seconds + 60)


# --------------------------------------------------------------------------- probe


def _probe(location: str, until: Callable[[], bool], limit: float) -> tuple[list[float], int]:
    """Put one row and get it back until ``until()`` or ``limit`` seconds; the latencies,
    and how many probes the server refused as busy."""
    import flightq

    out: list[float] = []
    refused = 0
    ids = {"input_ids": [np.arange(8, dtype=np.int64)]}
    end = time.monotonic() + limit
    with flightq.Client(location, timeout=_CALL_TIMEOUT) as c:
        n = 0
        while not until() and time.monotonic() < end:
            key = f"probe{time.monotonic_ns()}_{n}"
            t0 = time.perf_counter()
            try:
                c.put("probe", [key], ids)
                got = c.get("probe", [key], as_="numpy")
            except flightq.ResourceExhaustedError:  # "server busy": typed, at once
                refused += 1
                time.sleep(0.01)
                continue
            out.append(time.perf_counter() - t0)
            assert got.keys == [key]
            n += 1
    return out, refused


def measure(
    loads: Sequence[str], seconds: float, rows: int, server_args: Sequence[str] = ()
) -> list[Probe]:
    """The baseline and one :class:`Probe` per load, against one server process."""
    from flightq_bench import procs
    from flightq_bench.flightq_system import server_argv

    import flightq

    ctx = mp.get_context("spawn")
    out: list[Probe] = []
    with procs.ServerProcess([*server_argv(), *server_args], "flightq") as server:
        location = server.info["listening"]
        with flightq.connect(location, timeout=30) as c:
            for name in ("probe", "flood", "stalled"):
                c.create_partition(name, TEXT, tasks=["t"])
        out.append(Probe("none (baseline)", _probe(location, lambda: False, seconds)[0], ""))
        for load in loads:
            started, done = ctx.Event(), ctx.Event()
            child = ctx.Process(
                target=_load, args=(location, load, seconds, rows, started, done), daemon=True
            )
            t0 = time.monotonic()
            child.start()
            if not started.wait(_CALL_TIMEOUT):
                raise TimeoutError(f"load {load!r} did not start")
            lat, refused = _probe(location, done.is_set, _CALL_TIMEOUT)
            took = time.monotonic() - t0
            child.join(_CALL_TIMEOUT)
            note = f"load ran {took:.1f} s" + (
                "" if child.exitcode == 0 else f", exit {child.exitcode}"
            )
            if refused:
                note += f", {refused} probes refused 'server busy'"
            out.append(Probe(load, lat, note))
            with flightq.Client(location, timeout=30) as c:
                c.health()  # the server still serves
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated of {LOADS}")
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of a timed load")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the large put")
    ap.add_argument(
        "--server-arg", action="append", default=[], help="passed to flightq serve (repeat)"
    )
    args = ap.parse_args(argv)
    loads = [x for x in args.loads.split(",") if x]
    unknown = set(loads) - set(LOADS)
    if unknown:
        ap.error(f"unknown loads {sorted(unknown)}")
    res = measure(loads, args.seconds, args.rows, args.server_arg)
    print("| load | probe calls | p50 ms | p25..p75 ms | p99 ms | max ms | note |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(r.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
