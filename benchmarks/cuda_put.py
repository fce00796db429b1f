"""Where a put from CUDA tensors spends, against the CPU put of the same rows.

A client in this process puts a workload step (W1 and W1-bf16 by default) to a
``flightq serve`` process on 127.0.0.1, from the step's torch tensors on the CPU and from
the same tensors on ``cuda:0`` (a prompt group's image stays one tensor on both), in
interleaved rounds, clearing the partition between puts (untimed). Beside the two puts it
times their parts, without sending:

- ``stage``: :func:`flightq.cuda.stage` of the CUDA columns and the wait for every
  device-to-host copy (what a CUDA put does before and besides encoding);
- ``encode cpu`` / ``encode cuda``: :func:`flightq.batch.encode_chunks` of the CPU columns,
  and of the staged CUDA columns (the copies included), as the socket put encodes them
  (checks and layout; payloads are copied while sending).

Medians in milliseconds over ``--rounds`` (the first ``--warmup`` dropped), with the
spread, and the CUDA put's speed as a ratio of the CPU put's, paired per round. It runs
with whichever ``flightq`` is first on ``sys.path``, so two trees compare on one host::

    python benchmarks/cuda_put.py --rounds 30
    PYTHONPATH=/path/to/old/tree python benchmarks/cuda_put.py --rounds 30

Needs torch and a CUDA device; it says so and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def measure(
    location: str, workload: str, rounds: int, warmup: int, device: str = "cuda:0"
) -> dict[str, list[float]]:
    """Per round, milliseconds of each part (see the module's doc); ``device="cpu"``
    runs every part on CPU copies (a check of the script itself, not a measurement)."""
    import torch
    from flightq_bench.flightq_system import step_on_device

    import flightq
    from flightq.batch import encode_chunks
    from flightq.cuda import PinnedPool, stage
    from flightq.workloads import make, to_torch

    step = to_torch(make(workload))
    schema = flightq.SchemaRegistry.default().get(step.schema)
    cpu = step.columns
    dev = step_on_device(step, device).columns
    joinable = {f.name for f in schema.fields if f.role in ("token", "tensor")}
    # The tree before rows were joined on the device has no ``pack``.
    extra = (joinable,) if "pack" in inspect.signature(stage).parameters else ()
    pool = PinnedPool()
    on_cuda = device.startswith("cuda")
    out: dict[str, list[float]] = {}
    with flightq.connect(location, schemas=[step.schema]) as client:
        part = f"cuda-put-{workload}"
        client.create_partition(part, schema=step.schema, tasks=["train"])
        max_bytes = client.max_batch_bytes

        def put(cols: Any) -> None:
            client.put(part, step.keys, cols, tags=step.tags)

        def staged() -> None:
            with stage(dev, pool, *extra):
                pass

        def encoded(cols: Any, on_device: bool) -> None:
            fills: list[Callable[[], None]] = []
            if not on_device:
                encode_chunks(schema, cols, step.keys, step.tags, max_bytes=max_bytes, fills=fills)
                return
            with stage(cols, pool, *extra) as st:
                encode_chunks(
                    schema,
                    st.columns,
                    step.keys,
                    step.tags,
                    max_bytes=max_bytes,
                    fills=fills,
                    on_range=st.on_range,
                )

        parts: dict[str, Callable[[], None]] = {
            "put cpu": lambda: put(cpu),
            "put cuda": lambda: put(dev),
            "stage": staged,
            "encode cpu": lambda: encoded(cpu, False),
            "encode cuda": lambda: encoded(dev, True),
        }
        for r in range(rounds + warmup):
            for name, fn in parts.items():
                if on_cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                dt = (time.perf_counter() - t0) * 1e3
                if name.startswith("put"):
                    client.clear(part)
                if r >= warmup:
                    out.setdefault(name, []).append(dt)
        client.drop(part)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W1-bf16")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--device", default="cuda:0", help="cpu: run the parts on CPU copies (checks the script)"
    )
    args = p.parse_args(argv)
    from flightq_bench import procs
    from flightq_bench.flightq_system import server_argv, usable_torch

    torch = usable_torch("cuda_put", args.device)
    if torch is None:
        return 2
    with procs.ServerProcess(server_argv(), "flightq") as srv:
        for w in args.workloads.split(","):
            t = measure(srv.info["listening"], w, args.rounds, args.warmup, args.device)
            ratio = [c / g for c, g in zip(t["put cpu"], t["put cuda"], strict=True)]
            print(f"{w}: ms, median [min-max] of {args.rounds} rounds")
            for name, xs in t.items():
                print(f"  {name:12s} {_spread(xs)}")
            print(f"  CUDA put's speed / CPU put's: {_spread(ratio)}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
