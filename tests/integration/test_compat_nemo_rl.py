"""NeMo RL's TransferQueue adapter sequence, played through flightq.compat.transferqueue
against a real flightq server: its configuration built from TransferQueue's own
``config.yaml`` (the shim's), the schema warm-up put it makes before each step, the
task-mediated fetch (``get_client().get_meta``), consumption and production status, and
the per-row tags (``custom_meta``) its claim reads.

The ``flightq`` section comes from the file ``FLIGHTQ_TQ_CONF`` names, as a NeMo RL job
would give it (its code builds the configuration and never names flightq).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import flightq

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]

#: NeMo RL's train partition fields (its data_plane.schema.DP_TRAIN_FIELDS): the shipped
#: rollout_text@1 declares them.
TRAIN_FIELDS = [
    "input_ids",
    "input_lengths",
    "generation_logprobs",
    "prev_logprobs",
    "reference_policy_logprobs",
    "advantages",
    "token_mask",
    "sample_mask",
]
TASKS = ["prev_lp", "ref_lp", "train"]


@pytest.fixture(name="TensorDict")
def tensordict_fixture() -> Any:
    return pytest.importorskip("tensordict", reason="tensordict is not installed").TensorDict


def _shim_conf(polling: bool) -> Any:
    """What NeMo RL's driver gives init: TransferQueue's config.yaml (here the shim's,
    found by package as NeMo RL finds it) merged with its overlay."""
    from omegaconf import OmegaConf

    import flightq.compat.transferqueue as tq

    shim = Path(tq.SHIM_PATH) / "transfer_queue"
    with resources.as_file(shim / "config.yaml") as path:
        base = OmegaConf.load(str(path))
    overlay = {
        "controller": {"polling_mode": polling},
        "backend": {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {"total_storage_size": 1000, "num_data_storage_units": 2},
        },
    }
    return OmegaConf.merge(base, overlay)


@pytest.fixture(name="tq")
def tq_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any) -> Iterator[Any]:
    import flightq.compat.transferqueue as tq

    section = {
        "partitions": {"train": {"schema": "rollout_text@1", "tasks": TASKS}},
        "warmup_keys": "__schema__:",
    }
    (tmp_path / "flightq.json").write_text(json.dumps(section))
    monkeypatch.setenv(tq.CONF_ENV, str(tmp_path / "flightq.json"))
    monkeypatch.setenv(tq.FETCH_WAIT_ENV, "0.2")
    monkeypatch.delenv("FLIGHTQ_LOCATION", raising=False)
    tq.init(conf=_shim_conf(polling=True))
    try:
        yield tq
    finally:
        tq.close()


def _use_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nested: bool = False, **extra: Any
) -> None:
    """The train partition (and ``extra`` entries) in a file ``FLIGHTQ_TQ_CONF`` names:
    the section itself, or under a ``flightq`` key (``nested``)."""
    import flightq.compat.transferqueue as tq

    section = {"partitions": {"train": {"schema": "rollout_text@1", "tasks": TASKS}}, **extra}
    (tmp_path / "f.json").write_text(json.dumps({"flightq": section} if nested else section))
    monkeypatch.setenv(tq.CONF_ENV, str(tmp_path / "f.json"))


def _warmup(tq: Any, torch: Any, TensorDict: Any, fields: list[str]) -> Any:
    """NeMo RL's register_partition: a placeholder row of every field, then its clear."""
    key = "__schema__:train:123:456:789"
    dummy = TensorDict({f: torch.zeros(1) for f in fields}, batch_size=[1])
    meta = tq.kv_batch_put(keys=[key], partition_id="train", fields=dummy, tags=[{}])
    tq.kv_clear(keys=[key], partition_id="train")
    return meta


def _rollout(tq: Any, torch: Any, TensorDict: Any, keys: list[str], first: int = 5) -> None:
    """The rollout's first put: jagged token fields, scalars, a length tag per row."""
    n = len(keys)

    def jag(dtype: Any) -> Any:
        rows = [torch.arange(first + i).to(dtype) for i in range(n)]
        return torch.nested.nested_tensor(rows, layout=torch.jagged)

    td = TensorDict(
        {
            "input_ids": jag(torch.int64),
            "token_mask": jag(torch.int64),
            "generation_logprobs": jag(torch.float32),
            "input_lengths": torch.tensor([first + i for i in range(n)], dtype=torch.int32),
            "sample_mask": torch.ones(n),
        },
        batch_size=[n],
    )
    tags = [{"input_lengths": first + i, "weight_version": 0} for i in range(n)]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=tags)


