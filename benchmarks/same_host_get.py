"""A same-host get of a step: Ray's object store against flightq through shared memory.

What a trainer's get of a step costs, in one process that has the step ready to read
(no reference passed between actors, unlike ``flightq bench``'s ``ray`` peer), median
milliseconds of ``--reps`` gets each:

- ``ray numpy``: ``ray.get`` of the step's per-row numpy arrays (Ray's zero-copy case);
- ``ray torch``: ``ray.get`` of the same rows as torch tensors, what an RL trainer holds:
  Ray pickles a tensor's bytes in band unless ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` is
  set before ``ray`` is imported, so each mode (``--modes off,on``) runs in a process of
  its own;
- ``flightq torch`` / ``flightq numpy``: ``Client.get(..., as_=...)`` with ``shm=True``
  from a ``flightq serve`` process, every field's per-row tensors (or arrays) built.

Every answer is checked once against the step before it is timed. Ray runs locally with
2 CPUs on 127.0.0.1; everything stops by itself::

    .venv/bin/python benchmarks/same_host_get.py --workloads W1,W2 --reps 15
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main", "measure"]

#: Gets of a mode whose median passes this many seconds stop at 3 repetitions.
_SLOW_S = 0.2
_LABELS = ("ray numpy", "ray torch", "flightq torch", "flightq numpy")


def _median_ms(f: Callable[[], Any], reps: int) -> float:
    f()  # warm
    out: list[float] = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
        if len(out) >= 3 and statistics.median(out) > _SLOW_S:
            break
    return statistics.median(out) * 1e3


def measure(workloads: Sequence[str], reps: int, zero_copy: bool) -> dict[str, dict[str, float]]:
    """Median ms per get of each system on each workload, in this process (``ray`` must
    not be imported yet: the zero-copy switch is read at its import)."""
    os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1" if zero_copy else "0"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import flightq
    from flightq.workloads import make

    tmp = tempfile.mkdtemp(prefix="fq-samehost-")
    argv = [sys.executable, "-m", "flightq.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    out: dict[str, dict[str, float]] = {}
    try:
        assert server.stdout is not None
        location = json.loads(server.stdout.readline())["listening"]
        ray.init(
            num_cpus=2,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            _temp_dir=tmp,
            log_to_driver=False,
            configure_logging=False,
        )
        for name in workloads:
            step = make(name)
            with flightq.connect(location, [step.schema], shm=True) as c:
                out[name] = _one(ray, c, step, reps)
    finally:
        server.terminate()
        server.wait(30)
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _one(ray: Any, c: Any, step: Any, reps: int) -> dict[str, float]:
    """Each system's median ms per get of ``step``, its answers checked first."""
    from flightq_bench.payload import as_payload, check_rows

    from flightq.workloads import to_torch

    tstep = to_torch(step)
    name = step.name
    refs = {"numpy": ray.put(as_payload(step)), "torch": ray.put(as_payload(tstep))}
    c.create_partition(name, step.schema, group_size=step.group_size)
    c.put(name, tstep.keys, tstep.columns, tags=tstep.tags)

    def flightq_get(as_: str) -> Callable[[], Any]:
        def get() -> Any:
            b = c.get(name, step.keys, as_=as_)
            return b.keys, {f: b[f] for f in b.fields}, b.tags

        return get

    def ray_get(kind: str) -> Callable[[], Any]:
        def get() -> Any:
            g = ray.get(refs[kind])
            return g["keys"], g["columns"], g["tags"]

        return get

    row: dict[str, float] = {}
    for label, f in [
        ("ray numpy", ray_get("numpy")),
        ("ray torch", ray_get("torch")),
        ("flightq torch", flightq_get("torch")),
        ("flightq numpy", flightq_get("numpy")),
    ]:
        keys, cols, tags = f()
        check_rows(step, list(keys), cols, tags, label)  # before it is timed
        row[label] = _median_ms(f, reps)
    c.drop(name)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--modes", default="off,on", help="Ray's zero-copy torch switch, per run")
    p.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.child:
        got = measure(workloads, args.reps, args.child == "on")
        print(json.dumps(got), flush=True)
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    print(f"{'workload':8} {'zero-copy':9} " + " ".join(f"{k:>14}" for k in _LABELS) + "  (ms)")
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, "--workloads", args.workloads]
        cmd += ["--reps", str(args.reps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        for name, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
            cells = " ".join(f"{row[k]:14.2f}" for k in _LABELS)
            print(f"{name:8} {mode:9} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
