"""TensorDicts and jagged tensors in and out, and packed token columns, over a real server.

A put takes a TensorDict whose batch dim is the rows (ragged columns as jagged nested
tensors); ``get``/``claim(..., as_="tensordict")`` answer one whose token fields are
jagged nested tensors over the received buffers. Every token column packs as
``(flat, cu_seqlens)`` with int32 offsets; media ``.cat()`` says when it copied.
"""

from __future__ import annotations

import pytest
from fixtures_dataplane import VLM, client_fixture, server_fixture

import flightq

__all__ = ["client_fixture", "server_fixture"]

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]

G = 4
KEYS = [f"p0_g{i}" for i in range(G)]
LENS = (3, 5, 2, 4)


@pytest.fixture(name="td")
def td_fixture():
    return pytest.importorskip("tensordict", reason="tensordict is not installed")


def _ids(torch):
    return torch.nested.nested_tensor(
        [torch.arange(n, dtype=torch.int64) + 10 * i for i, n in enumerate(LENS)],
        layout=torch.jagged,
    )


def _vlm_td(torch, td):
    lens = torch.tensor(LENS, dtype=torch.int32)
    return td.TensorDict({"input_ids": _ids(torch), "input_lengths": lens}, batch_size=[G])


def test_a_tensordict_put_round_trips_with_jagged_token_fields(client, torch, td) -> None:
    client.create_partition("r", VLM, tasks=["train"], group_size=G)
    assert client.put("r", KEYS, _vlm_td(torch, td)) == G
    out = client.get("r", KEYS, as_="tensordict")
    assert isinstance(out, td.TensorDict) and out.batch_size == torch.Size([G])
    ids = out["input_ids"]
    assert ids.is_nested and ids.layout == torch.jagged
    assert [r.tolist() for r in ids.unbind()] == [r.tolist() for r in _ids(torch).unbind()]
    assert out["input_lengths"].tolist() == list(LENS)
    assert list(out["__key__"]) == KEYS and list(out["__tags__"]) == [{}] * G
    # Padded to its longest row (5), not to the batch's 14 tokens: the tensor knows its
    # rows' lengths, as torch.nested.as_nested_tensor's does.
    assert ids.to_padded_tensor(0).shape == (G, max(LENS))
    padded = torch.nested.as_nested_tensor(list(_ids(torch).unbind()), layout=torch.jagged)
    assert torch.equal(ids.to_padded_tensor(-1), padded.to_padded_tensor(-1))


def test_jagged_values_are_the_received_buffers(client, torch) -> None:
    client.create_partition("r", VLM, tasks=["train"], group_size=G)
    client.put("r", KEYS, {"input_ids": _ids(torch)})
    b = client.get("r", KEYS)
    col = b.column("input_ids")
    nt = col.jagged()
    flat, cu = col.packed()
    assert nt.values().data_ptr() == flat.data_ptr() == b["input_ids"][0].data_ptr()
    assert nt.offsets().tolist() == cu.tolist() == [0, 3, 8, 10, 14]
    assert nt.to_padded_tensor(0).shape == (G, 5)  # the longest row, not 14


def test_a_token_column_packs_as_flash_attention_varlen_takes_it(client, torch) -> None:
    client.create_partition("r", VLM, tasks=["train"], group_size=G)
    client.put("r", KEYS, {"input_ids": _ids(torch)})
    p = client.get("r", KEYS).column("input_ids").packed()
    flat, cu_seqlens = p
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 8, 10, 14]
    assert flat.shape == (14,) and p.max_len == 5 and p.copied is False
    assert flat[3:8].tolist() == [10, 11, 12, 13, 14]


