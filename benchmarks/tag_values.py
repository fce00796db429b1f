"""A read of some fields of rows whose tags carry large values, with and without them.

The TransferQueue compat keeps non-tensor fields (``raw_prompt``, ``reward_model``) in
the rows' tags; a read of tensor fields alone needs none of those values. Three gets of
W3's 512 rows and three of its token fields, from a ``flightq serve`` process on
127.0.0.1, interleaved, their order reversed every other round:

- ``whole``: rows whose tags also hold a ``--bytes`` value each, read as they are;
- ``hidden``: the same rows, ``hide_tag_values`` leaving those values on the server;
- ``none``: the step's rows with their own small tags (no large value stored at all).

Each read ends with ``batch.tags`` (what a reader of the rows' tags pays). Prints each
read's median ms and the paired ratio per round (median [p10-p90]) of ``whole`` over
``hidden`` and of ``hidden`` over ``none``::

    .venv/bin/python benchmarks/tag_values.py --bytes 2048 --rounds 60
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


def measure(nbytes: int = 2048, rounds: int = 60) -> dict[str, list[float]]:
    """Seconds of each read (``whole``, ``hidden``, ``none``) per round."""
    import flightq
    from flightq.registry import SchemaRegistry
    from flightq.workloads import make

    step = make("W3")
    schema = SchemaRegistry.default().get(step.schema)
    big = [{**t, PREFIX + "raw_prompt": "x" * nbytes + str(i)} for i, t in enumerate(step.tags)]
    reads = {"whole": ("big", None), "hidden": ("big", PREFIX), "none": ("small", None)}
    out: dict[str, list[float]] = {k: [] for k in reads}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(server_argv(), "flightq"))
        c = stack.enter_context(flightq.connect(server.info["listening"], [schema], timeout=60))
        for name, tags in (("big", big), ("small", step.tags)):
            c.create_partition(name, schema, tasks=["train"], group_size=step.group_size)
            c.put(name, step.keys, step.columns, tags=tags)
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
    return out


def _ratio(a: list[float], b: list[float]) -> str:
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    n = len(r)
    return f"{statistics.median(r):.2f}x [{r[n // 10]:.2f}-{r[(9 * n) // 10]:.2f}]"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=2048, help="each row's large tag value")
    p.add_argument("--rounds", type=int, default=60)
    a = p.parse_args(argv)
    if a.rounds < 1 or a.bytes < 0:
        p.error("--rounds must be at least 1 and --bytes at least 0")
    got = measure(a.bytes, a.rounds)
    print(f"W3, 3 token fields of 512 rows, a {a.bytes}-byte tag value a row: median ms")
    for k, v in got.items():
        print(f"  {k:<7} {statistics.median(v) * 1e3:7.2f}")
    print(f"  whole / hidden {_ratio(got['whole'], got['hidden'])}")
    print(f"  hidden / none  {_ratio(got['hidden'], got['none'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
