"""``flightq demo``: the W1 write-back pattern across three processes over loopback.

An embedded server holds one partition (``rollout_vlm@1``, tasks ``prev_lp`` and
``train``, groups of 16). A generator process puts each step's 8 prompt groups one group
per put; a logprob process claims rows for ``prev_lp``, reads ``input_ids`` and writes
``prev_logprobs`` back under the same keys; a trainer process claims whole steps for
``train`` once ``prev_logprobs`` is there, checks every byte against the seeded step, and
clears the rows. Progress is printed as it runs and a table at the end.
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


def _step(s: int) -> Any:
    from . import workloads

    st = workloads.w1(seed=s, groups=GROUPS, g=G)
    st.keys = [f"s{s}_{k}" for k in st.keys]
    for t in st.tags:
        t["weight_version"] = s
    return st


#: What the consumers decode into: torch tensors, as a trainer does, where torch is
#: installed; numpy arrays elsewhere (the demo runs without torch too).
_AS = "torch" if importlib.util.find_spec("torch") is not None else "numpy"


def _generator(location: str, steps: int, out: Any) -> None:
    import flightq

    with flightq.connect(location, [SCHEMA]) as c:
        for s in range(steps):
            st = _step(s)
            t0 = time.perf_counter()
            for g in range(GROUPS):
                grp = st.group(g)
                c.put(PARTITION, grp.keys, grp.columns, grp.tags)
            out.put(("generator", s, st.rows, st.nbytes(), time.perf_counter() - t0))


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


def _trainer(location: str, steps: int, out: Any) -> None:
    import flightq

    with flightq.connect(location, [SCHEMA]) as c:
        for _ in range(steps):
            t0 = time.perf_counter()
            b = c.claim(
                PARTITION, "train", GROUPS * G, wait_for=["prev_logprobs"], timeout=TIMEOUT, as_=_AS
            )
            dt = time.perf_counter() - t0
            s = int(b.tags[0]["weight_version"])
            st = _step(s)
            order = {k: i for i, k in enumerate(st.keys)}
            nbytes = 0
            for name, want in st.columns.items():
                got = b[name]
                for j, k in enumerate(b.keys):
                    w = want[order[k]]
                    g = got[j]
                    if isinstance(w, list):
                        for ws, gs in zip(w, g, strict=True):
                            assert np.array_equal(ws, np.asarray(gs)), (name, k)
                            nbytes += ws.nbytes
                    else:
                        assert np.array_equal(np.asarray(w), np.asarray(g)), (name, k)
                        nbytes += np.asarray(w).nbytes
            for j, k in enumerate(b.keys):
                want_lp = prev_logprobs_of(st.columns["input_ids"][order[k]])
                assert np.array_equal(np.asarray(b["prev_logprobs"][j]), want_lp), k
            c.clear(PARTITION, b.keys)
            out.put(("trainer", s, len(b), nbytes, dt))


def run_demo(steps: int = 3) -> int:
    """Run the demo; returns 0 when every byte the trainer received checked out."""
    import flightq

    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    t_start = time.perf_counter()
    with flightq.Server() as srv:
        print(
            f"flightq demo: server at {srv.location}; {steps} steps of W1 "
            f"({GROUPS} groups x {G} rows, one 748x1176 float32 image per row)"
        )
        with flightq.connect(srv.location, [SCHEMA]) as c:
            c.create_partition(PARTITION, SCHEMA, tasks=["prev_lp", "train"], group_size=G)
        procs = [
            ctx.Process(target=fn, args=(srv.location, steps, out), name=fn.__name__[1:])
            for fn in (_generator, _logprob, _trainer)
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
    wall = time.perf_counter() - t_start
    print()
    print(f"  {'stage':10} {'rows':>6} {'bytes':>11} {'seconds':>8} {'GB/s':>6}")
    for stage, (rows, nbytes, secs) in totals.items():
        rate = nbytes / secs / 1e9 if secs else 0.0
        print(f"  {stage:10} {int(rows):>6} {human_bytes(nbytes):>11} {secs:>8.2f} {rate:>6.3f}")
    verdict = "every byte verified" if ok else "FAILED"
    print(f"\n{steps} steps in {wall:.1f}s wall: {verdict}")
    return 0 if ok else 1
