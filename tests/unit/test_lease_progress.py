"""Leases without a network: :class:`flightq.server.leases.Progress`, and the store's checks.

Time is passed in (``now``), so expiry is exact here; the integration tests
(``tests/integration/test_leases.py``) show the same rules through a real server.
"""

from __future__ import annotations

import math
import time

import pytest

import flightq
from flightq.server.leases import ENDED_KEPT, Progress
from flightq.server.store import Store

TEXT = "rollout_text@1"


def _progress(n: int = 4, max_failures: int = 3) -> tuple[Progress, list[str]]:
    p = Progress(["train", "ref"], max_failures)
    keys = [f"k{i}" for i in range(n)]
    p.added(keys)
    return p, keys


def _take(p: Progress, keys: list[str], seconds: float = 10.0, now: float = 0.0, session=None):
    # Each key's row number: the key's index, as a partition numbers the rows it creates.
    return p.take("train", keys, seconds, now, session, [int(k[1:]) for k in keys])


def _born(keys: list[str]) -> dict[str, int]:
    return {k: int(k[1:]) for k in keys}


def test_an_ack_marks_rows_done_and_acking_again_acks_nothing():
    p, keys = _progress()
    lease = _take(p, keys[:2])
    st = p.tasks["train"]
    assert list(st.ready) == keys[2:] and st.leased == {"k0": lease.id, "k1": lease.id}
    assert p.ack(lease, None, _born(keys)) == (2, [])
    assert st.done == {"k0", "k1"} and not st.leased
    assert lease.id not in p.leases and p.find(lease.id) is lease  # ended, remembered
    assert p.ack(lease, None, _born(keys)) == (0, [])
    assert list(p.tasks["ref"].ready) == keys  # another task's rows are its own


def test_given_back_rows_go_behind_the_ready_ones_and_a_later_ack_leaves_them_alone():
    p, keys = _progress()
    lease = _take(p, keys[:2])
    assert p.nack(lease, ["k0"], failed=False) == (1, 0)
    assert list(p.tasks["train"].ready) == ["k2", "k3", "k0"]
    assert p.ack(lease, None, _born(keys)) == (1, [])  # k1 only: k0 was handed on
    assert "k0" in p.tasks["train"].ready and p.tasks["train"].done == {"k1"}
    assert p.ack(lease, ["k0"], _born(keys)) == (0, [])


def test_a_failed_nack_counts_and_the_last_failure_goes_to_the_dead_letters():
    p, keys = _progress(2, max_failures=2)
    st = p.tasks["train"]
    assert p.nack(_take(p, keys), None, failed=True) == (2, 0)
    assert st.failures == {"k0": 1, "k1": 1} and st.deliveries == {"k0": 1, "k1": 1}
    lease = _take(p, ["k0", "k1"])
    assert p.nack(lease, ["k0"], failed=True) == (0, 1)
    assert st.dead == {"k0": "failed"} and "k0" not in st.ready
    assert p.ack(lease, None, _born(keys)) == (1, [])  # k1; k0 was handed on, dead
    assert st.failures == {"k0": 2}  # an ack forgets the row's failures


def test_a_lease_expires_at_its_time_each_row_counting_a_failure():
    p, keys = _progress(2, max_failures=2)
    st = p.tasks["train"]
    lease = _take(p, keys, seconds=5.0, now=100.0)
    assert p.next_expiry == 105.0
    assert p.expire(104.999) == 0 and st.leased
    assert p.expire(105.0) == 2
    assert list(st.ready) == keys and st.failures == {"k0": 1, "k1": 1}
    assert p.next_expiry == math.inf
    _take(p, keys, seconds=1.0, now=200.0)
    assert p.expire(201.0) == 2
    assert st.dead == {"k0": "expired", "k1": "expired"} and not st.ready
    # The first lease's late ack: its rows went dead meanwhile.
    assert p.ack(lease, None, _born(keys)) == (0, ["k0", "k1"])


def test_a_late_ack_acks_rows_nobody_took_and_names_the_ones_another_claim_has():
    p, keys = _progress(3)
    late = _take(p, keys, seconds=1.0)
    p.expire(1.0)
    other = _take(p, ["k0"], seconds=10.0, now=1.0)
    assert p.ack(late, None, _born(keys)) == (2, ["k0"])
    assert p.tasks["train"].leased == {"k0": other.id}


def test_an_ack_leaves_alone_a_row_cleared_and_put_again_under_its_key():
    p, keys = _progress(2)
    lease = _take(p, keys)
    p.removed(["k0"])
    p.added(["k0"])  # another row, numbered 7 by its partition
    assert p.ack(lease, None, {"k0": 7, "k1": 1}) == (1, [])
    assert "k0" in p.tasks["train"].ready


def test_a_session_that_ends_releases_only_its_own_leases():
    p, keys = _progress(4, max_failures=1)
    mine = _take(p, keys[:2], session="s1")
    _take(p, keys[2:], session="s2")
    assert p.session_ended("s1") == 2
    st = p.tasks["train"]
    assert st.dead == {"k0": "gone", "k1": "gone"}  # max_failures=1: one failure is enough
    assert set(st.leased) == {"k2", "k3"} and p.find(mine.id) is mine
    assert p.session_ended("nobody") == 0