def test_the_shims_config_and_the_files_section_start_the_partition_with_its_tasks(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    _warmup(tq, torch, TensorDict, TRAIN_FIELDS)
    _rollout(tq, torch, TensorDict, ["u0", "u1"])
    client = tq._tq().client
    assert client.partition_schema("train").ref == "rollout_text@1"
    assert client.inspect("train")["tasks"] == TASKS
    assert tq._tq().polling is True


def test_warmup_rows_are_checked_against_the_schema_and_not_stored(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    meta = _warmup(tq, torch, TensorDict, TRAIN_FIELDS)
    assert meta.fields == sorted(TRAIN_FIELDS) and meta.keys == ["__schema__:train:123:456:789"]
    assert tq.kv_list(partition_id="train") == {"train": {}}  # nothing stored
    # A field the schema does not declare is refused by name, as in a real put.
    with pytest.raises(flightq.UndeclaredFieldError, match="'routed_experts'"):
        _warmup(tq, torch, TensorDict, [*TRAIN_FIELDS, "routed_experts"])
    # Warm-up keys beside stored ones: refused, nothing stored.
    one = TensorDict({"sample_mask": torch.ones(2)}, batch_size=[2])
    with pytest.raises(flightq.ProtocolError, match="put them apart"):
        tq.kv_batch_put(keys=["__schema__:x", "real"], partition_id="train", fields=one)
    assert tq.kv_list(partition_id="train") == {"train": {}}


def test_without_warmup_keys_a_warmup_row_is_a_put_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    import flightq.compat.transferqueue as tq

    _use_section(tmp_path, monkeypatch, nested=True)
    monkeypatch.delenv("FLIGHTQ_LOCATION", raising=False)
    tq.init(conf=_shim_conf(polling=False))
    try:
        # zeros(1) per row is a float scalar where input_ids declares int64 tokens.
        with pytest.raises(flightq.FlightqError, match="input_ids"):
            _warmup(tq, torch, TensorDict, TRAIN_FIELDS)
        assert tq.kv_list(partition_id="train") == {"train": {}}
    finally:
        tq.close()


def test_get_meta_fetches_each_row_once_per_task_in_the_order_put(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    keys = [f"g0_{i}" for i in range(4)]
    _rollout(tq, torch, TensorDict, keys)
    client = tq.get_client()

    def fetch(task: str, n: int, fields: list[str] | None = None) -> Any:
        return client.get_meta(
            data_fields=fields or ["input_ids", "token_mask"],
            batch_size=n,
            partition_id="train",
            task_name=task,
            mode="fetch",
            sampling_config={"dp_rank": 0},
        )

    first = fetch("prev_lp", 3)
    assert first.size == 3 and first.field_names == ["input_ids", "token_mask"]
    got = client.kv_retrieve_keys(global_indexes=list(first.global_indexes), partition_id="train")
    assert got == keys[:3]
    assert first.custom_meta == [{"input_lengths": 5 + i, "weight_version": 0} for i in range(3)]
    # Polling mode: too few left answers an empty batch at once, consuming nothing.
    assert fetch("prev_lp", 2).size == 0
    assert fetch("prev_lp", 1).keys == keys[3:]
    # Another task consumes on its own; rows lacking a field wait for it.
    assert fetch("ref_lp", 4).keys == keys
    assert fetch("train", 1, ["prev_logprobs"]).size == 0
    lp = torch.nested.nested_tensor([-torch.ones(5)], layout=torch.jagged)
    tq.kv_batch_put(
        keys=keys[:1],
        partition_id="train",
        fields=TensorDict({"prev_logprobs": lp}, batch_size=[1]),
    )
    assert fetch("train", 1, ["prev_logprobs"]).keys == keys[:1]
    # A fetch leaves the rows' non-tensor values (message logs) on the server.
    client_ = tq._tq().client
    big = {"input_lengths": torch.tensor([5], dtype=torch.int32), "log": ["m" * 50_000]}
    _rollout(tq, torch, TensorDict, ["big0"])
    tq.kv_batch_put(keys=["big0"], partition_id="train", fields=big)
    sent = client_.stats()["counters"]["bytes_sent"]
    assert fetch("ref_lp", 1).custom_meta == [{"input_lengths": 5, "weight_version": 0}]
    assert client_.stats()["counters"]["bytes_sent"] - sent < 10_000
    # The fetched keys read by key (NeMo RL's get_data), with the fields asked.
    td = tq.kv_batch_get(keys=first.keys, partition_id="train", select_fields=["input_ids"])
    assert [r.tolist() for r in td["input_ids"].unbind()] == [list(range(5 + i)) for i in range(3)]
    # A task the partition does not declare is refused (also a ValueError, as NeMo RL's
    # own adapters raise for an unregistered task).
    with pytest.raises(tq.KeysNotFoundError, match="no task 'critic'"):
        fetch("critic", 1)
    with pytest.raises(ValueError):
        fetch("critic", 1)


def test_a_fetch_outside_polling_mode_waits_then_raises_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    import flightq.compat.transferqueue as tq

    _use_section(tmp_path, monkeypatch)
    monkeypatch.setenv(tq.FETCH_WAIT_ENV, "0.2")
    monkeypatch.delenv("FLIGHTQ_LOCATION", raising=False)
    tq.init(conf=_shim_conf(polling=False))
    try:
        _rollout(tq, torch, TensorDict, ["a0"])
        client = tq.get_client()
        with pytest.raises(TimeoutError):
            client.get_meta(["input_ids"], 2, "train", task_name="train")
        assert client.get_meta(["input_ids"], 1, "train", task_name="train").keys == ["a0"]
    finally:
        tq.close()


def test_consumption_and_production_status_and_their_reset(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    client = tq.get_client()
    assert client.check_consumption_status(task_name="train", partition_id="nope") is False
    assert client.check_production_status(data_fields=["input_ids"], partition_id="nope") is False
    keys = ["c0", "c1"]
    _rollout(tq, torch, TensorDict, keys)
    assert client.check_production_status(["input_ids", "sample_mask"], "train") is True
    assert client.check_production_status(["input_ids", "advantages"], "train") is False
    assert client.check_consumption_status("train", "train") is False
    client.get_meta(["input_ids"], 1, "train", task_name="train")
    assert client.check_consumption_status("train", "train") is False
    client.get_meta(["input_ids"], 1, "train", task_name="train")
    assert client.check_consumption_status("train", "train") is True
    assert client.check_consumption_status("ref_lp", "train") is False
    with pytest.raises(tq.KeysNotFoundError, match="no task 'critic'"):
        client.check_consumption_status("critic", "train")
    # Reset: every row is fetched once more.
    assert client.reset_consumption("train", "train") is True
    assert client.check_consumption_status("train", "train") is False
    assert client.get_meta(["input_ids"], 2, "train", task_name="train").keys == keys
    # Force fetch: every row, consuming none; insert and unknown modes refused.
    every = client.get_meta(["input_ids"], 0, "train", mode="force_fetch")
    assert every.keys == keys and every.custom_meta[1]["input_lengths"] == 6
    with pytest.raises(flightq.ProtocolError, match="insert"):
        client.get_meta(["input_ids"], 2, "train", mode="insert")
    with pytest.raises(ValueError, match="Invalid mode"):
        client.get_meta(["input_ids"], 2, "train", mode="sample", task_name="train")
    with pytest.raises(flightq.ProtocolError, match="task_name"):
        client.get_meta(["input_ids"], 2, "train")


def test_custom_meta_travels_with_the_rows_of_a_batch_meta(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    import asyncio

    _rollout(tq, torch, TensorDict, [f"m{i}" for i in range(5)])
    client = tq.get_client()
    meta = asyncio.run(client.async_get_meta(["input_ids"], 5, "train", task_name="prev_lp"))
    lengths = [m["input_lengths"] for m in meta.custom_meta]
    assert lengths == [5, 6, 7, 8, 9]
    parts = meta.chunk(2)
    assert [[m["input_lengths"] for m in p.custom_meta] for p in parts] == [[5, 6, 7], [8, 9]]
    back = tq.BatchMeta.concat(parts[::-1])
    assert [m["input_lengths"] for m in back.custom_meta] == [8, 9, 5, 6, 7]
    assert [m["input_lengths"] for m in meta[1:3].custom_meta] == [6, 7]
    copied = pickle.loads(pickle.dumps(meta))
    assert copied.custom_meta == meta.custom_meta and copied.keys == meta.keys
    meta.update_custom_meta([{"seen": True}] * 5)
    assert meta.get_all_custom_meta()[0] == {"input_lengths": 5, "weight_version": 0, "seen": True}
    assert parts[0].custom_meta[0] == {"input_lengths": 5, "weight_version": 0}  # its own copy
    with pytest.raises(ValueError, match="5 rows"):
        meta.update_custom_meta([{}])
    meta.clear_custom_meta()
    assert meta.custom_meta == [{}] * 5
    assert asyncio.run(client.async_check_consumption_status("prev_lp", "train")) is True
    assert asyncio.run(client.async_reset_consumption("train")) is True
    assert asyncio.run(client.async_check_production_status(["input_ids"], "train")) is True


def test_the_section_file_is_read_as_json_or_yaml_and_a_bad_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flightq.compat.transferqueue as tq

    yaml = tmp_path / "f.yaml"
    yaml.write_text("flightq:\n  schema: rollout_text@1\n  overwrite: false\n")
    monkeypatch.setenv(tq.CONF_ENV, str(yaml))
    conf = {"controller": {"polling_mode": False}, "flightq": {"overwrite": True}}
    # The file's entries fill those the configuration's own section leaves out.
    assert tq._section(conf) == {"schema": "rollout_text@1", "overwrite": True}
    assert tq._section({"controller": {}}) == {"schema": "rollout_text@1", "overwrite": False}
    for text, named in [("[1, 2]", "no mapping"), ("a: [unclosed", "neither JSON nor YAML")]:
        yaml.write_text(text)
        with pytest.raises(flightq.ProtocolError, match=named):
            tq._section({})
    monkeypatch.setenv(tq.CONF_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(flightq.ProtocolError, match="cannot read"):
        tq._section({})
    monkeypatch.delenv(tq.CONF_ENV)
    with pytest.raises(flightq.ProtocolError, match=tq.CONF_ENV):
        tq._section({"controller": {"polling_mode": True}, "backend": {}})
    with pytest.raises(flightq.ProtocolError, match="warmup_keys"):
        tq.TransferQueue({"flightq": {"warmup_keys": ""}})


def test_object_columns_put_whole_are_taken_row_by_row(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    # NeMo RL's rollout puts its message logs as numpy object arrays in the TensorDict,
    # which keeps each as one NonTensorData of the whole column: TransferQueue takes it
    # row by row. A single string entry is every row's.
    import numpy as np

    n = 3
    td = TensorDict(
        {
            "input_ids": torch.ones(n, 4, dtype=torch.int64),
            "turn_roles": np.asarray(
                [["user", "assistant"], ["user"], ["user", "a", "u"]], dtype=object
            ),
            "content": np.asarray([["q0", "a0"], ["q1", "a1"], ["q2", "a2"]], dtype=object),
            "task_name": "math",
        },
        batch_size=[n],
    )
    keys = ["o0", "o1", "o2"]
    meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=td)
    assert meta.fields == ["content", "input_ids", "task_name", "turn_roles"]
    got = tq.kv_batch_get(keys=keys[::-1], partition_id="train", select_fields=meta.fields)
    assert got.get("turn_roles").tolist() == [["user", "a", "u"], ["user"], ["user", "assistant"]]
    assert got.get("content").tolist() == [["q2", "a2"], ["q1", "a1"], ["q0", "a0"]]
    assert got.get("task_name").tolist() == ["math"] * n


def test_polling_mode_reaches_a_workers_bare_init_through_the_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    # TransferQueue's polling mode is its controller's, one for the job; NeMo RL sets it in
    # the driver's init only, and its workers call a bare init().
    import flightq.compat.transferqueue as tq

    section = {
        "partitions": {"train": {"schema": "rollout_text@1", "tasks": TASKS}},
        "polling_mode": True,
    }
    (tmp_path / "f.json").write_text(json.dumps(section))
    monkeypatch.setenv(tq.CONF_ENV, str(tmp_path / "f.json"))
    monkeypatch.setenv(tq.FETCH_WAIT_ENV, "30")  # a fetch that waited would time the test out
    server = flightq.Server().start()
    monkeypatch.setenv("FLIGHTQ_LOCATION", server.location)
    try:
        worker = tq.TransferQueue()  # what a worker's bare init() builds
        assert worker.polling is True
        # The configuration's own controller.polling_mode, where it gives one, decides.
        assert tq.TransferQueue({"controller": {"polling_mode": False}}).polling is False
        tq.init()
        try:
            client = tq.get_client()
            assert client.get_meta(["input_ids"], 2, "train", task_name="train").size == 0
            _rollout(tq, torch, TensorDict, ["w0", "w1"])
            assert client.get_meta(["input_ids"], 2, "train", task_name="train").size == 2
        finally:
            tq.close()
            worker.close()
    finally:
        server.stop()


def _own_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, extra: list[Any]
) -> Any:
    """rollout_text@1's fields and ``extra`` as ``name@1`` in a ``schemas_dir``, the train
    partition of that schema in the section, a server with the shipped schemas only
    (started; the caller stops it), and the compat's ``init``."""
    import flightq.compat.transferqueue as tq

    text = flightq.SchemaRegistry.default().get("rollout_text@1")
    mine = flightq.Schema(name, 1, [*text.fields, *extra])
    (tmp_path / "schemas" / name).mkdir(parents=True)
    (tmp_path / "schemas" / name / "v1.json").write_text(mine.to_json())
    server = flightq.Server().start()
    section = {
        "location": server.location,
        "schemas_dir": str(tmp_path / "schemas"),
        "partitions": {"train": {"schema": f"{name}@1", "tasks": TASKS}},
    }
    (tmp_path / "f.json").write_text(json.dumps(section))
    monkeypatch.setenv(tq.CONF_ENV, str(tmp_path / "f.json"))
    tq.init()
    return server


def test_a_schema_of_schemas_dir_the_server_lacks_is_registered_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    import flightq.compat.transferqueue as tq

    extra = flightq.Field("turn_lengths", "int64", "tensor", [None])
    server = _own_schema(tmp_path, monkeypatch, "nemo_rollout", [extra])
    try:
        td = TensorDict(
            {
                "input_ids": torch.ones(2, 3, dtype=torch.int64),
                "turn_lengths": torch.ones(2, 2, dtype=torch.int64),
            },
            batch_size=[2],
        )
        assert tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=td).fields == [
            "input_ids",
            "turn_lengths",
        ]
        got = tq.kv_batch_get(keys=["b"], partition_id="train", select_fields="turn_lengths")
        assert [r.tolist() for r in got["turn_lengths"].unbind()] == [[1, 1]]
    finally:
        tq.close()
        server.stop()


def test_a_long_message_log_fits_a_server_told_a_larger_tags_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    # A message log rides in its row's tags: past the default 64 KiB a row is refused
    # before it is sent, naming the field and the server's setting; a server told more
    # takes it.
    import flightq.compat.transferqueue as tq

    _use_section(tmp_path, monkeypatch)
    answer = "a" * 200_000  # a long reasoning turn

    def put() -> Any:
        td = TensorDict(
            {"input_ids": torch.ones(1, 3, dtype=torch.int64), "content": [answer]},
            batch_size=[1],
        )
        return tq.kv_batch_put(keys=["long"], partition_id="train", fields=td)

    for cap in (None, 2**20):
        server = flightq.Server(max_tags_bytes=cap) if cap else flightq.Server()
        monkeypatch.setenv("FLIGHTQ_LOCATION", server.start().location)
        tq.init()
        try:
            if cap is None:
                with pytest.raises(flightq.EncodeError, match=r"--max-tags-bytes.*field 'content'"):
                    put()
                continue
            assert put().fields == ["content", "input_ids"]
            got = tq.kv_batch_get(keys=["long"], partition_id="train", select_fields="content")
            assert got.get("content").tolist() == [answer]
        finally:
            tq.close()
            server.stop()


def test_message_text_declared_as_object_fields_takes_columns_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    # A schema that declares the message text as object fields: each goes in a column of
    # its own (no tags cap, read only by who asks for it), put whole as one NonTensorData
    # column (what NeMo RL's kv_first_write gives) or one value per row.
    import numpy as np
    from tensordict import NonTensorData, NonTensorStack

    import flightq.compat.transferqueue as tq

    objects = [flightq.Field(n, "uint8", "object") for n in ("content", "turn_contents")]
    server = _own_schema(tmp_path, monkeypatch, "nemo_chat", objects)  # 64 KiB tags a row
    long = ["a" * 200_000, "b" * 150_000]  # far past a row's tags
    turns = [["q", "a" * 10], ["q2", "b" * 3]]
    try:
        td = TensorDict(
            {
                "input_ids": torch.ones(2, 3, dtype=torch.int64),
                "content": NonTensorData(np.array(long, dtype=object), batch_size=[2]),
                "turn_contents": NonTensorStack.from_list(turns),
                "uid": NonTensorStack.from_list(["u0", "u1"]),  # undeclared: in the tags
            },
            batch_size=[2],
        )
        meta = tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=td)
        assert meta.fields == ["content", "input_ids", "turn_contents", "uid"]
        got = tq.kv_batch_get(keys=["b", "a"], partition_id="train", select_fields="content")
        assert got.get("content").tolist() == long[::-1]
        both = tq.kv_batch_get(keys=["a", "b"], partition_id="train")
        assert both.get("turn_contents").tolist() == turns
        assert both.get("uid").tolist() == ["u0", "u1"]
        listed = tq.kv_list(partition_id="train")["train"]
        assert sorted(listed) == ["a", "b"]
        assert all("content" not in str(v) for v in listed.values())  # not in the tags
        # The column of another length is refused, naming the field.
        bad = TensorDict(
            {"content": NonTensorData(np.array(["x"] * 3, dtype=object), batch_size=[2])},
            batch_size=[2],
        )
        with pytest.raises(flightq.ShapeError, match="'content'"):
            tq.kv_batch_put(keys=["c", "d"], partition_id="train", fields=bad)
    finally:
        tq.close()
        server.stop()


def test_fetches_and_status_keep_to_what_the_schema_declares_and_give_back_what_fails(
    tq: Any, torch: Any, TensorDict: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rollout(tq, torch, TensorDict, ["s0", "s1", "s2"])
    tq.kv_batch_put(keys=["s0", "s1", "s2"], partition_id="train", fields={"log": ["a", "b", "c"]})
    client = tq.get_client()
    # Production status reads non-tensor fields from the rows' tags; no field is False.
    assert client.check_production_status(["input_ids", "log"], "train") is True
    assert client.check_production_status(["log", "score"], "train") is False
    assert client.check_production_status([], "train") is False
    # A fetch waits for declared fields only: a typo or a non-tensor name is refused,
    # nothing consumed (it would hand the rows out at once).
    for odd in ("input_idz", "log"):
        with pytest.raises(flightq.UndeclaredFieldError, match=repr(odd)):
            client.get_meta(["input_ids", odd], 1, "train", task_name="train")
    # batch_size: an int; none asked is an empty batch in polling mode.
    assert client.get_meta(["input_ids"], 0, "train", task_name="train").size == 0
    for bad in (True, "2", 1.5):
        with pytest.raises(flightq.ProtocolError, match="batch_size"):
            client.get_meta(["input_ids"], bad, "train", task_name="train")
    # An ack that fails gives the rows back at once instead of leaving them leased.
    inner = tq._tq().client
    real_ack = inner.ack

    def failing(*a: Any, **kw: Any) -> Any:
        raise flightq.FlightqError("the ack did not arrive")

    monkeypatch.setattr(inner, "ack", failing)
    with pytest.raises(flightq.FlightqError, match="did not arrive"):
        client.get_meta(["input_ids"], 2, "train", task_name="train")
    monkeypatch.setattr(inner, "ack", real_ack)
    assert inner.inspect("train")["leased"]["train"] == 0
    back = client.get_meta(["input_ids"], 3, "train", task_name="train").keys
    assert sorted(back) == ["s0", "s1", "s2"]  # those given back after the one left


def test_a_section_of_wrong_types_or_an_odd_file_is_refused_at_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: Any, TensorDict: Any
) -> None:
    import os

    import flightq.compat.transferqueue as tq

    path = tmp_path / "f.json"
    monkeypatch.setenv(tq.CONF_ENV, str(path))
    for section, named in [
        ({"partitions": {"train": {"schema": "rollout_text@1", "tasks": "train"}}}, "tasks"),
        ({"partitions": ["train"]}, "'partitions'"),
        ({"partitions": {"train": {"schema": 1}}}, "partitions\\['train'\\]"),
        ({"partitions": {"t": {"schema": "rollout_text@1", "group_size": "2"}}}, "group_size"),
        ({"polling_mode": "false"}, "'polling_mode'"),
        ({"overwrite": "false"}, "'overwrite'"),
        ({"schemas_dir": 7}, "'schemas_dir'"),
        ({"location": True}, "'location'"),
    ]:
        path.write_text(json.dumps(section))
        with pytest.raises(flightq.ProtocolError, match=named):
            tq.TransferQueue()
    path.write_text("{}")
    with pytest.raises(flightq.ProtocolError, match=r"controller\.polling_mode"):
        tq.TransferQueue({"controller": {"polling_mode": "false"}, "flightq": {}})
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(flightq.ProtocolError, match="not UTF-8"):
        tq.TransferQueue()
    path.write_text(" " * (tq.MAX_CONF_FILE_BYTES + 1))
    with pytest.raises(flightq.ProtocolError, match="longer than"):
        tq.TransferQueue()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv(tq.CONF_ENV, str(fifo))
    with pytest.raises(flightq.ProtocolError, match="not a regular file"):
        tq.TransferQueue()  # it would wait for a writer for ever
    # The file's partitions and the configuration's are merged, the latter's winning.
    path.write_text(json.dumps({"partitions": {"a": "rollout_text@1", "b": "rollout_text@1"}}))
    monkeypatch.setenv(tq.CONF_ENV, str(path))
    merged = tq._section({"flightq": {"partitions": {"b": "rollout_vlm@1"}}})
    assert merged["partitions"] == {"a": "rollout_text@1", "b": "rollout_vlm@1"}
    monkeypatch.setenv(tq.FETCH_WAIT_ENV, "abc")
    with pytest.raises(flightq.ProtocolError, match=tq.FETCH_WAIT_ENV):
        tq._fetch_wait()


def test_columns_put_whole_must_have_a_value_per_row_and_warmups_a_row_per_key(
    tq: Any, torch: Any, TensorDict: Any
) -> None:
    import numpy as np

    td = TensorDict(
        {"input_ids": torch.ones(3, 2, dtype=torch.int64), "eos": np.asarray(["</s>", "<eos>"])},
        batch_size=[3],
    )
    with pytest.raises(flightq.ShapeError, match="'eos' is a column of 2 values for 3 rows"):
        tq.kv_batch_put(keys=["c0", "c1", "c2"], partition_id="train", fields=td)
    grid = np.asarray([["a", "b"], ["c", "d"], ["e", "f"]])  # 2-D strings: a list a row
    td = TensorDict(
        {"input_ids": torch.ones(3, 2, dtype=torch.int64), "grid": grid}, batch_size=[3]
    )
    tq.kv_batch_put(keys=["c0", "c1", "c2"], partition_id="train", fields=td)
    got = tq.kv_batch_get(keys=["c2"], partition_id="train", select_fields="grid")
    assert got.get("grid").tolist() == [["e", "f"]]
    one = TensorDict({"input_ids": torch.zeros(1)}, batch_size=[1])
    with pytest.raises(flightq.ShapeError, match="2 keys for a TensorDict of batch_size \\[1\\]"):
        tq.kv_batch_put(keys=["__schema__:a", "__schema__:b"], partition_id="train", fields=one)