def test_packing_rows_of_several_record_batches_copies_once_and_says_so(torch) -> None:
    schema = flightq.SchemaRegistry.default().get(VLM)
    rows = list(_ids(torch).unbind())
    parts = [
        flightq.encode(schema, {"input_ids": rows[:2]}, KEYS[:2]),
        flightq.encode(schema, {"input_ids": rows[2:]}, KEYS[2:]),
    ]
    b = flightq.decode(parts)
    assert len(b.parts) == 2
    p = b.column("input_ids").packed()
    assert p.copied is True and p.offsets.tolist() == [0, 3, 8, 10, 14]
    assert p.values.tolist() == torch.cat(rows).tolist()
    assert b.column("input_ids").jagged().offsets().tolist() == [0, 3, 8, 10, 14]
    assert flightq.decode(parts[0]).column("input_ids").packed().copied is False


def test_media_cat_says_when_it_copies(client, torch) -> None:
    client.create_partition("r", VLM, tasks=["train"], group_size=G)
    img = torch.rand(6, 1176)
    client.put("r", KEYS, {"input_ids": _ids(torch), "pixel_values": [[img]] * G})
    shared = client.get("r", KEYS).column("pixel_values").cat()
    assert shared.copied is True and shared.values.shape == (G * 6, 1176)  # one per row
    own = [[torch.rand(2, 1176)] for _ in range(G)]
    client.put("r", KEYS, {"pixel_values": own}, overwrite=True)
    values, offsets = client.get("r", KEYS).column("pixel_values").cat()
    again = client.get("r", KEYS).column("pixel_values").cat()
    assert again.copied is False and offsets.tolist() == [0, 2, 4, 6, 8]
    assert torch.equal(values[2:4], own[1][0])


def test_media_come_back_as_segment_lists_and_a_text_row_as_no_media(client, torch, td) -> None:
    client.create_partition("r", VLM, tasks=["train"])
    img = torch.rand(6, 1176)
    client.put("r", KEYS, {"input_ids": _ids(torch), "pixel_values": [[img], [img], [], []]})
    out = client.get("r", KEYS, as_="tensordict")
    rows = out.get("pixel_values").tolist()
    assert [len(r) for r in rows] == [1, 1, 0, 0] and torch.equal(rows[0][0], img)
    assert rows[0][0].data_ptr() == rows[1][0].data_ptr()  # the shared image, once


def test_keys_tags_and_media_rows_index_as_tensordicts_own_stacks(
    client, torch, td, monkeypatch
) -> None:
    # The per-row entries are built with tensordict's direct builder of a stack member;
    # they must list, index and slice as the general NonTensorData constructor's do.
    from flightq import tensordicts

    assert tensordicts._flat_member(td) is not None, "the fast path is not taken here"
    client.create_partition("r", VLM, tasks=["train"])
    img = torch.rand(6, 1176)
    tags = [{"uid": "u0", "n": 1}, {"uid": "u1", "nested": {"a": [1, 2]}}, {}, {"x": 0.5}]
    pixels = [[img], [img], [], [img[:2]]]
    client.put("r", KEYS, {"input_ids": _ids(torch), "pixel_values": pixels}, tags=tags)
    fast = client.get("r", KEYS, as_="tensordict")
    monkeypatch.setattr(tensordicts, "_flat_member", lambda td_mod: None)
    general = client.get("r", KEYS, as_="tensordict")
    for name in ("__key__", "__tags__", "pixel_values"):
        a, b = fast.get(name), general.get(name)
        assert type(a) is type(b) and a.batch_size == b.batch_size == (G,)
        assert [type(m) for m in a.tensordicts] == [type(m) for m in b.tensordicts]
    assert fast["__key__"] == general["__key__"] == KEYS
    assert fast["__tags__"] == general["__tags__"] == tags
    assert fast[1]["__tags__"] == tags[1] and fast[1:3]["__tags__"] == tags[1:3]
    assert fast[3]["__key__"] == KEYS[3]
    rows = fast.get("pixel_values").tolist()
    assert [len(r) for r in rows] == [1, 1, 0, 1] and torch.equal(rows[3][0], img[:2])
    assert torch.equal(fast[0]["pixel_values"][0], img)


