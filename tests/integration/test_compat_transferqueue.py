"""TransferQueue's public KV scenarios, played through flightq.compat.transferqueue against
a real flightq server: single and batch puts, new fields onto existing keys,
select_fields, tags in kv_list, kv_clear, get by meta, and every call's async twin.

The partitions' schema is drafted from a sample (``flightq.draft_schema``) into a schema
folder, as a user would before switching; flightq's stricter rules (declared schemas,
dtype drift, unknown keys) keep their typed errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import flightq

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


@pytest.fixture(name="TensorDict")
def tensordict_fixture() -> Any:
    return pytest.importorskip("tensordict", reason="tensordict is not installed").TensorDict


def _sample(torch: Any, TensorDict: Any) -> Any:
    """One row of every field the scenarios write: what a user drafts the schema from."""
    nested = torch.nested.nested_tensor([torch.zeros(2, dtype=torch.int64)], layout=torch.jagged)
    return TensorDict(
        {
            "input_ids": torch.zeros(1, 3, dtype=torch.int64),
            "attention_mask": torch.zeros(1, 3, dtype=torch.int64),
            "response": torch.zeros(1, 2, dtype=torch.int64),
            "data": nested,
            "score": torch.zeros(1),
            "pixel_values": flightq_media_sample(torch),
        },
        batch_size=[1],
    )


def flightq_media_sample(torch: Any) -> Any:
    from tensordict import NonTensorStack

    return NonTensorStack([torch.zeros(4, 6)])


@pytest.fixture(name="tq")
def tq_fixture(tmp_path: Path, torch: Any, TensorDict: Any) -> Iterator[Any]:
    import flightq.compat.transferqueue as tq

    draft = flightq.draft_schema(_sample(torch, TensorDict), "kv_test")
    # The review step: a row's token fields share its sequence length; "response" has its
    # own, so it is a tensor of one variable dim.
    fields = [
        flightq.Field(f.name, f.dtype, "tensor", [None]) if f.name == "response" else f
        for f in draft.fields
    ]
    schema = flightq.Schema(draft.name, draft.version, fields)
    (tmp_path / "kv_test").mkdir()
    (tmp_path / "kv_test" / "v1.json").write_text(schema.to_json())
    conf = tq.init({"flightq": {"schema": "kv_test@1", "schemas_dir": str(tmp_path)}})
    assert conf["location"].startswith("grpc://127.0.0.1:")
    try:
        yield tq
    finally:
        tq.close()


@pytest.fixture(name="api", params=["sync", "async"])
def api_fixture(request: Any, tq: Any) -> Any:
    """The KV calls, straight or through their async_ twins (asyncio.run each)."""

    class Api:
        def __getattr__(self, name: str) -> Any:
            if request.param == "sync":
                return getattr(tq, name)
            twin = getattr(tq, f"async_{name}")
            return lambda *a, **kw: asyncio.run(twin(*a, **kw))

    return Api()


def _rows(x: Any) -> list[list[int]]:
    return [r.tolist() for r in (x.unbind() if x.is_nested else x)]


def test_kv_put_with_a_dict_and_a_tag(api: Any, torch: Any) -> None:
    meta = api.kv_put(
        key="s0", partition_id="p", fields={"input_ids": torch.tensor([1, 2, 3])}, tag={"v": 1}
    )
    assert meta.keys == ["s0"] and meta.tags == [{"v": 1}] and meta.fields == ["input_ids"]
    got = api.kv_batch_get(keys="s0", partition_id="p")
    assert got.batch_size == torch.Size([1]) and _rows(got["input_ids"]) == [[1, 2, 3]]
    assert set(got.keys()) == {"input_ids"}


def test_kv_put_of_a_tag_only_updates_the_tags(api: Any, torch: Any, TensorDict: Any) -> None:
    one = TensorDict({"input_ids": torch.tensor([[10, 11]])}, batch_size=[1])
    api.kv_put(key="s1", partition_id="p", fields=one, tag={"version": 1})
    meta = api.kv_put(key="s1", partition_id="p", fields=None, tag={"version": 2, "st": "ok"})
    assert meta.tags == [{"version": 2, "st": "ok"}] and meta.fields == ["input_ids"]
    assert api.kv_list(partition_id="p")["p"]["s1"] == {"version": 2, "st": "ok"}


def test_kv_batch_put_then_get_every_row(api: Any, torch: Any, TensorDict: Any) -> None:
    keys = [f"b{i}" for i in range(4)]
    ids = torch.arange(12).view(4, 3)
    fields = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=4)
    meta = api.kv_batch_put(
        keys=keys, partition_id="p", fields=fields, tags=[{"idx": i} for i in range(4)]
    )
    assert meta.fields == ["attention_mask", "input_ids"] and len(meta) == 4  # by name, as TQ
    got = api.kv_batch_get(keys=keys, partition_id="p")
    assert _rows(got["input_ids"]) == ids.tolist()
    assert _rows(got["attention_mask"]) == [[1, 1, 1]] * 4


def test_ragged_rows_travel_as_jagged_tensors(api: Any, torch: Any, TensorDict: Any) -> None:
    keys = ["n0", "n1", "n2"]
    data = torch.nested.nested_tensor(
        [torch.tensor([10, 11, 12]), torch.tensor([20]), torch.tensor([30, 31])],
        layout=torch.jagged,
    )
    api.kv_batch_put(keys=keys, partition_id="p", fields=TensorDict({"data": data}, batch_size=3))
    got = api.kv_batch_get(keys=["n0", "n2"], partition_id="p")
    assert got["data"].layout == torch.jagged and _rows(got["data"]) == [[10, 11, 12], [30, 31]]


def test_a_later_put_adds_fields_to_existing_keys(api: Any, torch: Any, TensorDict: Any) -> None:
    keys = ["c0", "c1"]
    first = TensorDict({"input_ids": torch.tensor([[1, 2], [3, 4]])}, batch_size=2)
    assert api.kv_batch_put(keys=keys, partition_id="p", fields=first).fields == ["input_ids"]
    second = TensorDict({"response": torch.tensor([[5, 6]])}, batch_size=1)
    meta = api.kv_batch_put(keys=["c1"], partition_id="p", fields=second, tags=[{"v": 2}])
    assert meta.fields == ["input_ids", "response"] and meta.tags == [{"v": 2}]
    # Fields every row has: c0 has no response yet.
    both = api.kv_batch_put(keys=keys, partition_id="p", tags=[{"v": 3}, {"v": 3}])
    assert both.fields == ["input_ids"]
    got = api.kv_batch_get(keys="c1", partition_id="p")
    assert _rows(got["response"]) == [[5, 6]]
    # As TransferQueue reads rows that differ: the fields every row has.
    assert list(api.kv_batch_get(keys=keys, partition_id="p").keys()) == ["input_ids"]


def test_select_fields_leaves_out_what_not_every_row_has(
    api: Any, torch: Any, TensorDict: Any
) -> None:
    # verl asks for values, ref_log_prob and rollout_log_probs, then looks at which came
    # back: flightq raised for a field no row had (GRPO without a critic writes no values).
    ids = TensorDict({"input_ids": torch.tensor([[1, 2], [3, 4]])}, batch_size=2)
    api.kv_batch_put(keys=["s0", "s1"], partition_id="p", fields=ids)
    resp = TensorDict({"response": torch.tensor([[7]])}, batch_size=1)
    api.kv_batch_put(keys=["s1"], partition_id="p", fields=resp)
    asked = ["response", "input_ids", "score", "not_declared"]
    got = api.kv_batch_get(keys=["s0", "s1"], partition_id="p", select_fields=asked)
    assert list(got.keys()) == ["input_ids"] and _rows(got["input_ids"]) == [[1, 2], [3, 4]]
    none = api.kv_batch_get(keys=["s0", "s1"], partition_id="p", select_fields=["score"])
    assert none.batch_size == torch.Size([0]) and list(none.keys()) == []  # as TransferQueue
    with pytest.raises(ValueError, match="no row key 'nope'"):  # unknown keys still refused
        api.kv_batch_get(keys=["s0", "nope"], partition_id="p", select_fields=asked)
    with pytest.raises(ValueError, match="no keys"):  # as TransferQueue's
        api.kv_batch_get(keys=[], partition_id="p")
    # A key may repeat, as in a plain read.
    again = api.kv_batch_get(keys=["s1", "s0", "s1"], partition_id="p", select_fields=asked)
    assert _rows(again["input_ids"]) == [[3, 4], [1, 2], [3, 4]]
    # A row holding tags alone: no field is in every row, as TransferQueue's "not ready".
    api.kv_batch_put(keys=["s2"], partition_id="p", tags=[{"status": "pending"}])
    with pytest.raises(flightq.MissingFieldError, match="no field is present in every row"):
        api.kv_batch_get(keys=["s0", "s2"], partition_id="p")
    # Underneath, a get naming twice a row that has none of the fields asked: both went
    # into one record batch, which the client refused ("duplicate row key").
    import flightq.compat.transferqueue as tq

    got = tq._tq().client.get("p", ["s0", "s2", "s2"], as_="numpy")
    assert got.keys == ["s0", "s2", "s2"] and got.tags[1:] == [{"status": "pending"}] * 2


def test_non_tensor_fields_travel_in_the_rows_tags_and_read_back_as_fields(
    api: Any, torch: Any, TensorDict: Any
) -> None:
    # verl's agent loop puts uid, raw_prompt and reward_model beside the tensors, and its
    # trainer reads them back as fields: a flightq schema declares tensors only, and the
    # put was refused.
    from tensordict import NonTensorStack

    prompts = [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "hi"}]]
    fields = TensorDict(
        {
            "input_ids": torch.tensor([[1, 2], [3, 4]]),
            "uid": NonTensorStack("u0", "u1"),
            "raw_prompt": NonTensorStack.from_list(prompts),
        },
        batch_size=2,
    )
    meta = api.kv_batch_put(keys=["n0", "n1"], partition_id="p", fields=fields, tags=[{"v": 1}] * 2)
    assert meta.fields == ["input_ids", "raw_prompt", "uid"] and meta.tags == [{"v": 1}] * 2
    got = api.kv_batch_get(keys=["n1", "n0"], partition_id="p")
    assert list(got.keys()) == ["input_ids", "raw_prompt", "uid"]
    assert (
        got.get("uid").tolist() == ["u1", "u0"] and got.get("raw_prompt").tolist() == prompts[::-1]
    )
    # Selected alone, or beside a tensor; a dict of columns and kv_put take them too.
    only = api.kv_batch_get(keys=["n0"], partition_id="p", select_fields="uid")
    assert list(only.keys()) == ["uid"] and only.batch_size == torch.Size([1])
    api.kv_batch_put(keys=["n0", "n1"], partition_id="p", fields={"data_source": ["gsm8k", "math"]})
    api.kv_put(key="n0", partition_id="p", fields={"reward_model": {"ground_truth": "4"}})
    both = api.kv_batch_get(
        keys=["n0"], partition_id="p", select_fields=["reward_model", "input_ids"]
    )
    assert both.get("reward_model").tolist() == [{"ground_truth": "4"}]
    assert _rows(both["input_ids"]) == [[1, 2]]
    # Not every row has it: left out, as a tensor field would be.
    read = api.kv_batch_get(keys=["n0", "n1"], partition_id="p")
    assert "reward_model" not in list(read.keys())
    # The tags shown are the writers' own; a listing leaves the values on the server.
    assert api.kv_list(partition_id="p")["p"]["n1"] == {"v": 1}
    import flightq.compat.transferqueue as tq

    row = tq._tq().client.list_keys("p", ["n1"], hide_tag_values="__tq_field__:")["n1"]
    assert row["tags"] == {
        "v": 1,
        "__tq_field__:uid": None,
        "__tq_field__:raw_prompt": None,
        "__tq_field__:data_source": None,
    }
    # A read of tensor fields alone leaves the non-tensor values on the server too.
    client = tq._tq().client
    api.kv_batch_put(keys=["n1"], partition_id="p", fields={"raw_prompt": ["x" * 50_000]})
    sent = client.stats()["counters"]["bytes_sent"]
    assert _rows(
        api.kv_batch_get(keys=["n1"], partition_id="p", select_fields="input_ids")["input_ids"]
    ) == [[3, 4]]
    assert client.stats()["counters"]["bytes_sent"] - sent < 10_000
    whole = api.kv_batch_get(keys=["n1"], partition_id="p", select_fields="raw_prompt")
    assert whole.get("raw_prompt").tolist() == ["x" * 50_000]
    assert client.stats()["counters"]["bytes_sent"] - sent > 50_000
    # A tensor under an undeclared name is still refused, naming it.
    with pytest.raises(flightq.UndeclaredFieldError, match="'logits'"):
        api.kv_batch_put(keys=["n0"], partition_id="p", fields={"logits": [torch.ones(2)]})


def test_non_tensor_values_tags_cannot_carry_are_refused_naming_field_and_row(
    api: Any, torch: Any
) -> None:
    import numpy as np

    ids = [torch.tensor([1])]
    bad = [
        {"pixels": np.zeros(3)},  # an array inside a dict
        {1: "a"},  # a map key that is not a string
        {"s"},  # a set
    ]
    for value in bad:
        with pytest.raises(flightq.EncodeError, match="non-tensor field 'extra' of row 'e0'") as e:
            api.kv_batch_put(["e0"], "p", fields={"input_ids": ids, "extra": [value]})
        assert (e.value.field, e.value.key) == ("extra", "e0")
    # Past what a server takes of one row's tags in a put: named, with the largest field
    # (or tag).
    big = ["x" * 70_000]
    with pytest.raises(flightq.EncodeError, match="largest is field 'raw_prompt'"):
        api.kv_batch_put(["e0"], "p", fields={"input_ids": ids, "raw_prompt": big})
    with pytest.raises(flightq.EncodeError, match="largest is tag 'note'"):
        fields = {"input_ids": ids, "uid": ["u"]}
        api.kv_batch_put(["e0"], "p", fields=fields, tags=[{"note": big[0]}])
    with pytest.raises(flightq.EncodeError, match="must be a dict"):  # not a TypeError
        api.kv_batch_put(["e0"], "p", fields={"input_ids": ids}, tags=[5])
    # A tag key of the compat's own is refused; numpy object columns are objects.
    with pytest.raises(flightq.EncodeError, match="__tq_field__:uid"):
        api.kv_batch_put(["e0"], "p", fields={"input_ids": ids}, tags=[{"__tq_field__:uid": 1}])
    uids = np.array(["u0"], dtype=object)
    api.kv_batch_put(["e0"], "p", fields={"input_ids": ids, "uid": uids})
    assert api.kv_batch_get(["e0"], "p", select_fields="uid").get("uid").tolist() == ["u0"]
    # Non-tensor fields alone of a key named twice.
    twice = api.kv_batch_get(["e0", "e0"], "p", select_fields="uid")
    assert twice.get("uid").tolist() == ["u0", "u0"]


def test_fields_are_listed_and_read_in_name_order(api: Any, torch: Any, TensorDict: Any) -> None:
    fields = TensorDict(
        {
            "score": torch.ones(1),
            "input_ids": torch.tensor([[1, 2]]),
            "data": torch.ones(1, 2, dtype=torch.int64),
        },
        batch_size=1,
    )
    meta = api.kv_batch_put(keys=["o0"], partition_id="p", fields=fields)
    assert meta.fields == ["data", "input_ids", "score"]
    assert list(api.kv_batch_get(keys=["o0"], partition_id="p").keys()) == meta.fields


def test_numpy_and_tensor_scalars_in_tags_are_kept_as_their_values(api: Any, torch: Any) -> None:
    import numpy as np

    tag = {"step": np.int64(7), "score": torch.tensor(0.5), "seen": (np.bool_(True), 2)}
    api.kv_put(key="t0", partition_id="p", fields={"input_ids": torch.tensor([1])}, tag=tag)
    assert api.kv_list(partition_id="p")["p"]["t0"] == {
        "step": 7,
        "score": 0.5,
        "seen": [True, 2],
    }


def test_select_fields_takes_a_name_or_a_list(api: Any, torch: Any, TensorDict: Any) -> None:
    fields = TensorDict(
        {
            "input_ids": torch.tensor([[1, 2, 3]]),
            "attention_mask": torch.ones(1, 3, dtype=torch.int64),
            "response": torch.tensor([[10, 20]]),
        },
        batch_size=1,
    )
    api.kv_put(key="f0", partition_id="p", fields=fields, tag=None)
    one = api.kv_batch_get(keys="f0", partition_id="p", select_fields="input_ids")
    assert set(one.keys()) == {"input_ids"}
    two = api.kv_batch_get(keys="f0", partition_id="p", select_fields=["input_ids", "response"])
    assert set(two.keys()) == {"input_ids", "response"} and _rows(two["response"]) == [[10, 20]]


def test_get_by_meta_with_and_without_select_fields(api: Any, torch: Any, TensorDict: Any) -> None:
    keys = ["m0", "m1", "m2"]
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    fields = TensorDict({"input_ids": ids, "response": ids[:, :2]}, batch_size=3)
    meta = api.kv_batch_put(keys=keys, partition_id="p", fields=fields, tags=[{}] * 3)
    assert set(api.kv_batch_get_by_meta(meta).keys()) == {"input_ids", "response"}
    got = api.kv_batch_get_by_meta(meta, select_fields="response")
    assert set(got.keys()) == {"response"} and _rows(got["response"]) == ids[:, :2].tolist()
    with pytest.raises(ValueError, match=r"select_fields.*not found"):
        api.kv_batch_get_by_meta(meta, select_fields=["input_ids", "nope"])


def test_kv_list_shows_keys_and_tags_per_partition(api: Any, torch: Any, TensorDict: Any) -> None:
    for p, n in (("p0", 2), ("p1", 3)):
        keys = [f"{p}_{i}" for i in range(n)]
        fields = TensorDict({"input_ids": torch.zeros(n, 2, dtype=torch.int64)}, batch_size=n)
        api.kv_batch_put(
            keys=keys, partition_id=p, fields=fields, tags=[{"id": i} for i in range(n)]
        )
    one = api.kv_list(partition_id="p1")
    assert list(one) == ["p1"] and one["p1"] == {f"p1_{i}": {"id": i} for i in range(3)}
    every = api.kv_list()
    assert set(every) == {"p0", "p1"} and len(every["p0"]) == 2


def test_kv_clear_removes_only_the_keys_named(api: Any, torch: Any, TensorDict: Any) -> None:
    keys = [f"x{i}" for i in range(4)]
    fields = TensorDict({"input_ids": torch.zeros(4, 2, dtype=torch.int64)}, batch_size=4)
    api.kv_batch_put(keys=keys, partition_id="p", fields=fields)
    api.kv_clear(keys=keys[:2], partition_id="p")
    assert list(api.kv_list(partition_id="p")["p"]) == keys[2:]
    api.kv_clear(keys="x2", partition_id="p")
    assert list(api.kv_list(partition_id="p")["p"]) == ["x3"]
    # As TransferQueue: keys (or a partition) that are not there are left out.
    api.kv_clear(keys=["x0", "x3", "never"], partition_id="p")
    assert api.kv_list(partition_id="p") == {"p": {}}
    api.kv_clear(keys="x3", partition_id="never_written")
    assert api.kv_list(partition_id="never_written") == {}


def test_a_put_to_a_partition_dropped_elsewhere_declares_it_again(
    api: Any, tq: Any, torch: Any, TensorDict: Any
) -> None:
    fields = TensorDict({"input_ids": torch.zeros(2, 3, dtype=torch.int64)}, batch_size=2)
    api.kv_batch_put(keys=["a", "b"], partition_id="step_1", fields=fields)
    # Another process (or `flightq` on the command line) drops the partition.
    with flightq.connect(tq._tq().location) as other:
        other.drop("step_1")
    api.kv_batch_put(keys=["c", "d"], partition_id="step_1", fields=fields)
    assert list(api.kv_list(partition_id="step_1")["step_1"]) == ["c", "d"]


def test_an_unknown_key_is_not_found(api: Any, torch: Any) -> None:
    api.kv_put(key="k", partition_id="p", fields={"input_ids": torch.tensor([1])})
    # flightq's NotFoundError, and the ValueError TransferQueue raises (caught as either).
    with pytest.raises(ValueError, match="nonexistent") as info:
        api.kv_batch_get(keys="nonexistent", partition_id="p")
    assert isinstance(info.value, flightq.NotFoundError) and info.value.key == "nonexistent"
    with pytest.raises(ValueError, match="'elsewhere'"):
        api.kv_batch_get(keys="k", partition_id="elsewhere")


def test_flightq_rules_keep_their_typed_errors(tq: Any, torch: Any, TensorDict: Any) -> None:
    with pytest.raises(flightq.UndeclaredFieldError, match="'extra' is not declared"):
        tq.kv_put(key="e", partition_id="p", fields={"extra": torch.tensor([1])})
    with pytest.raises(flightq.DTypeError, match="int64"):
        tq.kv_put(
            key="e", partition_id="p", fields={"input_ids": torch.tensor([1], dtype=torch.int32)}
        )
    tq.kv_put(key="e", partition_id="p", fields={"input_ids": torch.tensor([1])})
    # Rewriting a field overwrites, as in TransferQueue (`overwrite: false` refuses it).
    tq.kv_put(key="e", partition_id="p", fields={"input_ids": torch.tensor([2])})
    assert tq.kv_batch_get(keys="e", partition_id="p")["input_ids"][0].tolist() == [2]
    with pytest.raises(flightq.ShapeError, match="3 keys for a TensorDict of batch_size"):
        fields = TensorDict({"input_ids": torch.zeros(2, 1, dtype=torch.int64)}, batch_size=2)
        tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields)


def test_a_partition_without_a_declared_schema_is_refused(tmp_path: Path, torch: Any) -> None:
    tq = pytest.importorskip("flightq.compat.transferqueue")
    pytest.importorskip("tensordict")
    q = tq.TransferQueue({"flightq": {"partitions": {"train": "rollout_text@1"}}})
    try:
        q.kv_put(key="a", partition_id="train", fields={"input_ids": torch.tensor([1, 2])})
        with pytest.raises(flightq.NotFoundError, match="partition 'other' has no schema"):
            q.kv_put(key="a", partition_id="other", fields={"input_ids": torch.tensor([1])})
        # A worker's bare init(), as TransferQueue's joins the job: the partition the
        # server has serves as declared there (its puts raised "has no schema" before).
        worker = tq.TransferQueue({"flightq": {"location": q.location}})
        try:
            worker.kv_put(key="b", partition_id="train", fields={"input_ids": torch.tensor([3])})
            assert sorted(worker.kv_list("train")["train"]) == ["a", "b"]
            with pytest.raises(flightq.NotFoundError, match="server has no such partition"):
                worker.kv_put(key="c", partition_id="other", fields={"input_ids": torch.ones(1)})
        finally:
            worker.close()
    finally:
        q.close()


def test_a_multimodal_step_round_trips_with_write_back(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    """A verl / NeMo RL-style step through the compat calls only: a generator puts a
    prompt group (token ids, one shared image), a logprob worker reads input_ids and
    writes logprobs back, the trainer reads every field by meta, then the rows are
    cleared."""
    from tensordict import NonTensorStack

    g = 4
    keys = [f"u0_g{i}" for i in range(g)]
    img = torch.rand(6, 6)
    ids = torch.nested.nested_tensor([torch.arange(n) for n in (3, 5, 2, 4)], layout=torch.jagged)
    step = TensorDict(
        {
            "data": ids,
            "pixel_values": NonTensorStack(*[[img] for _ in range(g)]),
            "score": torch.rand(g),
        },
        batch_size=[g],
    )
    tq.kv_batch_put(keys=keys, partition_id="rl", fields=step, tags=[{"weight_version": 3}] * g)
    got = tq.kv_batch_get(keys=keys, partition_id="rl", select_fields=["data"])
    lp = torch.nested.nested_tensor_from_jagged(got["data"].values() * 0 - 1, got["data"].offsets())
    meta = tq.kv_batch_put(
        keys=keys, partition_id="rl", fields=TensorDict({"input_ids": lp}, batch_size=[g])
    )
    assert meta.fields == ["data", "input_ids", "pixel_values", "score"]
    assert meta.tags == [{"weight_version": 3}] * g
    every = tq.kv_batch_get_by_meta(meta)
    assert _rows(every["input_ids"]) == [[-1] * n for n in (3, 5, 2, 4)]
    pixels = every.get("pixel_values").tolist()
    assert all(torch.equal(r[0], img) for r in pixels)
    tq.kv_clear(keys=keys, partition_id="rl")
    assert tq.kv_list(partition_id="rl") == {"rl": {}}


GENERATOR = """
import torch
from tensordict import NonTensorStack, TensorDict

