"""Which shard holds a row, and how rows from several shards are put back in order.

A sharded partition lives on N flightq servers. Every row goes to the shard chosen by
rendezvous (highest-random-weight) hashing of its *routing key* over the shards'
locations: each shard scores the key with a stable hash (BLAKE2b, never Python's salted
``hash()``), the highest score wins. Every process computes the same answer, and adding
a shard moves only the keys the new shard now wins (about ``1 / (N + 1)`` of them);
removing one moves only the keys it held.

The routing key of a row is its *group prefix*: the key up to the last ``_g<digits>``
(the NeMo RL convention ``"{group_uuid}_g{i}"``), or the whole key when it has no such
suffix. All generations of one prompt group therefore live on one shard, so a group is
never split by a put and a group claim never spans shards. See ``docs/sharding.md``.

This module knows no network: :class:`Router` maps keys to shards, :func:`merge` joins
the record batches that several shards returned for one request back into request order,
:func:`gather` is the claim's search over shards, the rest combines shards' answers.

Examples
--------
>>> from flightq.sharding.router import Router, group_key
>>> group_key("3f2a9c_g12"), group_key("prompt7"), group_key("a_g1_g2")
('3f2a9c', 'prompt7', 'a_g1')
>>> r = Router(["grpc://10.0.0.1:8815", "grpc://10.0.0.2:8815"])
>>> r.shard_of("3f2a9c_g0") == r.shard_of("3f2a9c_g15")
True
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from ..errors import ShapeError
from ..layout import KEY, arrow_schema, schema_of

__all__ = [
    "Router",
    "group_key",
    "score",
    "merge",
    "keys_of",
    "runs",
    "spans",
    "sequential",
    "gather",
    "sum_description",
    "sum_stats",
]

_GROUP_SUFFIX = re.compile(r"_g\d+\Z")


def group_key(key: str) -> str:
    """The routing key of a row key: the prefix before the last ``_g<digits>``, else the key.

    Parameters
    ----------
    key:
        A row key, e.g. ``"3f2a9c_g12"``.

    Returns
    -------
    str
        ``"3f2a9c"`` for ``"3f2a9c_g12"``; ``"prompt7"`` for ``"prompt7"``.
    """
    m = _GROUP_SUFFIX.search(key)
    return key[: m.start()] if m else key


def score(location: str, routing_key: str) -> int:
    """The rendezvous weight of ``routing_key`` on the shard at ``location``.

    A 64-bit BLAKE2b of both, so the same in every process and on every platform.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(location.encode())
    h.update(b"\x00")
    h.update(routing_key.encode())
    return int.from_bytes(h.digest(), "big")


#: Routing keys whose shard a :class:`Router` remembers: a long run meets endless new
#: groups and sees each only during its step, so the memo is emptied once full (the
#: groups of the current steps fill it again) instead of keeping the first ones forever.
MEMO_KEPT = 1 << 16


class Router:
    """Maps row keys to shards by rendezvous hashing of their routing key.

    Parameters
    ----------
    locations:
        The shards' locations. They are the shards' identity: every client of a sharded
        partition must list the same strings (their order does not matter).
    key_fn:
        Row key to routing key; :func:`group_key` by default. Rows that must stay
        together (a prompt group) must share a routing key.

    Raises
    ------
    ValueError
        If ``locations`` is empty or repeats a location.
    """

    def __init__(self, locations: Sequence[str], key_fn: Callable[[str], str] = group_key) -> None:
        self.locations = list(locations)
        if not self.locations:
            raise ValueError("a sharded client needs at least one shard location")
        if len(set(self.locations)) != len(self.locations):
            raise ValueError(f"shard locations repeat: {self.locations}")
        self.key_fn = key_fn
        self._memo: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.locations)

    def shard_of(self, key: str) -> int:
        """Index (into :attr:`locations`) of the shard holding row ``key``."""
        rk = self.key_fn(key)
        s = self._memo.get(rk)
        if s is None:
            scores = [score(loc, rk) for loc in self.locations]
            s = max(range(len(scores)), key=scores.__getitem__)
            if len(self._memo) >= MEMO_KEPT:  # long runs create endless groups
                self._memo.clear()
            self._memo[rk] = s
        return s

    def split(self, keys: Sequence[str]) -> dict[int, list[int]]:
        """Positions of ``keys`` per shard index, each list in request order."""
        out: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            out.setdefault(self.shard_of(k), []).append(i)
        return out

    def check_groups(self, keys: Sequence[str], group_size: int | None, what: str) -> None:
        """Refuse a put whose ``group_size`` consecutive rows do not share a routing key.

        The server forms groups from a put's new rows taken ``group_size`` at a time, so
        each such run must go to one shard whole. Only puts of a multiple of
        ``group_size`` rows are checked (others cannot create rows in a grouped partition).

        Raises
        ------
        ShapeError
            Naming the rows of the group and their routing keys.
        """
        g = group_size or 0
        if g <= 1 or len(keys) % g:
            return
        for lo in range(0, len(keys), g):
            chunk = keys[lo : lo + g]
            rks = sorted({self.key_fn(k) for k in chunk})
            if len(rks) > 1:
                raise ShapeError(
                    f"{what}: rows {lo}..{lo + g - 1} (keys {chunk[0]!r}..{chunk[-1]!r}) form "
                    f"one group of {g} but have routing keys {rks[:4]}; a group must live on "
                    "one shard: key its rows '{group}_g{i}' with one group prefix, list whole "
                    "groups in order, or give the client a key_fn"
                )


