"""The put's deferred copies and zero-copy payloads, and gets split over parallel streams.

Both paths must send and return exactly what the plain paths do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import assert_same_rows, shipped

import flightq
import flightq.client.client as fq_client
import flightq.client.reads as fq_reads
import flightq.client.streams as fq_streams
from flightq import workloads
from flightq.batch import encode_chunks

VLM = "rollout_vlm@1"
TEXT = "rollout_text@1"


def _ipc(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def _data_address(batch: pa.RecordBatch, column: str) -> int:
    col = batch.column(column)
    if isinstance(col, pa.LargeListArray):  # media: the dictionary's values
        col = col.values.dictionary
    return col.buffers()[2].address


def test_filled_batches_are_byte_identical_to_eagerly_encoded_ones() -> None:
    step = workloads.w2(groups=1, g=8)
    args = (shipped(VLM), step.columns, step.keys, step.tags)
    eager = encode_chunks(*args, max_bytes=8 * 2**20)
    fills: list = []
    lazy = encode_chunks(*args, max_bytes=8 * 2**20, fills=fills)
    assert len(fills) == len(lazy) == len(eager) > 1
    for fill in fills:
        fill()
    assert _ipc(lazy) == _ipc(eager)


def test_a_lone_payload_is_sent_from_the_tensors_memory_and_others_are_copied() -> None:
    rng = np.random.default_rng(0)
    one = [rng.standard_normal((1, 3, 448, 448), dtype=np.float32)]
    two = [rng.standard_normal((1, 3, 448, 448), dtype=np.float32) for _ in range(2)]
    for segs, alone in ((one, True), (two, False)):
        t = np.ones((1, 2), dtype=np.int32)
        cols = {
            "input_ids": [np.arange(5)],
            "pixel_values": [segs],
            "imgs_sizes": [[t * 448 for _ in segs]],
            "num_frames": [[np.ones(1, dtype=np.int32) for _ in segs]],
        }
        fills: list = []
        (batch,) = encode_chunks(shipped(VLM), cols, ["k"], max_bytes=2**30, fills=fills)
        at = _data_address(batch, "pixel_values")
        assert (at == segs[0].ctypes.data) is alone
        fills[0]()
        out = flightq.decode(batch, as_="numpy")
        assert_same_rows("media", out["pixel_values"], [segs])


def test_payloads_end_to_end_in_one_array_are_referenced_not_copied() -> None:
    rng = np.random.default_rng(1)
    stack = rng.standard_normal((3, 1, 3, 448, 448), dtype=np.float32)  # a processor's output
    for segs, in_place in (([stack[0], stack[1]], True), ([stack[0], stack[2]], False)):
        cols = {
            "input_ids": [np.arange(5)],
            "pixel_values": [segs],
            "imgs_sizes": [[np.full((1, 2), 448, dtype=np.int32) for _ in segs]],
            "num_frames": [[np.ones(1, dtype=np.int32) for _ in segs]],
        }
        fills: list = []
        (batch,) = encode_chunks(shipped(VLM), cols, ["k"], max_bytes=2**30, fills=fills)
        assert (_data_address(batch, "pixel_values") == stack.ctypes.data) is in_place
        fills[0]()
        out = flightq.decode(batch, as_="numpy")
        assert_same_rows("media", out["pixel_values"], [segs])


def test_a_multi_batch_put_with_a_bad_late_row_is_refused_before_anything_is_sent() -> None:
    step = workloads.w2(groups=1, g=8)
    cols = dict(step.columns)
    cols["input_ids"] = list(cols["input_ids"])
    cols["input_ids"][7] = cols["input_ids"][7].astype(np.int32)  # in the last batch
    with flightq.Server() as srv, flightq.connect(srv.location, max_batch_bytes=4 * 2**20) as c:
        c.create_partition("p", VLM, tasks=["train"], group_size=8)
        with pytest.raises(flightq.DTypeError, match=r"'input_ids'.*int64.*int32"):
            c.put("p", step.keys, cols, step.tags)
        assert c.stats()["partitions"]["p"]["rows"] == 0
        # The same rows, whole and right, land bit-exact through the pipelined path.
        assert c.put("p", step.keys, step.columns, step.tags) == 8
        got = c.get("p", step.keys, as_="numpy")
        assert_same_rows("media", got["pixel_values"], step.columns["pixel_values"])
        assert_same_rows("token", got["input_ids"], step.columns["input_ids"])


@pytest.fixture
def split_gets() -> Iterator[flightq.Client]:
    """A client that splits every get of 2 or more rows over up to 3 streams."""
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location, [TEXT], get_streams=3, min_stream_bytes=1) as c,
    ):
        c.create_partition("t", TEXT, tasks=["train"])
        c.put("t", ["w"], _text_rows(["w"]))
        first = c.get("t", ["w"])  # a partition's first get: one stream; now its size is known
        assert first.received is not None and first.received.route == "socket"
        yield c


def _text_rows(keys: list[str]) -> dict[str, list[np.ndarray]]:
    return {"input_ids": [np.arange(i + 3, dtype=np.int64) for i in range(len(keys))]}


@pytest.mark.torch
def test_a_split_get_returns_rows_in_the_order_asked_with_repeats(split_gets) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(7)]
    c.put("t", keys, _text_rows(keys))
    asked = ["k6", "k0", "k3", "k3", "k5", "k1", "k2", "k4"]
    got = c.get("t", asked, as_="numpy")
    assert got.keys == asked
    assert [len(r) for r in got["input_ids"]] == [int(k[1:]) + 3 for k in asked]
    assert got.received is not None and got.received.route == "streams=3"
    again = c.get("t", asked)
    assert again.received is not None and again.received.route == "streams=3"


@pytest.mark.torch
def test_each_streams_rows_are_validated_as_they_arrive_and_built_once(
    split_gets, monkeypatch
) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(7)]
    c.put("t", keys, _text_rows(keys))
    built: list[int] = []
    rows = flightq.batch.TensorColumn.rows

    def counting(col: flightq.batch.TensorColumn) -> list:
        built.append(len(col))
        return rows(col)

    monkeypatch.setattr(flightq.batch.TensorColumn, "rows", counting)
    got = c.get("t", keys, as_="numpy")
    # Each stream's one record batch is its last: its rows are built on first access
    # (a reader of whole columns builds none), then once for every later access.
    assert len(got.parts) == 3 and sum(built) == 0
    first, again = got["input_ids"], got["input_ids"]
    assert sum(built) == 7 and first is not again  # a new list of the same views
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert [len(r) for r in first] == [i + 3 for i in range(7)]


@pytest.mark.torch
def test_a_get_says_how_its_answer_arrived_over_every_stream(split_gets) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(7)]
    c.put("t", keys, _text_rows(keys))
    before = time.perf_counter()
    got = c.get("t", keys)
    r = got.received
    assert r is not None and r.record_batches == 3 and r.route == "streams=3"
    assert before < r.arrived < time.perf_counter() and r.decode_s > 0
    one = c.get("t", ["k0"])  # one row: one stream, one record batch
    assert one.received is not None and one.received.record_batches == 1
    assert one.received.arrived > r.arrived
    claimed = c.claim("t", "train", 2)
    assert claimed.received is not None and claimed.received.record_batches == 1
    assert flightq.decode(got.record_batch).received is None  # not read from a server


@pytest.mark.torch
def test_a_partitions_first_get_and_small_gets_travel_as_one_stream(
    split_gets, monkeypatch
) -> None:
    c = split_gets
    c.min_stream_bytes = 1
    c.create_partition("u", TEXT, tasks=["train"])
    keys = [f"k{i}" for i in range(8)]
    c.put("u", keys, _text_rows(keys))
    first = c.get("u", keys)  # nothing known yet about "u": one stream
    assert first.keys == keys and first.received is not None
    assert first.received.route == "socket"
    c.min_stream_bytes = 2**20
    small = c.get("u", keys)  # known small: still one stream
    assert small.keys == keys and small.received is not None
    assert small.received.route == "socket"
    c.min_stream_bytes = 1  # the same rows, known, split
    split = c.get("u", keys)
    assert split.keys == keys and split.received is not None
    assert split.received.route == "streams=3"


@pytest.mark.torch
def test_a_split_get_names_every_unknown_key_whichever_stream_had_it(split_gets) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(6)]
    c.put("t", keys, _text_rows(keys))
    with pytest.raises(flightq.NotFoundError, match=r"'nope0', 'nope5'"):
        c.get("t", ["nope0", "k1", "k2", "k3", "k4", "nope5"])


@pytest.mark.torch
def test_a_split_get_of_rows_with_different_fields_returns_their_union(split_gets) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(6)]
    c.put("t", keys, _text_rows(keys))
    late = keys[:2]  # only the first stream's rows get the write-back column
    c.put("t", late, {"prev_logprobs": [np.zeros(3, np.float32), np.zeros(4, np.float32)]})
    got = c.get("t", keys, as_="numpy")
    assert got.keys == keys
    lp = got["prev_logprobs"]
    assert [x is None for x in lp] == [False, False, True, True, True, True]
    # The server picks the columns from every key, so the parts agree: still split.
    assert got.received is not None and got.received.route == "streams=3"
    with pytest.raises(flightq.MissingFieldError, match=r"prev_logprobs"):
        c.get("t", keys, fields=["prev_logprobs"])


def test_a_split_get_cuts_where_a_stored_batch_starts_if_one_is_near() -> None:
    # Three puts of 7, 5 and 4 equal rows: over 2 streams the even cut is after row 8;
    # row 7 starts a stored batch, one row away, so the first stream serves the first
    # put's rows as stored and the second the other two puts'.
    import msgpack
    import pyarrow.flight as fl

    keys = [f"k{i:02}" for i in range(16)]
    with flightq.Server() as srv:
        with flightq.connect(srv.location, [TEXT]) as c:
            c.create_partition("t", TEXT, tasks=["train"])
            for a, b in [(0, 7), (7, 12), (12, 16)]:
                c.put("t", keys[a:b], {"input_ids": [np.arange(64) for _ in keys[a:b]]})
        with fl.connect(srv.location) as plain:

            def part(i: int) -> list[str]:
                t = {"op": "get", "partition": "t", "keys": keys, "part": i, "parts": 2}
                got = plain.do_get(fl.Ticket(msgpack.packb(t))).read_all()
                return got.column("__key__").to_pylist()

            assert [part(0), part(1)] == [keys[:7], keys[7:]]


@pytest.mark.torch
def test_a_groups_shared_image_counts_once_when_a_get_is_sized() -> None:
    # 2 groups of 16 rows share 2 images: what travels is about 8 MB, not 16 images' 57 MB.
    step = workloads.w1(groups=2)
    with flightq.Server() as srv, flightq.connect(srv.location, [VLM]) as c:
        c.create_partition("v", VLM, tasks=["train"], group_size=16)
        c.put("v", step.keys, step.columns, step.tags)
        c.get("v", step.keys)
        again = c.get("v", step.keys)
        assert again.keys == step.keys  # about 8 MB, under 2 x 16 MiB: one stream
        assert again.received is not None and again.received.route == "socket"
        assert step.nbytes(distinct_media=True) < 2 * 16 * 2**20 < step.nbytes()


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``device="cuda"`` decoded on the CPU: a fake decode_to_device that takes the record
    batches one by one, as the real one does; the list gets each call's batch count
    (-1: the call raised)."""
    calls: list[int] = []

    def decode_to_device(chunks, device, pool, *, copy=False, sync=True):
        calls.append(-1)
        batches = []
        for rb in chunks:  # an error of any stream surfaces here, as on the GPU
            batches.append(rb)
        calls[-1] = len(batches)
        return flightq.decode(batches, copy=copy)

    def decode_streams_to_device(streams, device, pool, *, copy=False, sync=True, stop=None):
        # The real one pulls each stream on its own thread; in stream order here.
        return decode_to_device(
            (rb for s in streams for rb in s), device, pool, copy=copy, sync=sync
        )

    monkeypatch.setattr(fq_client, "resolve_device", lambda d, as_="torch": d)
    for module in (fq_reads, fq_streams):
        monkeypatch.setattr(module, "decode_to_device", decode_to_device)
    monkeypatch.setattr(fq_streams, "decode_streams_to_device", decode_streams_to_device)
    return calls


