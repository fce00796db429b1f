"""A partition over three shard processes: routing, group locality, fan-out, claims, rollback."""

from __future__ import annotations

import random
import threading

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, VLM, raw, text_columns
from fixtures_shard import (  # noqa: F401
    SHORT,
    grouped_rows,
    ids_of,
    run_w1_writeback,
    shard_locations_fixture,
    sharded_fixture,
)

import flightq
from flightq import workloads

pytestmark = pytest.mark.timeout(60)


def _single(location: str) -> flightq.Client:
    return flightq.connect(location, timeout=SHORT)


def test_rows_land_on_the_shard_the_router_names_and_groups_stay_whole(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT, tasks=["train"], group_size=4)
    put = grouped_rows(12, 4)
    assert sharded.put("rows", **put) == 48
    per_shard = sharded.stats()["shards"]
    held = [per_shard[loc]["partitions"]["rows"]["rows"] for loc in sharded.locations]
    assert sum(held) == 48 and sum(1 for h in held if h) >= 2, held
    for s, loc in enumerate(sharded.locations):
        mine = [k for k in put["keys"] if sharded.router.shard_of(k) == s]
        assert len(mine) == held[s]
        assert len(mine) % 4 == 0  # whole groups only
        with _single(loc) as c:
            if mine:
                assert c.get("rows", mine, ["input_ids"], as_="numpy").keys == mine
            others = [k for k in put["keys"] if k not in mine][:1]
            with pytest.raises(flightq.NotFoundError):
                c.get("rows", others)


def test_get_fans_out_and_returns_rows_in_the_order_asked(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT, group_size=4)
    put = grouped_rows(9, 4)
    sharded.put("rows", **put)
    keys = list(put["keys"])
    random.Random(7).shuffle(keys)
    keys = [*keys, keys[3], keys[0]]  # a key may repeat
    b = sharded.get("rows", keys, as_="numpy")
    assert b.keys == keys
    for got, want in zip(b["input_ids"], ids_of(put["columns"], keys, put["keys"]), strict=True):
        assert raw(got) == raw(want)
    only = sharded.get("rows", keys[:5], ["input_lengths"], as_="numpy")
    assert only.fields == ["input_lengths"] and only.keys == keys[:5]
    assert len(sharded.get("rows", [], as_="numpy")) == 0


def test_get_of_every_field_unites_columns_that_only_some_shards_have(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT)
    put = grouped_rows(6, 2)
    sharded.put("rows", **put)
    first = put["keys"][:2]  # one group: one shard
    lp = [np.ones(len(x), dtype=np.float32) for x in ids_of(put["columns"], first, put["keys"])]
    sharded.put("rows", first, {"prev_logprobs": lp})
    b = sharded.get("rows", put["keys"][::-1], as_="numpy")
    assert "prev_logprobs" in b.fields
    assert [x is not None for x in b["prev_logprobs"]] == [k in first for k in b.keys]


def test_claims_gather_whole_groups_from_several_shards_each_row_once(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT, tasks=["train"], group_size=4)
    put = grouped_rows(6, 4)
    sharded.put("rows", **put)
    seen: list[str] = []
    for _ in range(2):
        b = sharded.claim("rows", "train", 12, timeout=SHORT, as_="numpy")
        assert len(b) == 12
        for lo in range(0, 12, 4):  # whole groups, each from one shard
            assert len({k.split("_")[0] for k in b.keys[lo : lo + 4]}) == 1, b.keys
        seen += b.keys
    assert sorted(seen) == sorted(put["keys"])
    with pytest.raises(flightq.ClaimTimeoutError, match=r"over 3 shards timed out"):
        sharded.claim("rows", "train", 4, as_="numpy", timeout=0.2)
    with pytest.raises(flightq.ProtocolError, match="multiple of the group size 4"):
        sharded.claim("rows", "train", 6, as_="numpy", timeout=0.2)


@pytest.mark.torch
def test_a_claim_that_times_out_gives_back_the_groups_it_gathered(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT, tasks=["train"], group_size=4)
    put = grouped_rows(2, 4)
    sharded.put("rows", **put)
    with pytest.raises(flightq.ClaimTimeoutError, match="8 rows were ready"):
        sharded.claim("rows", "train", 12, timeout=0.3)
    assert sorted(sharded.claim("rows", "train", 8, timeout=SHORT).keys) == sorted(put["keys"])
    assert sharded.inspect("rows")["delivered"] == {"train": 8}


def test_a_claim_waits_for_rows_put_later_on_any_shard(sharded: flightq.ShardedClient) -> None:
    sharded.create_partition("rows", TEXT, tasks=["train"], group_size=2)
    put = grouped_rows(3, 2)
    timer = threading.Timer(0.3, lambda: sharded.put("rows", **put))
    timer.start()
    try:
        b = sharded.claim("rows", "train", 6, timeout=SHORT, as_="numpy")
    finally:
        timer.join()
    assert sorted(b.keys) == sorted(put["keys"])


