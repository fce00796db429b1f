"""``flightq bench``: the side-by-side benchmark on the reference workloads.

Examples
--------
``flightq bench --quick`` (under two minutes on 2 cores, reduced rows),
``flightq bench --workloads W2,W4 --systems raw-tcp,flightq,transferqueue``,
``flightq bench --device cuda --workloads W1,W1-bf16 --systems flightq`` (puts from and
gets into CUDA tensors against the CPU path of the same run, and the pinned
host-to-device copy as the limit), ``flightq bench --hosts 2 --link 1gbit,10gbit --quick``
(as root: across a rate-limited link between network namespaces, see
:mod:`flightq_bench.link`), ``flightq bench --shards 2,4 --hosts 8 --link 10gbit``
(shards on hosts of their own), ``flightq bench --device cuda --ranks 1,2,4,8`` (trainer
ranks, rank i claiming into ``cuda:i % device_count``, see :mod:`flightq_bench.ranks`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .procs import LoopbackError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from .runner import ALL_WORKLOADS
    from .systems import SYSTEMS

    p = argparse.ArgumentParser(
        prog="flightq bench",
        description="Measure flightq against the reference points and peers on loopback.",
    )
    p.add_argument("--quick", action="store_true", help="reduced rows, fewer repetitions")
    p.add_argument(
        "--workloads",
        default="",
        help=f"comma-separated (default: all of {','.join(ALL_WORKLOADS)}; with --ranks: W1)",
    )
    p.add_argument(
        "--systems", default="", help=f"comma-separated (default: all of {','.join(SYSTEMS)})"
    )
    p.add_argument("--out", default="bench-results", help="output folder (default bench-results/)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 3)")
    p.add_argument(
        "--pings", type=int, default=None, help="W4 round trips (default 1000, quick 150)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shards",
        default="",
        help="e.g. 1,2,4: instead of the workloads, the aggregate W1 throughput of one "
        "partition sharded over that many server processes (see flightq_bench.shards)",
    )
    p.add_argument(
        "--workers", type=int, default=4, help="worker processes for --shards (default 4)"
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="as root: run across network namespaces (flightq_bench.hosts) instead of "
        "loopback: 2 for the workloads (clients on one host, servers on the other); with "
        "--shards, hosts for the shards and the workers (at least the largest count + 1)",
    )
    p.add_argument(
        "--link",
        default="10gbit",
        help="with --hosts: the rate of every link, each direction; comma-separated rates "
        "are measured one after the other (default 10gbit)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: also flightq from and into CUDA tensors (cuda:0) and the pinned "
        "host-to-device copy, against flightq on the CPU in the same run",
    )
    p.add_argument(
        "--ranks",
        default="",
        help="e.g. 1,2,4,8: instead of the systems, that many trainer rank processes "
        "(rank i on cuda:i %% device_count with --device cuda) claiming whole groups of "
        "W1 or W2 from one server until N x --rank-steps steps are drained; aggregate GB/s "
        "and the ratio to one rank (see flightq_bench.ranks)",
    )
    p.add_argument(
        "--rank-steps",
        type=int,
        default=None,
        help="with --ranks: steps each rank drains on average (default 4, quick 1)",
    )
    p.add_argument(
        "--no-numa",
        action="store_true",
        help="with --ranks: leave the ranks' CPU affinity alone (by default each rank runs "
        "on its GPU's NUMA node where the host has several)",
    )
    return p


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _cuda_problem() -> str:
    """Why ``--device cuda`` cannot run here, or ``""``."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'flightq[torch]')"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return ""