import flightq.compat.transferqueue as tq

tq.init({"flightq": {"schema": "rollout_vlm@1"}})  # the location comes from FLIGHTQ_LOCATION
keys = [f"u0_g{i}" for i in range(4)]
ids = torch.nested.nested_tensor([torch.arange(n) for n in (3, 5, 2, 4)], layout=torch.jagged)
img = torch.full((6, 1176), 0.5)
step = TensorDict(
    {"input_ids": ids, "pixel_values": NonTensorStack(*[[img]] * 4)}, batch_size=[4]
)
meta = tq.kv_batch_put(keys=keys, partition_id="rl", fields=step, tags=[{"weight_version": 1}] * 4)
assert meta.fields == ["input_ids", "pixel_values"], meta.fields
tq.close()
print("put", len(meta))
"""


def test_processes_share_a_server_through_flightq_location(torch: Any, TensorDict: Any) -> None:
    """A generator process that imports only the compat module puts a multimodal step; this
    process reads it, writes logprobs back and reads every field, as a trainer would."""
    import os
    import subprocess
    import sys

    import flightq.compat.transferqueue as tq

    with flightq.Server() as srv:
        env = {**os.environ, "FLIGHTQ_LOCATION": srv.location}
        out = subprocess.run(
            [sys.executable, "-c", GENERATOR], env=env, capture_output=True, text=True, timeout=90
        )
        assert out.returncode == 0 and out.stdout.strip() == "put 4", out.stderr
        q = tq.TransferQueue({"flightq": {"location": srv.location, "schema": "rollout_vlm@1"}})
        try:
            keys = list(q.kv_list("rl")["rl"])
            got = q.kv_batch_get(keys, "rl", select_fields="input_ids")
            lp = torch.nested.nested_tensor_from_jagged(
                -torch.ones(got["input_ids"].values().shape[0]), got["input_ids"].offsets()
            )
            meta = q.kv_batch_put(
                keys, "rl", fields=TensorDict({"prev_logprobs": lp}, batch_size=[len(keys)])
            )
            every = q.kv_batch_get_by_meta(meta)
        finally:
            q.close()
    assert meta.fields == ["input_ids", "pixel_values", "prev_logprobs"]
    assert [len(r) for r in every["prev_logprobs"].unbind()] == [3, 5, 2, 4]
    assert all(float(r[0].mean()) == 0.5 for r in every.get("pixel_values").tolist())


def test_a_rewrite_is_refused_where_the_configuration_says_overwrite_false(
    tmp_path: Path, torch: Any
) -> None:
    tq = pytest.importorskip("flightq.compat.transferqueue")
    pytest.importorskip("tensordict")
    conf = {"flightq": {"partitions": {"train": "rollout_text@1"}, "overwrite": False}}
    q = tq.TransferQueue(conf)
    try:
        q.kv_put(key="a", partition_id="train", fields={"input_ids": torch.tensor([1, 2])})
        with pytest.raises(flightq.ConflictError, match="already has column 'input_ids'"):
            q.kv_put(key="a", partition_id="train", fields={"input_ids": torch.tensor([3, 4])})
    finally:
        q.close()


def test_transferqueues_own_configuration_is_refused_naming_what_is_missing() -> None:
    tq = pytest.importorskip("flightq.compat.transferqueue")
    conf = {"controller": {"num_storage_units": 2}, "backend": {"storage_backend": "simple"}}
    with pytest.raises(
        flightq.ProtocolError, match=r"TransferQueue's own configuration .* no 'flightq' section"
    ):
        tq.TransferQueue(conf)


def test_a_server_init_starts_is_found_by_the_processes_it_starts(torch: Any) -> None:
    # Without a location, init serves the data in this process: the processes it starts
    # find it through FLIGHTQ_LOCATION instead of each starting a server of its own.
    import os
    import subprocess
    import sys

    tq = pytest.importorskip("flightq.compat.transferqueue")
    pytest.importorskip("tensordict")
    assert "FLIGHTQ_LOCATION" not in os.environ
    conf = tq.init({"flightq": {"partitions": {"train": "rollout_text@1"}}})
    try:
        assert os.environ["FLIGHTQ_LOCATION"] == conf["location"]
        tq.kv_put(
            key="a", partition_id="train", fields={"input_ids": torch.tensor([1])}, tag={"s": 1}
        )
        child = (
            "import flightq.compat.transferqueue as tq\n"
            "tq.init({'flightq': {'partitions': {'train': 'rollout_text@1'}}})\n"
            "print(tq.kv_list(partition_id='train'))\n"
            "tq.close()\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
        )
        assert out.stdout.strip() == "{'train': {'a': {'s': 1}}}"
        # A TransferQueue built by hand meanwhile finds it through the variable too.
        other = tq.TransferQueue({"flightq": {"partitions": {"train": "rollout_text@1"}}})
        try:
            assert other.location == conf["location"] and other.server is None
        finally:
            other.close()
    finally:
        tq.close()
    assert "FLIGHTQ_LOCATION" not in os.environ
    # Built by hand without a location, it serves rows of its own and exports nothing:
    # another object closing never takes away the server a second one uses.
    mine = tq.TransferQueue({"flightq": {"partitions": {"train": "rollout_text@1"}}})
    try:
        assert mine.server is not None and "FLIGHTQ_LOCATION" not in os.environ
    finally:
        mine.close()


def test_a_tensor_ragged_in_a_later_dim_reads_as_one_jagged_tensor(
    tmp_path: Path, torch: Any, TensorDict: Any
) -> None:
    # Multimodal rotary position ids, [3, L] per row: flightq's TensorDict holds them row by
    # row, TransferQueue's as one jagged tensor (code calling to_padded_tensor on them broke).
    import flightq.compat.transferqueue as tq

    schema = flightq.Schema(
        "mrope",
        1,
        [
            flightq.Field("input_ids", "int64", "token", [None]),
            flightq.Field("position_ids", "int64", "tensor", [3, None]),
            flightq.Field("position_bias", "int64", "tensor", [3, None], required=False),
        ],
    )
    (tmp_path / "mrope").mkdir()
    (tmp_path / "mrope" / "v1.json").write_text(schema.to_json())
    q = tq.TransferQueue({"flightq": {"schema": "mrope@1", "schemas_dir": str(tmp_path)}})
    try:
        rows = [torch.arange(3 * n).reshape(3, n) for n in (2, 5, 3)]
        ids = [torch.arange(n) for n in (2, 5, 3)]
        q.kv_batch_put(["a", "b", "c"], "p", {"input_ids": ids, "position_ids": rows})
        got = q.kv_batch_get(["a", "b", "c"], "p")["position_ids"]
        assert got.is_nested and got.layout == torch.jagged
        assert [r.tolist() for r in got.unbind()] == [r.tolist() for r in rows]
        assert got.to_padded_tensor(0).shape == (3, 3, 5)
        assert got.values().shape == (3, 10)  # ragged on L, the channels whole
        # Ragged on L whatever the lengths: one row, rows of one length (torch's own
        # as_nested_tensor makes the 3 ragged there).
        q.kv_batch_put(["d", "e"], "p", {"input_ids": ids[:2], "position_ids": [rows[0]] * 2})
        for keys in (["a"], ["d", "e"]):
            one = q.kv_batch_get(keys, "p")["position_ids"]
            assert one.values().shape == (3, 2 * len(keys)) and one.select(1, 0).is_nested
        # Two such fields of one read share their ragged dim: they combine.
        q.kv_batch_put(["a", "b", "c"], "p", {"position_bias": rows})
        both = q.kv_batch_get(["a", "b", "c"], "p")
        assert (both["position_ids"] + both["position_bias"]).values().tolist() == (
            2 * torch.cat(rows, dim=1)
        ).tolist()
    finally:
        q.close()


def test_async_calls_never_queue_behind_the_event_loops_own_executor(tq: Any, torch: Any) -> None:
    # They ran on the loop's default executor (asyncio.to_thread), which an application's
    # own blocking work shares: behind it they waited, and it behind them.
    import concurrent.futures
    import threading

    release = threading.Event()

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(2))
        held = [asyncio.to_thread(release.wait, 60) for _ in range(2)]  # both its threads
        waiting = asyncio.gather(*held)
        try:
            put = tq.async_kv_put(key="x", partition_id="p", fields={"score": torch.ones(())})
            await asyncio.wait_for(put, 30)
            return await asyncio.wait_for(tq.async_kv_list(partition_id="p"), 30)
        finally:
            release.set()
            await waiting

    assert list(asyncio.run(main())["p"]) == ["x"]


_WORKER = """
import asyncio, pickle, sys
import torch
from tensordict import TensorDict
import transfer_queue as tq  # the shim: flightq's compat under TransferQueue's name

