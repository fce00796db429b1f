"""A server memory budget: a put that does not fit waits for clears, then fails typed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers_waiting import stat_until

import flightq
from flightq.server.budget import PIECE_OVERHEAD, declaration_cost


def _rows(prefix: str, n: int, s: int = 1000) -> tuple[list[str], dict[str, list[np.ndarray]]]:
    keys = [f"{prefix}{i}" for i in range(n)]
    return keys, {"input_ids": [np.full(s, i, dtype=np.int64) for i in range(n)]}


def test_put_over_budget_fails_typed_after_its_timeout_and_stores_nothing() -> None:
    # 20 000 bytes for rows and a record batch's objects, and what the declaration counts.
    budget = 20_000 + PIECE_OVERHEAD + declaration_cost("p", ["train"])
    with flightq.Server(memory_budget=budget) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", "rollout_text@1", tasks=["train"])
        keys, cols = _rows("a", 2)  # 16 000 bytes
        c.put("p", keys, cols)
        keys2, cols2 = _rows("b", 1)  # 8 000 more: over the budget
        with pytest.raises(flightq.ResourceExhaustedError, match="memory budget"):
            c.put("p", keys2, cols2, timeout=0.5)
        stats = c.stats()
        assert stats["rows"] == 2
        assert stats["partitions"]["p"]["waiting_puts"] == 0  # the put that gave up is not counted
        big_keys, big = _rows("c", 4)
        with pytest.raises(flightq.ResourceExhaustedError, match="more than the server's whole"):
            c.put("p", big_keys, big)
        assert isinstance(flightq.ResourceExhaustedError("x"), RuntimeError)
        assert not isinstance(flightq.ResourceExhaustedError("x"), MemoryError)


def test_put_waiting_for_space_lands_once_rows_are_cleared() -> None:
    # 20 000 bytes for rows and a record batch's objects, and what the declaration counts.
    budget = 20_000 + PIECE_OVERHEAD + declaration_cost("p", ["train"])
    with flightq.Server(memory_budget=budget) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", "rollout_text@1", tasks=["train"])
        keys, cols = _rows("a", 2)
        c.put("p", keys, cols)
        done: list[int] = []
        t = threading.Thread(
            target=lambda: done.append(c.put("p", *_rows("b", 1), timeout=20)), daemon=True
        )
        t.start()
        stat_until(c, "p", "waiting_puts", 1)
        assert not done, "the put must wait while the budget is full"
        c.clear("p", keys)
        t.join(timeout=20)
        assert done == [1]
        assert c.stats()["partitions"]["p"]["waiting_puts"] == 0
        assert c.get("p", ["b0"], as_="numpy")["input_ids"][0][0] == 0


def test_partition_row_limit_makes_a_put_wait_for_clears_then_fail_typed() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", "rollout_text@1", tasks=["train"], max_rows=2)
        assert c.create_partition("p", "rollout_text@1", tasks=["train"], max_rows=2) is False
        with pytest.raises(flightq.ConflictError, match="max_rows 2, got 3"):
            c.create_partition("p", "rollout_text@1", tasks=["train"], max_rows=3)
        c.put("p", *_rows("a", 2, s=10))
        with pytest.raises(flightq.ResourceExhaustedError, match="2-row limit") as full:
            c.put("p", *_rows("b", 1, s=10), timeout=0.3)
        # Typed, not read from the message: full for now, a consumer's clear makes room.
        assert full.value.retry == "full" and full.value.room_may_come and not full.value.busy
        with pytest.raises(flightq.ResourceExhaustedError, match="more than the partition's") as e:
            c.put("p", *_rows("c", 3, s=10))
        assert e.value.retry is None and not e.value.room_may_come  # no wait lifts it
        # writing a column back onto existing rows creates none: not limited
        c.put("p", ["a0"], {"prev_logprobs": [np.zeros(10, dtype=np.float32)]})
        done: list[int] = []
        t = threading.Thread(
            target=lambda: done.append(c.put("p", *_rows("d", 1, s=10), timeout=20)), daemon=True
        )
        t.start()
        stat_until(c, "p", "waiting_puts", 1)
        assert c.inspect("p")["waiting_puts"] == 1
        assert not done, "the put must wait while the partition is full"
        c.clear("p", ["a1"])
        t.join(timeout=20)
        assert done == [1]
        assert c.inspect("p")["waiting_puts"] == 0
        assert c.stats()["partitions"]["p"]["rows"] == 2
        assert c.describe("p")["max_rows"] == 2
