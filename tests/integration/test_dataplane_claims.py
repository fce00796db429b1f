"""Claims per task, with and without groups, against a real server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import (  # noqa: F401
    TEXT,
    TIMEOUT,
    client_fixture,
    server_fixture,
    text_columns,
    text_keys,
)
from helpers_waiting import stat_until

import flightq

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def flat(client):
    """An ungrouped partition with 5 rows and tasks 'a' and 'b'."""
    keys = [f"k{i}" for i in range(5)]
    client.create_partition("flat", TEXT, tasks=["a", "b"])
    client.put("flat", keys, text_columns(keys))
    return keys


@pytest.fixture
def grouped(client):
    """A partition of group size 4 with 2 groups and tasks 'prev_lp' and 'train'."""
    keys = text_keys(2, 4)
    client.create_partition("grouped", TEXT, tasks=["prev_lp", "train"], group_size=4)
    client.put("grouped", keys, text_columns(keys))
    return keys


@pytest.mark.torch
def test_claims_deliver_rows_once_per_task_in_insertion_order(client, flat):
    first = client.claim("flat", "a", 2, timeout=TIMEOUT)
    second = client.claim("flat", "a", 2, timeout=TIMEOUT)
    assert first.keys == flat[:2]
    assert second.keys == flat[2:4]
    # Another task has its own progress.
    assert client.claim("flat", "b", 5, timeout=TIMEOUT).keys == flat
    assert client.inspect("flat")["delivered"] == {"a": 4, "b": 5}


@pytest.mark.torch
def test_claim_returns_the_required_fields_by_default_and_named_fields_otherwise(client, flat):
    everything = client.claim("flat", "a", 1, timeout=TIMEOUT)
    assert set(everything.fields) == {"input_ids", "token_mask", "input_lengths", "total_reward"}
    only = client.claim("flat", "b", 1, ["total_reward"], timeout=TIMEOUT)
    assert only.fields == ["total_reward"]


def test_a_claim_leaves_out_the_values_of_tags_it_is_told_to(client):
    keys = text_keys(2, 2)
    client.create_partition("h", TEXT, tasks=["a"], group_size=2)
    tags = [{"n": i, "doc:text": "x" * 500 + str(i)} for i in range(4)]
    client.put("h", keys, text_columns(keys), tags)
    got = client.claim("h", "a", 2, [], timeout=TIMEOUT, as_="numpy", hide_tag_values="doc:")
    assert got.keys == keys[:2] and got.tags == [
        {"n": 0, "doc:text": None},
        {"n": 1, "doc:text": None},
    ]
    client.ack(got)
    whole = client.claim("h", "a", 2, ["input_ids"], timeout=TIMEOUT, as_="numpy")
    assert whole.tags == tags[2:]  # without it, the values whole
    # From plain Flight, a prefix that is not a short non-empty string is refused and
    # takes no row.
    client.nack(whole)
    with fl.connect(client.location) as plain:
        for bad in ("", 7, "x" * 257):
            body = {"op": "claim", "partition": "h", "task": "a", "batch_size": 2}
            ticket = {**body, "timeout": 0.0, "hide_tag_values": bad}
            with pytest.raises(fl.FlightServerError, match="hide_tag_values"):
                plain.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
    assert client.inspect("h")["leased"]["a"] == 0
    assert client.claim("h", "a", 2, [], timeout=TIMEOUT, as_="numpy").keys == keys[2:]


@pytest.mark.torch
def test_claim_times_out_with_a_typed_error_that_is_also_a_timeout_error(client, flat):
    client.claim("flat", "a", 4, timeout=TIMEOUT)
    with pytest.raises(
        flightq.ClaimTimeoutError,
        match=r"claim of 2 rows for task 'a' from partition 'flat' timed out after 0.2s: "
        r"1 rows ready",
    ) as exc:
        client.claim("flat", "a", 2, timeout=0.2)
    assert isinstance(exc.value, TimeoutError)
    assert isinstance(exc.value, flightq.FlightqTimeoutError)
    # The timed-out claim took nothing: the one ready row is still there.
    assert client.claim("flat", "a", 1, timeout=TIMEOUT).keys == ["k4"]


@pytest.mark.torch
def test_reset_makes_rows_claimable_again(client, flat):
    client.claim("flat", "a", 5, timeout=TIMEOUT)
    assert client.reset("flat", "a", ["k3", "k1"]) == 2
    assert client.claim("flat", "a", 2, timeout=TIMEOUT).keys == ["k1", "k3"]
    assert client.reset("flat", "a") == 5
    assert client.claim("flat", "a", 5, timeout=TIMEOUT).keys == flat
    # Resetting one task leaves the other alone.
    assert client.inspect("flat")["delivered"] == {"a": 5, "b": 0}


@pytest.mark.torch
def test_reset_of_an_unknown_key_names_it_and_resets_nothing(client, flat):
    client.claim("flat", "a", 5, timeout=TIMEOUT)
    with pytest.raises(flightq.NotFoundError, match=r"partition 'flat' has no row key 'nope'"):
        client.reset("flat", "a", ["k0", "nope"])
    assert client.inspect("flat")["delivered"]["a"] == 5


@pytest.mark.torch
def test_claim_blocks_until_a_later_put_makes_rows_ready(client):
    client.create_partition("late", TEXT, tasks=["train"])
    keys = ["x0", "x1", "x2"]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.claim, "late", "train", 3, None, timeout=TIMEOUT)
        stat_until(client, "late", "waiting", {"train": 1})
        assert not fut.done()  # waiting on the server: nothing to claim yet
        client.put("late", keys, text_columns(keys))
        got = fut.result(timeout=TIMEOUT)
    assert got.keys == keys
    np.testing.assert_array_equal(got["input_ids"][1].numpy(), text_columns(keys)["input_ids"][1])


@pytest.mark.torch
def test_claim_blocks_until_a_write_back_adds_the_named_field(client, grouped):
    group0 = grouped[:4]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.claim, "grouped", "train", 4, ["prev_logprobs"], timeout=TIMEOUT)
        stat_until(client, "grouped", "waiting", {"prev_lp": 0, "train": 1})
        assert not fut.done()  # waiting on the server for the field
        lp = [np.zeros(len(ids), dtype=np.float32) for ids in text_columns(grouped)["input_ids"]]
        client.put("grouped", group0, {"prev_logprobs": lp[:4]})
        got = fut.result(timeout=TIMEOUT)
    assert got.keys == group0
    assert got.fields == ["prev_logprobs"]


@pytest.mark.torch
def test_claim_wait_for_a_field_returns_every_column_the_rows_have(client, grouped):
    lp = [np.zeros(len(ids), dtype=np.float32) for ids in text_columns(grouped)["input_ids"]]
    client.put("grouped", grouped[4:], {"prev_logprobs": lp[4:]})
    got = client.claim("grouped", "train", 4, wait_for=["prev_logprobs"], timeout=TIMEOUT)
    assert got.keys == grouped[4:]  # group 0 lacks prev_logprobs: not ready
    assert set(got.fields) == {
        "input_ids",
        "token_mask",
        "input_lengths",
        "total_reward",
        "prev_logprobs",
    }


@pytest.mark.torch
def test_grouped_claims_take_whole_groups_only(client, grouped):
    assert client.claim("grouped", "prev_lp", 4, timeout=TIMEOUT).keys == grouped[:4]
    with pytest.raises(flightq.ClaimTimeoutError, match=r"4 rows ready"):
        client.claim("grouped", "prev_lp", 8, timeout=0.2)
    assert client.claim("grouped", "prev_lp", 4, timeout=TIMEOUT).keys == grouped[4:]
    assert client.claim("grouped", "train", 8, timeout=TIMEOUT).keys == grouped


def test_grouped_claim_batch_size_must_be_a_multiple_of_the_group_size(client, grouped):
    with pytest.raises(
        flightq.ProtocolError, match=r"batch_size 6 must be >= 1 and a multiple of the group size 4"
    ):
        client.claim("grouped", "train", 6, as_="numpy", timeout=TIMEOUT)
    with pytest.raises(flightq.ProtocolError, match=r"'batch_size' in \[1, 1048576\], got 0"):
        client.claim("grouped", "train", 0, as_="numpy", timeout=TIMEOUT)
    assert client.inspect("grouped")["delivered"]["train"] == 0


def test_groups_cleared_in_part_to_a_multiple_of_the_group_size_are_not_stranded(client, grouped):
    # Group 0 loses one row, group 1 three: 4 rows ready, none acknowledged or dead. A
    # claim of 8 takes both remnants at once instead of waiting for rows that never come.
    client.clear("grouped", [grouped[1], *grouped[4:7]])
    got = client.claim("grouped", "train", 8, as_="numpy", timeout=TIMEOUT)
    assert got.keys == [grouped[0], grouped[2], grouped[3], grouped[7]]
    with pytest.raises(flightq.ClaimTimeoutError, match=r"0 rows ready"):
        client.claim("grouped", "train", 4, as_="numpy", timeout=0.2)


@pytest.mark.torch
def test_a_group_with_a_row_cleared_comes_after_the_whole_ones_without_it(client, grouped):
    client.clear("grouped", [grouped[5]])
    assert client.claim("grouped", "train", 4, timeout=TIMEOUT).keys == grouped[:4]
    rest = client.claim("grouped", "train", 4, timeout=TIMEOUT)
    assert rest.keys == [grouped[4], *grouped[6:8]]  # short: the group lost a row
    with pytest.raises(flightq.ClaimTimeoutError, match=r"0 rows ready"):
        client.claim("grouped", "train", 4, timeout=0.2)


def test_a_put_creating_rows_in_a_grouped_partition_creates_whole_groups(client, grouped):
    keys = text_keys(1, 3, prefix="q")
    with pytest.raises(
        flightq.ShapeError, match=r"group size 4: a put creates whole groups, got 3 new rows"
    ):
        client.put("grouped", keys, text_columns(keys))
    assert client.stats()["partitions"]["grouped"]["rows"] == 8


@pytest.mark.torch
def test_concurrent_claimers_of_one_task_never_share_a_row(client):
    keys = text_keys(6, 4)
    client.create_partition("many", TEXT, tasks=["train"], group_size=4)
    client.put("many", keys, text_columns(keys))
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(client.claim, "many", "train", 4, timeout=TIMEOUT) for _ in range(6)]
        got = [f.result(timeout=TIMEOUT).keys for f in futs]
    flat_keys = [k for ks in got for k in ks]
    assert sorted(flat_keys) == sorted(keys)
    for ks in got:  # each claim is one whole group
        assert len({k.split("_")[0] for k in ks}) == 1


def test_claim_for_an_undeclared_task_names_the_declared_ones(client, flat):
    with pytest.raises(
        flightq.NotFoundError,
        match=r"partition 'flat' declares no task 'zzz'; declared: \['a', 'b'\]",
    ):
        client.claim("flat", "zzz", 1, as_="numpy", timeout=TIMEOUT)


def test_claim_of_an_undeclared_field_names_it(client, flat):
    with pytest.raises(flightq.UnknownSchemaError, match=r"declares no field 'pixel_values'"):
        client.claim("flat", "a", 1, ["pixel_values"], as_="numpy", timeout=TIMEOUT)