def _shards(args: argparse.Namespace, reps: int, argv: list[str]) -> int:
    from .shards import markdown, run_shards

    try:
        counts = [int(x) for x in _split(args.shards)]
    except ValueError:
        print(
            f"flightq bench: --shards takes counts like 1,2,4, got {args.shards!r}", file=sys.stderr
        )
        return 2
    if not counts or min(counts) < 1 or args.workers < 1:
        print("flightq bench: --shards counts and --workers must be at least 1", file=sys.stderr)
        return 2
    command = shlex.join(["flightq", "bench", *argv])
    if args.hosts and args.hosts < max(counts) + 1:
        print(
            f"flightq bench: --shards {args.shards} on hosts needs --hosts of at least "
            f"{max(counts) + 1} (a host per shard and one for the workers)",
            file=sys.stderr,
        )
        return 2
    rows = run_shards(
        counts,
        workers=args.workers,
        groups=2 if args.quick else 8,
        reps=reps,
        seed=args.seed,
        progress=lambda line: print(line, flush=True),
        hosts=args.hosts,
        links=_split(args.link) if args.hosts else [],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shards.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    (out / "shards.md").write_text(markdown(rows, command))
    print(f"wrote {out / 'shards.json'}, {out / 'shards.md'}")
    return 0


def _ranks(args: argparse.Namespace, workloads: list[str], reps: int, argv: list[str]) -> int:
    from .ranks import markdown, run_ranks

    try:
        counts = [int(x) for x in _split(args.ranks)]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        print(
            f"flightq bench: --ranks takes counts like 1,2,4,8, got {args.ranks!r}", file=sys.stderr
        )
        return 2
    bad = [w for w in workloads if w not in ("W1", "W1-bf16", "W2")]
    if bad:
        print(f"flightq bench: --ranks runs W1, W1-bf16 or W2, not {bad}", file=sys.stderr)
        return 2
    steps = args.rank_steps if args.rank_steps is not None else (1 if args.quick else 4)
    if steps < 1:
        print("flightq bench: --rank-steps must be at least 1", file=sys.stderr)
        return 2
    command = shlex.join(["flightq", "bench", *argv])
    docs = [
        run_ranks(
            counts,
            workload=w,
            device=args.device,
            reps=reps,
            steps=steps,
            seed=args.seed,
            numa=not args.no_numa,
            progress=lambda line: print(line, flush=True),
        )
        for w in workloads
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks.json").write_text(json.dumps({"command": command, "runs": docs}, indent=2))
    (out / "ranks.md").write_text(markdown(docs, command))
    print(markdown(docs, command))
    print(f"wrote {out / 'ranks.json'}, {out / 'ranks.md'}")
    return 0


def _link(opts: Any, links: list[str], out: Path, t: float) -> int:
    from .hosts import TestbedError, parse_rate
    from .link import markdown, run_link

    try:
        for link in links:
            parse_rate(link)
        doc = run_link(links, opts, opts.progress)
    except (TestbedError, ValueError, LoopbackError) as e:
        print(f"flightq bench: {e}", file=sys.stderr)
        return 2
    doc["command"], doc["wall_s"] = opts.command, round(time.monotonic() - t, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "link.json").write_text(json.dumps(doc, indent=2, default=str))
    (out / "link.md").write_text(markdown(doc, opts.command))
    print(f"done in {doc['wall_s']:.0f}s: {out / 'link.json'}, {out / 'link.md'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``flightq bench``; returns the exit status (3: refused, a listener beyond loopback)."""
    from . import report
    from .runner import ALL_WORKLOADS, Options, run

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    workloads = _split(args.workloads) or (["W1"] if args.ranks else list(ALL_WORKLOADS))
    bad = [w for w in workloads if w not in ALL_WORKLOADS]
    if bad:
        print(
            f"flightq bench: unknown workload(s) {bad}; known: {', '.join(ALL_WORKLOADS)}",
            file=sys.stderr,
        )
        return 2
    reps = args.reps or (3 if args.quick else 5)
    if args.shards:
        return _shards(args, reps, argv)
    if args.ranks:
        if args.device == "cuda" and (problem := _cuda_problem()):
            print(f"flightq bench: --device cuda: {problem}", file=sys.stderr)
            return 2
        return _ranks(args, workloads, reps, argv)
    pings = args.pings or (150 if args.quick else 1000)
    if reps < 1 or pings < 1:
        print("flightq bench: --reps and --pings must be at least 1", file=sys.stderr)
        return 2
    if args.device == "cuda":
        problem = _cuda_problem()
        if problem:
            print(f"flightq bench: --device cuda: {problem}", file=sys.stderr)
            return 2
    if args.hosts and args.hosts != 2:
        print(
            "flightq bench: the workloads run on --hosts 2 (with --shards: more)", file=sys.stderr
        )
        return 2
    systems = _split(args.systems) or None
    if args.hosts and systems is None:
        from .link import DEFAULT_SYSTEMS

        systems = list(DEFAULT_SYSTEMS)
    opts = Options(
        workloads=workloads,
        systems=systems,
        quick=args.quick,
        reps=reps,
        pings=pings,
        seed=args.seed,
        # Across a slow link a repetition of W2 takes seconds: a wider budget.
        budget_s=(60.0 if args.hosts else 20.0) if args.quick else 240.0,
        command=shlex.join(["flightq", "bench", *argv]),
        progress=lambda line: print(line, flush=True),
        call_timeout=120.0 if args.quick else 300.0,
        device=args.device,
    )
    t = time.monotonic()
    if args.hosts:
        return _link(opts, _split(args.link), Path(args.out), t)
    try:
        doc = run(opts)
    except LoopbackError as e:
        print(f"flightq bench: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"flightq bench: {e}", file=sys.stderr)
        return 2
    doc["wall_s"] = round(time.monotonic() - t, 1)
    paths = report.write(doc, Path(args.out))
    print(f"done in {doc['wall_s']:.0f}s: " + ", ".join(str(p) for p in paths.values()))
    return 0