def test_a_claim_answers_a_tensordict_and_it_writes_back(client, torch, td) -> None:
    client.create_partition("r", VLM, tasks=["lp", "train"], group_size=G)
    client.put("r", KEYS, _vlm_td(torch, td))
    got = client.claim("r", "lp", G, fields=["input_ids"], as_="tensordict")
    ids = got["input_ids"]
    lp = torch.nested.nested_tensor_from_jagged(-torch.rand(ids.values().shape[0]), ids.offsets())
    back = td.TensorDict({"prev_logprobs": lp, "__key__": got["__key__"]}, batch_size=[G])
    client.put("r", list(got["__key__"]), back)
    out = client.claim("r", "train", G, wait_for=["prev_logprobs"], as_="tensordict")
    assert out["prev_logprobs"].offsets().tolist() == ids.offsets().tolist()


def test_a_tensordict_whose_keys_differ_from_the_puts_is_refused(client, torch, td) -> None:
    client.create_partition("r", VLM, tasks=["train"])
    client.put("r", KEYS, _vlm_td(torch, td))
    out = client.get("r", KEYS, as_="tensordict")
    with pytest.raises(flightq.EncodeError, match="wrong keys"):
        client.put("r", KEYS[::-1], out.select("__key__", "input_lengths"), overwrite=True)


def test_a_field_some_rows_lack_is_refused_as_a_tensordict(client, torch, td) -> None:
    client.create_partition("r", VLM, tasks=["train"])
    client.put("r", KEYS, _vlm_td(torch, td))
    client.put("r", KEYS[:1], {"prev_logprobs": [torch.rand(3)]})
    with pytest.raises(flightq.MissingFieldError, match="'prev_logprobs' is missing in 3 of 4"):
        client.get("r", KEYS, as_="tensordict")
    assert "prev_logprobs" not in client.get("r", KEYS, ["input_ids"], as_="tensordict")


def test_a_nested_tensordict_entry_is_refused(client, torch, td) -> None:
    client.create_partition("r", VLM, tasks=["train"])
    inner = td.TensorDict({"a": torch.zeros(G)}, batch_size=[G])
    cols = td.TensorDict({"input_ids": _ids(torch), "extra": inner}, batch_size=[G])
    with pytest.raises(flightq.EncodeError, match="nested TensorDict"):
        client.put("r", KEYS, cols)


def test_a_sharded_and_an_async_client_answer_tensordicts(server, torch, td) -> None:
    import asyncio

    import flightq.aio

    with flightq.Server() as other:
        sharded = flightq.connect_sharded([server.location, other.location], [VLM])
        try:
            sharded.create_partition("r", VLM, tasks=["train"], group_size=G)
            sharded.put("r", KEYS, _vlm_td(torch, td))
            out = sharded.get("r", KEYS, as_="tensordict")
        finally:
            sharded.close()
    assert out["input_ids"].offsets().tolist() == [0, 3, 8, 10, 14]

    async def main(location: str) -> object:
        async with await flightq.aio.connect(location, [VLM]) as c:
            await c.create_partition("a", VLM, tasks=["train"])
            await c.put("a", KEYS, _vlm_td(torch, td))
            return await c.claim("a", "train", G, as_="tensordict")

    got = asyncio.run(main(server.location))
    assert got["input_lengths"].tolist() == list(LENS)  # type: ignore[index]


