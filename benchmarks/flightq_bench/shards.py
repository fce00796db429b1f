"""``flightq bench --shards 1,2,4``: aggregate throughput of one partition over N servers.

For each shard count, N ``flightq serve --port 0`` processes start on 127.0.0.1 and
``workers`` separate worker processes each hold a :class:`flightq.ShardedClient` over all
of them. Every round, all workers start together (a barrier): each puts a W1 step under
its own keys (8 prompt groups of 16 rows, one image per group), then, after the next
barrier, gets its rows back by key. The parent times each phase from the barrier that
starts it to the barrier that ends it, so the figure is aggregate wall-clock throughput of
the bytes that travel (a group's image once). Workers check every row they read against a
checksum of the seeded step after the timed phase. Timing decides nothing: it is reported,
with the ratio to the first shard count of the same run.

With ``hosts`` (``flightq bench --shards 2,4 --hosts 6 --link 10gbit``, as root) the
servers run on hosts of a :class:`~flightq_bench.hosts.Testbed`, one shard per host
(``h0``, ``h1``, ...), and the workers on the hosts after the largest shard count, dealt
round-robin: every byte crosses a worker host's link and a shard's link, each limited to
the rate. The figure then adds the aggregate as a fraction of what the links allow:
``min(worker hosts, shards) x rate``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["shard_processes", "measure_shards", "run_shards", "markdown"]

_TIMEOUT = 300.0


@contextlib.contextmanager
def shard_processes(n: int, timeout: float = 60.0, testbed: Any = None) -> Iterator[list[str]]:
    """``n`` ``flightq serve --port 0`` processes on loopback (or one on each of hosts
    ``0..n-1`` of ``testbed``); yields their locations."""
    if testbed is not None:
        servers = [testbed.serve(i, timeout=timeout) for i in range(n)]
        try:
            yield [srv.location for srv in servers]
        finally:
            for srv in servers:
                srv.stop()
        return
    procs: list[subprocess.Popen[str]] = []
    try:
        locations = []
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "flightq.cli",
                        "serve",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"a shard did not start (exit code {p.poll()})")
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


def _checksum(ids: Any, px: Any) -> int:
    return zlib.crc32(px.tobytes(), zlib.crc32(ids.tobytes()))


def _worker(
    j: int,
    locations: list[str],
    groups: int,
    reps: int,
    seed: int,
    barrier: Any,
    out: Any,
    netns: str | None = None,
) -> None:
    if netns:
        from .hosts import enter

        enter(netns)  # before any thread of this process starts
    import flightq
    from flightq import workloads

    step = workloads.w1(seed, groups=groups)
    keys = [f"w{j}_{k}" for k in step.keys]
    want = {
        k: _checksum(ids, px[0])
        for k, ids, px in zip(
            keys, step.columns["input_ids"], step.columns["pixel_values"], strict=True
        )
    }
    c = flightq.connect_sharded(locations, [step.schema], timeout=_TIMEOUT)
    try:
        c.create_partition("w1", step.schema, group_size=step.group_size)
        for _ in range(reps):
            barrier.wait(_TIMEOUT)
            c.put("w1", keys, step.columns, step.tags)
            barrier.wait(_TIMEOUT)
            barrier.wait(_TIMEOUT)
            b = c.get("w1", keys, as_="numpy")
            barrier.wait(_TIMEOUT)
            ids, px = b["input_ids"], b["pixel_values"]
            for i, k in enumerate(b.keys):
                assert _checksum(ids[i], px[i][0]) == want[k], f"row {k} differs"
            c.clear("w1", keys)
            barrier.wait(_TIMEOUT)
        out.put((j, "ok"))
    except BaseException as e:  # reported to the parent, which aborts the barrier
        out.put((j, f"{type(e).__name__}: {e}"))
        barrier.abort()
    finally:
        c.close()


def measure_shards(
    shards: int,
    *,
    workers: int = 4,
    groups: int = 8,
    reps: int = 3,
    seed: int = 0,
    testbed: Any = None,
    first_worker_host: int = 0,
) -> dict[str, Any]:
    """Median aggregate put and get throughput over ``shards`` server processes.

    Returns
    -------
    dict
        ``shards``, ``workers``, ``bytes`` per round (what travels), ``put_Bps`` and
        ``get_Bps`` (medians) with their ``_min``/``_max``.
    """
    from flightq import workloads

    step = workloads.w1(seed, groups=groups)
    nbytes = step.nbytes(distinct_media=True) * workers
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers + 1)
    out = ctx.Queue()
    put_s: list[float] = []
    get_s: list[float] = []
    netns: list[str | None] = [None] * workers
    worker_hosts = 0
    if testbed is not None:
        free = testbed.hosts[first_worker_host:]
        netns = [free[j % len(free)].ns for j in range(workers)]
        worker_hosts = min(workers, len(free))
    with shard_processes(shards, testbed=testbed) as locations:
        procs = [
            ctx.Process(
                target=_worker, args=(j, locations, groups, reps, seed, barrier, out, netns[j])
            )
            for j in range(workers)
        ]
        for p in procs:
            p.start()
        try:
            for _ in range(reps):
                barrier.wait(_TIMEOUT)
                t0 = time.perf_counter()
                barrier.wait(_TIMEOUT)
                put_s.append(time.perf_counter() - t0)
                barrier.wait(_TIMEOUT)
                t0 = time.perf_counter()
                barrier.wait(_TIMEOUT)
                get_s.append(time.perf_counter() - t0)
                barrier.wait(_TIMEOUT)  # rows verified and cleared
            results = [out.get(timeout=_TIMEOUT) for _ in procs]
        except Exception:
            barrier.abort()
            errors = []
            while not out.empty():
                errors.append(out.get())
            raise RuntimeError(f"shard benchmark with {shards} shards failed: {errors}") from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        bad = [r for r in results if r[1] != "ok"]
        if bad:
            raise RuntimeError(f"shard benchmark with {shards} shards failed: {bad}")
    put_bps = [nbytes / s for s in put_s]
    get_bps = [nbytes / s for s in get_s]
    extra: dict[str, Any] = {}
    if testbed is not None:
        # What the links allow: each byte leaves one host and enters another.
        limit = min(worker_hosts, shards) * testbed.rate_bps / 8
        extra = {
            "link": testbed.link,
            "worker_hosts": worker_hosts,
            "links_Bps": limit,
            "put_util": statistics.median(put_bps) / limit,
            "get_util": statistics.median(get_bps) / limit,
        }
    return {
        **extra,
        "shards": shards,
        "workers": workers,
        "bytes": nbytes,
        "put_Bps": statistics.median(put_bps),
        "put_Bps_min": min(put_bps),
        "put_Bps_max": max(put_bps),
        "get_Bps": statistics.median(get_bps),
        "get_Bps_min": min(get_bps),
        "get_Bps_max": max(get_bps),
    }


def run_shards(
    counts: Sequence[int],
    *,
    workers: int = 4,
    groups: int = 8,
    reps: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    hosts: int = 0,
    links: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """:func:`measure_shards` for each count, with the ratio to the first count (of the
    same link rate); with ``hosts``, on a testbed of that many hosts, once per rate in
    ``links``."""
    if not hosts:
        return _curve(counts, progress, workers=workers, groups=groups, reps=reps, seed=seed)
    from .hosts import Testbed

    rows: list[dict[str, Any]] = []
    with Testbed(hosts, links[0]) as tb:
        for link in links:
            tb.set_rate(link)
            rows += _curve(
                counts,
                progress,
                workers=workers,
                groups=groups,
                reps=reps,
                seed=seed,
                testbed=tb,
                first_worker_host=max(counts),
            )
    return rows


def _curve(
    counts: Sequence[int], progress: Callable[[str], None], **kw: Any
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in counts:
        r = measure_shards(n, **kw)
        base = rows[0] if rows else r
        r["put_x"] = r["put_Bps"] / base["put_Bps"]
        r["get_x"] = r["get_Bps"] / base["get_Bps"]
        rows.append(r)
        where = ""
        if "link" in r:
            where = (
                f" over {r['link']} links ({r['worker_hosts']} worker hosts; of what the links "
                f"allow: put {100 * r['put_util']:.0f}%, get {100 * r['get_util']:.0f}%)"
            )
        progress(
            f"shards {n}: put {r['put_Bps'] / 1e9:.2f} GB/s ({r['put_x']:.2f}x)  "
            f"get {r['get_Bps'] / 1e9:.2f} GB/s ({r['get_x']:.2f}x)  "
            f"[{r['workers']} worker processes, {r['bytes'] / 1e6:.0f} MB per round]{where}"
        )
    return rows


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The shard curve as a markdown table."""
    on_hosts = "link" in rows[0]
    lines = [
        "# flightq bench --shards",
        "",
        f"- command: `{command}`",
        f"- {rows[0]['workers']} worker processes; W1 steps; bytes that travel per round: "
        f"{rows[0]['bytes'] / 1e6:.0f} MB; GB/s median [min-max]; x = ratio to "
        f"{rows[0]['shards']} shard(s) in the same run"
        + (" and link; links: the aggregate over what the links allow" if on_hosts else ""),
        "",
        "| link | shards | put GB/s | x | get GB/s | x | links put / get |"
        if on_hosts
        else "| shards | put GB/s | x | get GB/s | x |",
        "|---|---|---|---|---|---|---|" if on_hosts else "|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['link']} " if on_hosts else ""
        tail = f" {100 * r['put_util']:.0f}% / {100 * r['get_util']:.0f}% |" if on_hosts else ""
        lines.append(
            f"{head}| {r['shards']} | {r['put_Bps'] / 1e9:.2f} [{r['put_Bps_min'] / 1e9:.2f}-"
            f"{r['put_Bps_max'] / 1e9:.2f}] | {r['put_x']:.2f} | {r['get_Bps'] / 1e9:.2f} "
            f"[{r['get_Bps_min'] / 1e9:.2f}-{r['get_Bps_max'] / 1e9:.2f}] | {r['get_x']:.2f} |"
            + tail
        )
    return "\n".join(lines) + "\n"