def test_clearing_every_row_ends_the_leases_and_a_later_ack_is_harmless():
    p, keys = _progress(2)
    lease = _take(p, keys)
    p.removed_all()
    assert not p.leases and p.find(lease.id) is lease
    assert p.ack(lease, None, {}) == (0, [])


def test_a_reset_makes_rows_ready_again_in_partition_order_whatever_their_state():
    p, keys = _progress(4, max_failures=1)
    leased = _take(p, ["k1"])
    dead = _take(p, ["k2"])
    p.nack(dead, None, failed=True)
    done = _take(p, ["k3"])
    p.ack(done, None, _born(keys))
    assert p.reset("train", None, keys) == 3
    st = p.tasks["train"]
    assert list(st.ready) == keys
    assert not st.leased and not st.done and not st.dead and not st.deliveries
    assert leased.id not in p.leases  # it holds nothing any more


def test_ended_leases_are_remembered_up_to_a_bound():
    p, keys = _progress(1)
    first = _take(p, keys)
    p.nack(first, None, failed=False)
    for _ in range(ENDED_KEPT):
        p.nack(_take(p, keys), None, failed=False)
    assert len(p.ended) == ENDED_KEPT and p.find(first.id) is None


def test_the_store_refuses_leases_that_are_not_positive_and_unknown_claims_and_sessions():
    store = Store()
    schema = flightq.SchemaRegistry.default().get(TEXT)
    for lease in (0.0, -1.0, math.nan):
        with pytest.raises(flightq.ProtocolError, match=r"lease must be > 0 seconds"):
            store.declare("p", schema, ["train"], None, lease=lease)
    with pytest.raises(flightq.ProtocolError, match=r"max_failures must be >= 1, got 0"):
        store.declare("p", schema, ["train"], None, max_failures=0)
    assert store.declare("p", schema, ["train"], None, lease=30.0, max_failures=2)
    with pytest.raises(flightq.ConflictError, match=r"lease 30s and max_failures 2, got 60s"):
        store.declare("p", schema, ["train"], None, lease=60.0, max_failures=2)
    with pytest.raises(flightq.NotFoundError, match=r"session 'gone' is not open") as e:
        store.claim("p", "train", 1, None, 0.0, session="gone")
    assert e.value.key == "gone"
    for call in (lambda: store.ack("p", "c1", None), lambda: store.nack("p", "c1", None, True)):
        with pytest.raises(flightq.NotFoundError, match=r"knows no claim 'c1'") as e:
            call()
        assert e.value.key == "c1"
    sid = store.open_session()
    with pytest.raises(flightq.ClaimTimeoutError, match=r"0 rows ready"):
        store.claim("p", "train", 1, None, 0.0, session=sid)
    assert store.end_session(sid) == 0
    with pytest.raises(flightq.NotFoundError, match=r"is not open"):
        store.claim("p", "train", 1, None, 0.0, session=sid)
    assert store.dead_letters("p", "train", 10) == ([], [], [], 0)


def test_an_unclaimed_lease_leaves_its_rows_where_they_were_and_uncounted():
    # A claim whose answer never left the server (too large for the request stream, or a
    # stream that broke): its rows go back to the front, their delivery not counted.
    p, keys = _progress(4)
    st = p.tasks["train"]
    first = _take(p, keys[:2])
    assert p.release(first, None) == (2, 0)  # delivered once, back behind the others
    assert list(st.ready) == keys[2:] + keys[:2]
    second = _take(p, [keys[2], keys[0]])
    assert st.deliveries[keys[0]] == 2 and st.redelivered == 1
    assert p.unclaim(second) == 2
    assert list(st.ready) == [keys[2], keys[0], keys[3], keys[1]]
    assert st.deliveries == {keys[0]: 1, keys[1]: 1} and st.redelivered == 0
    assert p.find(second.id) is second and not p.held(second, None)


def test_a_claim_waiting_when_its_session_ends_takes_no_rows_under_it():
    # A claim checked its session once, as it started: rows that came after the session
    # ended (its consumer killed mid-wait) were leased to that session, which no longer
    # ends them (with an infinite lease: never).
    import threading

    from helpers_store import TEXT as SCHEMA
    from helpers_store import store_put

    store = Store()
    store.declare("p", SCHEMA, ["train"], None, lease=math.inf)
    sid = store.open_session()
    got: list[BaseException] = []

    def waiting() -> None:
        try:
            store.claim("p", "train", 2, None, 30.0, session=sid)
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    deadline = time.monotonic() + 10
    while not store._waiting.get("p"):  # the claim waits (past its session's first check)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.end_session(sid)
    store_put(store, "p", ["a", "b"])
    t.join(10)
    assert not t.is_alive() and isinstance(got[0], flightq.NotFoundError), got
    assert got[0].key == sid
    _, rows, _, lease = store.claim("p", "train", 2, None, 0.0)  # both ready for others
    assert [r.key for r in rows] == ["a", "b"] and lease.keys == ["a", "b"]
