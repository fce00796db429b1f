"""Run the workloads across the systems: servers, producer and consumer processes, cycles.

For each workload both worker processes generate the step from the seed; each system's
two halves are set up, the processes' listening sockets are checked to be on loopback,
one untimed warm-up cycle runs, then repetitions interleave the systems (the order
rotates each repetition). A cycle is put, then get, then (untimed) verify, release and
clear. W4 runs blocks of pings instead of repetitions. Every loop is bounded in count and
in time.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import payload, procs, summarize
from .systems import System, missing_module, resolve, server_for
from .worker import Worker

__all__ = ["Options", "run", "ALL_WORKLOADS"]

ALL_WORKLOADS = ("W1", "W1-bf16", "W2", "W3", "W4", "W5", "W5-copies")


@dataclass
class Options:
    """What a run measures.

    Attributes
    ----------
    workloads, systems:
        Names to run (systems: all when None).
    quick:
        Reduced rows (see :data:`flightq_bench.payload.QUICK_SIZES`), fewer repetitions.
    reps:
        Timed repetitions per system and workload (W4: blocks of pings).
    pings:
        W4 round trips per system.
    budget_s:
        Wall-clock cap on the timed repetitions of one workload.
    command:
        The command line, recorded in the output.
    device:
        ``cpu``, or ``cuda`` to add flightq into and out of CUDA memory and the pinned
        host-to-device copy (see :data:`flightq_bench.systems.CUDA_SYSTEMS`).
    """

    workloads: list[str]
    systems: list[str] | None = None
    quick: bool = False
    reps: int = 5
    pings: int = 1000
    seed: int = 0
    budget_s: float = 240.0
    command: str = "flightq bench"
    progress: Callable[[str], None] = print
    call_timeout: float = 300.0
    device: str = "cpu"
    #: Where the processes run when not all on loopback: a :class:`Placement`.
    place: Placement | None = None


@dataclass(frozen=True)
class Placement:
    """Processes on two hosts of a :class:`flightq_bench.hosts.Testbed`: the producer
    and consumer workers on ``client``, the servers (and the receiving end of the direct
    systems) on ``server``. ``meter(host)`` returns that host's (received, sent) bytes so
    far; ``rate_bps`` is the link's rate."""

    client_ns: str
    server_ns: str
    server_address: str
    network: str
    rate_bps: int
    meter: Callable[[], tuple[int, int]]


@dataclass
class _Active:
    system: System
    info: dict[str, Any] = field(default_factory=dict)
    server_pids: list[int] = field(default_factory=list)
    error: str = ""