@pytest.mark.torch
def test_a_device_get_splits_as_the_cpu_get_does(split_gets, fake_device) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(7)]
    c.put("t", keys, _text_rows(keys))
    asked = ["k6", "k0", "k3", "k3", "k5", "k1", "k2", "k4"]
    got = c.get("t", asked, as_="numpy", device="cuda")
    assert got.keys == asked
    assert [len(r) for r in got["input_ids"]] == [int(k[1:]) + 3 for k in asked]
    assert len(fake_device) == 1  # 3 streams, one decode
    assert got.received is not None and got.received.route == "device"
    assert got.received.record_batches == fake_device[0] >= 3


@pytest.mark.torch
def test_a_device_gets_first_and_small_gets_travel_as_one_stream(
    split_gets, fake_device, monkeypatch
) -> None:
    c = split_gets
    c.min_stream_bytes = 2**20
    c.create_partition("u", TEXT, tasks=["train"])
    keys = [f"k{i}" for i in range(8)]
    c.put("u", keys, _text_rows(keys))
    assert c.get("u", keys, device="cuda").keys == keys
    assert c.get("u", keys, device="cuda").keys == keys  # known small: one stream
    assert fake_device == [1, 1]
    c.min_stream_bytes = 1  # the device gets taught the rows' size: a CPU get splits
    split = c.get("u", keys)
    assert split.received is not None and split.received.route == "streams=3"


@pytest.mark.torch
def test_a_split_device_get_falls_back_to_one_stream(split_gets, fake_device) -> None:
    c = split_gets
    keys = [f"k{i}" for i in range(6)]
    c.put("t", keys, _text_rows(keys))
    with pytest.raises(flightq.NotFoundError, match=r"'nope0', 'nope5'"):
        c.get("t", ["nope0", "k1", "k2", "k3", "k4", "nope5"], device="cuda")
    assert fake_device == [-1, -1]  # the split's error, then the one stream's complete one
    c.put("t", keys[:2], {"prev_logprobs": [np.zeros(3, np.float32), np.zeros(4, np.float32)]})
    fake_device.clear()
    got = c.get("t", keys, as_="numpy", device="cuda")
    assert got.keys == keys
    assert [x is None for x in got["prev_logprobs"]] == [False, False, True, True, True, True]
    assert fake_device == [3]  # the parts agree on the columns: split, no second read
    with pytest.raises(flightq.MissingFieldError, match=r"prev_logprobs"):
        c.get("t", keys, fields=["prev_logprobs"], device="cuda")