def _unify(tables: list[pa.Table]) -> list[pa.Table]:
    """The same tables, all with the union of their columns (nulls where absent)."""
    names = [tuple(t.column_names) for t in tables]
    if all(n == names[0] for n in names):
        return tables
    schema = schema_of(tables[0].schema)
    present = {c for t in tables for c in t.column_names}
    target = arrow_schema(schema, [f.name for f in schema.fields if f.name in present])
    out = []
    for t in tables:
        cols = [
            t.column(f.name) if f.name in t.column_names else pa.nulls(len(t), f.type)
            for f in target
        ]
        out.append(pa.Table.from_arrays(cols, schema=target))
    return out


def merge(
    n: int, parts: Sequence[tuple[Sequence[int], Sequence[pa.RecordBatch]]]
) -> list[pa.RecordBatch]:
    """Join several shards' answers to one request into the request's row order.

    Parameters
    ----------
    n:
        Rows of the whole answer.
    parts:
        Per shard: the positions (in the answer) of its rows, and its record batches,
        whose rows come in that order.

    Returns
    -------
    list of pyarrow.RecordBatch
        One schema for all (the union of the shards' columns, nulls where a shard's rows
        lack one). Runs of rows that stay together (a group) are zero-copy slices; when
        the order interleaves shards row by row, the rows are gathered with one ``take``
        (a copy).
    """
    if len(parts) == 1:
        return list(parts[0][1])
    tables = _unify([pa.Table.from_batches(list(b)) for _, b in parts])
    owner = [0] * n
    row = [0] * n
    for j, (pos, _) in enumerate(parts):
        for r, i in enumerate(pos):
            owner[i], row[i] = j, r
    runs: list[tuple[int, int, int]] = []  # (part, first row, length)
    for i in range(n):
        if runs and runs[-1][0] == owner[i] and runs[-1][1] + runs[-1][2] == row[i]:
            j, r0, m = runs[-1]
            runs[-1] = (j, r0, m + 1)
        else:
            runs.append((owner[i], row[i], 1))
    if len(runs) <= max(16, n // 8):
        out = [b for j, r0, m in runs for b in tables[j].slice(r0, m).to_batches() if b.num_rows]
    else:
        starts = [0]
        for t in tables[:-1]:
            starts.append(starts[-1] + len(t))
        idx = pa.array([starts[owner[i]] + row[i] for i in range(n)], type=pa.int64())
        out = [b for b in pa.concat_tables(tables).take(idx).to_batches() if b.num_rows]
    if not out:
        out = [pa.RecordBatch.from_pylist([], schema=tables[0].schema)]
    return _cut_repeats(out)


def _cut_repeats(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """Cut batches where a key repeats: keys are unique within one flightq batch."""
    out: list[pa.RecordBatch] = []
    for b in batches:
        keys = b.column(KEY).to_pylist()
        if len(set(keys)) == len(keys):
            out.append(b)
            continue
        seen: set[str] = set()
        lo = 0
        for i, k in enumerate(keys):
            if k in seen:
                out.append(b.slice(lo, i - lo))
                lo, seen = i, set()
            seen.add(k)
        out.append(b.slice(lo, len(keys) - lo))
    return out


def keys_of(batches: Sequence[pa.RecordBatch]) -> list[str]:
    """Row keys of a sequence of flightq record batches, in order."""
    return [k for b in batches for k in b.column(KEY).to_pylist()]


def spans(pos: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending, non-empty positions as ``[lo, hi)`` ranges of consecutive ones."""
    out: list[tuple[int, int]] = []
    lo = prev = pos[0]
    for i in pos[1:]:
        if i != prev + 1:
            out.append((lo, prev + 1))
            lo = i
        prev = i
    out.append((lo, prev + 1))
    return out


def runs(batch: pa.RecordBatch, pos: Sequence[int]) -> list[pa.RecordBatch]:
    """Zero-copy slices of ``batch`` covering rows ``pos`` (ascending, non-empty), run by run."""
    return [batch.slice(lo, hi - lo) for lo, hi in spans(pos)]


def sequential(
    got: Sequence[tuple[int, Sequence[pa.RecordBatch]]],
) -> list[tuple[range, Sequence[pa.RecordBatch]]]:
    """``(shard, batches)`` answers laid end to end, as :func:`merge` parts."""
    parts: list[tuple[range, Sequence[pa.RecordBatch]]] = []
    at = 0
    for _, bs in got:
        m = sum(b.num_rows for b in bs)
        parts.append((range(at, at + m), bs))
        at += m
    return parts


def gather(
    order: Sequence[int],
    need: int,
    unit: int,
    take: Callable[[int, int, float], int],
    deadline: float,
    poll: float,
    after_sweep: Callable[[int], None] | None = None,
) -> int:
    """Gather ``need`` rows from shards, ``unit`` (the group size) at a time at least.

    Sweeps the shards in ``order``, asking each without waiting for what is still needed,
    halving the size (in whole units) until it gives some or nothing is left to ask.
    When a sweep brings nothing, waits on one shard (rotating) for ``poll`` seconds for
    one unit. Stops at ``deadline`` (``time.monotonic()``).

    Parameters
    ----------
    take:
        ``take(shard, size, seconds)`` claims ``size`` rows on ``shard``, waiting up to
        ``seconds``, and returns the rows it took: ``size``, 0 when not enough were ready,
        or fewer when the shard answered with the rest of a group acked in part (a
        remnant), which ends the gathering short.
    after_sweep:
        Called with the rows still missing after each sweep that did not finish; may
        raise to stop (e.g. when a shard was unreachable).

    Returns
    -------
    int
        Rows still missing: 0 when all were gathered (or a remnant ended it short).
    """
    turn = 0
    while need:
        progressed = False
        for s in order:
            size = need
            while need and size >= unit:
                taken = take(s, size, 0.0)
                if 0 < taken < size:
                    return 0  # a remnant: the claim ends short rather than strand it
                need -= taken
                progressed = progressed or bool(taken)
                size = min(size, need) if taken else size // 2 // unit * unit
            if not need:
                return 0
        if after_sweep is not None:
            after_sweep(need)
        left = deadline - time.monotonic()
        if left <= 0:
            return need
        if not progressed:
            taken = take(order[turn % len(order)], unit, min(left, poll))
            if 0 < taken < unit:
                return 0
            need -= taken
            turn += 1
    return 0


def sum_description(ds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One partition's description summed over shards (rows, bytes, per-task counts)."""
    out = dict(ds[0])
    for k in ("rows", "bytes", "held", "waiting_puts", "staged_parts", "claims"):
        if k in out:
            out[k] = sum(int(d.get(k, 0)) for d in ds)
    for k in ("delivered", "acked", "leased", "dead", "waiting", "fields", "ready"):
        if k in out:
            acc: dict[str, int] = {}
            for d in ds:
                for name, v in d.get(k, {}).items():
                    acc[name] = acc.get(name, 0) + int(v)
            out[k] = acc
    return out


def sum_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several shards' ``stats`` answers as one: partitions, rows and bytes summed."""
    names = sorted({p for st in stats for p in st.get("partitions", {})})
    parts = {
        p: sum_description([st["partitions"][p] for st in stats if p in st["partitions"]])
        for p in names
    }
    return {
        "partitions": parts,
        "rows": sum(int(st.get("rows", 0)) for st in stats),
        "bytes": sum(int(st.get("bytes", 0)) for st in stats),
        "held": sum(int(st.get("held", 0)) for st in stats),
        "waiting_claims": sum(int(st.get("waiting_claims", 0)) for st in stats),
        "counters": _sum_counters([st.get("counters") for st in stats]),
    }


def _sum_counters(each: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Several shards' counters summed (refusals per class too); None if none has any."""
    have = [c for c in each if c]
    if not have:
        return None
    out: dict[str, Any] = {k: 0 for k in have[0] if k != "refusals"}
    refusals: dict[str, int] = {}
    for c in have:
        for k, v in c.items():
            if k == "refusals":
                for cls, n in v.items():
                    refusals[cls] = refusals.get(cls, 0) + n
            else:
                out[k] = out.get(k, 0) + v
    out["refusals"] = dict(sorted(refusals.items()))
    return out
