"""The ``flightq`` command line.

``flightq schema list | show NAME@V | diff A B | check DIR | draft SAMPLE``, ``flightq serve``,
``flightq stats LOCATION``, ``flightq inspect LOCATION PARTITION``, ``flightq demo`` and
``flightq bench``. Heavy modules are imported inside each command, so ``flightq --help``
stays fast and works without torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

from .errors import FlightqError
from .registry import SchemaRegistry
from .schema import Schema, diff_schemas

__all__ = ["main", "parse_bytes"]

#: Units a size on the command line may carry: decimal ones powers of 1000, binary ones
#: of 1024 (case aside).
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """A size given on the command line: ``67108864``, ``64MiB``, ``8GB``, ``1.5GiB``.

    Raises
    ------
    argparse.ArgumentTypeError
        For anything else, naming what it takes.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 67108864, 64MiB, 8GB or 1.5GiB, got {text!r}"
        )
    return int(Decimal(m.group(1)) * unit)


def _version() -> str:
    from . import __version__

    return __version__


def _registry(args: argparse.Namespace) -> SchemaRegistry:
    if getattr(args, "schemas", None):
        return SchemaRegistry.from_dir(args.schemas)
    return SchemaRegistry.default()


def _resolve(reg: SchemaRegistry, ref: str) -> Schema:
    if ref.endswith(".json"):
        with open(ref, "rb") as fh:
            return Schema.from_json(fh.read())
    return reg.get(ref)


def _cmd_schema(args: argparse.Namespace) -> int:
    reg = _registry(args)
    if args.action == "list":
        for s in reg:
            req = ", ".join(s.required)
            print(f"{s.ref:28} {s.fingerprint}  {len(s)} fields (required: {req})")
        return 0
    if args.action == "show":
        s = _resolve(reg, args.ref)
        if args.json:
            print(s.to_json(), end="")
            return 0
        print(f"{s.ref}  fingerprint {s.fingerprint}")
        if s.doc:
            print(f"  {s.doc}")
        for f in s.fields:
            shape = "any rank" if f.shape is None else json.dumps(list(f.shape))
            extra = " required" if f.required else ""
            codec = "" if f.codec.id == "raw" else f" codec={f.codec.to_dict()}"
            print(f"  {f.name:28} {f.dtype:14} {f.role:7} {shape}{extra}{codec}")
        return 0
    if args.action == "diff":
        a, b = _resolve(reg, args.a), _resolve(reg, args.b)
        lines = diff_schemas(a, b)
        if not lines:
            print(f"{a.ref} and {b.ref} are identical (fingerprint {a.fingerprint})")
            return 0
        for line in lines:
            print(line)
        return 1
    if args.action == "check":
        reg = SchemaRegistry.from_dir(args.dir)
        if not len(reg):
            print(
                f"flightq: no schemas under {args.dir!r}: a schema folder holds "
                "<name>/v<N>.json files (see schemas/README.md)",
                file=sys.stderr,
            )
            return 1
        for s in reg:
            print(f"ok  {s.ref:28} {s.fingerprint}")
        print(f"{len(reg)} schema versions follow the evolution rules")
        return 0
    if args.action == "draft":
        return _draft(args)
    raise AssertionError(args.action)


