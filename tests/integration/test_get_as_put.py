"""A get of rows as one put made them is that put's stored batch, against a real server.

The server answers such rows with a slice of the record batch the put sent, its keys and
tags included; rows changed since (a write-back of a column or of tags) are assembled
again. Either way a get returns each row's fields and tags as they stand, in the order
asked.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import (  # noqa: F401
    client_fixture,
    raw,
    server_fixture,
    text_columns,
    text_keys,
)

import flightq
from flightq.protocol import GetTicket

pytestmark = [pytest.mark.timeout(60)]

TAGS = [{"prompt_idx": i // 4, "weight_version": 3} if i % 5 else None for i in range(12)]


def _put(client: flightq.Client, keys: list[str], tags: list) -> dict:
    client.create_partition("p", "rollout_text@1", tasks=["train"], group_size=4)
    cols = text_columns(keys)
    client.put("p", keys, cols, tags)
    return cols


def test_a_get_of_a_whole_put_returns_its_rows_and_tags(client, server):
    keys = text_keys(3, 4)
    cols = _put(client, keys, TAGS)
    batch = client.get("p", keys, as_="numpy")
    assert batch.keys == keys
    assert batch.tags == [t or {} for t in TAGS]
    for name in ("input_ids", "token_mask"):
        assert [raw(x) for x in batch[name]] == [raw(x) for x in cols[name]]
    # A slice of the stored batch: the rows of one group, then the rows in another order.
    part = client.get("p", keys[4:8], as_="numpy")
    assert part.keys == keys[4:8] and part.tags == [t or {} for t in TAGS[4:8]]
    back = keys[::-1]
    rev = client.get("p", back, as_="numpy")
    assert rev.keys == back and rev.tags == [t or {} for t in TAGS[::-1]]
    assert [raw(x) for x in rev["input_ids"]] == [raw(x) for x in cols["input_ids"][::-1]]


def test_rows_changed_since_their_put_are_served_as_they_stand(client):
    keys = text_keys(3, 4)
    cols = _put(client, keys, TAGS)
    lp = [np.full(len(x), i, dtype=np.float32) for i, x in enumerate(cols["input_ids"][:4])]
    client.put("p", keys[:4], {"prev_logprobs": lp}, [{"scored": True}] * 4)
    client.put("p", keys[9:10], {}, [{"weight_version": 4}])  # tags only
    batch = client.get("p", keys, as_="numpy")
    want = [dict(t or {}) for t in TAGS]
    for i in range(4):
        want[i]["scored"] = True
    want[9]["weight_version"] = 4
    assert batch.tags == want
    assert [raw(x) for x in batch["input_ids"]] == [raw(x) for x in cols["input_ids"]]
    assert [raw(x) for x in batch["prev_logprobs"][:4]] == [raw(x) for x in lp]
    assert batch["prev_logprobs"][4:] == [None] * 8
    # The last group alone: the put's fields only, one row of it with new tags.
    last = client.get("p", keys[8:], as_="numpy")
    assert sorted(last.fields) == ["input_ids", "input_lengths", "token_mask", "total_reward"]
    assert last.tags == want[8:]


def test_a_plain_flight_get_reads_the_keys_and_tags_as_put(client, server):
    keys = text_keys(1, 4)
    _put(client, keys, [{}, None, {"a": 1}, {}])
    ticket = GetTicket(partition="p", keys=keys, fields=None).to_wire()
    with fl.connect(server.location) as plain:
        table = plain.do_get(fl.Ticket(ticket)).read_all()
    got = [None if b is None else msgpack.unpackb(b) for b in table.column("__tags__").to_pylist()]
    assert [t or {} for t in got] == [{}, {}, {"a": 1}, {}]
    assert table.column("__key__").to_pylist() == keys
    assert table.column("input_ids").type == pa.large_binary()
