"""The store's running totals of what its memory budget counts (:class:`Tally`) equal, after
every operation, what a walk of its partitions adds up, and its holders are the partitions
keeping records: puts, write-backs, claims, acks, nacks, clears, drops, restores, records
dropped for room, and large puts' merges beginning and ending (their logs of moved keys),
in random order."""

from __future__ import annotations

import random

import pytest
from helpers_store import TEXT, store_put

from flightq.errors import FlightqError
from flightq.server.budget import moved_cost
from flightq.server.partition import Partition
from flightq.server.store import Store


def _logged(p: Partition) -> int:
    """What the budget counts for the partition's logs of moved keys, from the logs."""
    return sum(moved_cost(st.moved) for st in p.progress.tasks.values() if st.moved is not None)


def _walked(store: Store) -> dict[str, int]:
    parts = store.partitions()
    return {
        "held": sum(p.held for p in parts),
        "declared": sum(p.declared for p in parts),
        "records": sum(p.records for p in parts),
        "leased": sum(p.progress.live_bytes + _logged(p) for p in parts),
    }


def _tally(store: Store) -> dict[str, int]:
    t = store._tally
    return {"held": t.held, "declared": t.declared, "records": t.records, "leased": t.leased}


@pytest.mark.parametrize("seed", range(6))
def test_the_running_totals_equal_a_walk_of_the_partitions_after_every_operation(seed: int):
    rng = random.Random(seed)
    # A budget small enough that records are dropped for room now and then.
    store = Store(memory_budget=rng.choice([None, 600_000, 4_000_000]))
    names = ["a", "b", "c"]
    claims: list[tuple[str, str]] = []
    merging: list[Partition] = []  # each once per merge under way (as Merge.begin does)
    n = 0
    ops = ["put", "put", "back", "claim", "ack", "nack", "clear", "drop", "copy", "merge", "end"]
    for step in range(150):
        op = rng.choice(ops)
        name = rng.choice(names)
        try:
            if name not in {p.name for p in store.partitions()}:
                store.declare(name, TEXT, ["t", "u"][: rng.randint(1, 2)], None)
            p = store.partition(name)
            keys = list(p.rows)
            if op == "put":
                new = [f"{name}{n + i}".ljust(rng.choice([4, 300]), "k") for i in range(8)]
                n += 8
                store_put(store, name, new)
            elif op == "back" and keys:
                store_put(store, name, rng.sample(keys, min(4, len(keys))), "generation_logprobs")
            elif op == "claim" and keys:
                _, _, _, lease = store.claim(name, "t", rng.randint(1, 4), None, 0.0)
                claims.append((name, lease.id))
            elif op in ("ack", "nack") and claims:
                at, claim = claims.pop(rng.randrange(len(claims)))
                lease = store.partition(at).progress.find(claim)
                if op == "ack":
                    store.ack(at, claim, None)
                elif lease is not None:
                    store.nack(at, claim, lease.keys[:1], rng.random() < 0.5)
            elif op == "clear" and keys:
                store.clear(name, rng.sample(keys, rng.randint(1, len(keys))))
            elif op == "drop":
                store.drop(name)
            elif op == "copy":  # a snapshot's capture, restored under the store
                (c,) = store.capture([name])
                store.drop(name)
                store.restore([c])
            elif op == "merge":  # a large put begins merging: the tasks log moved keys
                with store._lock:
                    p.progress.watch()
                merging.append(p)
            elif op == "end" and merging:
                with store._lock:
                    merging.pop(rng.randrange(len(merging))).progress.unwatch()
        except FlightqError:
            pass  # refusals (no room, no rows ready, a claim forgotten): fine here
        assert _tally(store) == _walked(store), (seed, step, op)
        holding = {id(p) for p in store.partitions() if p.records}
        assert set(store._tally.holders) == holding, (seed, step, op)
    assert any(_logged(p) for p in merging), "no key was logged: the test tests nothing"
    with store._lock:
        for p in merging:
            p.progress.unwatch()
    assert not any(p.progress.moved_bytes for p in store.partitions())
    assert _tally(store) == _walked(store)
    for name in [p.name for p in store.partitions()]:
        store.drop(name)
    assert _tally(store) == {"held": 0, "declared": 0, "records": 0, "leased": 0}
    assert not store._tally.holders


def test_a_dropped_partition_is_freed_at_once_not_by_the_cyclic_collector():
    # A partition and its progress must not refer to each other strongly: a cycle would
    # keep a dropped partition's rows (their record batches) alive until the cyclic
    # collector ran, and the server's memory past what the budget counts.
    import gc
    import weakref

    store = Store(memory_budget=1 << 30)
    store.declare("p", TEXT, ["t", "u"], None)
    store_put(store, "p", [f"k{i}" for i in range(8)])
    _, _, _, lease = store.claim("p", "t", 4, None, 0.0)
    store.ack("p", lease.id, None)  # an ended lease: a record, filed with the store
    store.clear("p", ["k0"])  # a journal entry
    p = store.partition("p")
    assert p.records and store._tally.holders
    gone = weakref.ref(p)
    del p, lease
    gc.disable()
    try:
        store.drop("p")
        assert gone() is None
    finally:
        gc.enable()


