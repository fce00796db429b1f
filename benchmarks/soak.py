"""A long run's steady state: RL steps through one server, its resources sampled as it goes.

One ``flightq serve --port 0`` process on 127.0.0.1 (``--memory-budget``, 256 MiB by
default) and, in this process, the clients of an RL loop, each step:

- a generator puts ``--groups`` prompt groups of ``--group-size`` rows (``rollout_vlm@1``:
  token ids, an image per group shared by its rows, tags), new keys every step;
- a logprob worker claims the step's rows for its task (``input_ids`` only), writes
  ``prev_logprobs`` back and acks (leaving the ``with`` block);
- a trainer claims whole groups once ``prev_logprobs`` is there, checks every row
  against what was put, and clears them.

Every ``--crash-every`` steps a second worker claims the step's rows first and goes away
without an ack (its client closes: the session ends, the rows come back at once) and the
worker takes them again. Every ``--sample-every`` steps the server's and this process's
resident memory (``VmRSS``), threads and open files, the server's held bytes (``stats``)
and records of the past (its Prometheus endpoint), and the segment files of both
processes in the shared-memory directory are recorded. At the end a table gives the
first sample after ``--warmup`` steps (half the run by default: records of the past,
kept up to their bounds, grow until then), the last, and the drift per 1000 steps (a
least-squares line over the samples after warm-up). The run stops by itself after
``--steps`` steps or ``--minutes``, whichever comes first.

Run::

    .venv/bin/python benchmarks/soak.py --steps 3000
    .venv/bin/python benchmarks/soak.py --steps 3000 --shm
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flightq_bench import procs
from flightq_bench.flightq_system import server_argv

import flightq

__all__ = ["Sample", "drift", "main", "run", "server_process"]

SCHEMA = "rollout_vlm@1"
PARTITION = "soak"


@dataclasses.dataclass(frozen=True)
class Sample:
    """Resources after ``step`` steps (memory in bytes)."""

    step: int
    server_rss: int
    server_threads: int
    server_fds: int
    server_held: int
    server_records: int
    shm_files: int
    client_rss: int
    client_threads: int
    client_fds: int

    #: The columns a table and :func:`drift` report, with their units' divisors.
    COLUMNS: ClassVar[dict[str, int]] = {
        "server_rss": 2**20,
        "server_threads": 1,
        "server_fds": 1,
        "server_held": 2**20,
        "server_records": 2**20,
        "shm_files": 1,
        "client_rss": 2**20,
        "client_threads": 1,
        "client_fds": 1,
    }


def _rss(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _count(path: str) -> int:
    return len(os.listdir(path))


def _shm_files(shm_dir: str | None, pids: Sequence[int]) -> int:
    """Segment files of these processes in ``shm_dir`` (named ``flightq-<pid>-...``)."""
    if shm_dir is None:
        return 0
    mine = tuple(f"flightq-{pid}-" for pid in pids)
    return sum(1 for n in os.listdir(shm_dir) if n.startswith(mine))


def _records(metrics: str | None) -> int:
    """The server's ``flightq_records_bytes`` at its metrics endpoint (0 without one)."""
    if metrics is None:
        return 0
    with urllib.request.urlopen(metrics, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("flightq_records_bytes "):
                return int(float(line.split()[1]))
    raise RuntimeError(f"no flightq_records_bytes at {metrics}")


def sample(
    step: int,
    server_pid: int,
    client: flightq.Client,
    shm_dir: str | None,
    metrics: str | None = None,
) -> Sample:
    """The resources of the server process and this one now (the server's records of the
    past from its Prometheus endpoint ``metrics``, where given)."""
    return Sample(
        step=step,
        server_rss=_rss(server_pid),
        server_threads=_count(f"/proc/{server_pid}/task"),
        server_fds=_count(f"/proc/{server_pid}/fd"),
        server_held=int(client.stats()["held"]),
        server_records=_records(metrics),
        shm_files=_shm_files(shm_dir, (server_pid, os.getpid())),
        client_rss=_rss("self"),
        client_threads=_count("/proc/self/task"),
        client_fds=_count("/proc/self/fd"),
    )


class _Step:
    """One step's rows: keys, columns and tags, made from a seed."""

    def __init__(self, step: int, groups: int, group_size: int) -> None:
        import torch

        g = torch.Generator().manual_seed(step)
        self.keys = [f"s{step}_p{p}_g{i}" for p in range(groups) for i in range(group_size)]
        n = len(self.keys)
        lengths = torch.randint(64, 512, (n,), generator=g)
        self.ids = [torch.randint(0, 32_000, (int(k),), generator=g) for k in lengths]
        images = [torch.rand(64, 1176, generator=g) for _ in range(groups)]
        thw = torch.tensor([[1, 8, 8]])
        self.columns: dict[str, Any] = {
            "input_ids": self.ids,
            "input_lengths": [torch.tensor(len(x), dtype=torch.int32) for x in self.ids],
            "pixel_values": [[images[i // group_size]] for i in range(n)],
            "image_grid_thw": [[thw]] * n,
        }
        self.tags = [{"step": step, "row": i} for i in range(n)]

    def logprobs(self, keys: Sequence[str]) -> list[Any]:
        at = {k: i for i, k in enumerate(self.keys)}
        return [-self.ids[at[k]].float() / 32_000 for k in keys]


def run(
    location: str,
    steps: int,
    *,
    server_pid: int,
    groups: int = 2,
    group_size: int = 8,
    crash_every: int = 25,
    sample_every: int = 50,
    shm: bool | str = False,
    deadline: float | None = None,
    progress: bool = False,
    metrics: str | None = None,
    partition_per_step: bool = False,
) -> Iterator[Sample]:
    """Run ``steps`` RL steps against the server at ``location`` (process ``server_pid``),
    yielding a :class:`Sample` before the first and after every ``sample_every`` steps;
    stops early at ``time.monotonic() >= deadline``. ``metrics``: the server's Prometheus
    endpoint, where its records of the past are read. ``partition_per_step``: each step
    in a partition of its own (``soak-<step>``), declared by the trainer before the
    generator puts and dropped by it once the rows are read, as a run that names its
    partitions by step does.

    Raises
    ------
    AssertionError
        If a row the trainer receives differs from what was put, or rows are left over.
    """
    import torch

    n = groups * group_size
    wait = 60.0
    with contextlib.ExitStack() as stack:
        gen = stack.enter_context(flightq.connect(location, [SCHEMA], shm=shm))
        worker = stack.enter_context(flightq.connect(location, [SCHEMA], shm=shm))
        trainer = stack.enter_context(flightq.connect(location, [SCHEMA], shm=shm))
        shm_dir = gen.shm_dir
        tasks = ["prev_lp", "train"]
        part = PARTITION
        if not partition_per_step:
            gen.create_partition(part, SCHEMA, tasks=tasks, group_size=group_size)
        yield sample(0, server_pid, gen, shm_dir, metrics)
        for step in range(1, steps + 1):
            s = _Step(step, groups, group_size)
            if partition_per_step:
                part = f"{PARTITION}-{step}"
                trainer.create_partition(part, SCHEMA, tasks=tasks, group_size=group_size)
            gen.put(part, s.keys, s.columns, tags=s.tags)
            if crash_every and step % crash_every == 0:
                # A worker that claims the rows and dies before its ack: its client goes
                # away, the session ends, and the rows come back for the next worker.
                with flightq.connect(location, [SCHEMA], shm=shm) as doomed:
                    taken = doomed.claim(part, "prev_lp", n, fields=["input_ids"])
                    assert len(taken) == n, f"step {step}: the doomed worker got {len(taken)}"
            with worker.claim(part, "prev_lp", n, fields=["input_ids"], timeout=wait) as b:
                assert sorted(b.keys) == sorted(s.keys), f"step {step}: worker got {b.keys}"
                worker.put(part, b.keys, {"prev_logprobs": s.logprobs(b.keys)})
            b = trainer.claim(part, "train", n, wait_for=["prev_logprobs"], timeout=wait)
            assert b.keys == s.keys, f"step {step}: the trainer got {b.keys}"
            ids, lps, pixels = b["input_ids"], b["prev_logprobs"], b["pixel_values"]
            want = s.logprobs(b.keys)
            for i, k in enumerate(b.keys):
                assert torch.equal(ids[i], s.ids[i]), f"{k}: input_ids differ"
                assert torch.equal(lps[i], want[i]), f"{k}: prev_logprobs differ"
                assert torch.equal(pixels[i][0], s.columns["pixel_values"][i][0]), k
                assert b.tags[i] == s.tags[i], f"{k}: tags differ"
            trainer.clear(part, b.keys)
            del b, ids, lps, pixels
            if partition_per_step:
                left = trainer.stats()["partitions"][part]
                assert left["rows"] == 0 and left["claims"] == 0, f"step {step} left {left}"
                trainer.drop(part)
            if step % sample_every == 0 or step == steps:
                smp = sample(step, server_pid, gen, shm_dir, metrics)
                if progress:
                    print(_line(smp), file=sys.stderr, flush=True)
                yield smp
            if deadline is not None and time.monotonic() >= deadline:
                yield sample(step, server_pid, gen, shm_dir, metrics)
                break
        if not partition_per_step:
            left = gen.stats()["partitions"][part]
            assert left["rows"] == 0 and left["claims"] == 0, f"left over: {left}"
            gen.drop(part)
        assert not gen.stats()["partitions"], "partitions left over"


def drift(samples: Sequence[Sample], name: str) -> float:
    """The least-squares slope of ``name`` over ``samples``, per 1000 steps."""
    x = np.array([s.step for s in samples], dtype=float)
    y = np.array([getattr(s, name) for s in samples], dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0
    return float(np.polyfit(x, y, 1)[0]) * 1000


def _line(s: Sample) -> str:
    return (
        f"step {s.step}: server {s.server_rss / 2**20:.1f} MiB, {s.server_threads} threads, "
        f"{s.server_fds} fds, held {s.server_held / 2**20:.2f} MiB, records "
        f"{s.server_records / 2**20:.2f} MiB, shm files {s.shm_files}; "
        f"client {s.client_rss / 2**20:.1f} MiB, {s.client_threads} threads, {s.client_fds} fds"
    )


@contextlib.contextmanager
def server_process(budget: str) -> Iterator[procs.ServerProcess]:
    """A ``flightq serve`` process on 127.0.0.1 with memory budget ``budget`` and its
    Prometheus metrics on a free loopback port (``info["metrics"]``)."""
    argv = [*server_argv(), "--memory-budget", budget, "--metrics-port", "0"]
    with procs.ServerProcess(argv, "flightq") as srv:
        yield srv


def main(argv: Sequence[str] | None = None) -> int:
    """Run the loop and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--minutes", type=float, default=30.0, help="stop after this long")
    p.add_argument(
        "--warmup", type=int, help="steps before the drift counts (default: half the steps)"
    )
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--crash-every", type=int, default=25)
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument("--memory-budget", default=str(256 * 2**20), help="bytes")
    p.add_argument("--shm", action="store_true", help="clients move bytes through /dev/shm")
    p.add_argument(
        "--partition-per-step",
        action="store_true",
        help="each step in a partition of its own, declared and dropped by the trainer",
    )
    args = p.parse_args(argv)
    started = time.monotonic()
    with server_process(args.memory_budget) as srv:
        assert srv.proc is not None
        samples = list(
            run(
                srv.info["listening"],
                args.steps,
                server_pid=srv.proc.pid,
                groups=args.groups,
                group_size=args.group_size,
                crash_every=args.crash_every,
                sample_every=args.sample_every,
                shm=args.shm,
                deadline=started + 60 * args.minutes,
                progress=True,
                metrics=srv.info.get("metrics"),
                partition_per_step=args.partition_per_step,
            )
        )
    warmup = args.steps // 2 if args.warmup is None else args.warmup
    steady = [s for s in samples if s.step >= warmup] or samples[-1:]
    took = time.monotonic() - started
    route = "shared memory" if args.shm else "socket"
    print(
        f"{samples[-1].step} steps of {args.groups} x {args.group_size} rows in {took:.0f} s "
        f"({route}, budget {int(args.memory_budget) / 2**20:.0f} MiB, "
        f"a worker gone every {args.crash_every} steps"
        f"{', a partition per step' if args.partition_per_step else ''}), {os.cpu_count()} CPUs"
    )
    print(f"{'':16} {'start':>10} {'warm':>10} {'last':>10} {'per 1000 steps':>15}")
    for name, unit in Sample.COLUMNS.items():
        first, warm, last = samples[0], steady[0], samples[-1]
        print(
            f"{name:16} {getattr(first, name) / unit:>10.1f} {getattr(warm, name) / unit:>10.1f} "
            f"{getattr(last, name) / unit:>10.1f} {drift(steady, name) / unit:>+15.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