def _draft(args: argparse.Namespace) -> int:
    """``schema draft``: a schema JSON from a sample saved with ``torch.save``."""
    from .draft import draft_schema

    try:
        import torch
    except ImportError:
        print("flightq: schema draft loads its sample with torch: install torch", file=sys.stderr)
        return 2
    try:
        sample = torch.load(args.sample, weights_only=not args.trust_pickle)
    except Exception as e:  # torch.load raises many kinds; name the file and the way out
        print(
            f"flightq: cannot load {args.sample!r} as a dict of tensors ({type(e).__name__}: "
            f"{e}); a saved TensorDict or nested tensors need --trust-pickle (only for files "
            "you made: unpickling runs code)",
            file=sys.stderr,
        )
        return 2
    s = draft_schema(sample, args.name, args.version)
    if args.out is None:
        print(s.to_json(), end="")
        return 0
    dest = Path(args.out) / s.name / f"v{s.version}.json"
    if dest.exists():
        print(f"flightq: {dest} exists; schema versions are immutable", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(s.to_json())
    print(f"wrote {dest} ({len(s)} fields): review roles, shapes and required, then commit")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server.flight import serve_forever

    return serve_forever(args)


def _cmd_stats(args: argparse.Namespace) -> int:
    from .tools import stats

    return stats(args.location, as_json=args.json)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools import inspect

    return inspect(args.location, args.partition, as_json=args.json)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, workload=args.workload)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flightq", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"flightq {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("schema", help="list, show, diff and check schemas")
    sp.add_argument("--schemas", help="a schema folder instead of the shipped one")
    # The same option after the action (``schema list --schemas DIR``); SUPPRESS keeps
    # what came before the action when it is not repeated.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--schemas", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ssub = sp.add_subparsers(dest="action", required=True)
    ssub.add_parser("list", help="every schema version with its fingerprint", parents=[after])
    show = ssub.add_parser("show", help="one schema's fields", parents=[after])
    show.add_argument("ref", help="NAME@V, NAME (latest) or a .json file")
    show.add_argument("--json", action="store_true", help="print the JSON document")
    diff = ssub.add_parser(
        "diff", help="field-by-field differences (exit 1 if any)", parents=[after]
    )
    diff.add_argument("a")
    diff.add_argument("b")
    check = ssub.add_parser(
        "check", help="load a folder and check the evolution rules", parents=[after]
    )
    check.add_argument("dir")
    dr = ssub.add_parser(
        "draft",
        parents=[after],
        help="write a schema from a sample batch, for review",
        description="Write a schema JSON declaring every entry of a sample batch (a dict "
        "of batched tensors or a TensorDict, saved with torch.save): nested tensors and "
        "dense tensors of rank >= 2 as token fields, 1-D tensors as scalars, lists of "
        "tensor lists as media. Review the roles, shapes and required flags, then commit.",
    )
    dr.add_argument("sample", help="a file written by torch.save")
    dr.add_argument("--name", required=True, help="the schema's name")
    dr.add_argument("--version", type=int, default=1)
    dr.add_argument("--out", help="a schema folder: writes OUT/NAME/vVERSION.json (else stdout)")
    dr.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load with full unpickling (TensorDicts, nested tensors): only files you made",
    )
    sp.set_defaults(func=_cmd_schema)

    sv = sub.add_parser(
        "serve",
        help="run a flightq server in the foreground",
        description="Run a flightq server in the foreground until SIGINT or SIGTERM. It "
        "prints one JSON line once it listens: the location, the schemas and what it set "
        "in its own allocator. This command tunes glibc's malloc of its own process (and "
        "only its own, see flightq.memory): it restarts itself once with "
        "MALLOC_ARENA_MAX=1 unless the environment sets MALLOC_ARENA_MAX, and keeps freed "
        "memory for the next transfer (mmap threshold 32 MiB, trim threshold 2 GiB) "
        'instead of returning it to the kernel; the startup line\'s "malloc" entry says '
        "what took.",
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    sv.add_argument("--port", type=int, default=8815)
    sv.add_argument("--schemas", help="schema folder (default: the shipped schemas)")
    sv.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="bytes the store may hold (67108864, 64MiB, 8GB, ...)",
    )
    sv.add_argument(
        "--memory-cap",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="limit on the process's data segment (RLIMIT_DATA): an allocation past it fails "
        "and its call is refused, ResourceExhaustedError (default: its size at start + 4x "
        "the budget, or the host's memory without one, + thread stacks + 2 GiB; 0: none; "
        "Linux)",
    )
    sv.add_argument(
        "--max-batch-bytes",
        type=parse_bytes,
        default=None,
        help="payload bytes per record batch of an answer (default 16 MiB; hosts with "
        "cores to spare for the reader may gain from 8 MiB, see docs/performance.md)",
    )
    sv.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="largest control message a client may send (a ticket, an action body, a "
        "descriptor), in bytes and in the Python objects it decodes to: past it a call is "
        "refused before it is decoded, ResourceExhaustedError (default 16 MiB, at least "
        "2 MiB)",
    )
    sv.add_argument(
        "--max-tags-bytes",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="longest tags a put may give one row, in msgpack bytes: past it the put is "
        "refused, ResourceExhaustedError (default 64 KiB, at most 16 MiB; raise it for rows "
        "carrying large non-tensor values, such as the TransferQueue compat's message logs)",
    )
    sv.add_argument(
        "--peers",
        help="every shard's location, comma-separated, this one's included "
        "(GetFlightInfo lists one endpoint per peer; see docs/sharding.md)",
    )
    sv.add_argument(
        "--max-calls",
        type=int,
        default=None,
        help="calls in flight at once (puts, reads, claims, actions; default 128): past it "
        "a call is refused at once, ResourceExhaustedError 'server busy'",
    )
    sv.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="consumer sessions open at once, counted apart from --max-calls (default 128)",
    )
    sv.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="cut the connection of a client whose put stream sends nothing, or who takes "
        "nothing of an answer, for this long; every call on that connection ends and the "
        "client reconnects on its next call; consumer sessions are never cut; 0: never; "
        "Linux only (default 60)",
    )
    sv.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long calls in flight may take to end (a stream its "
        "client stalls is cut after half of it, or --idle-timeout if shorter); past it the "
        "process exits without them (default 10)",
    )
    sv.add_argument("--snapshot-dir", help="directory the snapshot action writes into")
    sv.add_argument("--restore", help="a snapshot directory to load before serving")
    sv.add_argument("--tls-cert", help="PEM certificate: serve grpc+tls:// (with --tls-key)")
    sv.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sv.add_argument("--token-file", help="accepted bearer tokens, one per line")
    sv.add_argument(
        "--tokens-from-env",
        action="store_true",
        help="accepted bearer tokens from $FLIGHTQ_TOKENS, one per line",
    )
    sv.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="what the server logs to stderr: info adds start, stop and every refused call "
        "(class, partition, key); debug adds every request (default warning)",
    )
    sv.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:N/metrics (0: any free port; the "
        "startup line's \"metrics\" says where); needs pip install 'flightq[metrics]'",
    )
    sv.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default loopback: metrics name "
        "partitions and tasks)",
    )
    sv.set_defaults(func=_cmd_serve)

    st = sub.add_parser("stats", help="what a running server holds")
    st.add_argument("location", help="e.g. grpc://127.0.0.1:8815")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_stats)

    ins = sub.add_parser("inspect", help="one partition of a running server")
    ins.add_argument("location")
    ins.add_argument("partition")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=_cmd_inspect)

    dm = sub.add_parser("demo", help="a generator, a logprob worker and a trainer over loopback")
    dm.add_argument("--steps", type=int, default=3)
    dm.add_argument(
        "--workload",
        choices=["W1", "W5", "W5-copies"],
        default="W1",
        help="W1: a put per prompt group; W5: two generators putting a row per put as "
        "generations finish (W5-copies: each row's image its own array)",
    )
    dm.set_defaults(func=_cmd_demo)

    bn = sub.add_parser("bench", help="the side-by-side benchmark (see flightq bench --help)")
    bn.add_argument("rest", nargs=argparse.REMAINDER)
    bn.set_defaults(func=None)
    return p


