"""By-key reads of column subsets, and puts that land all or nothing, on a real server."""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, client_fixture, raw, server_fixture, text_columns, text_keys  # noqa: F401

import flightq

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rows(client):
    """An ungrouped partition with 4 rows; 'k1' also carries prev_logprobs."""
    keys = [f"k{i}" for i in range(4)]
    cols = text_columns(keys)
    client.create_partition("rows", TEXT, tasks=["train"])
    client.put("rows", keys, cols, [{"weight_version": 1, "prompt_idx": i} for i in range(4)])
    lp = np.linspace(-1, 0, len(cols["input_ids"][1]), dtype=np.float32)
    client.put("rows", ["k1"], {"prev_logprobs": [lp]})
    return keys, cols, lp


def _snapshot(client: flightq.Client, partition: str) -> tuple:
    """What the server holds for a partition: stats, inspect, and every row (plain Flight)."""
    flight = fl.connect(client.location)
    info = flight.get_flight_info(fl.FlightDescriptor.for_path(partition))
    table = flight.do_get(info.endpoints[0].ticket).read_all()
    flight.close()
    st = client.stats()["partitions"][partition]
    return st, client.inspect(partition), table.to_pylist()


# --------------------------------------------------------------------------- reads


def test_get_returns_rows_in_the_order_asked_with_only_the_fields_asked(client, rows):
    _, cols, _ = rows
    b = client.get("rows", ["k3", "k0", "k2"], ["total_reward", "input_ids"], as_="numpy")
    assert b.keys == ["k3", "k0", "k2"]
    assert sorted(b.fields) == ["input_ids", "total_reward"]  # served in schema order
    for j, i in enumerate([3, 0, 2]):
        assert raw(b["input_ids"][j]) == raw(cols["input_ids"][i])
        assert raw(b["total_reward"][j]) == raw(cols["total_reward"][i])
    assert b.tags == [{"weight_version": 1, "prompt_idx": i} for i in (3, 0, 2)]


@pytest.mark.torch
def test_get_of_one_row_keeps_its_shapes(client, rows):
    _, cols, _ = rows
    b = client.get("rows", ["k2"], ["input_ids", "input_lengths"])
    assert tuple(b["input_ids"][0].shape) == (len(cols["input_ids"][2]),)
    assert tuple(b["input_lengths"].shape) == (1,)


def test_get_may_repeat_a_key(client, rows):
    b = client.get("rows", ["k1", "k1"], ["input_ids"], as_="numpy")
    assert b.keys == ["k1", "k1"]
    assert raw(b["input_ids"][0]) == raw(b["input_ids"][1])
    # Of no field (keys and tags alone): the server put both in one record batch, which
    # the client refused ("duplicate row key").
    for keys in (["k1", "k1"], ["k1", "k2", "k1"]):
        assert client.get("rows", keys, [], as_="numpy").keys == keys


def test_list_keys_leaves_out_the_values_of_tags_it_is_told_to(client, rows):
    client.put("rows", ["k0"], {}, tags=[{"step": 3, "big:prompt": "x" * 1000}])
    listed = client.list_keys("rows", ["k0", "k1"], hide_tag_values="big:")
    tags = listed["k0"]["tags"]
    assert (tags["step"], tags["big:prompt"], tags["prompt_idx"]) == (3, None, 0)
    assert listed["k1"]["tags"] == {"weight_version": 1, "prompt_idx": 1}
    assert client.list_keys("rows", ["k0"])["k0"]["tags"]["big:prompt"] == "x" * 1000
    # From plain Flight too; a prefix that is not a short non-empty string is refused.
    with fl.connect(client.location) as plain:
        body = {"partition": "rows", "keys": ["k0"], "hide_tag_values": "big:"}
        (res,) = plain.do_action(fl.Action("list_keys", msgpack.packb(body)))
        assert msgpack.unpackb(res.body.to_pybytes())["tags"][0]["big:prompt"] is None
        for bad in ("", 7, "x" * 257):
            body = {"partition": "rows", "hide_tag_values": bad}
            with pytest.raises(fl.FlightServerError, match="hide_tag_values"):
                list(plain.do_action(fl.Action("list_keys", msgpack.packb(body))))
        assert client.list_keys("rows", ["k0"])  # the server serves on


