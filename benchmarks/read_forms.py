"""A get of a stored step in each form a reader takes it, optionally from several source trees.

One ``flightq serve --port 0`` process on 127.0.0.1 holds a workload step (W3 by
default). For each form, and each source tree given, a fresh client process gets every
row of it by key ``--gets`` times and reports the median of all but the first two; the
forms and trees alternate over ``--rounds`` so that load drifts hit all alike. Forms:

- ``torch`` / ``numpy``: ``Client.get(..., as_=...)``, every field's per-row tensors built
  (``batch[field]``), as ``flightq bench`` reads;
- ``packed``: ``as_="torch"``, each token and tensor field ``.packed()`` (no tensor per
  row), media and scalars as ``torch``;
- ``tensordict``: ``as_="tensordict"`` (keys and tags ride along as ``__key__``/``__tags__``);
- ``tensordict-nometa``: ``as_="torch"``, then ``to_tensordict(meta=False)``.

Every client checks its first answer against the step (keys, every field bit for bit).
``--trees`` names checkouts (``git archive REV | tar -x -C DIR``) whose ``flightq`` the
clients import instead of this one's (the server is always this tree's): an A/B of a
change in the client's read path. Prints median ms [p10-p90] and the slowest get per form
and tree, and each full garbage collection (Python's generation 2) that ran while the
gets did: the objects a get makes set them off, and each walks every object of the
process. ``--freeze``: each client calls ``gc.freeze()`` first, as a trainer may once its
model is loaded, so that collections skip what existed before.

Run::

    .venv/bin/python benchmarks/read_forms.py --workload W3 --forms torch,tensordict --rounds 4
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["FORMS", "main", "measure", "read"]

FORMS = ("torch", "numpy", "packed", "tensordict", "tensordict-nometa")
#: Gets of each client left out before timing (connection, first allocations).
_WARM = 2


def read(client: Any, partition: str, keys: Sequence[str], form: str) -> dict[str, Any]:
    """One get of ``keys`` in ``form``; returns per field what :func:`check_rows` takes,
    plus ``__key__`` and ``__tags__`` (the rows' keys and tags, where the form has them)."""
    if form in ("torch", "numpy"):
        b = client.get(partition, keys, as_=form)
        return {"__key__": b.keys, "__tags__": b.tags, **{f: b[f] for f in b.fields}}
    if form == "packed":
        b = client.get(partition, keys)
        roles = {f: b.schema[f].role for f in b.fields}
        cols = {
            f: b.column(f).packed() if roles[f] in ("token", "tensor") else b[f] for f in b.fields
        }
        return {"__key__": b.keys, "__tags__": b.tags, **cols}
    if form == "tensordict":
        td = client.get(partition, keys, as_="tensordict")
    elif form == "tensordict-nometa":
        td = client.get(partition, keys).to_tensordict(meta=False)
    else:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    names = list(td.keys())  # iterating a TensorDict walks its rows, not its entries
    return {name: td.get(name) for name in names}


def _as_rows(got: dict[str, Any]) -> dict[str, Any]:
    """Per field, the per-row structure :func:`check_rows` compares."""
    import numpy as np
    import torch

    from flightq.layout import Packed

    out: dict[str, Any] = {}
    for name, v in got.items():
        if name.startswith("__"):
            continue
        if isinstance(v, Packed):
            offs = v.offsets.tolist()
            out[name] = [v.values[a:b] for a, b in itertools.pairwise(offs)]
        elif isinstance(v, torch.Tensor) and v.is_nested:
            out[name] = list(v.unbind())
        elif isinstance(v, (torch.Tensor, np.ndarray, list)):
            out[name] = v
        else:  # a NonTensorStack: its rows
            out[name] = v.tolist()
    return out


def _client(location: str, workload: str, form: str, gets: int, freeze: bool = False) -> None:
    """A client process: check the first answer, print the seconds of the others and of
    each full garbage collection that ran during them (``freeze``: ``gc.freeze()`` first)."""
    from flightq_bench.payload import check_rows

    import flightq
    from flightq import workloads

    ref = workloads.make(workload)
    c = flightq.connect(location, [ref.schema], timeout=60)
    got = read(c, "p", ref.keys, form)
    keys, tags = got.get("__key__"), got.get("__tags__")
    tags = tags.tolist() if hasattr(tags, "tolist") else tags
    keys = list(keys.tolist() if hasattr(keys, "tolist") else ref.keys if keys is None else keys)
    check_rows(ref, keys, _as_rows(got), tags, form)
    if freeze:
        gc.freeze()  # what a trainer may do once its model is loaded (README)
    full: list[float] = []  # seconds of each full collection that ran inside a get

    def watch(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            full.append(time.perf_counter() if phase == "start" else -time.perf_counter())

    out = []
    gc.callbacks.append(watch)
    for i in range(gets):
        t0 = time.perf_counter()
        got = read(c, "p", ref.keys, form)
        out.append(time.perf_counter() - t0)
        if i < _WARM:
            full.clear()
    gc.callbacks.remove(watch)
    c.close()
    pauses = [a + b for a, b in zip(full[::2], full[1::2], strict=False)]
    print(json.dumps({"gets": out[_WARM:], "full_gc": [-p for p in pauses]}), flush=True)


def measure(
    workload: str,
    forms: Sequence[str],
    rounds: int,
    gets: int,
    trees: Sequence[str] = ("",),
    freeze: bool = False,
    pauses: dict[tuple[str, str], list[float]] | None = None,
) -> dict[tuple[str, str], list[float]]:
    """Per (tree, form), the seconds of every timed get (``""``: this tree); ``pauses``
    gains the seconds of each full garbage collection during them; ``freeze``: each
    client calls ``gc.freeze()`` before its gets."""
    from flightq_bench import procs
    from flightq_bench.flightq_system import server_argv

    import flightq
    from flightq import workloads

    for form in forms:
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    step = workloads.to_torch(workloads.make(workload))
    here = os.path.dirname(os.path.abspath(__file__))
    out: dict[tuple[str, str], list[float]] = {(t, f): [] for t in trees for f in forms}
    with procs.ServerProcess(server_argv(), "flightq") as server:
        location = server.info["listening"]
        with flightq.connect(location, [step.schema], timeout=60) as c:
            c.create_partition("p", schema=step.schema, tasks=["t"], group_size=step.group_size)
            c.put("p", step.keys, step.columns, tags=step.tags)
            for _ in range(rounds):
                for tree in trees:
                    path = [os.path.abspath(tree)] if tree else []
                    path += [here, os.environ.get("PYTHONPATH", "")]
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
                    for form in forms:
                        argv = [sys.executable, __file__, "--client", location, workload, form]
                        done = subprocess.run(
                            [*argv, str(gets + _WARM), "freeze" if freeze else "-"],
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=300,
                            cwd=os.path.abspath(tree) if tree else None,
                        )
                        if done.returncode != 0:
                            raise RuntimeError(
                                f"{form} client ({tree or 'this tree'}): {done.stderr}"
                            )
                        res = json.loads(done.stdout.strip().splitlines()[-1])
                        out[(tree, form)] += res["gets"]
                        if pauses is not None:
                            pauses.setdefault((tree, form), []).extend(res["full_gc"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client"]:
        _client(argv[1], argv[2], argv[3], int(argv[4]), argv[5:6] == ["freeze"])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W3")
    p.add_argument("--forms", default="torch,tensordict")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--gets", type=int, default=50, help="timed gets per client process")
    p.add_argument("--trees", default="", help="checkouts whose flightq the clients import")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() in each client first")
    a = p.parse_args(argv)
    trees = [t for t in a.trees.split(",") if t] or [""]
    pauses: dict[tuple[str, str], list[float]] = {}
    got = measure(a.workload, a.forms.split(","), a.rounds, a.gets, trees, a.freeze, pauses)
    print(
        f"{a.workload}: median ms [p10-p90] and slowest of {a.rounds} x {a.gets} gets per "
        "form and tree; full garbage collections during them (count, ms each)"
    )
    for (tree, form), xs in got.items():
        xs = sorted(x * 1e3 for x in xs)
        p10, p90 = xs[len(xs) // 10], xs[(9 * len(xs)) // 10]
        med = statistics.median(xs)
        full = " ".join(f"{x * 1e3:.1f}" for x in pauses.get((tree, form), []))
        print(
            f"{tree or 'this tree':<24} {form:<18} {med:7.2f} [{p10:.2f}-{p90:.2f}] "
            f"max {xs[-1]:.2f}; full gc {len(pauses.get((tree, form), []))}: {full}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
