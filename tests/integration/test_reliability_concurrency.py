"""Concurrency: many writers, write-backs and consumers at once lose and repeat nothing.

Everything is bounded: a fixed number of groups per writer, a deadline on every wait, and
every thread joined with a timeout. Threads share one in-process server; each has its own
client, as separate processes would.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, raw

import flightq

pytestmark = pytest.mark.timeout(120)

WRITERS = 16
GROUPS_PER_WRITER = 10
G = 4
SCORERS = 4  # task "score": claims input_ids as soon as a group lands
TRAINERS = 4  # task "train": claims whole rows once prev_logprobs is written back
TOTAL = WRITERS * GROUPS_PER_WRITER * G
DEADLINE = 60.0


def ids_for(key: str) -> np.ndarray:
    """The seeded input_ids of a row, from its key alone (so any reader can verify)."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return rng.integers(0, 50_000, size=int(rng.integers(1, 64)), dtype=np.int64)


def logprobs_for(key: str) -> np.ndarray:
    """The prev_logprobs written back for a row."""
    return (-ids_for(key) / 50_000).astype(np.float32)


def _run_all(targets: list[Callable[[], Any]]) -> list[BaseException]:
    """Start every target at once (a barrier), join all with a timeout, return errors."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait(timeout=TIMEOUT)
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE + TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a worker did not finish in time"
    return errors


def test_writers_write_backs_and_consumers_lose_and_repeat_nothing():
    claimed: dict[str, list[str]] = {"score": [], "train": []}
    created: list[bool] = []
    verified = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + DEADLINE

    with flightq.Server() as srv:

        def declare(c: flightq.Client) -> None:
            # Partitions are declared while writers start: every worker declares.
            ok = c.create_partition("stress", TEXT, tasks=["score", "train"], group_size=G)
            with lock:
                created.append(ok)

        def writer(w: int) -> None:
            with flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c:
                declare(c)
                for j in range(GROUPS_PER_WRITER):
                    keys = [f"w{w}_{j}_g{i}" for i in range(G)]
                    ids = [ids_for(k) for k in keys]
                    tags = [{"writer": w, "group": j}] * G
                    assert c.put("stress", keys, {"input_ids": ids}, tags) == G
                    lp = [logprobs_for(k) for k in keys]
                    assert c.put("stress", keys, {"prev_logprobs": lp}) == G

        def consumer(task: str) -> None:
            with flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c:
                declare(c)
                while time.monotonic() < stop_at:
                    with lock:
                        if len(claimed[task]) >= TOTAL:
                            return
                    try:
                        if task == "score":
                            b = c.claim("stress", task, G, ["input_ids"], timeout=0.5, as_="numpy")
                        else:
                            b = c.claim(
                                "stress",
                                task,
                                2 * G,
                                wait_for=["prev_logprobs"],
                                timeout=0.5,
                                as_="numpy",
                            )
                    except flightq.ClaimTimeoutError:
                        continue
                    n = 0
                    for i, k in enumerate(b.keys):
                        assert raw(b["input_ids"][i]) == raw(ids_for(k)), k
                        n += ids_for(k).nbytes
                        if task == "train":
                            assert raw(b["prev_logprobs"][i]) == raw(logprobs_for(k)), k
                            n += logprobs_for(k).nbytes
                            w, j = k[1:].split("_")[:2]
                            assert b.tags[i] == {"writer": int(w), "group": int(j)}, k
                    # A claim is whole groups of one writer's put.
                    for s in range(0, len(b.keys), G):
                        assert len({k.rsplit("_", 1)[0] for k in b.keys[s : s + G]}) == 1
                    assert c.ack(b) == len(b.keys)  # done: never delivered to the task again
                    with lock:
                        claimed[task].extend(b.keys)
                        verified[0] += n
                raise AssertionError(f"task {task!r}: {len(claimed[task])} of {TOTAL} by deadline")

        targets: list[Callable[[], Any]] = [lambda w=w: writer(w) for w in range(WRITERS)]
        targets += [lambda: consumer("score") for _ in range(SCORERS)]
        targets += [lambda: consumer("train") for _ in range(TRAINERS)]
        errors = _run_all(targets)
        assert errors == [], errors[:3]

        everything = sorted(
            f"w{w}_{j}_g{i}"
            for w in range(WRITERS)
            for j in range(GROUPS_PER_WRITER)
            for i in range(G)
        )
        for task in ("score", "train"):
            assert sorted(claimed[task]) == everything, task  # none lost, none twice
        assert created.count(True) == 1 and len(created) == WRITERS + SCORERS + TRAINERS
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            info = c.inspect("stress")
            assert info["rows"] == TOTAL
            assert info["delivered"] == {"score": TOTAL, "train": TOTAL}
            assert info["acked"] == {"score": TOTAL, "train": TOTAL}
            assert info["fields"] == {"input_ids": TOTAL, "prev_logprobs": TOTAL}
            assert c.health()["ok"] is True
        assert verified[0] > 0


def test_declaring_a_partition_and_a_schema_from_many_clients_at_once_is_idempotent():
    custom = flightq.Schema(
        "race", 1, [flightq.Field("input_ids", "int64", "token", (None,), required=True)]
    )
    results: list[Any] = []
    lock = threading.Lock()
    with flightq.Server() as srv:

        def declare(i: int) -> None:
            with flightq.Client(srv.location, timeout=TIMEOUT) as c:
                c.register_schema(custom)
                same = c.create_partition("same", custom, tasks=["t"], group_size=2)
                try:
                    mixed: Any = c.create_partition("mixed", TEXT, group_size=1 + i % 2)
                except flightq.ConflictError as e:
                    mixed = e
                with lock:
                    results.append((same, 1 + i % 2, mixed))

        errors = _run_all([lambda i=i: declare(i) for i in range(16)])
        assert errors == [], errors[:3]
        with flightq.Client(srv.location, timeout=TIMEOUT) as c:
            won = c.describe("mixed")["group_size"]
            assert c.describe("same")["group_size"] == 2
            assert c.stats()["partitions"]["same"]["schema"] == "race@1"
    assert [r[0] for r in results].count(True) == 1
    assert [r[2] for r in results].count(True) == 1
    for _, g, mixed in results:
        if g == won:
            assert mixed in (True, False)
        else:
            assert isinstance(mixed, flightq.ConflictError)
            assert f"group_size {won}; got rollout_text@1" in str(mixed)


def test_a_put_streaming_while_its_partition_is_dropped_and_made_again_stores_nothing():
    # Its batches were checked against the old partition: the new one may declare other
    # dtypes, and rows checked against the old schema would be acknowledged unreadable.
    import msgpack
    import pyarrow.flight as fl
    from helpers_reliability import put_command, text_batch

    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        first, second = text_batch(["a", "b"]), text_batch(["c", "d"], seed=1)
        with fl.connect(srv.location) as plain:
            writer, reader = plain.do_put(put_command("p", rows=4), first.schema)
            writer.write_batch(first)
            # The server has read the first batch once the drop sees it as pending.
            time.sleep(0.5)
            c.drop("p")
            c.create_partition("p", TEXT, tasks=["t"])
            writer.write_batch(second)
            writer.done_writing()
            with pytest.raises(fl.FlightError) as e:
                reader.read()
                writer.close()
        info = msgpack.unpackb(e.value.extra_info)
        assert info["type"] == "ConflictError", info
        assert "dropped and created again" in info["message"]
        assert c.stats()["partitions"]["p"]["rows"] == 0
        c.put("p", ["e"], {"input_ids": [np.arange(3)]})  # the new one serves
        assert c.get("p", ["e"], as_="numpy").keys == ["e"]