def test_a_partition_cleared_of_most_rows_gives_back_its_tables():
    # Python never shrinks a dict or set on deletion: a partition cleared of all but one
    # of 20 000 rows kept its rows' and tasks' tables at their peak size (1.6 MB here),
    # counted nowhere once the rows went, in as many partitions as a client declares.
    import sys

    store = Store(memory_budget=1 << 30)
    store.declare("p", TEXT, ["t", "u"], None)
    keys = [f"k{i:06d}" for i in range(20_000)]
    for i in range(0, len(keys), 2000):
        store_put(store, "p", keys[i : i + 2000])
    _, _, _, lease = store.claim("p", "t", 5000, None, 0.0)
    store.ack("p", lease.id, None)
    _, _, _, lease = store.claim("p", "u", 5000, None, 0.0)
    store.nack("p", lease.id, None, True)
    for i in range(0, len(keys) - 1, 500):  # cleared in pieces, as consumers clear
        store.clear("p", keys[i : min(i + 500, len(keys) - 1)])
    p = store.partition("p")
    assert list(p.rows) == [keys[-1]]
    tables = [p.rows]
    for st in p.progress.tasks.values():
        tables += [st.ready, st.leased, st.done, st.dead, st.deliveries, st.failures]
    assert max(sys.getsizeof(t) for t in tables) < 4096, [sys.getsizeof(t) for t in tables]
    assert list(p.progress.tasks["t"].ready) == [keys[-1]]  # what is left stands


def test_a_partition_cleared_of_most_rows_gives_back_its_media_and_index_tables():
    # The same for the partition's table of media copies, and for a claim's index of the
    # rows carrying a written-back field: a partition of 4 000 rows with an image each,
    # cleared to one, kept them at their peak size (600 KB and 2 MB for 20 000 rows), the
    # index also every cleared row's key until a claim needing that field came again.
    import sys

    import numpy as np

    from flightq import SchemaRegistry, encode
    from flightq.server.media import media_piece

    vlm = SchemaRegistry.default().get("rollout_vlm@1")
    store = Store(memory_budget=1 << 30)
    store.declare("p", vlm, ["t", "u"], None)
    keys = [f"k{i:06d}" for i in range(4000)]
    for i in range(0, len(keys), 1000):
        part = keys[i : i + 1000]
        cols = {
            "input_ids": [np.arange(4) for _ in part],
            "generation_logprobs": [np.zeros(4, np.float32) for _ in part],
            "pixel_values": [[np.full((1, 4), i + j, np.float32)] for j in range(len(part))],
        }
        rb = encode(vlm, cols, part)
        store.put("p", [media_piece(store.partition("p"), rb, None, "put", None)], False)
    want = ["generation_logprobs"]
    _, _, _, lease = store.claim("p", "t", 10, None, 0.0, wait_for=want)
    store.ack("p", lease.id, None)
    for i in range(0, len(keys) - 1, 500):  # cleared in pieces, as consumers clear
        store.clear("p", keys[i : min(i + 500, len(keys) - 1)])
    p = store.partition("p")
    (index,) = p.complete.values()
    assert index.keys == {keys[-1]} and len(p.media) == 1
    assert sys.getsizeof(p.media) < 4096 and sys.getsizeof(index.keys) < 4096, (
        sys.getsizeof(p.media),
        sys.getsizeof(index.keys),
    )
    _, rows, _, _ = store.claim("p", "u", 1, None, 0.0, wait_for=want)  # what is left serves
    assert [r.key for r in rows] == [keys[-1]]
    store.clear("p", None)
    assert not p.media and not p.complete


def test_a_reader_without_the_lock_finds_every_kept_row_at_each_step_of_a_clear():
    # A put plans, and a large put's merge copies the row table and each task's ready
    # order, without the store's lock: between any two calls the clear makes, another
    # thread may run. A clear that gives a table's peak size back must never show it empty
    # midway (rebuilt in place, between its clear() and update(), it did: a put planned
    # then took the rows kept for new ones, a merge copied an empty order and left them
    # unclaimable). Each call's return is such a moment; a reader looks there.
    import sys

    store = Store(memory_budget=1 << 30)
    store.declare("p", TEXT, ["t", "u"], None)
    keys = [f"k{i:06d}" for i in range(20_000)]
    for i in range(0, len(keys), 2000):
        store_put(store, "p", keys[i : i + 2000])
    p, kept = store.partition("p"), keys[-1]
    seen: list[bool] = []

    def reader(frame: object, event: str, arg: object) -> None:
        if event == "c_return":
            tasks = p.progress.tasks.values()
            seen.append(kept in p.rows and all(kept in st.ready for st in tasks))

    sys.setprofile(reader)
    try:
        store.clear("p", keys[:-1])
    finally:
        sys.setprofile(None)
    assert len(seen) > 1000 and all(seen), seen.index(False)
    assert list(p.rows) == [kept]


def test_resolving_a_puts_media_reads_only_the_shape_dims_its_segments_use():
    # A put's shapes column may carry dims past those its segments use (Arrow's full
    # validation accepts them): the server, resolving the put's media before anything
    # else checks it, must not turn them into Python objects (36 bytes each, for 8).
    import tracemalloc

    import numpy as np
    import pyarrow as pa

    from flightq import SchemaRegistry, encode, workloads
    from flightq.server.media import media_piece

    step = workloads.w1(0, groups=1, g=2)
    vlm = SchemaRegistry.default().get(step.schema)
    store = Store(memory_budget=1 << 30)
    store.declare("p", vlm, ["t"], None)
    rb = encode(vlm, step.columns, step.keys, step.tags)
    name = "pixel_values__shape"
    shapes = rb.column(name)
    inner = shapes.values
    tail = np.zeros(2_000_000, dtype=np.int64)  # 16 MB no segment uses
    padded = pa.ListArray.from_arrays(
        inner.offsets, pa.concat_arrays([inner.values, pa.array(tail)])
    )
    col = pa.LargeListArray.from_arrays(shapes.offsets, padded)
    i = rb.schema.get_field_index(name)
    rb = rb.set_column(i, rb.schema.field(i), col)
    tracemalloc.start()
    try:
        piece = media_piece(store.partition("p"), rb, None, "put", None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert piece.media["pixel_values"], "the put's image was resolved"
    assert peak < tail.nbytes // 4, peak
