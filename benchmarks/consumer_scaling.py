"""Aggregate get throughput of 1, 2, 4, 8 consumer processes against one flightq server.

One ``flightq serve --port 0`` process on 127.0.0.1 holds a workload step (W2 by default:
no shared media, so every byte crosses the wire); with ``--shards N``, N such processes
hold it between them (rows routed by group, as :func:`flightq.connect_sharded` does), and
every consumer reads from all of them. Each consumer is its own process: it
connects, then gets every row of the step by key ``--gets`` times (every field, decoded
as numpy views), checking the first answer bit for bit against the seeded step outside the
timed part. The wall time from the moment all consumers are ready to the moment the last
one finishes gives the aggregate GB/s of logical payload; the ratio to one consumer,
measured in the same run, is printed. Timing decides nothing here.

``--raw-tcp`` adds the reference for one server process: a process that answers each
consumer's request with the step's bytes over loopback TCP (``sendall`` of one
prefaulted buffer, a thread per connection, as a Flight server serves each call on a
thread of its own), read by the same number of consumer processes into prefaulted
buffers, interleaved with flightq's rounds. Where raw TCP's own 8 consumers stay under
6x its one, no design over one process's sockets on that host reaches it.

``--shm`` is the same host's path: the step is put and read through shared memory
(``shm=True``), so each get maps the producer's pages instead of receiving them; each
consumer then copies every array once into a buffer of its own (the read a trainer's copy
to its device makes), so every byte is still read.

``--memcpy`` adds the same host's floor for that read, interleaved with flightq's rounds:
each consumer process maps a file of the step's size in ``/dev/shm`` (written once by the
parent) as flightq's reader maps a segment (private, page tables filled for reading) and
copies it into a prefaulted buffer of its own, then unmaps it, per get; a second table
does the same with the pages mapped on first touch, as a get maps a segment; a third
copies from a mapping made once, the memory bandwidth alone. Where eight such processes
stay under 6x one, no read that copies every byte on that host reaches it.

Each table also gives the host's TLB shootdown interrupts per GB moved while timed (from
``/proc/interrupts``): unmapping what a process read sends one to every other CPU running
a thread of it. ``--beside K`` starts K threads in each memcpy consumer that wake every
half millisecond, as a flightq consumer's gRPC threads do.

``--populate`` (with ``--shm``) adds flightq consumers whose gets fill the page tables of
the segments they map at once (:data:`flightq.shm.table.POPULATE_READS`), interleaved.

Run::

    .venv/bin/python benchmarks/consumer_scaling.py --consumers 1,2,4,8 --workload W2
    .venv/bin/python benchmarks/consumer_scaling.py --consumers 1,8 --shards 4 --reps 1
    .venv/bin/python benchmarks/consumer_scaling.py --consumers 1,8 --raw-tcp
    .venv/bin/python benchmarks/consumer_scaling.py --consumers 1,2,4,8 --shm --memcpy
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from flightq_bench import procs
from flightq_bench.flightq_system import server_argv

import flightq
from flightq import digest, workloads

__all__ = ["main", "measure", "measure_memcpy", "measure_tcp", "SharedFile", "TcpSender"]


def _connect(
    locations: Sequence[str], schema: Any, streams: int | None = None, shm: bool = False
) -> Any:
    """A client of the one server (through shared memory with ``shm``), or of every shard."""
    if len(locations) == 1:
        return flightq.connect(locations[0], [schema], timeout=300, get_streams=streams, shm=shm)
    return flightq.connect_sharded(locations, [schema], timeout=300, get_streams=streams)


def _fingerprint(value: Any) -> Any:
    """What a column holds, small enough to send to every consumer: dtype, shape and a
    BLAKE3 digest of each array, nested as the column nests its arrays."""
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return (data.dtype.str, data.shape, digest.digest_of(data))
    return [_fingerprint(v) for v in value]


def _same(got: Any, want: Any) -> bool:
    """Whether an answer's column matches a fingerprint, row by row where the step's
    column was a list (an answer may hold those rows as one array)."""
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    return bool(_fingerprint(np.asarray(got)) == want)


def _consumer(
    locations: list[str],
    schema: str,
    keys: list[str],
    want: dict[str, Any],
    gets: int,
    streams: int,
    shm: bool,
    populate: bool,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    if populate:
        import flightq.shm.table

        flightq.shm.table.POPULATE_READS = True
    with _connect(locations, schema, streams, shm) as c:
        b = c.get("p", keys, as_="numpy")  # one answer untimed, checked bit for bit
        for f, fp in want.items():
            assert _same(b[f], fp), f"answer differs from the step in field {f!r}"
        # Through shared memory a get maps the producer's pages and reads none of them:
        # there each consumer copies every array once into a buffer of its own, the read
        # a trainer's copy to its device makes.
        sink = np.ones(sum(a.nbytes for a in _arrays(b.to_dict())), np.uint8) if shm else None
        del b
        ready.put(os.getpid())
        go.wait()
        t0 = time.perf_counter()
        for _ in range(gets):
            got = c.get("p", keys, as_="numpy").to_dict()
            if sink is not None:
                at = 0
                for a in _arrays(got):
                    sink[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
                    at += a.nbytes
            del got
        out.put(time.perf_counter() - t0)


def _arrays(value: Any) -> Iterator[np.ndarray]:
    """Every array in an answer's columns, nested lists walked."""
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _arrays(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)


