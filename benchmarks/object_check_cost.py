"""What the server's checks of a put of an object field cost: one put of message logs.

A put of ``--rows`` rows of one object field, each row a message log of three turns of
``--words`` words of this repository's README, encoded once; then, in this process, the
server's checks of that record batch (:func:`flightq.server.media.media_piece`'s: the shape
column against the cap, validation, the value check), timed ``--reps`` times for each
form, interleaved:

- ``raw``: the field without a codec;
- ``zstd``: with a zstd codec, each frame decoded once (validation holds the frames'
  headers to their shapes and leaves the decode to the value check, as the server does);
- ``zstd twice``: the same batch, validation also decoding each frame (the server before
  it shared the decode): the baseline of ``zstd``.

Every timed call is checked to accept the batch. Prints each form's median ms [min-max],
the values' MB/s and the paired ratio per rep ``zstd twice`` / ``zstd`` (median
[min-max])::

    .venv/bin/python benchmarks/object_check_cost.py --rows 512 --reps 40
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flightq
from flightq.objects import check_columns, check_sizes, coded
from flightq.validation import validate

__all__ = ["FORMS", "main", "measure"]

FORMS = ("raw", "zstd", "zstd twice")
_README = Path(__file__).resolve().parent.parent / "README.md"


def _logs(rows: int, words: int, seed: int = 0) -> list[Any]:
    vocab = _README.read_text().split()
    rng = random.Random(seed)
    return [
        [
            {"role": r, "content": " ".join(rng.choice(vocab) for _ in range(words))}
            for r in ("system", "user", "assistant")
        ]
        for _ in range(rows)
    ]


def _schema(codec: dict[str, Any] | None) -> flightq.Schema:
    field: dict[str, Any] = {"name": "message_log", "role": "object"}
    if codec is not None:
        field["codec"] = codec
    return flightq.Schema.from_dict({"name": "object_check", "version": 1, "fields": [field]})


def measure(
    rows: int = 512, words: int = 150, reps: int = 40
) -> tuple[dict[str, list[float]], int]:
    """Seconds of each form's checks per rep, and the values' msgpack bytes."""
    import msgpack

    logs = _logs(rows, words)
    keys = [f"r{i}" for i in range(rows)]
    raw, zstd = _schema(None), _schema({"id": "zstd", "level": 3})
    batches = {s: flightq.encode(s, {"message_log": logs}, keys) for s in (raw, zstd)}

    def check(schema: flightq.Schema, decoded: frozenset[str]) -> None:
        rb = batches[schema]
        check_sizes(rb, schema.fields, None)
        checked = validate(rb, schema, decoded=decoded)
        check_columns(rb, schema.fields, None)
        if checked.keys != keys:
            raise AssertionError("the checks did not accept the batch as put")

    calls = {
        "raw": lambda: check(raw, coded(raw.fields)),
        "zstd": lambda: check(zstd, coded(zstd.fields)),
        "zstd twice": lambda: check(zstd, frozenset()),
    }
    for call in calls.values():
        call()  # warm, and checked once before anything is timed
    out: dict[str, list[float]] = {k: [] for k in FORMS}
    for r in range(reps):
        for k in FORMS if r % 2 == 0 else FORMS[::-1]:
            t0 = time.perf_counter()
            calls[k]()
            out[k].append(time.perf_counter() - t0)
    return out, sum(len(msgpack.packb(v)) for v in logs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--words", type=int, default=150, help="words per turn (three turns a row)")
    p.add_argument("--reps", type=int, default=40)
    a = p.parse_args(argv)
    got, nbytes = measure(a.rows, a.words, a.reps)
    print(f"server checks of one put of {a.rows} message logs ({nbytes / 1e6:.2f} MB of values)")
    for k, ts in got.items():
        med = statistics.median(ts)
        print(
            f"  {k:<11} {med * 1e3:7.2f} ms [{min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}]"
            f"  {nbytes / med / 1e6:7.0f} MB/s"
        )
    r = [b / a for a, b in zip(got["zstd"], got["zstd twice"], strict=True)]
    print(f"  zstd twice / zstd {statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
