"""Waiting for what the server says it is doing, through ``stats()``, never its internals.

A test that must know a claim or a put is blocked on the server (before it asserts the
call is not done, then unblocks it) polls the partition's public counters: ``waiting``
(claims per task), ``waiting_puts`` (puts waiting for room) and ``staged_parts`` (parts of
a put in parts waiting for the others). Every wait is bounded and fails with the last
stats it saw.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

__all__ = ["WAIT_S", "stat_until", "stat_until_async"]

#: Seconds a wait for the server's stats may take before the test fails.
WAIT_S = 30.0
#: Seconds between two polls.
_POLL_S = 0.01


def _seen(stats: dict[str, Any], partition: str, key: str) -> Any:
    return stats.get("partitions", {}).get(partition, {}).get(key)


def _fail(partition: str, key: str, want: Any, timeout: float, stats: Any) -> None:
    pytest.fail(
        f"stats()['partitions'][{partition!r}][{key!r}] never became {want!r} within "
        f"{timeout:g}s; last seen {_seen(stats, partition, key)!r} in {stats}"
    )


def stat_until(
    client: Any, partition: str, key: str, want: Any, timeout: float = WAIT_S
) -> dict[str, Any]:
    """Poll ``client.stats()`` until the partition's ``key`` equals ``want``; returns the
    partition's stats. Fails the test after ``timeout`` seconds with what it last saw."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if _seen(stats, partition, key) == want:
            return dict(stats["partitions"][partition])
        if time.monotonic() > deadline:
            _fail(partition, key, want, timeout, stats)
        time.sleep(_POLL_S)


async def stat_until_async(
    client: Any, partition: str, key: str, want: Any, timeout: float = WAIT_S
) -> dict[str, Any]:
    """:func:`stat_until` for an :class:`flightq.aio.AsyncClient`, letting the loop turn."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.stats()
        if _seen(stats, partition, key) == want:
            return dict(stats["partitions"][partition])
        if time.monotonic() > deadline:
            _fail(partition, key, want, timeout, stats)
        await asyncio.sleep(_POLL_S)