def test_a_packed_column_from_a_get_is_put_back_under_new_keys(client, torch) -> None:
    """``column(name).packed()`` is a put's column as it is: the rows land as they were."""
    client.create_partition("r", VLM, tasks=["train"])
    client.put("r", KEYS, {"input_ids": _ids(torch)})
    packed = client.get("r", KEYS).column("input_ids").packed()
    again = [f"again_{k}" for k in KEYS]
    assert client.put("r", again, {"input_ids": packed}) == G
    got = client.get("r", again)["input_ids"]
    assert [r.tolist() for r in got] == [r.tolist() for r in _ids(torch).unbind()]


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_jagged_and_dense_columns_round_trip_over_either_route(server, torch, shm) -> None:
    """Large enough for a shared-memory put to gather into its segment: the rows the server
    stores are those of the jagged and dense tensors, a column at a time."""
    n, width = 32, 4096
    lens = [width - 37 * i for i in range(n)]
    keys = [f"g0_{i}" for i in range(n)]
    rows = [torch.arange(s, dtype=torch.int64) * (i + 1) for i, s in enumerate(lens)]
    lps = [torch.rand(s) for s in lens]
    ids = torch.arange(n * width, dtype=torch.int64).reshape(n, width)  # dense: rows of `width`
    with flightq.connect(server.location, [VLM], shm=shm) as c:
        c.create_partition("j", VLM, tasks=["train"])
        receipt = c.put(
            "j",
            keys,
            {
                "input_ids": torch.nested.nested_tensor(rows, layout=torch.jagged),
                "generation_logprobs": torch.nested.nested_tensor(lps, layout=torch.jagged),
                "input_lengths": torch.tensor(lens, dtype=torch.int32),
            },
        )
        assert receipt == n and receipt.route == ("shm" if shm else "socket")
        c.create_partition("d", VLM, tasks=["train"])
        c.put("d", keys, {"input_ids": ids, "token_mask": torch.ones_like(ids)})
        got = c.get("j", keys)
        dense = c.get("d", keys)["input_ids"]
    assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], rows, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(got["generation_logprobs"], lps, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(dense, ids, strict=True))


def test_token_fields_of_a_tensordict_share_their_ragged_dim(client, torch, td) -> None:
    """torch refuses arithmetic between jagged tensors of different offsets objects: a
    row's token fields share its sequence length, so they share one (``logprobs * mask``
    works), over one record batch and over several."""
    client.create_partition("r", VLM, tasks=["train"])
    for lo, hi in ((0, 2), (2, G)):  # two puts, read together
        rows = range(lo, hi)
        client.put(
            "r",
            KEYS[lo:hi],
            {
                "input_ids": [torch.arange(LENS[i]) for i in rows],
                "generation_logprobs": [torch.full((LENS[i],), -0.5) for i in rows],
                "token_mask": [torch.ones(LENS[i], dtype=torch.int64) for i in rows],
            },
        )
    for keys in (KEYS[:2], KEYS):
        got = client.get("r", keys, as_="tensordict")
        lp, mask = got["generation_logprobs"], got["token_mask"]
        assert lp.offsets() is mask.offsets() is got["input_ids"].offsets()
        assert float((lp * mask).values().sum()) == -0.5 * sum(LENS[: len(keys)])
        b = client.get("r", keys)
        assert (b.column("input_ids").jagged() + b.column("token_mask").jagged()).is_nested
    other = client.get("r", KEYS[2:], as_="tensordict")  # another read: its own offsets
    assert other["input_ids"].offsets() is not got["input_ids"].offsets()


def test_only_token_fields_share_a_ragged_dim_over_several_record_batches(torch) -> None:
    """A ``tensor`` field of its own length (a response) keeps its own ragged dim even
    where its lengths happen to equal the tokens': torch still catches mixing the two."""
    schema = flightq.Schema(
        "resp",
        1,
        [
            flightq.Field("input_ids", "int64", "token", (None,)),
            flightq.Field("token_mask", "int64", "token", (None,)),
            flightq.Field("response", "int64", "tensor", (None,)),
        ],
    )
    rows = [torch.arange(n) for n in LENS]
    cols = {"input_ids": rows, "token_mask": [torch.ones_like(r) for r in rows], "response": rows}
    parts = [
        flightq.encode(schema, {k: v[:2] for k, v in cols.items()}, KEYS[:2]),
        flightq.encode(schema, {k: v[2:] for k, v in cols.items()}, KEYS[2:]),
    ]
    b = flightq.decode(parts)
    assert type(b.column("input_ids")).__name__ == "ChunkedColumn"
    ids, mask, resp = (b.column(n).jagged() for n in ("input_ids", "token_mask", "response"))
    assert ids.offsets() is mask.offsets() and (ids * mask).is_nested
    assert resp.offsets() is not ids.offsets()
    with pytest.raises(RuntimeError, match="binary pointwise"):
        resp * mask
