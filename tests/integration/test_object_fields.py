"""Object fields: a declared non-tensor column, one msgpack value per row (``role: object``).

Real servers on loopback port 0, real sockets and shared-memory segments; the hostile puts
are written with plain ``pyarrow.flight``. Every test reads numpy (the suite runs without
torch too) but the TensorDict one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TIMEOUT
from helpers_reliability import partition_state, plain_error, plain_put, put_command
from helpers_wire import replace_column

import flightq
from flightq.schema import Schema

pytestmark = pytest.mark.timeout(120)

SCHEMA = Schema.from_dict(
    {
        "name": "chat_rollout",
        "version": 1,
        "fields": [
            {"name": "input_ids", "dtype": "int64", "role": "token", "shape": [None]},
            {"name": "prev_logprobs", "dtype": "float32", "role": "token", "shape": [None]},
            {"name": "message_log", "role": "object"},
            {"name": "reward_inputs", "role": "object"},
            {"name": "total_reward", "dtype": "float32", "role": "scalar"},
        ],
    }
)


def _rows(n: int, text: int = 40) -> tuple[list[str], dict[str, Any], list[Any]]:
    keys = [f"p{i // 4}_g{i % 4}" for i in range(n)]
    logs = [
        [
            {"role": "user", "content": f"question {i} " + "é" * text},
            {"role": "assistant", "content": "answer " * (i % 5), "tokens": i},
        ]
        for i in range(n)
    ]
    cols = {
        "input_ids": [np.arange(3 + i, dtype=np.int64) for i in range(n)],
        "message_log": logs,
        "total_reward": np.linspace(0, 1, n, dtype=np.float32),
    }
    return keys, cols, logs


def _connect(location: str, **kw: Any) -> flightq.Client:
    c = flightq.connect(location, timeout=TIMEOUT, **kw)
    c.register_schema(SCHEMA)
    return c


def test_a_schema_declares_an_object_field_with_its_dtype_and_shape_implied():
    f = SCHEMA["message_log"]
    assert (f.role, f.dtype, f.shape) == ("object", "uint8", (None,))
    assert f.to_dict() == {
        "name": "message_log",
        "dtype": "uint8",
        "role": "object",
        "shape": [None],
        "required": False,
    }
    again = Schema.from_dict(SCHEMA.to_dict())  # the canonical form reads back the same
    assert again.fingerprint == SCHEMA.fingerprint
    base = {"name": "log", "role": "object"}
    for bad, says in (
        ({"dtype": "float32"}, "its dtype is uint8 and its shape"),
        ({"shape": [3]}, "its dtype is uint8 and its shape"),
        ({"shape": [None, None]}, "its dtype is uint8 and its shape"),
    ):
        with pytest.raises(flightq.SchemaError, match=says) as info:
            Schema.from_dict({"name": "t", "version": 1, "fields": [{**base, **bad}]})
        assert info.value.field == "log"


def test_object_values_come_back_as_put_over_the_socket_and_through_shared_memory():
    d = tempfile.mkdtemp(prefix="flightq-objects-", dir="/dev/shm")
    try:
        with flightq.Server(shm=d) as srv:
            for shm in (None, d):
                with _connect(srv.location, shm=shm) as c:
                    if shm is not None:
                        c.shm_min_bytes = 0  # through a segment, however small
                    p = "s" if shm is None else "m"
                    c.create_partition(p, SCHEMA, tasks=["train"])
                    keys, cols, logs = _rows(12)
                    odd = [
                        (1, "two", 3.5),  # a tuple comes back as a list
                        {"nested": {"deep": [b"\x00\xff", True, None, -(2**63), 2**64 - 1]}},
                        np.float32(0.25),  # numpy scalars as their values
                        np.array(7),
                        "",
                        [],
                        {},
                        0,
                        False,
                        "x" * 100_000,  # past the 64 KiB a row's tags take
                        None,  # a row without the field
                        b"raw",
                    ]
                    cols["reward_inputs"] = odd
                    c.put(p, keys, cols)
                    b = c.get(p, keys, as_="numpy")
                    assert b.received is not None
                    assert b.received.route == ("socket" if shm is None else "shm")
                    assert b["message_log"] == logs
                    want = [
                        [1, "two", 3.5],
                        odd[1],
                        0.25,
                        7,
                        "",
                        [],
                        {},
                        0,
                        False,
                        odd[9],
                        None,
                        b"raw",
                    ]
                    assert b["reward_inputs"] == want
                    assert b.column("reward_inputs")[10] is None
                    assert not b.column("reward_inputs").complete
                    # Some rows, some fields, in another order; a claim.
                    some = c.get(p, keys[::-3], fields=["message_log"], as_="numpy")
                    assert some.fields == ["message_log"]
                    assert some["message_log"] == logs[::-3]
                    with c.claim(p, "train", 4, fields=["message_log"], as_="numpy") as got:
                        assert got["message_log"] == [logs[keys.index(k)] for k in got.keys]
                    with pytest.raises(flightq.ShapeError, match="an object field"):
                        b.column("message_log").packed()
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def test_an_answer_of_several_record_batches_reads_every_value():
    with flightq.Server(max_batch_bytes=4096) as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        keys, cols, logs = _rows(40, text=200)
        c.put("p", keys, cols)
        b = c.get("p", keys, fields=["message_log", "input_ids"], as_="numpy")
        assert b.received is not None and b.received.record_batches > 1  # about 4 KB each
        assert b["message_log"] == logs
        assert [b.column("message_log")[i] for i in (0, 17, 39, -1)] == [
            logs[0],
            logs[17],
            logs[39],
            logs[-1],
        ]


def test_an_object_field_is_written_back_and_rewritten_as_any_field():
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA, tasks=["train"])
        keys, cols, logs = _rows(8)
        del cols["message_log"]
        c.put("p", keys, cols)
        # A later stage adds the field to rows that lacked it...
        c.put("p", keys[:5], {"message_log": logs[:5]})
        b = c.get("p", keys, as_="numpy")  # every field the rows have
        assert b["message_log"] == [*logs[:5], None, None, None]
        with pytest.raises(flightq.MissingFieldError, match="message_log"):
            c.get("p", keys, fields=["message_log"], as_="numpy")
        # ...and a rewrite needs overwrite, as for any column.
        with pytest.raises(flightq.ConflictError, match="message_log"):
            c.put("p", keys[:1], {"message_log": ["new"]})
        c.put("p", keys[:1], {"message_log": ["new"]}, overwrite=True)
        assert c.get("p", keys[:2], fields=["message_log"], as_="numpy")["message_log"] == [
            "new",
            logs[1],
        ]
        # A claim waits for it like for a tensor field.
        with c.claim("p", "train", 5, wait_for=["message_log"], as_="numpy") as got:
            assert sorted(got.keys) == sorted(keys[:5])


def test_a_read_of_other_fields_receives_none_of_an_object_fields_bytes():
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        keys, cols, _ = _rows(16, text=20_000)  # 40 KB of text a row
        c.put("p", keys, cols)
        counters = lambda: c.stats()["counters"]["bytes_sent"]  # noqa: E731
        before = counters()
        c.get("p", keys, fields=["input_ids"], as_="numpy")
        without = counters() - before
        before = counters()
        c.get("p", keys, fields=["input_ids", "message_log"], as_="numpy")
        with_log = counters() - before
        assert without < 10_000 < 16 * 40_000 < with_log


def test_the_budget_counts_an_object_fields_bytes_and_clearing_gives_them_back():
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        keys, cols, _ = _rows(8)
        del cols["message_log"]
        c.put("p", keys, cols)
        held = c.stats()["partitions"]["p"]["bytes"]
        big = ["y" * 50_000 for _ in keys]
        c.put("p", keys, {"message_log": big})
        grew = c.stats()["partitions"]["p"]["bytes"] - held
        assert 8 * 50_000 <= grew <= 8 * 50_000 + 8 * 1024
        c.clear("p", keys)
        assert c.stats()["partitions"]["p"]["bytes"] == 0


@pytest.mark.parametrize(
    "value, says",
    [
        ({1, 2}, "can not serialize 'set'"),
        (np.zeros(3), "can not serialize 'ndarray'"),
        ({"ok": {7: "int key"}}, "string keys, got key 7"),
        ({b"k": 1}, "string keys, got key b'k'"),
        (object(), "can not serialize 'object'"),
    ],
)
def test_a_value_an_object_field_cannot_hold_is_refused_naming_the_row(value, says):
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        keys, cols, logs = _rows(3)
        cols["message_log"] = [logs[0], value, logs[2]]
        with pytest.raises(flightq.EncodeError, match=says) as info:
            c.put("p", keys, cols)
        assert (info.value.field, info.value.key) == ("message_log", keys[1])
        assert c.inspect("p")["rows"] == 0  # nothing stored


def test_an_object_column_of_another_shape_is_refused():
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        keys, cols, logs = _rows(3)
        for bad, err, says in (
            (logs[:2], flightq.ShapeError, "2 rows for 3 keys"),
            ("one string", flightq.EncodeError, "one value per row"),
            ({"a": 1}, flightq.EncodeError, "one value per row"),
        ):
            with pytest.raises(err, match=says):
                c.put("p", keys, {**cols, "message_log": bad})
        # A numpy object column (as a TensorDict's non-tensor entry may hold) is one per row.
        c.put("p", keys, {**cols, "message_log": np.array([{"a": 1}, "b", None], dtype=object)})
        got = c.get("p", keys, as_="numpy")["message_log"]
        assert got == [{"a": 1}, "b", None]


def _plain_batch(keys: list[str], payloads: list[bytes | None]) -> pa.RecordBatch:
    """A record batch with ``payloads`` as the message_log bytes, shapes to match."""
    good = flightq.encode(
        SCHEMA, {"message_log": ["x" if p is not None else None for p in payloads]}, keys
    )
    rb = replace_column(good, "message_log", pa.array(payloads, type=pa.large_binary()))
    shapes = [None if p is None else [len(p)] for p in payloads]
    return replace_column(rb, "message_log__shape", pa.array(shapes, type=pa.list_(pa.int64())))


_BOMB = b"\xdd\x00\x10\x00\x00" + b"\x80" * (2**20)  # a list of 1 Mi empty maps: 64 MiB


@pytest.mark.parametrize(
    "payload, says",
    [
        (b"\xc1", "not one msgpack value"),  # never used
        (msgpack.packb("a") + b"\x00", "extra data"),  # bytes after the value
        (b"\xa2\xff\xfe", "utf-8"),  # a string that is not UTF-8
        (msgpack.packb({1: 2}), "map key"),
        (msgpack.packb({"a": {b"raw": 1}}, use_bin_type=True), "string keys, got key b'raw'"),
        (msgpack.packb(msgpack.ExtType(5, b"\x00")), "extension value"),
        (b"\xdd\xff\xff\xff\xff", "claim"),  # a header claiming 2**32 items, none follow
        (_BOMB, "would decode to more than"),  # far more than the server takes of a value
        (b"", "not one msgpack value"),
    ],
)
def test_plain_flight_puts_of_bytes_no_object_field_holds_are_refused_and_nothing_stored(
    payload, says
):
    with flightq.Server(max_request_bytes=16 * 2**20) as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        c.put("p", ["kept"], {"message_log": ["before"]})
        before = partition_state(srv.location, "p")
        held = srv.store.held()
        keys = ["a", "b", "c"]
        rb = _plain_batch(keys, [msgpack.packb("fine"), None, payload])
        with pytest.raises(fl.FlightError) as info:
            plain_put(srv.location, put_command("p"), [rb])
        kind, message = plain_error(info.value)
        assert kind == "EncodeError", message
        assert says.lower() in message.lower() and "'message_log'" in message, message
        assert "'c'" in message  # the row
        assert partition_state(srv.location, "p") == before
        assert srv.store.held() == held
        # The server serves on, the good rows of a good put included.
        plain_put(srv.location, put_command("p"), [_plain_batch(keys, [msgpack.packb(1)] * 3)])
        got = c.get("p", ["kept", *keys], fields=["message_log"], as_="numpy")["message_log"]
        assert got == ["before", 1, 1, 1]


@pytest.mark.torch
def test_a_tensordict_puts_and_reads_an_object_field_as_a_non_tensor_stack(torch):
    tensordict = pytest.importorskip("tensordict", reason="tensordict is not installed")
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        logs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}], "s"]
        td = tensordict.TensorDict(
            {
                "input_ids": torch.nested.nested_tensor(
                    [torch.arange(3), torch.arange(2), torch.arange(4)], layout=torch.jagged
                ),
                "message_log": tensordict.NonTensorStack(*logs),
            },
            batch_size=[3],
        )
        c.put("p", ["a", "b", "c"], td)
        out = c.get("p", ["a", "b", "c"], as_="tensordict")
        assert type(out.get("message_log")).__name__ == "NonTensorStack"
        assert out.get("message_log").tolist() == logs
        assert c.get("p", ["a", "b", "c"])["message_log"] == logs  # torch reads alike


def test_a_put_cut_into_several_record_batches_and_a_sharded_put_carry_every_value():
    keys, cols, logs = _rows(30, text=300)
    with flightq.Server() as srv, _connect(srv.location, max_batch_bytes=2048) as c:
        c.create_partition("p", SCHEMA)
        c.put("p", keys, cols)  # about 2 KB a batch
        assert c.get("p", keys, ["message_log"], as_="numpy")["message_log"] == logs
    with flightq.Server() as a, flightq.Server() as b:
        for s in (a, b):
            with _connect(s.location):
                pass
        with flightq.connect_sharded([a.location, b.location], [SCHEMA], timeout=TIMEOUT) as c:
            c.create_partition("p", SCHEMA)
            c.put("p", keys, cols)
            assert c.get("p", keys, ["message_log"], as_="numpy")["message_log"] == logs
        held = []
        for s in (a, b):
            with flightq.connect(s.location, timeout=TIMEOUT) as one:
                held.append(one.inspect("p")["rows"])
        assert sum(held) == len(keys) and min(held) > 0  # both shards hold rows


def test_bad_bytes_a_client_sends_on_its_request_stream_or_per_call_are_refused_by_the_server():
    from flightq.rows import PackedRows

    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        for rows in (2, 3000):  # a small put rides the request stream, a large one a DoPut
            keys = [f"r{i}" for i in range(rows)]
            good = msgpack.packb("fine")
            raw = good * (rows - 1) + b"\xc1"  # the last row's bytes are no msgpack value
            offsets = np.arange(rows + 1, dtype=np.int64) * len(good)
            offsets[-1] = len(raw)
            column = PackedRows(np.frombuffer(raw, dtype=np.uint8), offsets)
            with pytest.raises(flightq.EncodeError, match="not one msgpack value") as info:
                c.put("p", keys, {"message_log": column})  # passed as packed, unchecked
            assert (info.value.field, info.value.key) == ("message_log", keys[-1])
            assert c.inspect("p")["rows"] == 0
        assert c.stats()["counters"]["refusals"].get("EncodeError") == 2


def test_a_snapshot_restores_object_values_to_a_server_of_the_same_request_cap(tmp_path):
    cap = 64 * 2**20
    keys, cols, logs = _rows(4)
    cols["reward_inputs"] = ["z" * (20 * 2**20), None, {"a": 1}, [1, 2]]  # past 16 MiB
    with (
        flightq.Server(snapshot_dir=tmp_path, max_request_bytes=cap) as srv,
        _connect(srv.location) as c,
    ):
        c.create_partition("p", SCHEMA)
        c.put("p", keys, cols)
        held = c.stats()["partitions"]["p"]["bytes"]
        c.snapshot("s")
    with (
        flightq.Server(restore=tmp_path / "s", max_request_bytes=cap) as srv,
        _connect(srv.location) as c,
    ):
        assert c.stats()["partitions"]["p"]["bytes"] == held
        got = c.get("p", keys, as_="numpy")
        assert got["message_log"] == logs
        assert got["reward_inputs"] == cols["reward_inputs"]
    # A server told a smaller cap says which row and what to raise.
    with pytest.raises(flightq.DecodeError, match=r"row key 'p0_g0'.*max-request-bytes"):
        flightq.Server(restore=tmp_path / "s")


def test_a_writer_stores_an_object_value_as_it_was_when_put_and_refuses_a_bad_one_at_once():
    with flightq.Server() as srv, _connect(srv.location) as c:
        c.create_partition("p", SCHEMA)
        log = [{"role": "user", "content": "first"}]
        with flightq.Writer(c, "p") as w:
            w.put(["a"], {"message_log": [log]})
            log.append({"role": "assistant", "content": "appended after the put"})
            with pytest.raises(flightq.EncodeError, match="can not serialize 'set'") as info:
                w.put(["b"], {"message_log": [{1, 2}]})
            assert info.value.key == "b"
            w.flush()
        got = c.get("p", ["a"], ["message_log"], as_="numpy")["message_log"]
        assert got == [[{"role": "user", "content": "first"}]]
        assert c.inspect("p")["rows"] == 1


ZSTD = Schema.from_dict(
    {
        "name": "chat_zstd",
        "version": 1,
        "fields": [{"name": "message_log", "role": "object", "codec": {"id": "zstd", "level": 3}}],
    }
)


def test_an_object_field_with_zstd_sends_and_holds_its_values_compressed():
    pytest.importorskip("zstandard", reason="zstd payloads need the zstandard package")
    keys, _, logs = _rows(16, text=4000)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.register_schema(ZSTD)
        c.create_partition("p", ZSTD)
        c.put("p", keys, {"message_log": [*logs[:-1], None]})
        got = c.get("p", keys, as_="numpy")["message_log"]
        assert got == [*logs[:-1], None]
        assert c.get("p", keys[3:4], as_="numpy").column("message_log")[0] == logs[3]
        raw = sum(len(msgpack.packb(v)) for v in logs[:-1])
        assert c.stats()["partitions"]["p"]["bytes"] < raw / 5  # held as sent: compressed


def test_plain_flight_zstd_frames_of_bytes_no_object_field_holds_are_refused():
    zstd = pytest.importorskip("zstandard", reason="zstd payloads need the zstandard package")
    with flightq.Server(max_request_bytes=2 * 2**20) as srv, flightq.connect(srv.location) as c:
        c.register_schema(ZSTD)
        c.create_partition("p", ZSTD)
        good = flightq.encode(ZSTD, {"message_log": ["x", "y"]}, ["a", "b"])
        for plain, says in (
            (b"\xc1", "not one msgpack value"),
            (msgpack.packb({"k": {1: 2}}), "map key"),
            (b"\xa1" + b"x" * (3 * 2**20), "would decode to more than"),  # past the cap
        ):
            frame = zstd.ZstdCompressor(write_content_size=True).compress(plain)
            rb = replace_column(
                good,
                "message_log",
                pa.array([good.column("message_log")[0].as_py(), frame], type=pa.large_binary()),
            )
            rb = replace_column(
                rb,
                "message_log__shape",
                pa.array([[1 + 1], [len(plain)]], type=pa.list_(pa.int64())),
            )
            with pytest.raises(fl.FlightError) as info:
                plain_put(srv.location, put_command("p"), [rb])
            kind, message = plain_error(info.value)
            assert kind == "EncodeError" and says in message and "'b'" in message, message
            assert c.inspect("p")["rows"] == 0


def _one_bad_frame(frame: bytes, size: int) -> pa.RecordBatch:
    """A put of rows ``a`` (good) and ``b`` (``frame``, its shape ``[size]``)."""
    good = flightq.encode(ZSTD, {"message_log": ["x", "y"]}, ["a", "b"])
    first = good.column("message_log")[0].as_py()
    rb = replace_column(good, "message_log", pa.array([first, frame], pa.large_binary()))
    return replace_column(rb, "message_log__shape", pa.array([[2], [size]], pa.list_(pa.int64())))


def test_a_zstd_object_frame_is_decoded_once_by_the_server(monkeypatch):
    pytest.importorskip("zstandard", reason="zstd payloads need the zstandard package")
    from flightq import codecs

    decoded: list[int] = []
    real = codecs.Zstd._exact

    def counted(self: Any, data: Any, nbytes: int, *a: Any, **kw: Any) -> Any:
        decoded.append(nbytes)
        return real(self, data, nbytes, *a, **kw)

    keys, _, logs = _rows(8, text=3000)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.register_schema(ZSTD)
        c.create_partition("p", ZSTD)
        rb = flightq.encode(ZSTD, {"message_log": logs}, keys)
        monkeypatch.setattr(codecs.Zstd, "_exact", counted)
        plain_put(srv.location, put_command("p"), [rb])  # the check and validation, once
        assert sorted(decoded) == sorted(len(msgpack.packb(v)) for v in logs)
        monkeypatch.undo()
        assert c.get("p", keys, as_="numpy")["message_log"] == logs


def test_plain_flight_zstd_object_frames_that_do_not_decode_to_their_shape_are_refused():
    zstd = pytest.importorskip("zstandard", reason="zstd payloads need the zstandard package")
    value = msgpack.packb([{"role": "user", "content": "word " * 400}])
    frame = zstd.ZstdCompressor(write_content_size=True).compress(value)
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    cut = frame[: len(frame) // 2]
    bare = zstd.ZstdCompressor(write_content_size=False).compress(value)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.register_schema(ZSTD)
        c.create_partition("p", ZSTD)
        for bad, says in (
            (cut, "zstd payload"),
            (frame + b"junk", "zstd payload is corrupt"),
            (frame + skippable, "zstd payload is corrupt"),
            (bare, "without a readable size"),
        ):
            with pytest.raises(fl.FlightError) as info:
                plain_put(srv.location, put_command("p"), [_one_bad_frame(bad, len(value))])
            kind, message = plain_error(info.value)
            want = "ShapeError" if bad is bare else "DecodeError"  # as for any zstd field
            assert kind == want and says in message and "row key 'b'" in message, message
            assert c.inspect("p")["rows"] == 0
        plain_put(srv.location, put_command("p"), [_one_bad_frame(frame, len(value))])
        assert c.get("p", ["b"], as_="numpy")["message_log"] == [msgpack.unpackb(value)]


def test_a_zstd_object_value_past_the_cap_is_refused_before_any_frame_is_decoded(monkeypatch):
    zstd = pytest.importorskip("zstandard", reason="zstd payloads need the zstandard package")
    from flightq import codecs

    decoded: list[int] = []
    real = codecs.Zstd._exact

    def counted(self: Any, data: Any, nbytes: int, *a: Any, **kw: Any) -> Any:
        decoded.append(nbytes)
        return real(self, data, nbytes, *a, **kw)

    monkeypatch.setattr(codecs.Zstd, "_exact", counted)
    with flightq.Server(max_request_bytes=2 * 2**20) as srv, flightq.connect(srv.location) as c:
        c.register_schema(ZSTD)
        c.create_partition("p", ZSTD)
        good = flightq.encode(ZSTD, {"message_log": ["x", "y"]}, ["a", "b"])
        big = b"\xa1" + b"x" * (3 * 2**20)  # honest, and past the cap once decoded
        frame = zstd.ZstdCompressor(write_content_size=True).compress(big)
        first = good.column("message_log")[0].as_py()
        rb = replace_column(good, "message_log", pa.array([first, frame], pa.large_binary()))
        rb = replace_column(
            rb, "message_log__shape", pa.array([[2], [len(big)]], pa.list_(pa.int64()))
        )
        decoded.clear()
        with pytest.raises(fl.FlightError) as info:
            plain_put(srv.location, put_command("p"), [rb])
        kind, message = plain_error(info.value)
        assert kind == "EncodeError" and "row key 'b'" in message, message
        assert decoded == []  # refused from the shape column alone
        assert c.inspect("p")["rows"] == 0
