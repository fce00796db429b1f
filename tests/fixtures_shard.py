"""Fixtures for the sharding tests: several real flightq servers on loopback port 0.

Shards run as ``python -m flightq.cli serve --port 0`` child processes (so one can be
killed with SIGKILL) or in-process (so their ``peers`` can be set once the OS has chosen
the ports). Nothing mocks the transport.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fixtures_dataplane import _ROLES, VLM, W1_GROUPS, W1_TASKS, cli_server, text_columns, text_keys

import flightq
from flightq import workloads

__all__ = [
    "SHORT",
    "cli_shards",
    "inproc_shards",
    "sharded_fixture",
    "shard_locations_fixture",
    "grouped_rows",
    "ids_of",
    "run_w1_writeback",
]

#: Seconds a call on a sharded client may take in these tests: short, so a dead shard
#: is noticed quickly, long enough for a loaded 2-core machine.
SHORT = 10.0


@contextlib.contextmanager
def cli_shards(n: int) -> Iterator[list[tuple[str, subprocess.Popen[str]]]]:
    """``n`` ``flightq serve --port 0`` processes; yields [(location, process)]."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(cli_server()) for _ in range(n)]


@contextlib.contextmanager
def inproc_shards(n: int) -> Iterator[list[flightq.Server]]:
    """``n`` in-process servers whose ``peers`` list all ``n`` locations."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(flightq.Server()) for _ in range(n)]
        for s in servers:
            s.peers = [t.location for t in servers]
        yield servers


@pytest.fixture(name="shard_locations", scope="module")
def shard_locations_fixture() -> Iterator[list[str]]:
    """Three shard processes shared by one test module."""
    with cli_shards(3) as shards:
        yield [loc for loc, _ in shards]


@pytest.fixture(name="sharded")
def sharded_fixture(shard_locations: list[str]) -> Iterator[flightq.ShardedClient]:
    """A sharded client over the module's three shards; drops what the test declared."""
    c = flightq.connect_sharded(shard_locations, ["rollout_text@1"], timeout=SHORT)
    try:
        yield c
        for p in c.partitions():
            c.drop(p)
    finally:
        c.close()


def grouped_rows(groups: int, g: int, prefix: str = "p", seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of a put of ``groups`` text groups of ``g`` rows each."""
    keys = text_keys(groups, g, prefix)
    return {"keys": keys, "columns": text_columns(keys, seed)}


def ids_of(columns: dict[str, Any], keys: list[str], all_keys: list[str]) -> list[np.ndarray]:
    """The ``input_ids`` written for ``keys`` (in that order)."""
    index = {k: i for i, k in enumerate(all_keys)}
    return [columns["input_ids"][index[k]] for k in keys]


def _w1_roles(c: Any, partition: str) -> dict[str, dict[str, Any]]:
    """The generator, logprob worker and trainer of the W1 write-back, as threads."""
    out: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(role: str) -> None:
        try:
            out[role] = _ROLES[role](c, partition)
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(r,), daemon=True)
        for r in ("trainer", "logprob", "generator")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    if errors:
        raise errors[0]
    return out


def run_w1_writeback(c: Any) -> None:
    """W1 (2 groups of 16) through ``c``: put, claim and write back, claim and verify."""
    step = workloads.w1(groups=W1_GROUPS)
    c.create_partition("w1", VLM, tasks=list(W1_TASKS), group_size=step.group_size)
    out = _w1_roles(c, "w1")
    assert out["generator"]["rows"] == step.rows
    assert sorted(out["logprob"]["keys"]) == sorted(step.keys)
    assert sorted(out["trainer"]["keys"]) == sorted(step.keys)
    assert out["trainer"]["bytes"] > step.nbytes(distinct_media=True)
    assert c.stats()["partitions"]["w1"]["rows"] == 0