def test_a_get_of_some_fields_carries_each_rows_own_key_and_tags(client, rows):
    # Rows as one put stored them answer their keys and tags as stored; a row whose
    # tags a later put replaced, or that a write-back added to, answers its own.
    keys, cols, lp = rows
    client.create_partition("some", TEXT, tasks=["train"])
    tags = [{"weight_version": 1, "prompt_idx": i, "doc": "d" * i} for i in range(4)]
    client.put("some", keys, cols, tags)

    def check(want_tags: list[dict]) -> None:
        for ks in (keys, keys[1:3], keys[2:]):
            b = client.get("some", ks, ["input_ids", "total_reward"], as_="numpy")
            assert b.keys == ks
            assert b.tags == [want_tags[int(k[1])] for k in ks]
            for j, k in enumerate(ks):
                assert raw(b["input_ids"][j]) == raw(cols["input_ids"][int(k[1])])

    check(tags)
    client.put("some", ["k2"], {}, [{"step": 9}])  # tags alone: merged into the row's
    tags[2] = {**tags[2], "step": 9}
    check(tags)
    client.put("some", ["k1"], {"prev_logprobs": [lp]})  # a write-back
    check(tags)
    assert client.get("some", ["k1"], ["prev_logprobs"], as_="numpy").tags == [tags[1]]


def test_get_leaves_out_the_values_of_tags_it_is_told_to(client, rows):
    _, cols, _ = rows
    hk = ["h0", "h1", "h2"]
    hc = text_columns(hk, seed=1)
    client.put("rows", hk, hc, [{"step": i, "big:doc": "x" * 1000 + str(i)} for i in range(3)])

    def want(key: str) -> dict:
        if key.startswith("h"):
            return {"step": int(key[1]), "big:doc": None}
        return {"weight_version": 1, "prompt_idx": int(key[1])}

    # Rows as one put stored them, out of order and repeated, beside rows without such
    # tags, with every field, some, or none (keys and tags alone).
    for keys, fields in [
        (hk, None),
        (["h2", "k0", "h0", "h2"], ["input_ids"]),
        (["k1", "h1", "k3"], []),
        (["k0", "k2"], None),
    ]:
        b = client.get("rows", keys, fields, as_="numpy", hide_tag_values="big:")
        assert b.keys == keys
        assert b.tags == [want(k) for k in keys]
        for j, k in enumerate(keys if fields != [] else []):
            source = hc if k.startswith("h") else cols
            assert raw(b["input_ids"][j]) == raw(source["input_ids"][int(k[1])])
    # The stored values are untouched: a get without it has them whole.
    assert client.get("rows", ["h1"], [], as_="numpy").tags[0]["big:doc"] == "x" * 1000 + "1"
    # Tag keys are strings: a key msgpack carries as bytes is refused (the prefix could
    # not be tested against it; a listing could not carry it), nothing stored.
    with pytest.raises(flightq.EncodeError, match=r"tags of row 'h2' must have string keys"):
        client.put("rows", ["h2"], {}, [{b"big:raw": 1, "big:doc": "y"}])
    kept = client.list_keys("rows", ["h2"])["h2"]["tags"]
    assert kept == {"step": 2, "big:doc": "x" * 1000 + "2"}
    # From plain Flight too; a prefix that is not a short non-empty string is refused.
    with fl.connect(client.location) as plain:
        ticket = {"op": "get", "partition": "rows", "keys": ["h0"], "hide_tag_values": "big:"}
        table = plain.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
        assert msgpack.unpackb(table.column("__tags__")[0].as_py()) == want("h0")
        for bad in ("", 7, "x" * 257, None):
            ticket["hide_tag_values"] = bad
            if bad is None:
                table = plain.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
                tags = msgpack.unpackb(table.column("__tags__")[0].as_py())
                assert tags["big:doc"] == "x" * 1000 + "0"  # null: nothing left out
                continue
            with pytest.raises(fl.FlightServerError, match="hide_tag_values"):
                plain.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
    assert client.get("rows", hk, as_="numpy").keys == hk  # the server serves on


def test_get_of_unknown_keys_names_them(client, rows):
    with pytest.raises(flightq.NotFoundError, match=r"partition 'rows' has no row key 'n1', 'n2'"):
        client.get("rows", ["k0", "n1", "n2"], ["input_ids"])


def test_get_of_a_field_a_row_lacks_names_field_and_key(client, rows):
    with pytest.raises(
        flightq.MissingFieldError,
        match=r"field 'prev_logprobs' is missing on row key 'k0', 'k2' of partition 'rows'",
    ):
        client.get("rows", ["k0", "k1", "k2"], ["prev_logprobs"])


def test_get_of_an_undeclared_field_names_it(client, rows):
    with pytest.raises(flightq.UnknownSchemaError, match=r"declares no field 'pixel_values'"):
        client.get("rows", ["k0"], ["pixel_values"])


