"""``flightq bench --device cuda --ranks 1,2,4,8``: trainer ranks claiming into their GPUs.

One ``flightq serve --port 0`` process on 127.0.0.1; ``max(counts)`` rank processes
(:mod:`flightq_bench.rank`, multiprocessing's spawn context), rank ``i`` on
``cuda:i % device_count`` (or the CPU with ``device="cpu"``), each first placed on its
GPU's NUMA node (:mod:`flightq.cuda.numa`; a no-op on a host with one node). For every
repetition and every count ``N`` (interleaved, so the ratios compare runs close in time),
the parent puts ``N x steps`` copies of the workload's step into a fresh partition
(untimed), warms ranks ``0..N-1`` with a get of one group each, then tells them to go:
each claims whole groups for task ``train`` into its device and acks them, until nothing
is ready. The figure is the bytes that cross to the devices (a group's image once)
over the wall time from the go to the last rank's last ack, aggregate and as a ratio
to one rank in the same repetition. The server's CPU seconds over the drain
(``/proc/<pid>/stat``) are reported per GB. Every repetition checks that the ranks'
keys are all the keys, each once: a row lost or claimed twice fails the run.

The limit, with ``device="cuda"``: one non-blocking copy of one rank's bytes from a
pinned buffer to each GPU in use (the ``h2d-pinned`` system's measurement), times
``min(N, device_count)``.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any

from flightq import workloads

from . import procs
from .flightq_system import server_argv
from .rank import rank_main
from .stats import fmt_spread, paired_ratio, summary

__all__ = ["run_ranks", "markdown", "h2d_pinned_gbps"]

_TIMEOUT = 300.0


def _copies(step: workloads.Step, n: int) -> list[workloads.Step]:
    """``n`` copies of ``step`` under keys of their own (``s<j>_<key>``)."""
    return [
        workloads.Step(
            step.name,
            step.schema,
            [f"s{j}_{k}" for k in step.keys],
            step.columns,
            step.tags,
            step.group_size,
        )
        for j in range(n)
    ]


def h2d_pinned_gbps(nbytes: int, index: int, reps: int = 5) -> float:
    """Median GB/s of one non-blocking copy of ``nbytes`` from pinned memory to
    ``cuda:index`` (synchronised), as the ``h2d-pinned`` system times it."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    ts = []
    for i in range(reps + 1):
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(index)
        if i:  # the first is a warm-up
            ts.append(time.perf_counter() - t)
    ts.sort()
    return nbytes / ts[len(ts) // 2] / 1e9


def _ask(conns: Sequence[Any], msg: Any, timeout: float) -> list[Any]:
    for c in conns:
        c.send(msg)
    out = []
    for c in conns:
        if not c.poll(timeout):
            raise RuntimeError(f"a rank did not answer {msg[0]!r} within {timeout:.0f}s")
        out.append(c.recv())
    return out


def _verify(reports: list[dict[str, Any]], want: set[str], label: str) -> None:
    seen = collections.Counter(k for r in reports for k in r["keys"])
    twice = sorted(k for k, n in seen.items() if n > 1)
    lost = sorted(want - set(seen))
    extra = sorted(set(seen) - want)
    if twice or lost or extra:
        raise AssertionError(
            f"{label}: {len(lost)} row(s) lost (e.g. {lost[:3]}), {len(twice)} claimed twice "
            f"(e.g. {twice[:3]}), {len(extra)} not put (e.g. {extra[:3]})"
        )


def run_ranks(
    counts: Sequence[int],
    *,
    workload: str = "W1",
    device: str = "cuda",
    reps: int = 3,
    steps: int = 4,
    groups_per_claim: int = 1,
    seed: int = 0,
    numa: bool = True,
    sysfs: str = "/sys",
    pci: Sequence[str] = (),
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Measure ``counts`` ranks draining ``N x steps`` copies of ``workload``.

    Parameters
    ----------
    counts:
        Rank counts; 1 is added (and measured first) where missing, as the reference.
    device:
        ``cuda`` (rank i on ``cuda:i % device_count``) or ``cpu`` (numpy claims: the
        orchestration, checks and placement without a GPU).
    steps:
        Copies of the step each rank drains on average.
    numa, sysfs, pci:
        Place each rank on its GPU's NUMA node read from the sysfs tree ``sysfs``; ``pci``
        gives the GPUs' PCI addresses (rank i takes ``pci[i % len]``) instead of torch's.

    Returns
    -------
    dict
        ``rows`` (one per count: GB/s, ratio to one rank, server CPU s/GB, limit),
        ``placements`` (per rank), ``h2d_gbps`` (per GPU index in use) and the settings.
    """
    counts = sorted({1, *counts})
    step = workloads.make(workload, seed)
    nbytes = step.nbytes(distinct_media=True)
    ndev = 0
    if device == "cuda":
        import torch

        ndev = torch.cuda.device_count()
    top = max(counts)
    batch = step.group_size * groups_per_claim
    h2d: dict[int, float] = {}
    if ndev:
        for i in sorted({r % ndev for r in range(top)}):
            h2d[i] = h2d_pinned_gbps(nbytes * steps, i)
            progress(f"h2d-pinned cuda:{i}: {h2d[i]:.1f} GB/s ({nbytes * steps / 1e6:.0f} MB)")
    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    ctx = mp.get_context("spawn")
    with procs.ServerProcess(server_argv(), "flightq") as srv:
        location = srv.info["listening"]
        cfg = {
            "location": location,
            "schema": step.schema,
            "device": device,
            "batch": batch,
            "timeout": _TIMEOUT,
            "numa": numa,
            "sysfs": sysfs,
            "pci": list(pci),
        }
        pipes = [ctx.Pipe() for _ in range(top)]
        ranks = [
            ctx.Process(target=rank_main, args=(i, cfg, pipes[i][1]), name=f"rank-{i}")
            for i in range(top)
        ]
        for p in ranks:
            p.start()
        conns = [a for a, _ in pipes]
        try:
            placements = [m[1] for m in _gather(conns, _TIMEOUT)]
            import flightq

            with flightq.connect(location, [step.schema], timeout=_TIMEOUT) as client:
                for rep in range(reps):
                    for n in counts:
                        samples[n].append(
                            _drain(client, srv, conns[:n], step, n * steps, f"ranks-{n}-{rep}")
                        )
                        s = samples[n][-1]
                        progress(
                            f"{workload} ranks={n} rep {rep + 1}/{reps}: {s['gbps']:.2f} GB/s, "
                            f"server {s['server_cpu_s_per_gb']:.2f} CPU s/GB"
                        )
            for conn in conns:
                conn.send(None)
            for p in ranks:
                p.join(timeout=30)
        finally:
            procs.end_processes([p.pid for p in ranks if p.pid is not None and p.is_alive()])
    one = [s["gbps"] for s in samples[1]]
    rows = []
    for n in counts:
        g = [s["gbps"] for s in samples[n]]
        used = min(n, ndev) if ndev else 0
        limit = sum(h2d[i % ndev] for i in range(used)) if ndev else None
        rows.append(
            {
                "ranks": n,
                "gpus": used,
                "gbps": summary(g),
                "vs_one": paired_ratio(g, one),
                "server_cpu_s_per_gb": summary([s["server_cpu_s_per_gb"] for s in samples[n]]),
                "limit_gbps": limit,
                "claims": samples[n][-1]["claims"],
                "bytes": samples[n][-1]["bytes"],
                "pinned_held_max": max((s["pinned_max"] or 0) for s in samples[n]) or None,
            }
        )
    return {
        "workload": workload,
        "device": device,
        "devices": ndev,
        "steps_per_rank": steps,
        "rows_per_claim": batch,
        "reps": reps,
        "step_bytes": nbytes,
        "h2d_gbps": h2d,
        "placements": placements,
        "rows": rows,
        "machine": procs.machine_info(),
    }


def _gather(conns: Sequence[Any], timeout: float) -> list[Any]:
    out = []
    for c in conns:
        if not c.poll(timeout):
            raise RuntimeError(f"a rank did not start within {timeout:.0f}s")
        out.append(c.recv())
    return out


def _drain(
    c: Any, srv: Any, conns: Sequence[Any], step: workloads.Step, copies: int, partition: str
) -> dict[str, Any]:
    """One repetition: put ``copies`` steps, warm the ranks, time their drain."""
    c.create_partition(partition, schema=step.schema, tasks=["train"], group_size=step.group_size)
    # bf16 pixels are uint16 bit patterns in the generated step: put them as torch.bfloat16.
    put = workloads.to_torch(step) if "bf16" in step.schema else step
    try:
        want: set[str] = set()
        for s in _copies(put, copies):
            c.put(partition, s.keys, s.columns, tags=s.tags)
            want.update(s.keys)
        warm = step.keys[: step.group_size]
        _ask(conns, ("prep", partition, [f"s0_{k}" for k in warm]), _TIMEOUT)
        pids = srv.pids
        cpu0 = sum(procs.cpu_seconds(p) for p in pids)
        t0 = time.monotonic()
        reports = _ask(conns, ("go", partition), _TIMEOUT)
        cpu = sum(procs.cpu_seconds(p) for p in pids) - cpu0
    finally:
        c.drop(partition)
    _verify(reports, want, f"{len(conns)} rank(s), {partition}")
    wall = max(r["end"] for r in reports) - t0
    total = step.nbytes(distinct_media=True) * copies
    return {
        "wall_s": wall,
        "bytes": total,
        "gbps": total / wall / 1e9,
        "server_cpu_s": cpu,
        "server_cpu_s_per_gb": cpu / (total / 1e9),
        "claims": sum(r["claims"] for r in reports),
        "pinned_max": max((r["pinned"] or 0) for r in reports) or None,
    }


def markdown(docs: Sequence[dict[str, Any]], command: str) -> str:
    """The ranks tables, one per workload, and where each rank was placed."""
    lines = [f"`{command}`", ""]
    for d in docs:
        lines += [
            f"### {d['workload']}, device {d['device']} ({d['devices']} GPU(s)), "
            f"{d['steps_per_rank']} step(s) per rank, {d['rows_per_claim']} rows per claim, "
            f"{d['reps']} repetitions; bytes that cross to the device, a group's image once",
            "",
            "| ranks | GPUs | aggregate GB/s | vs 1 rank | server CPU s/GB | limit GB/s "
            "(pinned H2D) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in d["rows"]:
            limit = "-" if r["limit_gbps"] is None else f"{r['limit_gbps']:.1f}"
            lines.append(
                f"| {r['ranks']} | {r['gpus']} | {fmt_spread(r['gbps'])} | "
                f"{fmt_spread(r['vs_one'], 2, 'x')} | "
                f"{fmt_spread(r['server_cpu_s_per_gb'])} | {limit} |"
            )
        lines.append("")
        placed = sorted(
            {(p["device"], p.get("node"), p["applied"], p["reason"]) for p in d["placements"]},
            key=str,
        )
        for dev, node, applied, reason in placed:
            lines.append(
                f"- {dev}: NUMA node {node}, "
                + ("ranks pinned to its CPUs" if applied else f"not pinned ({reason})")
            )
        lines.append("")
    return "\n".join(lines)
