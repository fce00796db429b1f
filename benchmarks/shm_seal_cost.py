"""What a sealed memfd would cost a put through shared memory, against the server's copy.

A writer must neither shrink nor change what the server acknowledged. flightq gets that
by copying: the server reads the writer's segment with ``pread`` into a segment it owns
(:func:`flightq.shm.store_copy`). The other way is a Linux sealed memfd: the writer fills
a ``memfd_create(MFD_ALLOW_SEALING)`` file, unmaps it (``F_SEAL_WRITE`` is refused while
a writable shared mapping exists), seals it (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_WRITE | F_SEAL_SEAL``) and passes the descriptor over a unix socket
(``SCM_RIGHTS``); the server checks the seals (``F_GET_SEALS``) and maps the file
read-only, with no copy. Seals cannot be taken off, so every such put needs fresh pages:
the writer's pool of warm segments cannot be reused.

This times a W1 and a W2 step (:mod:`flightq.workloads`), each encoded as a put through
shared memory is (``encode_chunks`` into :func:`flightq.shm.gathering`, written by
:meth:`flightq.shm.SegmentPool.write`), writer and server in one process, the ways
alternating in each rep:

- ``copy pooled``: today's put: the writer fills a warm segment of its pool; the server
  copies it into a warm segment of its own (its pool lives while it stores rows);
- ``copy fresh``: the same, the server's pool closed after every put (a server that held
  no other row: its copy lands on fresh pages);
- ``sealed``: the writer fills a fresh memfd (flightq's writer, pointed at a memfd),
  unmaps and seals it, sends the fd and the reference; the server receives it, checks the
  seals, the size and the header, and maps it read-only;
- ``sealed ahead``: the same, the memfd made and prefaulted before the put (a writer that
  keeps one ready): its cost (``ahead``) leaves the put's path but is still paid per put.

Per way it reports medians (ms) of the writer's part (``writer``: filling the segment;
for ``sealed`` also ``seal``, unmap and ``F_ADD_SEALS``, and ``send_fds``), of the
server's part until it holds bytes no writer can change (``server``: the copy, or for
``sealed`` ``recv_fds``, the checks and the mapping; ``pass`` is send and receive), of the
first read of every page of what the server holds (``touch``: the mapping the server
keeps is not prefaulted, whoever reads it first pays), and of letting the bytes go
(``release``, off the put's path); ``put`` is writer + server, ``put+touch``
adds touch, ``work`` adds ahead and release (all a put costs the host). Encoding (the
same for every way) and the Flight call are left out. Spread is the interquartile range
over the median; ratios are against ``copy pooled`` in the same run. Every rep checks
the row count of the stream the server holds, and the first rep that the server's bytes
equal the writer's::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/shm_seal_cost.py --reps 11
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import mmap
import os
import shutil
import socket
import stat
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from flightq import shm, workloads
from flightq.chunks import encode_chunks, split_batch
from flightq.errors import ProtocolError
from flightq.registry import SchemaRegistry
from flightq.shm import mapping
from flightq.shm.segments import HEADER, MAP_POPULATE_FLAG, Segment, SegmentPool, write_stream

__all__ = ["SEALS", "main", "measure", "seal", "sealing_available"]

#: Seals a server requires before it maps a writer's memfd.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
WAYS = ("copy pooled", "copy fresh", "sealed", "sealed ahead")
#: Timed parts; ``pass`` (send + recv), ``writer``, ``server`` and ``put`` are their sums.
_TIMED = ("ahead", "write", "seal", "send", "recv", "hold", "touch", "release")
#: Reported parts.
PARTS = (
    "ahead",
    "writer",
    "seal",
    "pass",
    "server",
    "touch",
    "release",
    "put",
    "put+touch",
    "work",
)


def sealing_available() -> str | None:
    """Why memfd sealing cannot be used here, or None where it can."""
    if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
        return "os.memfd_create or fcntl.F_ADD_SEALS missing (memfd sealing is Linux only)"
    try:
        fd = os.memfd_create("flightq-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        return f"memfd_create(MFD_ALLOW_SEALING) failed: {e}"
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as e:
        return f"F_ADD_SEALS failed: {e}"
    finally:
        os.close(fd)
    return None


class _MemfdPool(SegmentPool):
    """flightq's segment writer, each put written into a fresh memfd that may be sealed:
    made when the put needs it, or made ahead (:meth:`prepare`)."""

    def __post_init__(self) -> None:
        self.last: Segment | None = None  # no files in a directory: nothing to sweep
        self.ready: Segment | None = None

    def prepare(self, n: int) -> None:
        """Make the next put's memfd now (of exactly ``n`` bytes of data, prefaulted)."""
        self.ready = self._fresh(n)

    def room(self, n: int, what: str) -> Segment:
        seg, self.ready = self.ready, None
        if seg is None or seg.capacity != n:
            if seg is not None:
                seg.close()
            seg = self._fresh(n)
        self.last = seg
        return seg

    @staticmethod
    def _fresh(n: int) -> Segment:
        fd = os.memfd_create("flightq-put", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER + n)
            mm = mmap.mmap(fd, HEADER + n, flags=mmap.MAP_SHARED | MAP_POPULATE_FLAG)
        except BaseException:
            os.close(fd)
            raise
        return Segment(f"memfd:{fd}", fd, mm, n)

    def drop(self, seg: Segment) -> None:
        seg.close()


