"""Claims that wait for written-back fields find their rows through an index, not scans.

The store and real threads, no network. A claim needing fields beyond the required ones
reads the partition's index of rows that carry them (:mod:`flightq.server.readiness`),
kept in step with every write through the write journal. These tests check the index
against a brute-force reading of the rows after puts, write-backs, clears, claims, nacks
and resets, grouped and not, past the journal's reach; and that a claim waiting for a
field that 5 000 ready rows lack is not even woken, and reads none of those rows, when a
write-back leaves it short.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from helpers_store import TEXT, store_put

from flightq.errors import ClaimTimeoutError
from flightq.server.partition import JOURNAL_KEYS, Partition
from flightq.server.readiness import MAX_INDEXES, complete_keys, count_ready, ready_rows
from flightq.server.store import Store

#: Seconds the tests wait for the store to show something before failing.
TIMEOUT = 30.0


def _brute(p: Partition, need: tuple[str, ...]) -> set[str]:
    return {k for k, r in p.rows.items() if all(f in r.cells for f in need)}


def _slowly(rows: dict[str, Any], g: int | None, st: Any, need: Sequence[str], limit: int | None):
    """What a claim takes, read the slow way: every ready row's cells tested, no count
    first (whole groups as they complete in ready order, then remnants: groups in part,
    none of them leased, every ready row carrying the fields)."""

    def has(r: Any) -> bool:
        return all(f in r.cells for f in need)

    if not g:
        out = [rows[k] for k in st.ready if has(rows[k])]
        if limit is None:
            return out
        return out[:limit] if len(out) >= limit else None
    out, groups = [], {}
    for k in st.ready:
        members = groups.setdefault(rows[k].group, [])
        members.append(rows[k])
        if len(members) == g and all(map(has, members)):
            out.extend(members)
            if limit is not None and len(out) == limit:
                return out
    held = {rows[k].group for k in st.leased if k in rows}
    took = False
    for members in (m for m in groups.values() if len(m) < g):
        if members[0].group in held or not all(map(has, members)):
            continue
        if limit is not None and len(out) + len(members) > limit:
            continue
        out.extend(members)
        took = True
        if limit is not None and len(out) == limit:
            return out
    return out if limit is None or took else None


def _check(store: Store, name: str, need: tuple[str, ...]) -> None:
    """The index of ``need`` holds exactly the rows that carry it, and every claim size
    finds through it what the slow reading finds."""
    with store._lock:
        p = store._parts[name]
        got = complete_keys(p, need)
        assert got == _brute(p, need)
        for task, st in p.progress.tasks.items():
            assert count_ready(st, got) == len(_slowly(p.rows, None, st, need, None)), task
            for limit in (None, 1, 2, 4, 8, 12):
                a = ready_rows(p.rows, p.group_size, st, got, limit)
                b = _slowly(p.rows, p.group_size, st, need, limit)
                assert [r.key for r in a or []] == [r.key for r in b or []], (task, limit)


@pytest.mark.parametrize("group", [None, 4])
def test_the_index_follows_puts_write_backs_clears_claims_and_resets(group: int | None) -> None:
    rng = random.Random(7 if group else 3)
    store = Store()
    store.declare("p", TEXT, ["train", "ref"], group)
    need = ("advantages", "prev_logprobs")
    made = served = 0
    leases = []
    for _ in range(300):
        op = rng.random()
        with store._lock:
            keys = list(store._parts["p"].rows)
        if op < 0.25 or not keys:
            n = (group or 1) * rng.randint(1, 3)
            store_put(store, "p", [f"k{made + i}" for i in range(n)])
            made += n
        elif op < 0.55:
            some = rng.sample(keys, min(len(keys), rng.randint(1, 6)))
            store_put(store, "p", some, *rng.sample(need, rng.randint(1, 2)))
        elif op < 0.65:
            store.clear("p", rng.sample(keys, min(len(keys), rng.randint(1, 3))))
        elif op < 0.8:
            batch = (group or 1) * rng.randint(1, 2)
            with contextlib.suppress(ClaimTimeoutError):
                leases.append(store.claim("p", "train", batch, None, 0.0, wait_for=need)[3])
                served += 1
        elif op < 0.9 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            if rng.random() < 0.5:
                store.ack("p", lease.id, None)
            else:
                store.nack("p", lease.id, None, failed=False)
        else:
            store.reset("p", "ref", None)
        _check(store, "p", need)
        _check(store, "p", ("advantages",))
    assert served >= 10  # the claims found rows, not only timed out
    store.clear("p", None)
    _check(store, "p", need)


def test_the_index_is_rebuilt_when_the_journal_no_longer_reaches_back() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    store_put(store, "p", ["a0", "a1"])
    _check(store, "p", ("advantages",))  # made now, in step with write 1
    keys = [f"b{i}" for i in range(JOURNAL_KEYS // 4 + 1)]  # a write the journal cannot hold
    store_put(store, "p", keys)
    store_put(store, "p", ["a1", *keys[:3]], "advantages")
    with store._lock:
        assert store._parts["p"].written_since(1) is None
    _check(store, "p", ("advantages",))
    with store._lock:
        assert complete_keys(store._parts["p"], ("advantages",)) == {"a1", *keys[:3]}


def test_a_partition_keeps_at_most_a_few_indexes_the_least_recently_used_going() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    store_put(store, "p", ["a0"])
    sets = [("advantages",), ("prev_logprobs",), ("token_mask",), ("sample_mask",)]
    sets += [("total_reward",), ("advantages", "token_mask")]
    with store._lock:
        p = store._parts["p"]
        assert complete_keys(p, ("input_ids",)) is None  # required only: no index
        for s in sets:
            complete_keys(p, s)
        complete_keys(p, sets[2])  # used again: kept
        assert len(p.complete) == MAX_INDEXES
        assert frozenset(sets[2]) in p.complete and frozenset(sets[0]) not in p.complete


class _Reads(dict):  # type: ignore[type-arg]
    """A row table that counts the rows read by key (a claim's walk of its ready order)."""

    reads = 0

    def __getitem__(self, k: str) -> Any:
        _Reads.reads += 1
        return super().__getitem__(k)


class _Counted:
    """A waiting claim's condition that records each notify (and passes it on)."""

    def __init__(self, changed: threading.Condition, woken: list[int]) -> None:
        self._changed, self._woken = changed, woken

    def notify(self) -> None:
        self._woken.append(1)
        self._changed.notify()

    def wait(self, timeout: float) -> bool:
        return self._changed.wait(timeout)


def test_claims_waiting_for_a_field_read_no_ready_row_that_lacks_it_on_a_write() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    lacking = [f"r{i}" for i in range(5000)]
    store_put(store, "p", lacking)
    with store._lock:
        p = store._parts["p"]
        p.rows = _Reads(p.rows)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.claim("p", "train", 100, None, TIMEOUT, wait_for=["advantages"])
        except BaseException as e:
            errors.append(e)

    waiters = [threading.Thread(target=wait, daemon=True) for _ in range(4)]
    for t in waiters:
        t.start()
    deadline = time.monotonic() + TIMEOUT
    while store.stats()["waiting_claims"] < 4:
        assert time.monotonic() < deadline, "the claims never waited"
        time.sleep(0.005)
    woken = []
    with store._lock:
        for w in store._claims["p"]:
            w.changed = _Counted(w.changed, woken)
    _Reads.reads = 0
    for i in range(50):  # each write-back wakes every claim: 5 000 rows may serve them
        store_put(store, "p", [lacking[i]], "advantages")
    deadline = time.monotonic() + TIMEOUT
    while store.stats()["waiting_claims"] < 4:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert _Reads.reads < 1000  # walking the ready order: 4 claims x 50 writes x 5 000 rows
    assert woken == []  # 50 rows carry the field: no claim of 100 is woken to look
    store_put(store, "p", lacking[50:100], "advantages")  # 100 rows carry it: one claim's
    deadline = time.monotonic() + TIMEOUT
    while store.stats()["waiting_claims"] > 3:
        assert time.monotonic() < deadline, "no claim took the 100 rows"
        time.sleep(0.005)
    store.close()  # the other three stop waiting
    for t in waiters:
        t.join(TIMEOUT)
    assert [type(e).__name__ for e in errors] == ["UnavailableError"] * 3
    with store._lock:
        (lease,) = store._parts["p"].progress.leases.values()
        assert sorted(lease.keys) == sorted(lacking[:100])