tq.init()  # bare, as verl's workers: the location comes from FLIGHTQ_LOCATION
meta = pickle.loads(sys.stdin.buffer.read())
client = tq.get_client()
data = asyncio.run(client.async_get_data(meta))
mask = torch.nested.nested_tensor_from_jagged(
    data["input_ids"].values() % 2, data["input_ids"].offsets()
)
out = TensorDict({"attention_mask": mask}, batch_size=[len(mask)])
done = asyncio.run(client.async_put(data=out, metadata=meta))
print(tq.__file__, sorted(done.field_names), len(data), flush=True)
tq.close()
"""


def test_verls_worker_dispatch_runs_over_batch_meta_and_get_client(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    # verl's v1 trainer hands KVBatchMeta to its worker groups: the driver turns it into a
    # BatchMeta (kv_retrieve_meta), chunks it per worker, each worker (another process,
    # importing `transfer_queue`) reads its rows and writes new columns onto them by the
    # BatchMeta, and the driver joins the parts and turns them back into keys.
    import os
    import pickle
    import subprocess
    import sys

    keys = [f"v{i}" for i in range(5)]
    ids = torch.nested.as_nested_tensor(
        [torch.arange(3 + i) for i in range(5)], layout=torch.jagged
    )
    tq.kv_batch_put(keys, "p", fields=TensorDict({"input_ids": ids}, batch_size=5), tags=[{}] * 5)
    batch = tq.KVBatchMeta(partition_id="p", keys=keys, tags=[{}] * 5)
    batch.reorder([4, 3, 2, 1, 0])
    client = tq.get_client()
    meta = asyncio.run(client.async_kv_retrieve_meta(keys=batch.keys, partition_id="p"))
    assert meta.field_names == ["input_ids"] and meta.size == 5
    meta.extra_info = {"temperature": 1.0}
    chunks = meta.chunk(2)
    assert [c.size for c in chunks] == [3, 2] and chunks[0].extra_info == {"temperature": 1.0}
    env = {
        **os.environ,
        "FLIGHTQ_LOCATION": tq._tq().location,
        "PYTHONPATH": os.pathsep.join([tq.SHIM_PATH, os.environ.get("PYTHONPATH", "")]),
    }
    outs = []
    for c in chunks:
        got = subprocess.run(
            [sys.executable, "-c", _WORKER],
            input=pickle.dumps(c),
            env=env,
            capture_output=True,
            timeout=90,
        )
        assert got.returncode == 0, got.stderr.decode()[-2000:]
        where, rest = got.stdout.decode().strip().split(" ", 1)
        names, n = rest.rsplit(" ", 1)
        assert where.endswith(os.path.join("shim", "transfer_queue", "__init__.py")), where
        assert names == "['attention_mask', 'input_ids']" and n == str(c.size), got.stdout
        outs.append(c.add_fields({"attention_mask": None}))
    whole = tq.BatchMeta.concat(outs)
    back = asyncio.run(client.async_kv_retrieve_keys(whole.global_indexes, partition_id="p"))
    assert back == batch.keys and whole.field_names == ["attention_mask", "input_ids"]
    read = tq.kv_batch_get(back, "p", select_fields=["input_ids", "attention_mask"])
    for r_ids, r_mask in zip(
        read["input_ids"].unbind(), read["attention_mask"].unbind(), strict=True
    ):
        assert torch.equal(r_mask, r_ids % 2)
    # An id this process did not give, or a cleared row's, is refused naming it.
    with pytest.raises(tq.KeysNotFoundError, match="row id 999999"):
        client.kv_retrieve_keys([999999], "p")
    import numpy as np

    assert client.kv_retrieve_keys(np.int64(whole.global_indexes[0]), "p") == back[:1]
    with pytest.raises(tq.KeysNotFoundError, match="is of partition 'p', not 'q'"):
        client.kv_retrieve_keys(whole.global_indexes[:1], "q")
    with pytest.raises(flightq.ProtocolError, match="named twice"):
        client.kv_retrieve_meta([keys[1], keys[1]], "p")
    tq.kv_clear(keys[:1], "p")
    with pytest.raises(tq.KeysNotFoundError):
        client.kv_retrieve_keys(whole.global_indexes, "p")
    # What is not offered says so; an empty batch as verl builds one reads empty.
    with pytest.raises(flightq.ProtocolError, match="insert mode"):
        client.put(TensorDict({}, batch_size=[0]))
    with pytest.raises(flightq.EncodeError, match="give the data"):
        client.put(None, metadata=meta)
    with pytest.raises(flightq.ShapeError, match="5 keys for a TensorDict of batch_size"):
        client.put(TensorDict({"input_ids": torch.ones(3, 2)}, batch_size=[3]), metadata=meta)
    with pytest.raises(flightq.ProtocolError, match="create=True"):
        client.kv_retrieve_meta(keys[1:], "p", create=True)
    assert client.get_data(tq.BatchMeta()).batch_size == torch.Size([0])
    assert [c.size for c in tq.BatchMeta().chunk(2)] == [0, 0]
    other = meta.select_samples([0])
    other.extra_info = {"temperature": 0.5}
    with pytest.raises(ValueError, match="extra_info 'temperature' differs"):
        tq.BatchMeta.concat([meta.select_samples([1]), other])


def test_kv_batch_meta_chunks_reorders_and_concatenates_as_transferqueues() -> None:
    tq = pytest.importorskip("flightq.compat.transferqueue")
    keys = [f"k{i}" for i in range(5)]
    meta = tq.KVBatchMeta(
        keys=keys,
        tags=[{"i": i} for i in range(5)],
        partition_id="p",
        fields=["a", "b"],
        extra_info={"step": 3},
    )
    parts = meta.chunk(3)  # sizes 2, 2, 1: the larger first
    assert [p.keys for p in parts] == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    assert all(p.partition_id == "p" and p.fields == ["a", "b"] for p in parts)
    assert [len(p) for p in meta.chunk(7)] == [1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        meta.chunk(0)
    whole = tq.KVBatchMeta.concat([*parts, tq.KVBatchMeta()])
    assert whole.keys == keys and whole.tags == meta.tags and whole.extra_info == {"step": 3}
    assert tq.KVBatchMeta.concat([]).size == 0
    whole.reorder([4, 3, 2, 1, 0])
    assert whole.keys == keys[::-1] and whole.tags[0] == {"i": 4}
    whole.reorder([-1, 1, 2, 3, -5])  # counted from the end, as Python's (and TQ's) indexes
    assert whole.keys == ["k0", "k3", "k2", "k1", "k4"]
    # -1 names the last row: with 4 too it is a row twice, refused (not two copies of it)
    for bad in ([0, 1, 2, 3], [0, 0, 1, 2, 3], [0, 1, 2, 3, 5], [0, 1, 2, 4, -1], [-6, 1, 2, 3, 4]):
        with pytest.raises(ValueError, match="order of this batch"):
            whole.reorder(bad)
    other = tq.KVBatchMeta(keys=["z"], tags=[{}], partition_id="q", fields=["a", "b"])
    with pytest.raises(ValueError, match="partitions differ"):
        tq.KVBatchMeta.concat([meta, other])
    fewer = tq.KVBatchMeta(keys=["z"], tags=[{}], partition_id="p", fields=["a"])
    with pytest.raises(ValueError, match="fields differ"):
        tq.KVBatchMeta.concat([meta, fewer])
    with pytest.raises(ValueError, match="duplicate keys"):
        tq.KVBatchMeta.concat([meta, meta])
    clash = tq.KVBatchMeta(keys=["z"], tags=[{}], partition_id="p", fields=["b", "a"])
    clash.extra_info = {"step": 4}
    with pytest.raises(ValueError, match="extra_info 'step' differs"):
        tq.KVBatchMeta.concat([meta, clash])


def test_kv_batch_meta_concat_compares_tensor_and_array_extra_info_by_value(torch: Any) -> None:
    import numpy as np

    tq = pytest.importorskip("flightq.compat.transferqueue")
    # bfloat16 and tensors that need grad: numpy takes neither (concat raised TypeError).
    grad = torch.ones(3, requires_grad=True)
    for value in (torch.ones(3), np.ones(3), torch.ones(3, dtype=torch.bfloat16), grad):
        meta = tq.KVBatchMeta(
            keys=["a", "b"], tags=[{}, {}], partition_id="p", extra_info={"w": value}
        )
        whole = tq.KVBatchMeta.concat(meta.chunk(2))
        assert whole.keys == ["a", "b"] and (whole.extra_info["w"] == value).all()
    one = tq.KVBatchMeta(keys=["a"], tags=[{}], partition_id="p", extra_info={"w": 1})
    other = tq.KVBatchMeta(keys=["b"], tags=[{}], partition_id="p", extra_info={"w": 1.0})
    with pytest.raises(ValueError, match="extra_info 'w' differs"):
        tq.KVBatchMeta.concat([one, other])  # of two types, as TransferQueue holds
    bare = tq.KVBatchMeta(keys=["a"], tags=[{}], partition_id="p", extra_info=None)
    assert tq.KVBatchMeta.concat([bare]).extra_info is None


def test_ranks_clearing_one_steps_keys_together_never_fail(api: Any, torch: Any) -> None:
    # The ranks of a data-parallel group each clear the step's keys: whichever comes
    # second finds some gone, and leaves them out.
    import concurrent.futures

    keys = [f"r{i}" for i in range(16)]
    ids = torch.nested.nested_tensor([torch.arange(2)] * 16, layout=torch.jagged)
    windows = [(keys * 2)[i * 4 : i * 4 + 10] for i in range(4)]  # each overlaps two others
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(20):
            api.kv_batch_put(keys=keys, partition_id="dp", fields={"input_ids": ids})
            cleared = [pool.submit(api.kv_clear, w, "dp") for w in windows]
            for f in cleared:
                f.result(timeout=60)
            assert api.kv_list(partition_id="dp") == {"dp": {}}


@pytest.mark.parametrize("gone", ["cleared", "dropped"])
def test_a_put_whose_rows_go_before_they_are_listed_still_succeeds(
    api: Any, tq: Any, torch: Any, TensorDict: Any, monkeypatch: Any, gone: str
) -> None:
    # Another rank consumes (clears) what kv_list shows, or drops the step, between the
    # put's store and its listing of the rows for the KVBatchMeta: the put stored them,
    # so it returns, describing them by what it sent (tags as sent, fields in schema order).
    client = tq._tq().client
    listed = client.list_keys

    def list_after_another_rank(partition: str, keys: Any = None, **kw: Any) -> Any:
        with flightq.connect(tq._tq().location) as other:
            assert sorted(other.list_keys(partition)) == ["g0", "g1"]  # stored
            other.clear(partition) if gone == "cleared" else other.drop(partition)
        return listed(partition, keys, **kw)

    monkeypatch.setattr(client, "list_keys", list_after_another_rank)
    ids = torch.arange(6).view(2, 3)
    fields = TensorDict({"attention_mask": torch.ones_like(ids), "input_ids": ids}, batch_size=2)
    meta = api.kv_batch_put(
        keys=["g0", "g1"], partition_id="race", fields=fields, tags=[{"v": 1}, None]
    )
    assert (meta.keys, meta.tags, meta.partition_id) == (["g0", "g1"], [{"v": 1}, {}], "race")
    assert meta.fields == ["attention_mask", "input_ids"]
    monkeypatch.undo()
    assert api.kv_list(partition_id="race") in ({"race": {}}, {})
