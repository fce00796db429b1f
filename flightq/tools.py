"""``flightq stats`` and ``flightq inspect``: what a running server holds, for people."""

from __future__ import annotations

import json
from typing import Any

from .client.client import Client

__all__ = ["stats", "inspect", "human_bytes"]


def human_bytes(n: float) -> str:
    """``1536`` to ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def stats(location: str, as_json: bool = False) -> int:
    """Print every partition of the server at ``location``: rows, bytes, per-task progress."""
    with Client(location, timeout=10) as c:
        s = c.stats()
    if as_json:
        print(json.dumps(s, indent=2, sort_keys=True))
        return 0
    size, held = human_bytes(s["bytes"]), human_bytes(s.get("held", 0))
    print(f"{location}: {len(s['partitions'])} partitions, {s['rows']} rows, {size} ({held} held)")
    if s["partitions"]:
        head = f"  {'partition':20} {'schema':22} {'group':>5} {'rows':>7} {'bytes':>11}"
        print(f"{head}  delivered per task")
    for name, p in sorted(s["partitions"].items()):
        delivered = ", ".join(f"{t}={n}" for t, n in p["delivered"].items()) or "-"
        g = p["group_size"] or "-"
        size = human_bytes(p["bytes"])
        print(f"  {name:20} {p['schema']:22} {g!s:>5} {p['rows']:>7} {size:>11}  {delivered}")
    return 0


def inspect(location: str, partition: str, as_json: bool = False) -> int:
    """Print one partition: its schema, fields present, delivered and ready rows per task."""
    with Client(location, timeout=10) as c:
        d: dict[str, Any] = c.inspect(partition)
        decl = c.describe(partition)
    if as_json:
        print(json.dumps({**d, "declaration": decl}, indent=2, sort_keys=True))
        return 0
    print(f"partition {partition!r} on {location}")
    print(f"  schema      {d['schema']} ({d['fingerprint']})")
    print(f"  tasks       {', '.join(d['tasks']) or '-'}; group size {d['group_size'] or '-'}")
    size, held = human_bytes(d["bytes"]), human_bytes(d.get("held", 0))
    print(f"  rows        {d['rows']} ({size} payload, {held} held)")
    print("  fields present (rows):")
    for name, n in d["fields"].items():
        print(f"    {name:28} {n}")
    print("  per task:    delivered / ready now (rows with the required fields)")
    for t in d["tasks"]:
        print(f"    {t:28} {d['delivered'][t]} / {d['ready'][t]}")
    return 0