#: Where a source checkout keeps the benchmark harness (it does not ship in the wheel).
_BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(argv: list[str]) -> int:
    """``flightq bench``: the harness of a source checkout (``benchmarks/flightq_bench``)."""
    if not (_BENCH_DIR / "flightq_bench" / "__init__.py").is_file():
        print(
            "flightq bench runs from a source checkout: the harness lives in "
            "benchmarks/flightq_bench and does not ship in the wheel. Clone the repository, "
            "then run `make bench` (or `pip install -e '.[torch,bench,peers]'` and "
            "`flightq bench`) there.",
            file=sys.stderr,
        )
        return 2
    if str(_BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(_BENCH_DIR))
    from flightq_bench.cli import main as bench_main

    return int(bench_main(argv))


#: The commands, and the actions of ``flightq schema``.
_COMMANDS = ("schema", "serve", "stats", "inspect", "demo", "bench")
_SCHEMA_ACTIONS = ("list", "show", "diff", "check", "draft")


def _options_after(argv: list[str], names: Sequence[str]) -> list[str]:
    """``argv`` with the options before its first word in ``names`` moved after it:
    argparse reads a command's options only after the command's name, and people type
    ``flightq --json stats LOCATION`` too. A word after an option is taken as its value."""
    for i, word in enumerate(argv):
        if word in names:
            return [word, *argv[:i], *argv[i + 1 :]]
        if not word.startswith("-") and (i == 0 or not argv[i - 1].startswith("-")):
            break  # a positional before any command: leave it to argparse
    return argv


def _reordered(argv: list[str]) -> list[str]:
    """Options before or after the command, and before or after schema's action."""
    argv = _options_after(argv, _COMMANDS)
    if argv[:1] == ["schema"]:
        argv = ["schema", *_options_after(argv[1:], _SCHEMA_ACTIONS)]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    own = argv is None
    argv = _reordered(list(sys.argv[1:] if argv is None else argv))
    if own and argv[:1] == ["serve"]:
        from .memory import exec_with_one_arena

        exec_with_one_arena(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlightqError as e:
        print(f"flightq: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