@functools.lru_cache(maxsize=2)
def _reference(name: str) -> tuple[str, list[str], dict[str, Any], int]:
    """The step's schema, keys, per-field fingerprints and payload bytes, made once: a
    consumer checks its first answer against the fingerprints instead of building the
    step again (W2 takes seconds to build, and 8 consumers would each hold a copy)."""
    step = workloads.make(name)
    want = {f: _fingerprint(v) for f, v in step.columns.items()}
    return step.schema, step.keys, want, step.nbytes()


def measure(
    locations: list[str],
    name: str,
    consumers: int,
    gets: int,
    streams: int = 1,
    shm: bool = False,
    populate: bool = False,
) -> float:
    """Aggregate GB/s of ``consumers`` processes each getting the step ``gets`` times from
    the servers at ``locations``, each get over at most ``streams`` parallel DoGet streams
    per server, or through shared memory (``shm``, one server; ``populate``: each get
    fills the page tables of what it maps at once, :data:`flightq.shm.table.POPULATE_READS`)."""
    schema, keys, want, nbytes = _reference(name)
    args = (locations, schema, keys, want, gets, streams, shm, populate)
    return _timed(_consumer, args, consumers, nbytes * gets)


def tlb_shootdowns() -> int | None:
    """TLB shootdown interrupts the host's CPUs have taken so far (the ``TLB:`` line of
    ``/proc/interrupts``); None where the kernel does not count them."""
    try:
        with open("/proc/interrupts") as f:
            for line in f:
                head, _, rest = line.partition(":")
                if head.strip() == "TLB":
                    return sum(int(x) for x in rest.split() if x.isdigit())
    except OSError:
        pass
    return None


#: TLB shootdowns per GB moved in the timed part of the last :func:`_timed` run (None:
#: not counted): a consumer's threads beside its copy each take one where it unmaps.
last_shootdowns: list[float | None] = [None]


def _timed(target: Any, args: tuple[Any, ...], consumers: int, nbytes: int) -> float:
    """GB/s of ``consumers`` processes running ``target(*args, ready, go, out)``, each
    moving ``nbytes``: from the moment all are ready to the moment the last one is done
    (its TLB shootdowns per GB in :data:`last_shootdowns`)."""
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=target, args=(*args, ready, go, out)) for _ in range(consumers)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)
        before = tlb_shootdowns()
        t0 = time.perf_counter()
        go.set()
        for _ in procs:
            out.get(timeout=600)
        wall = time.perf_counter() - t0
        after = tlb_shootdowns()
        moved = nbytes * consumers / 1e9
        last_shootdowns[0] = None if before is None or after is None else (after - before) / moved
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return nbytes * consumers / wall / 1e9


def _serve_tcp(listener: socket.socket, payload: memoryview) -> None:
    """Accept connections until the listener closes; on each, a thread that answers every
    one-byte request with ``payload``."""

    def serve(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1):
                conn.sendall(payload)

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _tcp_server(nbytes: int, port: Any, stop: Any) -> None:
    buf = np.ones(nbytes, dtype=np.uint8)  # every page touched before any request
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port.put(listener.getsockname()[1])
        threading.Thread(target=_serve_tcp, args=(listener, memoryview(buf)), daemon=True).start()
        stop.wait(3600)