def seal(seg: Segment) -> None:
    """Unmap the writer's segment and seal it: no one may shrink, grow or write it again.

    Raises
    ------
    OSError
        ``EBUSY`` if a writable shared mapping of it still exists.
    """
    seg.mm.close()
    fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, SEALS)


def _received(sock: socket.socket, what: str) -> tuple[int, dict[str, Any]]:
    msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"{what}: expected one descriptor with the reference, got {len(fds)}")
    return fds[0], json.loads(msg)


def _map_sealed(fd: int, ref: dict[str, Any], what: str) -> np.ndarray:
    """The server's side of a sealed put: check the seals, the file and its header, then
    map it read-only. The mapping is not prefaulted: its first reader pays the faults."""
    gen, n = ref["gen"], ref["nbytes"]
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise ProtocolError(f"{what}: memfd seals {seals:#x}, expected at least {SEALS:#x}")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER + n:
        raise ProtocolError(f"{what}: memfd of {st.st_size} bytes, {HEADER + n} announced")
    mapping._check_header(os.pread(fd, mapping.HEADER_FORMAT.size, 0), "memfd", gen, n, what)
    body = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=HEADER)
    return np.frombuffer(body, dtype=np.uint8)


def _touch(data: np.ndarray) -> int:
    return int(data[:: mmap.PAGESIZE].sum())


def _rows(data: np.ndarray, what: str) -> int:
    return sum(b.num_rows for b in mapping._stream(data, what))


