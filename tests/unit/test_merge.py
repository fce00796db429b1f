"""A large put into a partition that holds rows is merged outside the store's lock.

The store and real threads, no network. :class:`flightq.server.merge.Merge` copies the row
table and each task's ready order, adds the put's rows to the copies without the lock and
swaps them in at the commit, after replaying what changed meanwhile. These tests run
claims, acks, nacks, clears, resets, small puts and write-backs between the copy and the
commit (inside the put, through the store's own calls), grouped and not, and check that
the partition ends exactly as an in-place update would have left it, that the swap is what
happened where it could, and that rows claimed and acked by another thread while large
puts land are neither lost nor given twice.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any

import pytest
from helpers_store import TEXT, store_put

from flightq.errors import ClaimTimeoutError
from flightq.server import merge as merge_module
from flightq.server import store as store_module
from flightq.server.budget import moved_cost
from flightq.server.store import Store

TASKS = ["train", "ref"]


class _Meddler:
    """Another client's calls, made while a put's merge is built (between its copy and its
    commit), on rows other than the put's own."""

    def __init__(self, store: Store, rng: random.Random, group: int | None) -> None:
        self.store, self.rng, self.group = store, rng, group
        self.leases: list[Any] = []
        self.made = 0
        self.spare: set[str] = set()  # keys the put in progress writes: left alone
        self.reshape = True

    def keys(self) -> list[str]:
        with self.store._lock:
            return [k for k in self.store._parts["p"].rows if k not in self.spare]

    def meddle(self, n: int) -> None:
        rng, store, g = self.rng, self.store, self.group or 1
        for _ in range(n):
            op, keys = rng.random(), self.keys()
            if op < 0.3:
                with contextlib.suppress(ClaimTimeoutError):
                    task = rng.choice(TASKS)
                    self.leases.append(store.claim("p", task, g * rng.randint(1, 2), None, 0.0)[3])
            elif op < 0.5 and self.leases:
                lease = self.leases.pop(rng.randrange(len(self.leases)))
                if rng.random() < 0.5:
                    store.ack("p", lease.id, None)
                else:
                    store.nack("p", lease.id, None, failed=rng.random() < 0.5)
            elif op < 0.65:
                store_put(store, "p", [f"m{self.made + i}" for i in range(g)])
                self.made += g
            elif op < 0.8 and keys:
                store_put(store, "p", rng.sample(keys, min(3, len(keys))), "advantages")
            elif op < 0.9 and keys:
                store.clear("p", rng.sample(keys, min(g, len(keys))))
            elif self.reshape and op < 0.95:
                store.reset("p", rng.choice(TASKS), None)  # an order rebuilt: no swap
            elif self.reshape and keys and rng.random() < 0.2:
                store.clear("p", None)  # every row cleared: no swap


def _done(store: Store, task: str) -> bool:
    with store._lock:
        st = store._parts["p"].progress.tasks[task]
        return not st.ready and not st.leased


def _state(store: Store) -> tuple[dict[str, Any], dict[str, tuple[set[str], ...]]]:
    with store._lock:
        p = store._parts["p"]
        tasks = {
            t: (set(st.ready), set(st.leased), set(st.done), set(st.dead))
            for t, st in p.progress.tasks.items()
        }
        return dict(p.rows), tasks