def test_get_with_fields_none_gives_none_where_a_row_lacks_a_column(client, rows):
    _, cols, lp = rows
    b = client.get("rows", ["k0", "k1"], as_="numpy")
    assert "prev_logprobs" in b.fields
    got = b["prev_logprobs"]
    assert got[0] is None
    assert raw(got[1]) == raw(lp)
    assert raw(b["input_ids"][0]) == raw(cols["input_ids"][0])


@pytest.mark.torch
def test_get_with_fields_none_on_rows_without_the_column_omits_it(client, rows):
    b = client.get("rows", ["k0", "k2"])
    assert "prev_logprobs" not in b.fields


# --------------------------------------------------------------------------- atomic puts


def _with_payload(rb: pa.RecordBatch, column: str, row: int, payload: bytes) -> pa.RecordBatch:
    """``rb`` with one row's payload of ``column`` replaced (shape column untouched)."""
    values = rb.column(column).to_pylist()
    values[row] = payload
    arrays = [
        pa.array(values, type=rb.schema.field(column).type) if name == column else rb.column(name)
        for name in rb.schema.names
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=rb.schema)


@pytest.mark.torch
def test_a_put_with_one_int32_row_is_refused_by_the_server_and_stores_nothing(client):
    client.create_partition("g", TEXT, tasks=["train"], group_size=4)
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    schema = flightq.SchemaRegistry.default().get(TEXT)
    good = flightq.encode(schema, cols, keys)
    # A writer that bypasses the encoder sends row 6's ids as int32 under the int64 field.
    bad = _with_payload(good, "input_ids", 6, cols["input_ids"][6].astype(np.int32).tobytes())
    n = len(cols["input_ids"][6])
    with pytest.raises(
        flightq.ShapeError,
        match=rf"column 'input_ids': shape \({n},\) needs {8 * n} bytes of int64, payload has "
        rf"{4 * n} \(row key 'p1_g2'\)",
    ):
        client.put_batch("g", bad)
    st = client.stats()["partitions"]["g"]
    assert (st["rows"], st["bytes"]) == (0, 0)
    with pytest.raises(flightq.NotFoundError, match="no row key 'p0_g0'"):
        client.get("g", ["p0_g0"])
    # The next valid put lands in full.
    assert client.put_batch("g", good) == 8
    assert client.claim("g", "train", 8, timeout=30).keys == keys


def test_a_put_with_an_int32_tensor_is_refused_before_it_is_sent(client):
    client.create_partition("g", TEXT, group_size=4)
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    cols["input_ids"][5] = cols["input_ids"][5].astype(np.int32)
    with pytest.raises(
        flightq.DTypeError, match=r"'input_ids'.*int64.*int32|'input_ids'.*int32.*int64"
    ):
        client.put("g", keys, cols)
    assert client.stats()["partitions"]["g"]["rows"] == 0


def test_a_mixed_put_conflicting_on_one_existing_row_changes_nothing(client, rows):
    _, cols, _ = rows
    before = _snapshot(client, "rows")
    new = ["n0", "n1"]
    mixed = ["n0", "k0", "k1", "n1"]  # k1 already has prev_logprobs
    ids_new = text_columns(new, seed=9)["input_ids"]
    lens = [len(ids_new[0]), len(cols["input_ids"][0]), len(cols["input_ids"][1]), len(ids_new[1])]
    mixed_cols = {
        "input_ids": [ids_new[0], None, None, ids_new[1]],  # new rows carry what is required
        "prev_logprobs": [np.full(n, -0.5, np.float32) for n in lens],
    }
    with pytest.raises(
        flightq.ConflictError,
        match=r"row key 'k1' already has column 'prev_logprobs' in partition 'rows'; "
        r"pass overwrite=True to rewrite it",
    ):
        client.put("rows", mixed, mixed_cols)
    assert _snapshot(client, "rows") == before
    with pytest.raises(flightq.NotFoundError, match=r"no row key 'n0', 'n1'"):
        client.get("rows", new)
    # Without the conflicting row, the same put lands: new rows and the write-back onto k0.
    keep = [0, 1, 3]
    ok = {name: [v[j] for j in keep] for name, v in mixed_cols.items()}
    assert client.put("rows", [mixed[j] for j in keep], ok) == 3
    got = client.get("rows", ["n0", "k0", "n1"], ["prev_logprobs"], as_="numpy")
    assert [len(x) for x in got["prev_logprobs"]] == [len(ok["prev_logprobs"][j]) for j in range(3)]