class _Timer:
    def __init__(self) -> None:
        self.t: dict[str, float] = dict.fromkeys(_TIMED, 0.0)

    def __call__(self, part: str, f: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        out = f(*args)
        self.t[part] += time.perf_counter() - t
        return out


def _one(
    way: str,
    step: workloads.Step,
    schema: Any,
    pools: dict[str, SegmentPool],
    dirs: dict[str, str],
    socks: tuple[socket.socket, socket.socket],
    check: np.ndarray | None,
) -> tuple[dict[str, float], np.ndarray | None]:
    """One put of ``step`` one way; returns its timings, and the bytes the writer wrote
    (when ``check`` is None, to compare the other ways' against)."""
    what = f"{way} put"
    timer = _Timer()
    gc.collect()
    with shm.gathering() as sink:
        batches = encode_chunks(
            schema, step.columns, step.keys, step.tags, max_bytes=shm.BATCH_BYTES, sink=sink
        )
        chunks = [c for b in batches for c in split_batch(b, shm.BATCH_BYTES)]
        pool = pools[way]
        if isinstance(pool, _MemfdPool) and way == "sealed ahead":
            size = pa.MockOutputStream()
            write_stream(size, chunks[0].schema, chunks)
            timer("ahead", pool.prepare, int(size.size()))
        ref = timer("write", pool.write, chunks[0].schema, chunks, what, sink)
    del batches, chunks
    if isinstance(pool, _MemfdPool):
        assert pool.last is not None
        seg, pool.last = pool.last, None
        wrote = None if check is not None else np.frombuffer(seg.mm, np.uint8)[HEADER:].copy()
        timer("seal", seal, seg)
        msg = json.dumps({"gen": ref["gen"], "nbytes": ref["nbytes"]}).encode()

        def send() -> None:
            socket.send_fds(socks[0], [msg], [seg.fd])
            os.close(seg.fd)  # the writer keeps nothing

        timer("send", send)
        fd, got = timer("recv", _received, socks[1], what)
        try:
            data = timer("hold", _map_sealed, fd, got, what)
        finally:
            os.close(fd)  # the mapping keeps the file
    else:
        wrote = None
        if check is None:
            seg = next(s for s in pool.segments() if s.path == ref["path"])
            wrote = np.frombuffer(seg.mm, np.uint8)[HEADER : HEADER + ref["nbytes"]].copy()
        data, _ = timer("hold", mapping.store_copy, ref, dirs[way], what)
        pool.release(ref)
    if _rows(data, what) != step.rows:
        raise AssertionError(f"{what}: the server holds other than {step.rows} rows")
    if check is not None and not np.array_equal(data, check):
        raise AssertionError(f"{what}: the server holds other bytes than the writer wrote")
    timer("touch", _touch, data)

    def release() -> None:
        nonlocal data
        del data  # the last view: its mapping, descriptor (and a fresh pool) go

    timer("release", release)
    t = timer.t
    t["pass"] = t["send"] + t["recv"]
    t["writer"] = t["write"] + t["seal"] + t["send"]
    t["server"] = t["recv"] + t["hold"]
    t["put"] = t["writer"] + t["server"]
    t["put+touch"] = t["put"] + t["touch"]
    t["work"] = t["put+touch"] + t["ahead"] + t["release"]
    return t, wrote


def _spread(ts: list[float]) -> float:
    q = statistics.quantiles(ts, n=4)
    med = statistics.median(ts)
    return (q[2] - q[0]) / med if med else 0.0


def measure(reps: int, small: bool = False) -> Iterator[dict[str, Any]]:
    """Per workload and way: median ms and spread of each part, and put ratios against
    ``copy pooled``."""
    steps = (
        (workloads.w1(groups=2), workloads.w2(groups=1))
        if small
        else (workloads.w1(), workloads.w2())
    )
    registry = SchemaRegistry.default()
    root = tempfile.mkdtemp(prefix="flightq-sealcost-", dir=shm.DEFAULT_DIR)
    dirs = {w: os.path.realpath(os.path.join(root, w.split()[1])) for w in WAYS[:2]}
    for d in dirs.values():
        os.mkdir(d)
    pools: dict[str, SegmentPool] = {w: SegmentPool(d) for w, d in dirs.items()}
    pools["sealed"] = _MemfdPool()
    pools["sealed ahead"] = _MemfdPool()
    # The server's pool of "copy pooled" lives across puts, as while a server holds rows.
    held = shm.STORES.hold(dirs["copy pooled"])
    socks = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for step in steps:
            schema = registry.get(step.schema)
            times: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
            check: np.ndarray | None = None
            for i in range(reps + 2):
                for way in WAYS:
                    t, wrote = _one(way, step, schema, pools, dirs, socks, check)
                    check = wrote if check is None else check
                    if i >= 2:  # two warm-up rounds: pools filled, pages faulted once
                        times[way].append(t)
            med = {
                w: {p: statistics.median(r[p] for r in ts) for p in PARTS}
                for w, ts in times.items()
            }
            row: dict[str, Any] = {
                "workload": step.name,
                "rows": step.rows,
                "segment MB": round(check.nbytes / 1e6, 1) if check is not None else None,
            }
            for w, ts in times.items():
                for p in PARTS:
                    if (p in ("seal", "pass") and "sealed" not in w) or (
                        p == "ahead" and w != "sealed ahead"
                    ):
                        continue
                    row[f"{w} {p} ms"] = round(med[w][p] * 1e3, 2)
                for p in ("put", "put+touch"):
                    row[f"{w} {p} spread"] = round(_spread([r[p] for r in ts]), 3)
            for w in WAYS[1:]:
                for p in ("put", "put+touch", "work"):
                    row[f"ratio {w}/copy pooled {p}"] = round(med[w][p] / med["copy pooled"][p], 3)
            yield row
    finally:
        for s in socks:
            s.close()
        for p in pools.values():
            p.close()
        shm.STORES.let_go(dirs["copy pooled"], held)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--small", action="store_true", help="shm_put_cost.py's smaller steps")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    reason = sealing_available()
    if reason is not None:
        print(f"memfd sealing unavailable: {reason}", file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):
        for row in measure(args.reps, args.small):
            print(json.dumps(row) if args.json else "  ".join(f"{k}: {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
