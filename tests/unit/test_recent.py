"""A client's per-partition tables keep the partitions used last."""

from __future__ import annotations

import threading

import pytest

from flightq.client.recent import RECENT_PARTITIONS, Recent


def test_the_entry_used_least_recently_goes_first() -> None:
    r: Recent[str, int] = Recent(limit=3)
    for i, k in enumerate("abc"):
        r[k] = i
    assert r.get("a") == 0  # read: now used last
    r["b"] = 10  # written: now used last
    r["d"] = 3
    assert r.keys() == ["a", "b", "d"] and "c" not in r and len(r) == 3
    assert r.get("c") is None and r.get("c", -1) == -1
    assert r.pop("a") == 0 and r.pop("a") is None and r.keys() == ["b", "d"]


def test_the_default_limit_and_a_refused_one() -> None:
    assert Recent().limit == RECENT_PARTITIONS >= 256
    with pytest.raises(ValueError, match="at least 1"):
        Recent(limit=0)


def test_writers_on_many_threads_never_pass_the_limit() -> None:
    r: Recent[tuple[int, int], int] = Recent(limit=50)
    sizes: list[int] = []

    def write(t: int) -> None:
        for i in range(2000):
            r[(t, i)] = i
            r.get((t, i - 1))
            sizes.append(len(r))

    failed: list[BaseException] = []

    def run(t: int) -> None:
        try:
            write(t)
        except BaseException as e:  # a race surfaces here, not as a thread's traceback
            failed.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failed, failed
    assert max(sizes) <= 50 and len(r) == 50
