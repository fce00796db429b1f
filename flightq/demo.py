"""``flightq demo``: the W1 write-back pattern across processes over loopback.

An embedded server holds one partition (``rollout_vlm@1``, tasks ``prev_lp`` and
``train``, groups of 16). A generator process puts each step's 8 prompt groups one group
per put (``--workload W5``: two generator processes put a row per put as generations
finish, the groups split between them, each group's image sent once); a logprob process
claims rows for ``prev_lp``, reads ``input_ids`` and writes ``prev_logprobs`` back under
the same keys; a trainer process claims whole steps for ``train`` once ``prev_logprobs``
is there, checks every byte against the seeded step, and clears the rows. Progress is
printed as it runs and a table at the end.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import queue
import time
from typing import Any

import numpy as np

from .tools import human_bytes

__all__ = ["run_demo", "prev_logprobs_of"]

PARTITION = "rollouts"
SCHEMA = "rollout_vlm@1"
GROUPS, G = 8, 16
TIMEOUT = 60.0


def prev_logprobs_of(input_ids: np.ndarray) -> np.ndarray:
    """The logprobs the demo's logprob worker writes: a pure function of the tokens."""
    return -((input_ids % 1000).astype(np.float32) / 1000.0)


def _step(s: int, workload: str = "W1") -> Any:
    from . import workloads

    if workload == "W1":
        st = workloads.w1(seed=s, groups=GROUPS, g=G)
    else:
        st = workloads.w5(seed=s, copies=workload == "W5-copies")
    st.keys = [f"s{s}_{k}" for k in st.keys]
    for t in st.tags:
        t["weight_version"] = s
    return st


#: What the consumers decode into: torch tensors, as a trainer does, where torch is
#: installed; numpy arrays elsewhere (the demo runs without torch too).
_AS = "torch" if importlib.util.find_spec("torch") is not None else "numpy"


def _generator(location: str, steps: int, out: Any, workload: str = "W1", writer: int = 0) -> None:
    import flightq

    with flightq.connect(location, [SCHEMA]) as c:
        for s in range(steps):
            st = _step(s, workload)
            t0 = time.perf_counter()
            if not st.streams:
                for g in range(GROUPS):
                    grp = st.group(g)
                    c.put(PARTITION, grp.keys, grp.columns, grp.tags)
                out.put(("generator", s, st.rows, st.nbytes(), time.perf_counter() - t0))
                continue
            mine = st.streams[writer]
            nbytes = 0
            for i in mine:  # one row per put, as its generation finishes
                cols = {k: v[i : i + 1] for k, v in st.columns.items()}
                c.put(PARTITION, st.keys[i : i + 1], cols, st.tags[i : i + 1])
                nbytes += sum(_nbytes(v) for v in cols.values())
            out.put(("generator", s, len(mine), nbytes, time.perf_counter() - t0))


def _nbytes(col: Any) -> int:
    if isinstance(col, np.ndarray):
        return col.nbytes
    return sum(sum(x.nbytes for x in r) if isinstance(r, list) else r.nbytes for r in col)