def test_a_partitions_schema_is_known_on_every_client(
    sharded: flightq.ShardedClient, shard_locations: list[str]
) -> None:
    sharded.create_partition("declared", TEXT, tasks=["train"])
    want = flightq.SchemaRegistry.default().get(TEXT).fingerprint
    assert sharded.partition_schema("declared").fingerprint == want
    # Listing leaves out the values of the tags named, on every shard.
    put = grouped_rows(3, 1)
    put["tags"] = [{"big:x": "y" * 100, "n": i} for i in range(3)]
    sharded.put("declared", **put)
    listed = sharded.list_keys("declared", hide_tag_values="big:")
    assert sorted(r["tags"]["n"] for r in listed.values()) == [0, 1, 2]
    assert all(r["tags"]["big:x"] is None for r in listed.values())
    # So do gets, on every shard.
    got = sharded.get("declared", put["keys"], [], as_="numpy", hide_tag_values="big:")
    assert got.tags == [{"big:x": None, "n": i} for i in range(3)]
    took = sharded.claim(
        "declared", "train", 3, [], timeout=SHORT, as_="numpy", hide_tag_values="big:"
    )
    assert sorted((t["n"], t["big:x"]) for t in took.tags) == [(0, None), (1, None), (2, None)]
    with flightq.connect(shard_locations[0], timeout=SHORT) as one:
        assert one.partition_schema("declared").fingerprint == want
        with pytest.raises(flightq.NotFoundError, match="nope"):
            one.partition_schema("nope")


@pytest.mark.torch
def test_clear_reset_and_stats_fan_out(sharded: flightq.ShardedClient) -> None:
    assert sharded.create_partition("rows", TEXT, tasks=["train"], group_size=2)
    assert not sharded.create_partition("rows", TEXT, tasks=["train"], group_size=2)
    put = grouped_rows(6, 2)
    sharded.put("rows", **put)
    assert sharded.stats()["partitions"]["rows"]["rows"] == 12
    sharded.claim("rows", "train", 12, timeout=SHORT)
    assert sharded.reset("rows", "train", put["keys"][:4]) == 4
    assert sharded.inspect("rows")["delivered"] == {"train": 8}
    assert sharded.reset("rows", "train") == 8  # the rows still delivered
    assert sharded.clear("rows", put["keys"][:2]) == 2
    with pytest.raises(flightq.NotFoundError):
        sharded.clear("rows", put["keys"][:2])  # gone
    assert sharded.clear("rows", ["never", *put["keys"][:3]], missing_ok=True) == 1
    assert sharded.clear("rows") == 9
    assert sharded.stats()["rows"] == 0
    assert sharded.partitions() == ["rows"]


def test_a_put_that_fails_on_one_shard_is_rolled_back_on_the_others(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT)
    put = grouped_rows(8, 2)
    taken = put["keys"][0]
    bad = sharded.locations[sharded.router.shard_of(taken)]
    with _single(bad) as c:  # a row the sharded put will collide with on one shard
        c.put("rows", [taken], text_columns([taken], seed=5))
    with pytest.raises(flightq.ConflictError, match=f"shard {bad}: .*rolled back"):
        sharded.put("rows", **put)
    assert sharded.stats()["rows"] == 1  # only the row that was there before
    with pytest.raises(flightq.NotFoundError) as missing:
        sharded.get("rows", put["keys"][2:])
    # The shard's error keeps what it names, beside the shard's location in its message.
    assert missing.value.partition == "rows" and missing.value.key in put["keys"][2:]
    with pytest.raises(flightq.ConflictError) as conflict:
        sharded.put("rows", **put)
    assert conflict.value.key == taken and conflict.value.partition == "rows"
    assert raw(sharded.get("rows", [taken], as_="numpy")["input_ids"][0]) == raw(
        text_columns([taken], seed=5)["input_ids"][0]
    )


def test_a_put_that_would_split_a_group_is_refused_and_stores_nothing(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT, group_size=2)
    keys = ["a_g0", "b_g0", "a_g1", "b_g1"]
    with pytest.raises(flightq.ShapeError, match="a group must live on one shard"):
        sharded.put("rows", keys, text_columns(keys))
    assert sharded.stats()["rows"] == 0


@pytest.mark.torch
def test_the_w1_writeback_pattern_runs_over_three_shards(shard_locations: list[str]) -> None:
    with flightq.connect_sharded(shard_locations, [VLM], timeout=30) as c:
        try:
            run_w1_writeback(c)
        finally:
            c.drop("w1")


def test_each_shard_receives_only_the_media_of_its_own_groups(shard_locations: list[str]) -> None:
    step = workloads.w1(groups=3, g=4)  # one image per group, shared by its 4 rows
    with flightq.connect_sharded(shard_locations, [VLM], timeout=SHORT) as c:
        try:
            c.create_partition("w1", VLM, group_size=4)
            c.put("w1", step.keys, step.columns, step.tags)
            for s, loc in enumerate(c.locations):
                groups = {k.split("_")[0] for k in step.keys if c.router.shard_of(k) == s}
                with fl.connect(loc) as plain:
                    scan = fl.Ticket(msgpack.packb({"op": "scan", "partition": "w1"}))
                    t = plain.do_get(scan).read_all()
                chunks = t.column("pixel_values").chunks if t.num_rows else []
                # Distinct images the shard holds (a served slice may repeat its dictionary).
                images = {bytes(x) for ch in chunks for x in ch.values.dictionary.to_pylist()}
                assert len(images) == len(groups), (loc, len(images), groups)
        finally:
            c.drop("w1")


def test_a_sharded_claim_hands_out_the_rest_of_a_group_acked_in_part(
    sharded: flightq.ShardedClient,
) -> None:
    sharded.create_partition("rows", TEXT, tasks=["train"], group_size=4)
    put = grouped_rows(6, 4)
    sharded.put("rows", **put)
    first = sharded.claim("rows", "train", 4, as_="numpy", timeout=SHORT)
    sharded.ack(first, first.keys[:1])  # one row done; the lease of the rest ends unacked
    sharded.nack(first)
    got: list[str] = []
    while len(got) < 23:
        b = sharded.claim("rows", "train", 4, as_="numpy", timeout=SHORT)
        got += b.keys
        sharded.ack(b)
    assert sorted(got) == sorted(k for k in put["keys"] if k not in first.keys[:1])
