"""Where a get into CUDA tensors spends, against the CPU get of the same rows.

A client in this process puts a workload step (W1 and W1-bf16 by default) once to a
``flightq serve`` process on 127.0.0.1, then, in interleaved rounds, gets every row to the
CPU and to ``cuda:0`` (``Client.get(..., device=)``), both split over the streams the
client chooses for that size. Beside the two gets it times the parts of the CUDA get on
the answer of one read:

- ``read``: the streams read to their end, each on its own thread (no decode);
- ``read+check``: the same, each record batch checked on its stream's thread as it
  arrives, by the CUDA get's own step;
- ``check``: the record batches checked after the read, on one thread;
- ``plan``: where every column lands in the get's device buffer (``_plan``);
- ``host copy``: the payloads copied into a pinned buffer (``_windows`` and ``_copy``);
- ``to device``: that buffer's copy to the device, waited for;
- ``pageable``: the payloads copied to the device straight from the received buffers
  (pageable memory), one copy per piece, waited for: the route without pinned memory;
- ``registered``: the same from the received buffers page-locked where they lie
  (``cudaHostRegister`` of their pages, unregistered after the copies).

Both gets end once every field's per-row tensors are built (``batch[field]``), as in
``flightq bench``; ``get cpu, no rows`` and ``get cuda, no rows`` are the gets alone.
``--copy-threads 4,8`` runs every workload once per count of pinned-copy threads (each
given at least 16 MiB / count), in that order; ``--min-stream-mib 4`` splits the gets
over more streams than the client's default (:data:`flightq.client.streams.MIN_STREAM_BYTES`).

Medians in milliseconds over ``--rounds`` (the first ``--warmup`` dropped), with the
spread, and the CUDA get's speed as a ratio of the CPU get's, paired per round, and of
the floor of a get that copies once the stream ended (the CPU get, the host copy and
the copy to the device, summed per round). It runs
with whichever ``flightq`` is first on ``sys.path``, so two trees compare on one host::

    python benchmarks/cuda_get.py --rounds 30
    PYTHONPATH=/path/to/old/tree python benchmarks/cuda_get.py --rounds 30

``--device cpu`` runs the parts that need no device (the CPU get, the reads, the checks,
the plan and the host copy into ordinary memory): a check of the script, and the host
side's cost. Needs torch; without a CUDA device it says so and exits 2 unless
``--device cpu``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main", "measure"]


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` side by side (the first on this thread); their results in order."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        out[i] = fns[i]()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(1, len(fns))]
    for t in ts:
        t.start()
    run(0)
    for t in ts:
        t.join()
    return out


def measure(
    location: str,
    workload: str,
    rounds: int,
    warmup: int,
    device: str = "cuda:0",
    min_stream_bytes: int | None = None,
) -> dict[str, list[float]]:
    """Per round, milliseconds of each part (see the module's doc); ``min_stream_bytes``
    sets the client's fewest bytes per stream (None: its default)."""
    import torch

    import flightq
    from flightq.client.streams import split, split_count
    from flightq.cuda import get as cuda_get
    from flightq.protocol import GetTicket
    from flightq.workloads import make, to_torch

    step = to_torch(make(workload))
    on_cuda = device.startswith("cuda")
    out: dict[str, list[float]] = {}
    with flightq.connect(location, schemas=[step.schema]) as client:
        part = f"cuda-get-{workload}"
        client.create_partition(part, schema=step.schema, tasks=["train"])
        client.put(part, step.keys, step.columns, tags=step.tags)
        if min_stream_bytes is not None:
            client.min_stream_bytes = min_stream_bytes
        client.get(part, step.keys)  # the client learns the rows' size: the get splits
        reader = client._reader
        ticket = GetTicket(partition=part, keys=list(step.keys), fields=None)
        n = split_count(reader, ticket)
        tickets = split(ticket, n) if n > 1 else [ticket]
        what = f"get from {part!r}"
        pool = reader.pinned
        dev = torch.device(device)

        def stream(i: int, check: bool) -> Any:
            rbs = reader.transport.get(tickets[i], what, timeout=None, connection=i)
            # With the checks: each record batch as it arrives, as the CUDA get does.
            return cuda_get._validated(rbs, False) if check else list(rbs)

        state: dict[str, Any] = {}

        def read() -> None:
            state["rbs"] = _threads([functools.partial(stream, i, False) for i in range(n)])

        def read_check() -> None:
            _threads([functools.partial(stream, i, True) for i in range(n)])

        def check() -> None:
            state["parts"] = [p for r in state["rbs"] for p in cuda_get._validated(r, False)]

        def plan() -> None:
            state["plan"] = cuda_get._plan(state["parts"])

        def host_copy() -> None:
            regions, total = state["plan"]
            size = max(total, 1)
            buf = pool.take(size) if on_cuda else torch.empty(size, dtype=torch.uint8)
            for start, _, copies in cuda_get._windows(regions, total):
                cuda_get._copy(copies, buf[start:].numpy(), lambda: None)
            state["buf"] = buf

        def to_device() -> None:
            buf = state.pop("buf")
            side = pool.stream(dev)
            total = max(state["plan"][1], 1)  # the pool's buffer may be larger
            with torch.cuda.stream(side):
                d = torch.empty(total, dtype=torch.uint8, device=dev)
                d.copy_(buf[:total], non_blocking=True)
            side.synchronize()
            pool.give(buf, [])

        def pageable() -> None:
            # Every piece copied to the device from where it lies on the host (the received
            # buffers), waited for.
            regions, total = state["plan"]
            d = torch.empty(max(total, 1), dtype=torch.uint8, device=dev)
            for r in regions:
                src = torch.from_numpy(r.source())
                for a, nb, to in r.pieces:
                    d[to : to + nb].copy_(src[a : a + nb], non_blocking=True)
            torch.cuda.synchronize(dev)

        def registered() -> None:
            # Page-lock the received buffers where they lie (cudaHostRegister, the spans
            # merged by page), copy each piece from them, unlock.
            regions = state["plan"][0]
            page = 4096
            spans: list[list[int]] = []
            for r in regions:
                if r.pieces:
                    a = r.base.data_ptr()
                    spans.append([a // page * page, -(-(a + r.base.nbytes) // page) * page])
            spans.sort()
            merged: list[list[int]] = []
            for sp in spans:
                if merged and sp[0] <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], sp[1])
                else:
                    merged.append(sp)
            rt = torch.cuda.cudart()
            done: list[int] = []
            try:
                for a, b in merged:
                    err = rt.cudaHostRegister(a, b - a, 0)
                    if int(err) != 0:
                        raise RuntimeError(f"cudaHostRegister of {b - a} bytes: {err}")
                    done.append(a)
                pageable()  # now from page-locked memory
            finally:
                for a in done:
                    rt.cudaHostUnregister(a)

        def with_rows(batch: Any) -> Any:
            {f: batch[f] for f in batch.fields}  # every field's per-row tensors, as the bench
            return batch

        parts: dict[str, Callable[[], Any]] = {
            "get cpu": lambda: with_rows(client.get(part, step.keys)),
            "get cpu, no rows": lambda: client.get(part, step.keys),
            "read": read,
            "read+check": read_check,
            "check": check,
            "plan": plan,
            "host copy": host_copy,
        }
        if on_cuda:
            parts["to device"] = to_device
            parts["pageable"] = pageable
            parts["registered"] = registered
            parts["get cuda"] = lambda: with_rows(client.get(part, step.keys, device=device))
            parts["get cuda, no rows"] = lambda: client.get(part, step.keys, device=device)
        for r in range(rounds + warmup):
            for name, fn in list(parts.items()):
                if on_cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                try:
                    got = fn()
                except Exception as e:  # a route this host refuses: say so, drop it
                    if name.startswith("get") or name in ("read", "check", "plan"):
                        raise
                    print(f"  {name}: failed, left out: {e!r}")
                    del parts[name]
                    continue
                dt = (time.perf_counter() - t0) * 1e3
                if name.startswith("get") and r == 0 and not name.endswith("rows"):
                    assert len(got) == len(step.keys), (name, len(got))
                if r >= warmup:
                    out.setdefault(name, []).append(dt)
        out["streams"] = [float(n)]
        out["device bytes"] = [float(state["plan"][1])]
        client.drop(part)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W1-bf16")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--device", default="cuda:0", help="cpu: the parts that need no device (checks the script)"
    )
    p.add_argument("--copy-threads", default="", help="counts of pinned-copy threads to try")
    p.add_argument(
        "--min-stream-mib", type=float, default=None, help="the client's fewest MiB per stream"
    )
    args = p.parse_args(argv)
    from flightq_bench import procs
    from flightq_bench.flightq_system import server_argv, usable_torch

    torch = usable_torch("cuda_get", args.device)
    if torch is None:
        return 2
    on_cuda = args.device.startswith("cuda")
    with procs.ServerProcess(server_argv(), "flightq") as srv:
        from flightq.cuda import get as fq_get

        mib = args.min_stream_mib
        min_stream = None if mib is None else int(mib * 2**20)
        counts = [int(x) for x in args.copy_threads.split(",") if x] or [fq_get._COPY_THREADS]
        for w, k in ((w, k) for k in counts for w in args.workloads.split(",")):
            fq_get._COPY_THREADS, fq_get._THREAD_BYTES = k, 16 * 2**20 // k
            if hasattr(fq_get, "_copiers_of"):
                fq_get._copiers_of = None  # made again with k threads
            t = measure(srv.info["listening"], w, args.rounds, args.warmup, args.device, min_stream)
            n, nbytes = int(t.pop("streams")[0]), t.pop("device bytes")[0]
            print(f"{w}: {n} streams, {nbytes / 2**20:.1f} MiB to the device, {k} copy threads")
            print("  ms, median")
            print(f"  [min-max] of {args.rounds} rounds")
            for name, xs in t.items():
                print(f"  {name:17s} {_spread(xs)}")
            if on_cuda:
                ratio = [c / g for c, g in zip(t["get cpu"], t["get cuda"], strict=True)]
                print(f"  CUDA get's speed / CPU get's: {_spread(ratio)}x")
                if "host copy" in t and "to device" in t:
                    # The floor of a get that copies after the stream: the CPU get, then
                    # the distinct bytes once into pinned memory and once across.
                    parts = zip(t["get cpu"], t["host copy"], t["to device"], strict=True)
                    floor = [c + h + d for c, h, d in parts]
                    at = [f / g for f, g in zip(floor, t["get cuda"], strict=True)]
                    print(f"  CPU get + host copy + to device: {_spread(floor)} ms")
                    print(f"  CUDA get's speed / that floor's: {_spread(at)}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
