"""Waiting claims wake when a put may serve them: the store, real threads, no network.

A put wakes only the claims on its partition whose task now has as many ready rows as
they take; every other change wakes every waiting claim. A claim here waits with no
``cancelled`` to poll (the server's claims poll theirs every 0.2 s) and a timeout ten
times as long as the test waits for it, so a wake that is missed leaves it waiting and the
test fails; a claim woken as it should be returns at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from flightq import SchemaRegistry, encode
from flightq.errors import ClaimTimeoutError, NotFoundError, UnavailableError
from flightq.server.partition import make_piece
from flightq.server.store import Store
from flightq.validation import validate

TEXT = SchemaRegistry.default().get("rollout_text@1")
#: Seconds a claim waits, or the test waits for the store to show something, before failing.
TIMEOUT = 30.0


def _put(store: Store, name: str, keys: list[str], advantages: bool = False) -> None:
    cols: dict[str, Any] = {"input_ids": [np.arange(4, dtype=np.int64) for _ in keys]}
    if advantages:
        cols = {"advantages": [np.zeros(4, dtype=np.float32) for _ in keys]}
    rb = encode(TEXT, cols, keys)
    store.put(name, [make_piece(rb, validate(rb, TEXT))], overwrite=False)


class _Claim(threading.Thread):
    """One claim waiting in the store on a thread of its own; ``keys`` once it returns."""

    def __init__(self, store: Store, name: str, task: str, n: int, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.args_ = (store, name, task, n, kw)
        self.keys: list[str] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        store, name, task, n, kw = self.args_
        try:
            _, rows, _, _ = store.claim(name, task, n, None, 10 * TIMEOUT, **kw)
            self.keys = [r.key for r in rows]
        except BaseException as e:
            self.error = e

    def result(self) -> list[str]:
        self.join(TIMEOUT + 5)
        if self.error is not None:
            raise self.error
        assert self.keys is not None, "the claim never returned"
        return self.keys


def _until(ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail("the store never showed what was waited for")
        time.sleep(0.005)


def _waiting(store: Store, n: int) -> None:
    _until(lambda: store.stats()["waiting_claims"] == n)


def test_a_put_wakes_a_claim_once_its_rows_are_all_there() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    store.declare("q", TEXT, ["train"], None)
    claim = _Claim(store, "p", "train", 3)
    _waiting(store, 1)
    _put(store, "p", ["a0", "a1"])  # two of three: it waits on
    _put(store, "q", ["b0", "b1", "b2"])  # another partition's rows are not its own
    assert claim.is_alive() and store.stats()["waiting_claims"] == 1
    _put(store, "p", ["a2"])
    assert claim.result() == ["a0", "a1", "a2"]
    assert store.stats()["waiting_claims"] == 0


def test_a_put_wakes_each_claim_it_serves_across_tasks_and_sizes() -> None:
    store = Store()
    store.declare("p", TEXT, ["train", "ref"], None)
    small = [_Claim(store, "p", "train", 1) for _ in range(3)]
    big = _Claim(store, "p", "train", 2**20)  # never served: times out alone
    ref = _Claim(store, "p", "ref", 4)
    _waiting(store, 5)
    _put(store, "p", [f"k{i}" for i in range(4)])
    got = sorted(k for c in small for k in c.result())
    assert len(got) == 3 and set(got) < {"k0", "k1", "k2", "k3"}  # each row to one claim
    assert ref.result() == ["k0", "k1", "k2", "k3"]  # the other task sees them all
    assert big.is_alive()
    store.close()  # every claim wakes on a close
    with pytest.raises(UnavailableError, match="shutting down"):
        big.result()


def test_a_write_back_wakes_a_claim_waiting_for_its_field() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    claim = _Claim(store, "p", "train", 2, wait_for=["advantages"])
    _waiting(store, 1)
    _put(store, "p", ["a0", "a1"])  # enough rows, not yet with the field: it looks, waits on
    _waiting(store, 1)
    _put(store, "p", ["a0", "a1"], advantages=True)  # no new row, the field written back
    assert claim.result() == ["a0", "a1"]


def test_a_claim_served_by_other_changes_wakes_on_them() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    _put(store, "p", ["a0", "a1"])
    _, _, _, lease = store.claim("p", "train", 2, None, 0.0)
    claim = _Claim(store, "p", "train", 2)
    _waiting(store, 1)
    store.nack("p", lease.id, None, failed=False)  # the rows are ready again
    assert claim.result() == ["a0", "a1"]
    dropped = _Claim(store, "p", "train", 1)  # its rows are leased: it waits
    _waiting(store, 1)
    store.drop("p")  # a drop wakes it: the partition is gone
    with pytest.raises(NotFoundError, match="unknown partition 'p'"):
        dropped.result()


def test_a_claim_that_nothing_serves_still_times_out() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    with pytest.raises(ClaimTimeoutError, match="0 rows ready"):
        store.claim("p", "train", 1, None, 0.05)


@pytest.mark.parametrize("tasks", [[], ["train"], ["train", "ref"]])
def test_a_large_put_into_an_empty_partition_of_any_task_count_is_stored(tasks):
    # The plan's ready indexes (one per declared task) are adopted whole; a partition
    # with no tasks has none to adopt.
    store = Store()
    store.declare("p", TEXT, tasks, None)
    keys = [f"k{i}" for i in range(20)]
    _put(store, "p", keys)
    assert len(store.scan("p")[1]) == 20
    for t in tasks:
        _, rows, _, _ = store.claim("p", t, 20, None, 1.0)
        assert sorted(r.key for r in rows) == sorted(keys)
