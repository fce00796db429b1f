"""A read of some fields of rows whose tags carry large values, with and without them.

The TransferQueue compat keeps non-tensor fields (``raw_prompt``, ``reward_model``) in
the rows' tags unless the schema declares them as object fields; a read of tensor fields
alone needs none of those values. Four gets of W3's 512 rows and three of its token
fields, from a ``flightq serve`` process on 127.0.0.1, interleaved, their order reversed
every other round:

- ``whole``: rows whose tags also hold a ``--bytes`` value each, read as they are;
- ``hidden``: the same rows, ``hide_tag_values`` leaving those values on the server;
- ``object``: the same values in an object field of their own (``role: object``), which
  the read does not name;
- ``none``: the step's rows with their own small tags (no large value stored at all).

Each read ends with ``batch.tags`` (what a reader of the rows' tags pays). Then, with
``--puts``, the step's put with the values in its tags against the same put with them in
the object field (fresh keys each round, cleared untimed). Prints each read's median ms
and the paired ratios per round (median [p10-p90]) of ``whole`` over ``hidden``, of
``hidden`` over ``none``, of ``whole`` and ``hidden`` over ``object``, and of the puts::

    .venv/bin/python benchmarks/tag_values.py --bytes 2048 --rounds 60 --puts 20
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence

from flightq_bench.flightq_system import server_argv
from flightq_bench.procs import ServerProcess

__all__ = ["main", "measure", "PREFIX"]

#: The tags' prefix of the large values (the compat's own, for non-tensor fields).
PREFIX = "__tq_field__:"
_FIELDS = ["input_ids", "generation_logprobs", "token_mask"]


def measure(nbytes: int = 2048, rounds: int = 60, puts: int = 0) -> dict[str, list[float]]:
    """Seconds of each read (``whole``, ``hidden``, ``object``, ``none``) per round, and
    of each put (``put tags``, ``put object``) per put round."""
    import flightq
    from flightq.registry import SchemaRegistry
    from flightq.workloads import make

    step = make("W3")
    schema = SchemaRegistry.default().get(step.schema)
    values = ["x" * nbytes + str(i) for i in range(step.rows)]
    big = [{**t, PREFIX + "raw_prompt": v} for t, v in zip(step.tags, values, strict=True)]
    objects = flightq.Schema(
        "bench_objects", 1, [*schema.fields, flightq.Field("raw_prompt", "uint8", "object")]
    )
    reads = {
        "whole": ("big", None),
        "hidden": ("big", PREFIX),
        "object": ("obj", None),
        "none": ("small", None),
    }
    out: dict[str, list[float]] = {k: [] for k in reads}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(server_argv(), "flightq"))
        c = stack.enter_context(flightq.connect(server.info["listening"], [schema], timeout=60))
        c.register_schema(objects)
        for name, tags in (("big", big), ("small", step.tags)):
            c.create_partition(name, schema, tasks=["train"], group_size=step.group_size)
            c.put(name, step.keys, step.columns, tags=tags)
        c.create_partition("obj", objects, tasks=["train"], group_size=step.group_size)
        c.put("obj", step.keys, {**step.columns, "raw_prompt": values}, tags=step.tags)
        if c.get("obj", step.keys, ["raw_prompt"], as_="numpy")["raw_prompt"] != values:
            raise AssertionError("object: the values came back other than put")
        for which, (name, hide) in reads.items():  # checked once, untimed
            got = c.get(name, step.keys, _FIELDS, as_="numpy", hide_tag_values=hide).tags
            want = [{**t, PREFIX + "raw_prompt": None} for t in step.tags] if hide else None
            if got != (want or (big if name == "big" else step.tags)):
                raise AssertionError(f"{which}: the tags came back other than put")
        order = list(reads)
        for r in range(rounds):
            for which in order if r % 2 == 0 else order[::-1]:
                name, hide = reads[which]
                t0 = time.perf_counter()
                _ = c.get(name, step.keys, _FIELDS, hide_tag_values=hide).tags
                out[which].append(time.perf_counter() - t0)
        ways = {
            "put tags": ("big", step.columns, big),
            "put object": ("obj", {**step.columns, "raw_prompt": values}, step.tags),
        }
        out.update({k: [] for k in ways})
        for r in range(puts):
            keys = [f"{k}-r{r}" for k in step.keys]
            for which in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                name, columns, tags = ways[which]
                t0 = time.perf_counter()
                c.put(name, keys, columns, tags=tags)
                out[which].append(time.perf_counter() - t0)
                c.clear(name, keys)
    return out


def _ratio(a: list[float], b: list[float]) -> str:
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    n = len(r)
    return f"{statistics.median(r):.2f}x [{r[n // 10]:.2f}-{r[(9 * n) // 10]:.2f}]"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=2048, help="each row's large tag value")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--puts", type=int, default=0, help="put rounds (0: none)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.bytes < 0 or a.puts < 0:
        p.error("--rounds must be at least 1, --bytes and --puts at least 0")
    got = measure(a.bytes, a.rounds, a.puts)
    print(f"W3, 3 token fields of 512 rows, a {a.bytes}-byte value a row: median ms")
    for k, v in got.items():
        if v:
            print(f"  {k:<10} {statistics.median(v) * 1e3:7.2f}")
    print(f"  whole / hidden   {_ratio(got['whole'], got['hidden'])}")
    print(f"  hidden / none    {_ratio(got['hidden'], got['none'])}")
    print(f"  whole / object   {_ratio(got['whole'], got['object'])}")
    print(f"  hidden / object  {_ratio(got['hidden'], got['object'])}")
    if a.puts:
        print(f"  put tags / put object {_ratio(got['put tags'], got['put object'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