def test_a_put_creating_a_row_without_a_required_field_stores_nothing(client):
    client.create_partition("g", TEXT, group_size=2)
    keys = ["a", "b"]
    with pytest.raises(
        flightq.MissingFieldError,
        match=r"row key 'a' is new in partition 'g' and lacks required field\(s\) \['input_ids'\]",
    ):
        client.put("g", keys, {"total_reward": np.ones(2, np.float32)})
    cols = text_columns(keys)
    cols["input_ids"][1] = None
    with pytest.raises(flightq.MissingFieldError, match=r"row key 'b': required field 'input_ids'"):
        client.put("g", keys, cols)
    assert client.stats()["partitions"]["g"]["rows"] == 0


def test_a_write_back_with_another_sequence_length_is_refused(client, rows):
    _, cols, _ = rows
    n = len(cols["input_ids"][0])
    with pytest.raises(
        flightq.ShapeError, match=rf"row key 'k0'.*sequence length {n + 1}, the stored row has {n}"
    ):
        client.put("rows", ["k0"], {"advantages": [np.zeros(n + 1, np.float32)]})


def test_overwrite_rewrites_sample_mask(client, rows):
    keys, _, _ = rows
    client.put("rows", keys, {"sample_mask": np.ones(4, np.float32)})
    with pytest.raises(flightq.ConflictError, match=r"already has column 'sample_mask'"):
        client.put("rows", keys, {"sample_mask": np.zeros(4, np.float32)})
    assert client.get("rows", keys, ["sample_mask"], as_="numpy")["sample_mask"].tolist() == [1] * 4
    client.put("rows", keys, {"sample_mask": np.full(4, 0.5, np.float32)}, overwrite=True)
    got = client.get("rows", keys, ["sample_mask"], as_="numpy")["sample_mask"]
    assert got.tolist() == [0.5] * 4


@pytest.mark.torch
def test_tags_of_a_later_put_are_merged_into_the_row(client, rows):
    _, cols, _ = rows
    n = len(cols["input_ids"][2])
    client.put(
        "rows",
        ["k2"],
        {"advantages": [np.ones(n, np.float32)]},
        tags=[{"weight_version": 2, "stage": "adv"}],
    )
    b = client.get("rows", ["k2", "k3"], ["input_ids"])
    assert b.tags == [
        {"weight_version": 2, "prompt_idx": 2, "stage": "adv"},
        {"weight_version": 1, "prompt_idx": 3},
    ]


def test_an_undeclared_column_is_refused_never_registered(client, rows):
    with pytest.raises(
        flightq.UndeclaredFieldError, match=r"column 'pixel_values' is not declared"
    ):
        client.put("rows", ["k0"], {"pixel_values": [[np.zeros((1, 2), np.float32)]]})
    assert "pixel_values" not in client.inspect("rows")["fields"]


def test_clear_of_an_unknown_key_clears_nothing(client, rows):
    with pytest.raises(flightq.NotFoundError, match=r"no row key 'zz'"):
        client.clear("rows", ["k0", "zz"])
    assert client.stats()["partitions"]["rows"]["rows"] == 4
    assert client.clear("rows", ["k0"]) == 1
    assert client.clear("rows") == 3


def test_clear_missing_ok_removes_the_keys_held_and_skips_the_rest(client, rows):
    # as the ranks of a data-parallel group clearing one step's keys, each all of them
    assert client.clear("rows", ["k0", "zz", "k0", "k1"], missing_ok=True) == 2
    assert sorted(client.list_keys("rows")) == ["k2", "k3"]
    assert client.clear("rows", ["k0", "k1"], missing_ok=True) == 0
    assert client.clear("rows", [], missing_ok=True) == 0
    with pytest.raises(flightq.NotFoundError, match=r"no row key 'k0'"):
        client.clear("rows", ["k2", "k0"])  # without it, still all or nothing
    assert sorted(client.list_keys("rows")) == ["k2", "k3"]
    with pytest.raises(flightq.NotFoundError) as gone:
        client.clear("nope", ["k2"], missing_ok=True)  # a partition is never skipped
    assert gone.value.partition == "nope" and gone.value.key is None


def test_overwrite_replaces_the_bytes_counted_in_stats(client, rows):
    _, _, lp = rows
    before = client.stats()["partitions"]["rows"]["bytes"]
    client.put("rows", ["k1"], {"prev_logprobs": [lp * 2]}, overwrite=True)
    assert client.stats()["partitions"]["rows"]["bytes"] == before
    got = client.get("rows", ["k1"], ["prev_logprobs"], as_="numpy")["prev_logprobs"][0]
    assert raw(got) == raw(lp * 2)
