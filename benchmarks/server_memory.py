"""What a flightq server holds in memory for the rows it stores, cycle after cycle.

One ``flightq serve --port 0`` process on 127.0.0.1 (as deployed: it keeps freed memory
and runs with one malloc arena). This process puts a workload step (W2 by default: no
shared media, every byte is stored; ``--per-group``: one put per prompt group, as
generators write), gets every row by key, and clears the partition; again, ``--cycles``
times. Before the first put the server's resident set is its baseline; its peak
(``VmHWM``) is reset before the cycle's puts (all groups' puts together with
``--per-group``) and again before its get, and read from ``/proc`` after each. Printed
per cycle: the peak above the baseline as a multiple of the bytes the server holds (the
step's distinct payload bytes, shared media once); the aim is at most 1.1x. Timing
decides nothing here.

Run::

    .venv/bin/python benchmarks/server_memory.py --workload W2 --cycles 4
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import NamedTuple

from flightq_bench import payload, procs
from flightq_bench.flightq_system import server_argv

import flightq
from flightq import workloads
from flightq.client.client import DEFAULT_MAX_BATCH_BYTES

__all__ = ["Cycle", "main", "measure"]


class Cycle(NamedTuple):
    """One put, get and clear: the server's peak resident set above its baseline."""

    put_peak: int
    get_peak: int
    after_clear: int
    held: int

    @property
    def ratio(self) -> float:
        """Peak over the cycle above the baseline, per byte held."""
        return max(self.put_peak, self.get_peak) / self.held


def measure(
    name: str,
    cycles: int,
    quick: bool = False,
    put_streams: int = 4,
    batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    per_group: bool = False,
) -> tuple[int, list[Cycle]]:
    """The server's baseline RSS and one :class:`Cycle` per put/get/clear round."""
    with procs.ServerProcess(server_argv(), "flightq") as server:
        assert server.proc is not None
        location = server.info["listening"]
        step = payload.generate(name, quick=quick)
        torch_step = workloads.to_torch(step)
        # A generator puts a prompt group at a time; a benchmark the whole step at once.
        groups = step.rows // step.group_size
        puts = [torch_step.group(g) for g in range(groups)] if per_group else [torch_step]
        with flightq.connect(
            location,
            [step.schema],
            timeout=600,
            put_streams=put_streams,
            max_batch_bytes=batch_bytes,
        ) as c:
            c.create_partition("p", step.schema, tasks=["t"], group_size=step.group_size)
            pid = server.proc.pid
            base = procs.rss(pid)[0]
            out: list[Cycle] = []
            for _ in range(cycles):
                _reset_peak(pid)
                for part in puts:
                    c.put("p", part.keys, part.columns, part.tags)
                put_peak = procs.rss(pid)[1] - base
                held = int(c.stats()["partitions"]["p"]["bytes"])
                _reset_peak(pid)
                batch = c.get("p", step.keys)
                assert batch.keys == step.keys
                get_peak = procs.rss(pid)[1] - base
                del batch
                c.clear("p")
                out.append(Cycle(put_peak, get_peak, procs.rss(pid)[0] - base, held))
        return base, out


def _reset_peak(pid: int) -> None:
    if not procs.reset_peak(pid):
        raise RuntimeError(f"cannot reset the peak RSS of process {pid} (/proc/{pid}/clear_refs)")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the server's memory per cycle."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W2")
    p.add_argument("--cycles", type=int, default=4)
    p.add_argument("--put-streams", type=int, default=4)
    p.add_argument("--batch-mib", type=float, default=16, help="record-batch size of a put")
    p.add_argument("--per-group", action="store_true", help="one put per prompt group")
    p.add_argument("--quick", action="store_true", help="the reduced rows of flightq bench --quick")
    args = p.parse_args(argv)
    batch = int(args.batch_mib * 2**20)
    base, cycles = measure(
        args.workload, args.cycles, args.quick, args.put_streams, batch, args.per_group
    )
    print(
        f"{args.workload}: server baseline {base / 2**20:.0f} MiB, holds "
        f"{cycles[0].held / 2**20:.0f} MiB per step, {args.put_streams} put stream(s) of "
        f"{args.batch_mib:g} MiB record batches, "
        f"{'one put per group, ' if args.per_group else ''}{os.cpu_count()} CPUs"
    )
    print(f"{'cycle':>5} {'put peak':>9} {'get peak':>9} {'after clear':>12} {'x held':>7}")
    for i, c in enumerate(cycles):
        print(
            f"{i + 1:>5} {c.put_peak / 2**20:>8.0f}M {c.get_peak / 2**20:>8.0f}M "
            f"{c.after_clear / 2**20:>11.0f}M {c.ratio:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
