"""Claims waiting for rows are visible in stats() and inspect(), per partition and task."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import flightq

pytestmark = pytest.mark.torch  # the claims decode to torch tensors

TEXT = "rollout_text@1"
#: Seconds a claim, or a wait for the stats to show it, may take before the test fails.
TIMEOUT = 30.0


def _rows(keys: list[str]) -> dict[str, list[np.ndarray]]:
    return {"input_ids": [np.arange(4, dtype=np.int64) for _ in keys]}


def _stats_until(c: flightq.Client, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll stats() until ``ok`` holds; fail after TIMEOUT seconds."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        stats = c.stats()
        if ok(stats):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"stats never showed what was waited for; last: {stats}")
        time.sleep(0.01)


def test_a_claim_waiting_for_rows_shows_in_stats_until_a_put_satisfies_it() -> None:
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location) as producer,
        flightq.connect(srv.location) as consumer,
    ):
        producer.create_partition("p", TEXT, tasks=["train", "eval"])
        producer.create_partition("q", TEXT, tasks=["train"])
        idle = producer.stats()
        assert idle["waiting_claims"] == 0
        assert idle["partitions"]["p"]["waiting"] == {"train": 0, "eval": 0}
        got: list[flightq.Batch] = []
        claim = threading.Thread(
            target=lambda: got.append(consumer.claim("p", "train", 2, timeout=TIMEOUT)),
            daemon=True,
        )
        claim.start()
        stats = _stats_until(producer, lambda s: s["waiting_claims"] == 1)
        assert stats["partitions"]["p"]["waiting"] == {"train": 1, "eval": 0}
        assert stats["partitions"]["q"]["waiting"] == {"train": 0}
        assert producer.inspect("p")["waiting"] == {"train": 1, "eval": 0}
        producer.put("p", ["a0"], _rows(["a0"]))  # one row: the claim of 2 still waits
        assert producer.stats()["partitions"]["p"]["waiting"] == {"train": 1, "eval": 0}
        producer.put("p", ["a1"], _rows(["a1"]))
        claim.join(timeout=TIMEOUT)
        assert [b.keys for b in got] == [["a0", "a1"]]
        after = producer.stats()
        assert after["waiting_claims"] == 0
        assert after["partitions"]["p"]["waiting"] == {"train": 0, "eval": 0}


def test_a_claim_that_times_out_stops_counting_as_waiting() -> None:
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location) as c,
        flightq.connect(srv.location) as waiter,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        got: list[flightq.Batch] = []

        def claim() -> None:
            got.append(waiter.claim("p", "train", 1, timeout=TIMEOUT, wait_for=["advantages"]))

        threads = [threading.Thread(target=claim, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        _stats_until(c, lambda s: s["partitions"]["p"]["waiting"] == {"train": 2})
        with pytest.raises(flightq.ClaimTimeoutError, match="timed out"):
            c.claim("p", "train", 1, timeout=0.2, wait_for=["advantages"])
        assert c.stats()["waiting_claims"] == 2  # the claim that gave up is not counted
        keys = ["a0", "a1"]
        advantages = [np.zeros(4, dtype=np.float32) for _ in keys]
        c.put("p", keys, {**_rows(keys), "advantages": advantages})
        for t in threads:
            t.join(timeout=TIMEOUT)
        assert sorted(k for b in got for k in b.keys) == keys
        assert c.stats()["waiting_claims"] == 0