def _server_pids(system: System, server: procs.ServerProcess) -> list[int]:
    if not system.server_procs:
        return [server.proc.pid] if server.proc else []
    return [p for p in server.pids if any(s in procs.cmdline(p) for s in system.server_procs)]


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark; returns the results document (see :mod:`flightq_bench.report`)."""
    say = opts.progress
    run_id = secrets.token_hex(3)
    chosen = resolve(opts.systems, opts.device)
    doc: dict[str, Any] = {
        "flightq_bench": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": opts.command,
        "machine": procs.machine_info(),
        "mode": "quick" if opts.quick else "full",
        "size_notes": payload.describe_sizes(opts.quick),
        "repetitions": opts.reps,
        "pings": opts.pings,
        "seed": opts.seed,
        "device": opts.device,
        "systems": {},
        "workloads": {},
    }
    active: list[_Active] = []
    for s in chosen:
        entry: dict[str, Any] = {"kind": s.kind, "note": s.note}
        miss = missing_module(s)
        if miss:
            entry["status"] = "skipped (not installed)"
            entry["reason"] = f"module {miss!r} is not importable; pip install 'flightq[peers]'"
            say(f"{s.name:14} skipped (not installed): {miss}")
        else:
            entry["status"] = "measured"
            active.append(_Active(s))
        doc["systems"][s.name] = entry

    with contextlib.ExitStack() as stack:
        servers: dict[str, procs.ServerProcess] = {}
        want_tq = any(a.system.name == "transferqueue" for a in active)
        for key in dict.fromkeys(a.system.server for a in active if a.system.server):
            t = time.monotonic()
            try:
                where = {}
                if opts.place:
                    where = {"host": opts.place.server_address, "netns": opts.place.server_ns}
                servers[key] = stack.enter_context(server_for(key, want_tq, **where))
                say(f"server {key:10} up in {time.monotonic() - t:.1f}s: {servers[key].info}")
            except Exception as e:
                for a in active:
                    if a.system.server == key:
                        a.error = f"server did not start: {e}"
                say(f"server {key:10} FAILED: {e}")
        for a in active:
            if a.system.server in servers:
                srv = servers[a.system.server]
                loc = srv.info.get("listening")
                a.info = {"run": run_id, **srv.info, "location": loc}
            else:
                a.info = {"run": run_id}
            if opts.place:
                a.info["bind"] = opts.place.server_address
            if a.error:
                doc["systems"][a.system.name]["status"] = f"failed: {a.error}"
        runnable = [a for a in active if not a.error]
        place = opts.place
        on = {"netns": place.client_ns} if place else {}
        producer = stack.enter_context(Worker("producer", opts.call_timeout, **on))
        consumer = stack.enter_context(Worker("consumer", opts.call_timeout, **on))
        # Across hosts, the direct systems' receiving end sits on the server's host.
        receiver = None
        if place:
            receiver = stack.enter_context(
                Worker("receiver", opts.call_timeout, netns=place.server_ns)
            )
        ctx = _Ctx(opts, producer, consumer, servers, receiver)
        for name in opts.workloads:
            doc["workloads"][name] = ctx.workload(name, runnable)
        doc["listeners"] = ctx.listeners
    return doc


class _Ctx:
    """The state of one run: options, the two workers, the servers."""

    def __init__(
        self,
        opts: Options,
        producer: Worker,
        consumer: Worker,
        servers: dict[str, procs.ServerProcess],
        receiver: Worker | None = None,
    ) -> None:
        self.opts = opts
        self.p = producer
        self.c = consumer
        self.rx = receiver
        self.servers = servers
        self.listeners: list[dict[str, Any]] = []

    def _pids(self) -> list[int]:
        me = os.getpid()
        out = {me, *procs.descendants(me)}
        for srv in self.servers.values():
            out.update(srv.pids)
        return sorted(out)

    def _check_loopback(self) -> None:
        place = self.opts.place
        found = procs.check_loopback(self._pids(), place.network if place else None)
        self.listeners = [
            {"pid": x.pid, "proto": x.proto, "address": x.address, "port": x.port} for x in found
        ]

    def workload(self, name: str, runnable: list[_Active]) -> dict[str, Any]:
        opts, say = self.opts, self.opts.progress
        t = time.monotonic()
        for w in self._workers():
            w.send("load", workload=name, seed=opts.seed, quick=opts.quick)
        loaded = self.p.recv()
        for w in self._workers()[1:]:
            w.recv()
        nbytes = int(loaded["nbytes"])
        note = payload.describe_sizes(opts.quick).get(name, "full size")
        say(
            f"{name}: {loaded['rows']} rows, {nbytes / 1e6:.1f} MB logical ({note}); "
            f"generated in {time.monotonic() - t:.1f}s"
        )
        out: dict[str, Any] = {"rows": loaded["rows"], "nbytes": nbytes, "size": note}
        samples: dict[str, list[dict[str, Any]]] = {}
        errors: dict[str, str] = {}
        live: list[_Active] = []
        try:
            for a in runnable:
                try:
                    self._setup(a)
                    live.append(a)
                except Exception as e:
                    errors[a.system.name] = f"setup failed: {e}"
            self._check_loopback()
            for a in list(live):
                try:
                    self._cycle(a, verify=True)  # warm-up, untimed, verified
                except Exception as e:
                    errors[a.system.name] = f"warm-up failed: {e}"
                    live.remove(a)
            samples = self._repeat(name, live, errors)
        finally:
            for a in runnable:
                for w in self._workers()[::-1]:
                    with contextlib.suppress(Exception):
                        w.call("teardown", system=a.system.name, timeout=60)
        out["results"] = summarize.results(name, nbytes, runnable, samples, errors)
        out["ratios"] = summarize.ratios(name, samples, nbytes)
        for a in runnable:
            say(summarize.progress_line(name, a.system.name, out["results"][a.system.name]))
        if out["ratios"].get("cuda"):
            say(summarize.cuda_line(name, out["ratios"]["cuda"], out["results"]))
        return out

    def _workers(self) -> list[Worker]:
        return [self.p, self.c] + ([self.rx] if self.rx else [])

    def _consumer(self, s: System) -> Worker:
        return self.rx if self.rx is not None and s.kind == "direct" else self.c

    def _setup(self, a: _Active) -> None:
        s = a.system
        info = dict(a.info)
        c = self._consumer(s)
        info.update(c.call("setup", system=s.name, path=s.consumer, info=info) or {})
        if s.producer:
            self.p.call("setup", system=s.name, path=s.producer, info=info)
        c.call("call", system=s.name, method="ready")
        if s.producer:
            self.p.call("call", system=s.name, method="ready")
        if s.server:
            a.server_pids = _server_pids(s, self.servers[s.server])

    def _repeat(
        self, name: str, live: list[_Active], errors: dict[str, str]
    ) -> dict[str, list[dict[str, Any]]]:
        opts = self.opts
        samples: dict[str, list[dict[str, Any]]] = {a.system.name: [] for a in live}
        ping = name == "W4"
        per_block = max(1, opts.pings // max(1, opts.reps)) if ping else 1
        deadline = time.monotonic() + opts.budget_s
        for r in range(opts.reps):
            if time.monotonic() > deadline:
                opts.progress(f"{name}: time budget reached after {r} repetitions")
                break
            k = r % len(live) if live else 0
            for a in live[k:] + live[:k]:
                if a.system.name in errors:
                    continue
                try:
                    block = [self._cycle(a, verify=(i == 0), rep=r) for i in range(per_block)]
                except Exception as e:
                    errors[a.system.name] = f"repetition {r} failed: {e}"
                    continue
                samples[a.system.name].extend(block)
        return samples

    def _cycle(self, a: _Active, verify: bool, rep: int = -1) -> dict[str, Any]:
        s, p, c = a.system, self.p, self._consumer(a.system)
        name = s.name
        meter = self.opts.place.meter if self.opts.place else None
        m0 = meter() if meter else (0, 0)
        if s.kind == "local":
            g = c.call("call", system=name, method="get")
            dt = (g["t1"] - g["t0"]) / 1e9
            res = {"put_s": dt, "get_s": dt, "step_s": dt, "peak_consumer": g["peak"]}
            res["rss0_consumer"] = g["rss0"]
            res["cpu_put"] = res["cpu_get"] = g["cpu_s"]
        elif s.kind == "direct":
            p.call("call", system=name, method="prepare")
            c.send("call", system=name, method="get")
            try:
                put = p.call("call", system=name, method="put")
            except Exception:
                with contextlib.suppress(Exception):
                    c.recv()  # the receiver gives up at its socket timeout
                raise
            g = c.recv()
            dt = (g["t1"] - put["t0"]) / 1e9
            res = {"put_s": dt, "get_s": dt, "step_s": dt}
            if meter:  # the one transfer arrives at the server's host
                m1 = meter()
                res["wire_put"] = res["wire_get"] = m1[0] - m0[0]
            res.update(_peaks(put, g))
            # One transfer: its cost is both ends'.
            res["cpu_put"] = res["cpu_get"] = put["cpu_s"] + g["cpu_s"]
        else:
            p.call("call", system=name, method="prepare")
            for pid in a.server_pids:
                procs.reset_peak(pid)
            srv0 = sum(procs.rss(pid)[0] for pid in a.server_pids)
            cpu0 = _cpu(a.server_pids)
            m0 = meter() if meter else m0
            put = p.call("call", system=name, method="put")
            cpu1 = _cpu(a.server_pids)
            m1 = meter() if meter else m0
            g = c.call("call", system=name, method="get")
            cpu2 = _cpu(a.server_pids)
            m2 = meter() if meter else m0
            put_s, get_s = (put["t1"] - put["t0"]) / 1e9, (g["t1"] - g["t0"]) / 1e9
            res = {"put_s": put_s, "get_s": get_s, "step_s": put_s + get_s}
            res.update(_peaks(put, g))
            res.update({k: g[k] for k in ("decode_s", "decode_tail_s", "record_batches") if k in g})
            # A streamed put's bytes received and held, a claim's bytes sent (W5).
            res.update(
                {k: put[k] for k in ("wire_bytes", "held_bytes", "distinct_bytes") if k in put}
            )
            if "get_wire_bytes" in g:
                res["get_wire_bytes"] = g["get_wire_bytes"]
            # CPU of the writer or reader and of the server's processes, over the operation
            # (the server's readings include the runner's round trips to the workers).
            res["cpu_put"] = put["cpu_s"] + cpu1 - cpu0
            res["cpu_get"] = g["cpu_s"] + cpu2 - cpu1
            res["peak_server"] = sum(procs.rss(pid)[1] for pid in a.server_pids)
            res["rss0_server"] = srv0
            if meter:  # a put arrives at the server's host, a get leaves it
                res["wire_put"], res["wire_get"] = m1[0] - m0[0], m2[1] - m1[1]
        if meter:
            res["link_Bps"] = self.opts.place.rate_bps / 8  # type: ignore[union-attr]
        if verify:
            c.call("call", system=name, method="verify")
            res["verified"] = True
        c.call("call", system=name, method="release")
        if s.kind != "local":
            p.call("call", system=name, method="clear")
        res["rep"] = rep
        return res


def _cpu(pids: list[int]) -> float:
    return sum(procs.cpu_seconds(pid) for pid in pids)


def _peaks(put: dict[str, Any], get: dict[str, Any]) -> dict[str, Any]:
    return {
        "peak_producer": put["peak"],
        "rss0_producer": put["rss0"],
        "peak_consumer": get["peak"],
        "rss0_consumer": get["rss0"],
    }
