"""Routing, merging and the claim's search over shards, without a network."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
from fixtures_dataplane import TEXT, python_env, text_columns, text_keys

from flightq import SchemaRegistry, ShapeError, decode, encode
from flightq.sharding.router import MEMO_KEPT, Router, gather, group_key, merge, runs, score

pytestmark = pytest.mark.timeout(60)

LOCS = [f"grpc://10.0.0.{i}:8815" for i in range(1, 4)]


@pytest.mark.parametrize(
    ("key", "group"),
    [
        ("3f2a9c_g12", "3f2a9c"),
        ("p0_g0", "p0"),
        ("a_g1_g2", "a_g1"),
        ("prompt7", "prompt7"),
        ("x_g", "x_g"),
        ("x_gz", "x_gz"),
        ("_g3", ""),
        ("", ""),
    ],
)
def test_group_key_is_the_prefix_before_the_last_g_suffix(key: str, group: str) -> None:
    assert group_key(key) == group


def test_rows_of_one_group_route_to_one_shard() -> None:
    r = Router(LOCS)
    for p in range(200):
        assert len({r.shard_of(f"u{p}_g{i}") for i in range(16)}) == 1


def test_routing_is_the_same_in_another_process_with_another_hash_seed() -> None:
    keys = [f"group{p}_g0" for p in range(64)]
    here = [Router(LOCS).shard_of(k) for k in keys]
    code = (
        "import json, sys; from flightq.sharding.router import Router; "
        f"print(json.dumps([Router({LOCS!r}).shard_of(k) for k in {keys!r}]))"
    )
    env = {**python_env(), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == here


def test_score_is_a_fixed_function_of_location_and_key() -> None:
    # Golden values: a change here re-routes every deployed partition.
    assert score("grpc://10.0.0.1:8815", "p0") == 0xDD1F6FAB0EEC4877
    assert [Router(LOCS).shard_of(f"p{i}_g0") for i in range(12)] == GOLDEN_SHARDS


GOLDEN_SHARDS = [0, 2, 2, 2, 0, 1, 0, 1, 1, 2, 1, 2]


def test_groups_spread_over_all_shards() -> None:
    r = Router(LOCS)
    counts = np.bincount([r.shard_of(f"g{p}_g0") for p in range(3000)], minlength=3)
    assert counts.min() > 0.25 * 3000, counts


def test_adding_a_shard_moves_only_the_keys_the_new_shard_wins() -> None:
    groups = [f"g{p}" for p in range(4000)]
    before = Router(LOCS)
    after = Router([*LOCS, "grpc://10.0.0.4:8815"])
    moved = [g for g in groups if before.shard_of(g) != after.shard_of(g)]
    assert all(after.shard_of(g) == 3 for g in moved)
    fraction = len(moved) / len(groups)
    print(f"adding a 4th shard moved {fraction:.3f} of the groups (ideal 1/4)")
    assert 0.2 < fraction < 0.3, fraction


def test_removing_a_shard_moves_only_its_keys() -> None:
    groups = [f"g{p}" for p in range(2000)]
    before = Router(LOCS)
    survivors = Router([LOCS[0], LOCS[2]])
    for g in groups:
        if before.shard_of(g) != 1:
            assert survivors.locations[survivors.shard_of(g)] == LOCS[before.shard_of(g)]


def test_location_order_does_not_change_where_a_key_lives() -> None:
    a, b = Router(LOCS), Router(LOCS[::-1])
    for p in range(300):
        k = f"g{p}_g0"
        assert a.locations[a.shard_of(k)] == b.locations[b.shard_of(k)]


def test_a_long_runs_endless_groups_keep_the_routing_memo_bounded_and_routing_unchanged() -> None:
    # A run meets new prompt groups every step: the memo of their shards is emptied once
    # full (it kept the first million before, about 106 MiB, then helped no more).
    locs = [f"grpc://node{i}:8815" for i in range(3)]
    r = Router(locs)
    n = MEMO_KEPT + 1000
    routed = [r.shard_of(f"step{i}_g0") for i in range(n)]
    assert 0 < len(r._memo) <= MEMO_KEPT
    assert r.shard_of("step7_g0") == routed[7]  # remembered again after the memo emptied
    fresh = Router(locs)
    assert [fresh.shard_of(f"step{i}_g0") for i in range(0, n, 997)] == routed[::997]


def test_router_refuses_no_locations_and_repeated_ones() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        Router([])
    with pytest.raises(ValueError, match="repeat"):
        Router([LOCS[0], LOCS[0]])


def test_a_put_that_would_split_a_group_is_refused_before_sending() -> None:
    r = Router(LOCS)
    r.check_groups(text_keys(2, 4), 4, "put")  # whole groups in order
    r.check_groups(["a_g0", "b_g0", "c_g0"], 4, "put")  # not a multiple: cannot create rows
    r.check_groups(["a", "b"], None, "put")
    mixed = ["a_g0", "a_g1", "b_g0", "b_g1", "a_g2", "a_g3", "b_g2", "b_g3"]
    with pytest.raises(ShapeError, match=r"put: rows 0\.\.3 .* routing keys \['a', 'b'\]"):
        r.check_groups(mixed, 4, "put")


def _text_batch(keys: list[str], seed: int = 0, **extra: object) -> pa.RecordBatch:
    schema = SchemaRegistry.default().get(TEXT)
    cols = {**text_columns(keys, seed), **extra}
    return encode(schema, cols, keys)


@pytest.mark.parametrize("interleave", [False, True], ids=["runs", "row-by-row"])
def test_merge_puts_rows_of_several_shards_back_in_request_order(interleave: bool) -> None:
    keys = text_keys(8, 4)
    if interleave:  # alternate shards every row: the take() path
        keys = [k for pair in zip(keys[:16], keys[16:], strict=True) for k in pair]
    whole = decode(_text_batch(text_keys(8, 4)), as_="numpy")
    want = {k: whole["input_ids"][i] for i, k in enumerate(whole.keys)}
    r = Router(LOCS)
    parts = []
    for _, pos in r.split(keys).items():
        ks = [keys[i] for i in pos]
        rb = _text_batch(text_keys(8, 4)).take(pa.array([whole.keys.index(k) for k in ks]))
        parts.append((pos, [rb]))
    b = decode(merge(len(keys), parts), as_="numpy")
    assert b.keys == keys
    for k, ids in zip(b.keys, b["input_ids"], strict=True):
        np.testing.assert_array_equal(ids, want[k])


def test_merge_unites_columns_that_only_some_shards_have() -> None:
    keys = ["a_g0", "b_g0"]
    lp = [np.zeros(len(x), dtype=np.float32) for x in text_columns(keys)["input_ids"]]
    with_lp = _text_batch(keys, prev_logprobs=lp).slice(0, 1)
    without = _text_batch(keys).slice(1, 1)
    b = decode(merge(2, [([1], [without]), ([0], [with_lp])]), as_="numpy")
    assert b.keys == ["a_g0", "b_g0"]
    assert "prev_logprobs" in b.fields
    assert b["prev_logprobs"][1] is None and len(b["prev_logprobs"][0]) == len(lp[0])


def test_runs_slices_contiguous_positions() -> None:
    rb = _text_batch(text_keys(1, 6))
    got = runs(rb, [0, 1, 2, 4, 5])
    assert [b.column(0).to_pylist() for b in got] == [
        ["p0_g0", "p0_g1", "p0_g2"],
        ["p0_g4", "p0_g5"],
    ]


def test_gather_takes_whole_units_from_several_shards_by_halving() -> None:
    ready = {0: 16, 1: 48, 2: 0}
    asked: list[tuple[int, int]] = []

    def take(s: int, size: int, secs: float) -> int:
        asked.append((s, size))
        if ready[s] >= size:
            ready[s] -= size
            return size
        return 0

    assert gather([2, 0, 1], 64, 16, take, time.monotonic() + 5, 0.01) == 0
    assert ready == {0: 0, 1: 0, 2: 0}
    assert all(size % 16 == 0 for _, size in asked)


def test_gather_gives_up_at_the_deadline_saying_what_is_missing() -> None:
    ready = {0: 16, 1: 0}

    def take(s: int, size: int, secs: float) -> int:
        if ready[s] >= size:
            ready[s] -= size
            return size
        return 0

    assert gather([0, 1], 64, 16, take, time.monotonic() - 1, 0.01) == 48


def test_gather_ends_short_when_a_shard_answers_with_a_remnant() -> None:
    # Shard 1 holds the rest of a group acked in part: 5 rows it hands out on their own.
    asked: list[tuple[int, int]] = []

    def take(s: int, size: int, secs: float) -> int:
        asked.append((s, size))
        return {0: 0, 1: 5}[s]

    assert gather([0, 1, 0], 32, 8, take, time.monotonic() + 5, 0.01) == 0
    assert asked == [(0, 32), (0, 16), (0, 8), (1, 32)]