def _logprob(location: str, steps: int, out: Any) -> None:
    import flightq

    per_claim = 2 * G
    with flightq.connect(location, [SCHEMA]) as c:
        for i in range(steps * GROUPS * G // per_claim):
            t0 = time.perf_counter()
            b = c.claim(
                PARTITION, "prev_lp", per_claim, fields=["input_ids"], timeout=TIMEOUT, as_=_AS
            )
            ids = [np.asarray(x) for x in b["input_ids"]]
            lps = [prev_logprobs_of(x) for x in ids]
            c.put(PARTITION, b.keys, {"prev_logprobs": lps})
            nbytes = sum(x.nbytes for x in ids) + sum(x.nbytes for x in lps)
            out.put(("logprob", i, len(b), nbytes, time.perf_counter() - t0))


def _trainer(location: str, steps: int, out: Any, workload: str = "W1") -> None:
    import flightq

    with flightq.connect(location, [SCHEMA]) as c:
        for _ in range(steps):
            t0 = time.perf_counter()
            b = c.claim(
                PARTITION, "train", GROUPS * G, wait_for=["prev_logprobs"], timeout=TIMEOUT, as_=_AS
            )
            dt = time.perf_counter() - t0
            # Streamed rows of two steps may share a claim: each row checks against its own.
            made: dict[int, Any] = {}
            of = [int(t["weight_version"]) for t in b.tags]
            for v in set(of):
                made[v] = _step(v, workload)
            s = min(of)
            st = made[s]
            order = {k: i for v in made.values() for i, k in enumerate(v.keys)}
            nbytes = 0
            for name in st.columns:
                got = b[name]
                for j, k in enumerate(b.keys):
                    w = made[of[j]].columns[name][order[k]]
                    g = got[j]
                    if isinstance(w, list):
                        for ws, gs in zip(w, g, strict=True):
                            assert np.array_equal(ws, np.asarray(gs)), (name, k)
                            nbytes += ws.nbytes
                    else:
                        assert np.array_equal(np.asarray(w), np.asarray(g)), (name, k)
                        nbytes += np.asarray(w).nbytes
            for j, k in enumerate(b.keys):
                want_lp = prev_logprobs_of(made[of[j]].columns["input_ids"][order[k]])
                assert np.array_equal(np.asarray(b["prev_logprobs"][j]), want_lp), k
            c.clear(PARTITION, b.keys)
            out.put(("trainer", s, len(b), nbytes, dt))


def run_demo(steps: int = 3, workload: str = "W1") -> int:
    """Run the demo (``workload``: ``W1``, ``W5`` or ``W5-copies``); returns 0 when every
    byte the trainer received checked out."""
    import flightq

    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    t_start = time.perf_counter()
    with flightq.Server() as srv:
        streamed = workload != "W1"
        how = "two generators, a row per put" if streamed else "a put per prompt group"
        print(
            f"flightq demo: server at {srv.location}; {steps} steps of {workload} "
            f"({GROUPS} groups x {G} rows, one 748x1176 float32 image per group; {how})"
        )
        with flightq.connect(srv.location, [SCHEMA]) as c:
            # Streamed rows arrive one at a time: no put creates a whole group.
            group = None if streamed else G
            c.create_partition(PARTITION, SCHEMA, tasks=["prev_lp", "train"], group_size=group)
        loc = srv.location
        gens = [(_generator, (loc, steps, out, workload, w)) for w in range(2 if streamed else 1)]
        procs = [
            ctx.Process(
                target=fn, args=a, name=f"generator{i}" if fn is _generator else fn.__name__[1:]
            )
            for i, (fn, a) in enumerate(
                [*gens, (_logprob, (loc, steps, out)), (_trainer, (loc, steps, out, workload))]
            )
        ]
        for p in procs:
            p.start()
        totals: dict[str, list[float]] = {
            n: [0, 0, 0.0] for n in ("generator", "logprob", "trainer")
        }
        trained = 0
        deadline = time.monotonic() + 10 * TIMEOUT
        while trained < steps and time.monotonic() < deadline:
            try:
                stage, i, rows, nbytes, secs = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode]
                if dead:
                    print(f"flightq demo: {dead[0].name} failed (exit code {dead[0].exitcode})")
                    break
                continue
            t = totals[stage]
            t[0] += rows
            t[1] += nbytes
            t[2] += secs
            if stage != "logprob":
                print(f"  {stage:9} step {i}: {rows} rows, {human_bytes(nbytes)} in {secs:.2f}s")
            if stage == "trainer":
                trained += 1
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        ok = trained == steps and all(p.exitcode == 0 for p in procs)
        for p in procs:
            if p.exitcode != 0:
                print(f"flightq demo: {p.name} exited with code {p.exitcode}")
        with flightq.connect(srv.location, [SCHEMA]) as c:
            received = c.stats()["counters"]["bytes_received"]
    wall = time.perf_counter() - t_start
    print()
    print(f"  {'stage':10} {'rows':>6} {'bytes':>11} {'seconds':>8} {'GB/s':>6}")
    for stage, (rows, nbytes, secs) in totals.items():
        rate = nbytes / secs / 1e9 if secs else 0.0
        print(f"  {stage:10} {int(rows):>6} {human_bytes(nbytes):>11} {secs:>8.2f} {rate:>6.3f}")
    distinct = steps * _step(0, workload).nbytes(distinct_media=True)
    print(
        f"\n  the server received {human_bytes(received)} for {human_bytes(distinct)} of "
        f"distinct payload (each image once): {received / distinct:.2f}x"
    )
    verdict = "every byte verified" if ok else "FAILED"
    print(f"\n{steps} steps in {wall:.1f}s wall: {verdict}")
    return 0 if ok else 1