class TcpSender:
    """The raw TCP reference's server: a process on 127.0.0.1 that sends ``nbytes`` for
    every one-byte request, on a thread per connection. A context manager."""

    def __init__(self, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.nbytes = nbytes
        self._stop = ctx.Event()
        port = ctx.Queue()
        self._proc = ctx.Process(target=_tcp_server, args=(nbytes, port, self._stop))
        self._proc.start()
        self.port = int(port.get(timeout=120))

    def __enter__(self) -> TcpSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _tcp_consumer(port: int, nbytes: int, gets: int, ready: Any, go: Any, out: Any) -> None:
    buf = np.zeros(nbytes, dtype=np.uint8)  # touched: no page faults while timed
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(b"g")  # one answer untimed, checked: the sender's bytes, every one
        _recv_all(sock, view)
        assert int(buf.min()) == 1, "raw TCP reference: bytes missing"
        ready.put(os.getpid())
        go.wait()
        t0 = time.perf_counter()
        for _ in range(gets):
            sock.sendall(b"g")
            _recv_all(sock, view)
        out.put(time.perf_counter() - t0)


def _recv_all(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"raw TCP reference: sender closed after {got} of {n} bytes")
        got += k


def measure_tcp(sender: TcpSender, consumers: int, gets: int) -> float:
    """Aggregate GB/s of ``consumers`` processes each reading ``sender``'s bytes ``gets``
    times, timed as :func:`measure` times flightq's consumers."""
    return _timed(
        _tcp_consumer, (sender.port, sender.nbytes, gets), consumers, sender.nbytes * gets
    )


class SharedFile:
    """The ``--memcpy`` reference's source: a file of ``nbytes`` ones in ``/dev/shm``,
    every page written, removed on exit. A context manager."""

    def __init__(self, nbytes: int, dirpath: str = "/dev/shm") -> None:
        self.nbytes = nbytes
        self.path = os.path.join(dirpath, f"flightq-bench-memcpy-{os.getpid()}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            with mmap.mmap(fd, nbytes) as mm:
                np.frombuffer(mm, np.uint8)[:] = 1
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    def __enter__(self) -> SharedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _map(fd: int, nbytes: int, populate: bool = True) -> mmap.mmap:
    """``fd`` mapped as flightq's reader maps a segment: private, writable; its page tables
    filled for reading (``populate``) or on first touch, as a get maps (see
    :mod:`flightq.shm.table`)."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if populate:
        with contextlib.suppress(OSError, AttributeError):
            mm.madvise(mmap.MADV_POPULATE_READ)  # type: ignore[attr-defined]
    return mm


def _memcpy_consumer(
    path: str, nbytes: int, gets: int, mode: str, beside: int, ready: Any, go: Any, out: Any
) -> None:
    sink = np.zeros(nbytes, np.uint8)  # touched: no page faults while timed
    fd = os.open(path, os.O_RDONLY)
    done = threading.Event()
    for _ in range(beside):  # threads that wake often, as a client's gRPC threads do
        threading.Thread(target=_wake_often, args=(done,), daemon=True).start()
    try:
        populate = mode != "lazy"
        kept = _map(fd, nbytes) if mode == "once" else None
        src = np.frombuffer(kept if kept is not None else _map(fd, nbytes, populate), np.uint8)
        np.copyto(sink, src)  # one copy untimed, checked
        assert int(sink.min()) == 1, "memcpy reference: bytes missing"
        del src
        ready.put(os.getpid())
        go.wait()
        t0 = time.perf_counter()
        for _ in range(gets):
            mm = kept if kept is not None else _map(fd, nbytes, populate)
            view = np.frombuffer(mm, np.uint8)
            np.copyto(sink, view)
            del view
            if kept is None:
                mm.close()
        out.put(time.perf_counter() - t0)
    finally:
        done.set()
        os.close(fd)


def _wake_often(done: threading.Event) -> None:
    while not done.wait(0.0005):
        pass


#: How a memcpy consumer maps the file: for each copy, page tables filled at the map
#: (``"populate"``) or on first touch (``"lazy"``, as a get maps); or once (``"once"``).
MEMCPY_MODES = ("populate", "lazy", "once")


def measure_memcpy(
    source: SharedFile, consumers: int, gets: int, mode: str = "populate", beside: int = 0
) -> float:
    """Aggregate GB/s of ``consumers`` processes each copying ``source`` into a buffer of
    their own ``gets`` times, mapped as ``mode`` says (:data:`MEMCPY_MODES`), timed as
    :func:`measure` times flightq's consumers; ``beside`` threads in each wake every half
    millisecond meanwhile."""
    if mode not in MEMCPY_MODES:
        raise ValueError(f"measure_memcpy: mode {mode!r} is not one of {MEMCPY_MODES}")
    args = (source.path, source.nbytes, gets, mode, beside)
    return _timed(_memcpy_consumer, args, consumers, source.nbytes * gets)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the curve and print one line per consumer count."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--consumers", default="1,2,4,8")
    p.add_argument("--workload", default="W2")
    p.add_argument("--gets", type=int, default=4, help="gets per consumer per round")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", type=int, default=1, help="DoGet streams per get (default 1)")
    p.add_argument("--shards", type=int, default=1, help="server processes holding the step")
    p.add_argument(
        "--shm",
        action="store_true",
        help="consumers get through shared memory (one server; same host), not the socket",
    )
    p.add_argument(
        "--raw-tcp",
        action="store_true",
        help="also time the raw TCP reference of one server process (see above)",
    )
    p.add_argument(
        "--memcpy",
        action="store_true",
        help="also time the same host's copy of every byte from a mapped file (see above)",
    )
    p.add_argument(
        "--beside",
        type=int,
        default=0,
        help="with --memcpy, threads in each memcpy consumer that wake every 0.5 ms",
    )
    p.add_argument(
        "--populate",
        action="store_true",
        help="with --shm, also flightq consumers whose gets fill the page tables at the map",
    )
    args = p.parse_args(argv)
    counts = [int(x) for x in args.consumers.split(",")]
    if args.shm and args.shards != 1:
        p.error("--shm takes one server (--shards 1)")
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(procs.ServerProcess(server_argv(), "flightq"))
            for _ in range(args.shards)
        ]
        locations = [s.info["listening"] for s in servers]
        step = workloads.make(args.workload)
        with _connect(locations, step.schema, shm=args.shm) as c:  # producer on the host
            c.create_partition("p", step.schema, tasks=["t"], group_size=step.group_size)
            c.put("p", step.keys, step.columns, step.tags)
        sender = stack.enter_context(TcpSender(step.nbytes())) if args.raw_tcp else None
        source = stack.enter_context(SharedFile(step.nbytes())) if args.memcpy else None
        results: dict[int, list[float]] = {n: [] for n in counts}
        populated: dict[int, list[float]] = {n: [] for n in counts}
        tcp: dict[int, list[float]] = {n: [] for n in counts}
        copies: dict[str, dict[int, list[float]]] = {
            m: {n: [] for n in counts} for m in MEMCPY_MODES
        }
        # Per table (by its dict's id) and consumer count: TLB shootdowns per GB.
        ipis: dict[tuple[int, int], list[float]] = {}

        def note(table: dict[int, list[float]], n: int, gbps: float) -> float:
            table[n].append(gbps)
            if last_shootdowns[0] is not None:
                ipis.setdefault((id(table), n), []).append(last_shootdowns[0])
            return gbps

        for rep in range(args.reps):  # interleave counts so load drifts hit all alike
            for n in counts:
                got = measure(locations, args.workload, n, args.gets, args.streams, args.shm)
                line = f"round {rep + 1}, {n} consumer(s): flightq {note(results, n, got):.2f} GB/s"
                if args.shm and args.populate:
                    got = measure(locations, args.workload, n, args.gets, args.streams, True, True)
                    line += f", populating {note(populated, n, got):.2f}"
                if sender is not None:
                    got = measure_tcp(sender, n, args.gets)
                    line += f", raw TCP {note(tcp, n, got):.2f} GB/s"
                if source is not None:
                    for m in MEMCPY_MODES:
                        got = measure_memcpy(source, n, args.gets, m, args.beside)
                        line += f", memcpy {m} {note(copies[m], n, got):.2f}"
                print(line, file=sys.stderr, flush=True)  # progress: a long run shows life
        print(
            f"{args.workload}: {step.nbytes() / 2**20:.0f} MiB per get, {args.streams} stream(s) "
            f"per get and server, {args.shards} server(s), {os.cpu_count()} CPUs"
            + (", gets through shared memory" if args.shm else "")
        )
        _table("flightq", counts, results, ipis)
        if args.shm and args.populate:
            _table("flightq, gets filling page tables at the map", counts, populated, ipis)
        if sender is not None:
            _table("raw TCP, one sender process", counts, tcp, ipis)
        if source is not None:
            _table("memcpy from /dev/shm, mapped for each get", counts, copies["populate"], ipis)
            _table(
                "memcpy from /dev/shm, mapped for each get, pages on first touch",
                counts,
                copies["lazy"],
                ipis,
            )
            _table("memcpy from /dev/shm, mapped once", counts, copies["once"], ipis)
    return 0


def _table(
    title: str,
    counts: list[int],
    results: dict[int, list[float]],
    ipis: dict[tuple[int, int], list[float]],
) -> None:
    """One table: per consumer count, GB/s (median, min-max), the host's TLB shootdowns
    per GB moved (median; "-" where not counted) and the ratio to the first count."""
    base = statistics.median(results[counts[0]])
    print(title)
    print(f"{'consumers':>9} {'GB/s median':>12} {'min-max':>15} {'TLB/GB':>9} {'x one':>7}")
    for n in counts:
        med = statistics.median(results[n])
        lo, hi = min(results[n]), max(results[n])
        tlb = ipis.get((id(results), n))
        shown = f"{statistics.median(tlb):>9.0f}" if tlb else f"{'-':>9}"
        print(f"{n:>9} {med:>12.2f} {lo:>7.2f}-{hi:<7.2f} {shown} {med / base:>7.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