@pytest.mark.parametrize("group", [None, 4])
def test_a_merged_put_ends_as_an_update_in_place_would_whatever_changed_meanwhile(
    group: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merge_module, "MERGE_ROWS", 8)
    rng = random.Random(11 if group else 5)
    store = Store()
    store.declare("p", TEXT, TASKS, group)
    g = group or 1
    meddler = _Meddler(store, rng, group)
    store_put(store, "p", [f"a{i}" for i in range(4 * g)])
    build = merge_module.Merge.build
    seen: dict[str, Any] = {}

    def build_while_others_call(self: merge_module.Merge, plan: Any) -> None:
        meddler.meddle(rng.randint(0, 6))  # between the copy's start and the copy
        build(self, plan)
        meddler.meddle(rng.randint(0, 6))  # between the copy and the commit
        seen["before"] = _state(store)
        with store._lock:
            p = store._parts["p"]
            seen["objects"] = (p.rows, [st.ready for st in p.progress.tasks.values()])
            logs = [st.moved for st in p.progress.tasks.values() if st.moved is not None]
            seen["logged"] = (p.progress.moved_bytes, sum(map(moved_cost, logs)))

    monkeypatch.setattr(merge_module.Merge, "build", build_while_others_call)
    swapped_rows = swapped_ready = logged_any = 0
    for n in range(40):
        meddler.reshape = n % 4 == 3
        if meddler.reshape or rng.random() < 0.7 or not meddler.keys():
            keys, fields = [f"b{n}_{i}" for i in range(g * rng.randint(8 // g, 16 // g))], ()
        else:  # a write-back of rows the meddler leaves alone
            have = meddler.keys()
            if len(have) < 8:
                continue
            keys, fields = rng.sample(have, 8), ("prev_logprobs",)
        meddler.spare = set(keys)
        seen.clear()
        store_put(store, "p", keys, *fields)
        meddler.spare = set()
        if not seen:  # no merge: the partition was empty
            continue
        (rows0, tasks0), (rows_obj, ready_objs) = seen["before"], seen["objects"]
        counted, logged = seen["logged"]
        assert counted == logged  # the budget counts the logs of moved keys while they live
        logged_any += logged > 0
        with store._lock:
            assert store._parts["p"].progress.moved_bytes == 0  # and stops when they go
        rows1, tasks1 = _state(store)
        assert set(rows1) == set(rows0) | set(keys)
        assert all(rows1[k] is rows0[k] for k in rows0 if k not in keys)
        new = [k for k in keys if k not in rows0]
        for t in TASKS:
            ready0, leased0, done0, dead0 = tasks0[t]
            assert tasks1[t] == (ready0 | set(new), leased0, done0, dead0), (n, t)
        with store._lock:
            p = store._parts["p"]
            swapped_rows += p.rows is not rows_obj
            swapped_ready += any(
                st.ready is not was
                for st, was in zip(p.progress.tasks.values(), ready_objs, strict=True)
            )
            order = list(p.progress.tasks["train"].ready)
        assert [k for k in order if k in set(new)] == new  # the put's rows in its order
    assert swapped_rows >= 10 and swapped_ready >= 5, (swapped_rows, swapped_ready)
    assert logged_any >= 10, logged_any
    # The partition still serves: every row ready for "ref" once reset, claimed whole.
    store.reset("p", "ref", None)
    _, rows, _, _ = store.claim("p", "ref", len(_state(store)[0]), None, 0.0)
    assert {r.key for r in rows} == set(_state(store)[0])


def test_rows_claimed_and_acked_beside_large_puts_are_neither_lost_nor_given_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(merge_module, "MERGE_ROWS", 1024)
    store = Store()
    store.declare("p", TEXT, TASKS, None)
    store_put(store, "p", [f"seed{i}" for i in range(32)])
    puts, rows_per_put = 12, 8192  # every row claimed in claims of 32
    stop = threading.Event()
    acked: dict[str, list[str]] = {t: [] for t in TASKS}
    errors: list[BaseException] = []

    def consume(task: str) -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (stop.is_set() and _done(store, task)):
                with contextlib.suppress(ClaimTimeoutError):
                    _, rows, _, lease = store.claim("p", task, 32, None, 0.05)
                    acked[task].extend(r.key for r in rows)
                    store.ack("p", lease.id, None)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(t,)) for t in TASKS]
    for t in threads:
        t.start()
    try:
        for n in range(puts):
            store_put(store, "p", [f"b{n}_{i}" for i in range(rows_per_put)])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors
    want = {f"seed{i}" for i in range(32)} | {
        f"b{n}_{i}" for n in range(puts) for i in range(rows_per_put)
    }
    rows, tasks = _state(store)
    assert set(rows) == want
    for task in TASKS:
        assert len(acked[task]) == len(set(acked[task])), task  # none given twice
        assert set(acked[task]) == want, task  # none lost
        assert tasks[task] == (set(), set(), want, set()), task


def test_a_put_whose_journal_was_dropped_for_room_plans_again_and_loses_no_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The journal of recent writes counts against the memory budget, and the store drops
    # it (oldest first, with the partition's other records) when the budget needs the
    # room. A put planned before writes that the journal no longer names cannot tell
    # whether they touched its keys: it plans again, and every write stands.
    monkeypatch.setattr(merge_module, "MERGE_ROWS", 8)
    store = Store(memory_budget=1 << 30)
    store.declare("p", TEXT, TASKS, None)
    store_put(store, "p", [f"a{i}" for i in range(8)])
    build = merge_module.Merge.build
    builds = []

    def build_then_drop_the_journal(self: merge_module.Merge, plan: Any) -> None:
        build(self, plan)
        builds.append(plan.seen)
        if len(builds) > 1:
            return
        store.clear("p", ["a0", "a1"])  # writes the first plan did not see
        store_put(store, "p", ["b3"], "advantages")  # a write-back beside the put
        with store._lock:
            p = store._parts["p"]
            assert p.journal and p.records > 0
            store.memory_budget = store._held() + store._declared()  # no room for records
            with monkeypatch.context() as m:  # nor the share they keep over a full budget
                m.setattr(store_module, "RECORDS_SHARE", 1 << 62)
                store._fit()
            assert not p.journal and p.records == 0
            store.memory_budget = 1 << 30

    monkeypatch.setattr(merge_module.Merge, "build", build_then_drop_the_journal)
    store_put(store, "p", ["b3"])
    keys = [f"b{i}" for i in range(16) if i != 3]
    store_put(store, "p", keys)
    assert len(builds) == 2 and builds[1] > builds[0]  # planned again after the drop
    rows, tasks = _state(store)
    assert set(rows) == {f"a{i}" for i in range(2, 8)} | {f"b{i}" for i in range(16)}
    assert "advantages" in rows["b3"].cells  # the write-back meanwhile stands
    for t in TASKS:
        assert tasks[t][0] == set(rows), t
