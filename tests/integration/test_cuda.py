"""CUDA tensors through the data plane: puts from device memory, gets and claims into it.

Tests marked ``gpu`` need a CUDA device and are skipped, with the reason, where torch sees
none. The others run everywhere: the CPU paths keep their behaviour, a device that cannot
be used is refused with a typed error before anything is read or claimed, and torch stays
unimported by ``import flightq.client.client``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from fixtures_dataplane import (
    TEXT,
    TIMEOUT,
    VLM,
    client_fixture,  # noqa: F401
    raw,
    server_fixture,  # noqa: F401
    text_columns,
    text_keys,
)
from flightq_bench.payload import check_rows

import flightq
import flightq.aio
from flightq import workloads
from flightq.batch import decode, encode, encode_chunks, join
from flightq.cuda import DeviceBatch, PinnedPool, has_cuda, rebase, resolve_device, stage
from flightq.cuda import get as fq_cuda  # the reading side: windows, threads, plans
from flightq.errors import ShapeError
from flightq.rows import PackedRows
from flightq.schema import Field, Schema

# Every test here moves torch tensors: without torch the module skips as a whole.
torch = pytest.importorskip("torch", reason="torch is not installed")

pytestmark = [pytest.mark.timeout(120), pytest.mark.torch]

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device; torch.cuda.is_available() is False"
)


def _on_device(x: Any, device: str) -> Any:
    """A step's column structure with every tensor moved to ``device``; shared stays shared."""
    memo: dict[int, Any] = {}

    def mv(t: Any) -> Any:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t)
        if id(t) not in memo:
            memo[id(t)] = (t, t.to(device))
        return memo[id(t)][1]

    out: dict[str, Any] = {}
    for name, col in x.items():
        if isinstance(col, (np.ndarray, torch.Tensor)):
            out[name] = mv(col)
        else:
            out[name] = [
                None if r is None else [mv(s) for s in r] if isinstance(r, list) else mv(r)
                for r in col
            ]
    return out


def _cuda_step(step: workloads.Step) -> workloads.Step:
    t = workloads.to_torch(step)
    cols = _on_device(t.columns, "cuda:0")
    torch.cuda.synchronize()
    return workloads.Step(t.name, t.schema, t.keys, cols, t.tags, t.group_size)


def _to_host(x: Any) -> Any:
    """A column's rows with every (CUDA) tensor copied to the host."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, list):
        return [_to_host(v) for v in x]
    return x


def _all_tensors(batch: flightq.Batch) -> list[Any]:
    out: list[Any] = []
    for name in batch.fields:
        rows = batch[name]
        if isinstance(rows, torch.Tensor):
            out.append(rows)
            continue
        for r in rows:
            if isinstance(r, list):
                out.extend(r)
            elif isinstance(r, torch.Tensor):
                out.append(r)
    return out


# --------------------------------------------------------------------------- everywhere


def test_import_flightq_client_and_cuda_leaves_torch_unloaded():
    code = "import sys, flightq.client.client, flightq.cuda; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_device_none_and_cpu_read_cpu_tensors(client):
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    client.create_partition("p", TEXT, tasks=["train"], group_size=4)
    client.put("p", keys, cols)
    plain = client.get("p", keys)
    for device in (None, "cpu", torch.device("cpu")):
        b = client.get("p", keys, device=device)
        assert type(b) is flightq.Batch
        assert all(t.device.type == "cpu" for t in _all_tensors(b))
        for name in plain.fields:
            got, want = b[name], plain[name]
            if isinstance(want, torch.Tensor):
                assert raw(got) == raw(want)
            else:
                assert [raw(x) for x in got] == [raw(x) for x in want]
    numpy_rows = client.get("p", keys, as_="numpy", device="cpu")["input_ids"]
    assert [x.tolist() for x in numpy_rows] == [c.tolist() for c in cols["input_ids"]]
    claimed = client.claim("p", "train", 8, timeout=TIMEOUT, device="cpu")
    assert claimed.keys == keys


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused_before_claiming(client):
    keys = text_keys(1, 4)
    client.create_partition("p", TEXT, tasks=["train"], group_size=4)
    client.put("p", keys, text_columns(keys))
    with pytest.raises(flightq.DeviceError, match=r"CUDA is not available here") as e:
        client.get("p", keys, device="cuda:0")
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, flightq.FlightqError)
    with pytest.raises(flightq.DeviceError, match=r"device=None"):
        client.claim("p", "train", 4, timeout=TIMEOUT, device="cuda")
    # Nothing was claimed by the refused call.
    assert client.claim("p", "train", 4, timeout=TIMEOUT).keys == keys


@pytest.mark.parametrize(
    ("device", "as_", "match"),
    [
        ("banana", "torch", r"device='banana' names no device; expected None, 'cpu'"),
        ("meta", "torch", r"reads into 'cpu' or 'cuda\[:N\]', not 'meta'"),
        ("cuda:0", "numpy", r"as_='numpy' is for CPU reads"),
    ],
)
def test_unusable_device_is_a_device_error(client, device, as_, match):
    keys = text_keys(1, 2)
    client.create_partition("p", TEXT)
    client.put("p", keys, text_columns(keys))
    with pytest.raises(flightq.DeviceError, match=match):
        client.get("p", keys, as_=as_, device=device)


def test_async_client_passes_device_through(server):
    keys = text_keys(1, 4)
    cols = text_columns(keys)

    async def main() -> tuple[flightq.Batch, BaseException | None]:
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT)
            await c.put("p", keys, cols)
            b = await c.get("p", keys, device="cpu")
            err = None
            if not CUDA:
                try:
                    await c.get("p", keys, device="cuda:0")
                except flightq.DeviceError as e:
                    err = e
            return b, err

    b, err = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert [raw(x) for x in b["input_ids"]] == [raw(torch.from_numpy(x)) for x in cols["input_ids"]]
    assert CUDA or isinstance(err, flightq.DeviceError)


def test_cpu_puts_are_not_staged():
    keys = text_keys(1, 3)
    cols = text_columns(keys)
    as_torch = {
        k: [torch.from_numpy(x) for x in v] if isinstance(v, list) else v for k, v in cols.items()
    }
    pool = PinnedPool()
    for c in (cols, as_torch):
        assert not has_cuda(c)
        with stage(c, pool) as s:
            assert s.columns is c and s.on_range is None
    assert pool.allocated_bytes == 0
    assert resolve_device(None) is None and resolve_device(" CPU ") is None


def test_rebase_points_rows_at_a_new_flat_base():
    # The device path swaps each column's flat base for a device copy; on the CPU the same
    # swap to a modified copy shows that rows, segments and cat() all read from the base.
    step = workloads.w1(groups=1, g=3)
    s = flightq.SchemaRegistry.default().get(VLM)
    b = decode(encode(s, step.columns, step.keys))
    tok, med = b.column("input_ids"), b.column("pixel_values")
    new_tok = tok._base.clone() + 1
    new_med = med._base.clone() * 2
    rebase(tok, new_tok)
    rebase(med, new_med)
    assert torch.equal(b["input_ids"][1], torch.from_numpy(step.columns["input_ids"][1]) + 1)
    img = torch.from_numpy(step.columns["pixel_values"][2][0])
    assert torch.equal(b["pixel_values"][2][0], img * 2)
    assert torch.equal(med.cat()[0], torch.cat([img * 2] * 3))
    # A compact base holding only some dictionary entries, in another order: rows follow
    # the per-entry offsets given with it (how a read shares an image across chunks).
    two = decode(encode(s, workloads.w1(groups=2, g=2).columns, ["a", "b", "c", "d"]))
    m2 = two.column("pixel_values")
    e0, e1 = (m2._base[m2._elem[e] : m2._elem[e] + 748 * 1176].clone() for e in (0, 1))
    rebase(m2, torch.cat([e1, e0]), np.array([748 * 1176, 0]))
    assert torch.equal(two["pixel_values"][0][0].reshape(-1), e0)
    assert torch.equal(two["pixel_values"][3][0].reshape(-1), e1)
    with pytest.raises(TypeError, match="no flat base"):
        rebase(b.column("input_lengths"), new_tok)


def test_a_device_get_lays_its_parts_out_in_one_buffer_filled_window_by_window(monkeypatch):
    # The host half of a device get, on the CPU: every part's columns are placed in one
    # buffer (a group's image once, though each part of the group carries it), copied in
    # through windows that cut payloads, on several threads; the rows then read from it.
    monkeypatch.setattr(fq_cuda, "_WINDOW", 100_000)
    monkeypatch.setattr(fq_cuda, "_THREAD_BYTES", 10_000)
    step = workloads.w1(groups=2, g=4)
    s = flightq.SchemaRegistry.default().get(VLM)
    chunks = encode_chunks(s, step.columns, step.keys, step.tags, max_bytes=2**20)
    # One row per part, as a get's slices of stored batches: a group's parts share its
    # dictionary.
    parts = fq_cuda._validated([c.slice(i, 1) for c in chunks for i in range(c.num_rows)], False)
    assert len(parts) == 8
    regions, total = fq_cuda._plan(parts)
    image = 748 * 1176 * 4
    assert 2 * image < total < 3 * image
    buf = np.zeros(total, dtype=np.uint8)
    windows = list(fq_cuda._windows(regions, total))
    assert [(a, b) for a, b, _ in windows] == [
        (a, min(a + 100_000, total)) for a in range(0, total, 100_000)
    ]
    for start, stop, copies in windows:
        assert all(to >= 0 and to + n <= stop - start for to, _, _, n in copies)
        fq_cuda._copy(copies, buf[start:stop], lambda: None)
    for r in regions:
        r.finish(torch.from_numpy(buf))
    whole = join(parts)
    assert isinstance(whole, DeviceBatch) and whole.keys == step.keys
    check_rows(step, whole.keys, {f: whole[f] for f in whole.fields}, whole.tags, "one buffer")
    lo, hi = buf.ctypes.data, buf.ctypes.data + total
    views = [whole["input_ids"], [r[0] for r in whole["pixel_values"]]]
    assert all(lo <= t.data_ptr() < hi for rows in views for t in rows)


def test_host_copies_split_over_threads_land_where_asked():
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 255, n, dtype=np.uint8) for n in (5, 3 * 2**20, 1, 9 * 2**20 + 7)]
    copies, at = [], 0
    for src in srcs:
        copies.append((at, src, 1, len(src) - 1))
        at += len(src) + 3
    dst = np.zeros(at, dtype=np.uint8)
    ran: list[int] = []
    fq_cuda._copy(copies, dst, lambda: ran.append(1))
    assert ran == [1]
    want = np.zeros(at, dtype=np.uint8)
    for to, src, a, n in copies:
        want[to : to + n] = src[a : a + n]
    assert np.array_equal(dst, want)


def test_a_device_gets_stream_is_checked_as_it_arrives_and_stops_at_a_bad_batch():
    # The host half of a device get: a record batch whose shapes disagree with its payload
    # fails as it arrives, before the next one is pulled from the stream (as on the CPU).
    step = workloads.w1(groups=1, g=2)
    s = flightq.SchemaRegistry.default().get(VLM)
    good = encode_chunks(s, step.columns, step.keys, step.tags, max_bytes=2**20)[0]
    i = good.schema.get_field_index("input_ids__shape")
    wrong = pa.array([[n + 1 for n in r] for r in good.column(i).to_pylist()], good.column(i).type)
    bad = good.set_column(i, good.schema.field(i), wrong)
    pulled: list[int] = []

    def stream():
        for k, rb in enumerate([good, bad, good]):
            pulled.append(k)
            yield rb

    dev, pool = torch.device("cuda:0"), PinnedPool()  # neither touches a device
    with pytest.raises(ShapeError) as e:
        fq_cuda.decode_to_device(stream(), dev, pool)
    assert e.value.field == "input_ids" and e.value.key == step.keys[0]
    assert pulled == [0, 1]
    # Split over streams, each on its thread: the bad one stops, and asks the others to.
    pulled.clear()
    stop = threading.Event()
    with pytest.raises(ShapeError):
        fq_cuda.decode_streams_to_device([iter([good]), stream()], dev, pool, stop=stop)
    assert pulled == [0, 1] and stop.is_set()


def test_the_pinned_copy_threads_are_made_once_per_process(monkeypatch):
    monkeypatch.setattr(fq_cuda, "_copiers_of", None)
    first = fq_cuda._copiers()
    assert fq_cuda._copiers() is first  # kept between gets
    big = [(0, np.ones(8 * 2**20, np.uint8), 0, 8 * 2**20)]
    dst = np.zeros(8 * 2**20, np.uint8)
    fq_cuda._copy(big, dst, lambda: None)
    assert int(dst.min()) == 1 and fq_cuda._copiers() is first
    # Threads made in another process (as a forked child sees them) are made again.
    monkeypatch.setattr(fq_cuda, "_copiers_of", (os.getpid() + 1, first))
    child = fq_cuda._copiers()
    assert child is not first and fq_cuda._copiers() is child
    first.shutdown()
    child.shutdown()


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bf16", [False, True], ids=["W1", "W1-bf16"])
def test_w1_put_from_cuda_and_get_into_cuda_bit_exact(client, bf16):
    step = workloads.w1(groups=2, bf16=bf16)
    client.create_partition("p", step.schema, tasks=["train"], group_size=16)
    dev = _cuda_step(step)
    assert client.put("p", dev.keys, dev.columns, tags=dev.tags) == 32
    b = client.get("p", step.keys, device="cuda:0")
    assert isinstance(b, DeviceBatch) and b.device == torch.device("cuda", 0)
    assert all(t.device == torch.device("cuda", 0) for t in _all_tensors(b))
    if bf16:
        assert b["pixel_values"][0][0].dtype == torch.bfloat16
    check_rows(step, b.keys, {f: _to_host(b[f]) for f in b.fields}, b.tags, "get(device=)")
    # The rows of a group share their image on the device, as in the put: each of the
    # two images crosses once, whatever record batches the rows came in.
    ptrs = [r[0].data_ptr() for r in b["pixel_values"]]
    assert ptrs[0] == ptrs[1] and ptrs[0] != ptrs[16]
    assert len(set(ptrs)) == 2
    c = client.claim("p", "train", 16, timeout=TIMEOUT, device="cuda")
    assert c.keys == step.keys[:16] and c["input_ids"][0].is_cuda


@pytest.mark.gpu
@needs_cuda
def test_a_get_larger_than_a_pinned_window_crosses_window_by_window(client, monkeypatch):
    monkeypatch.setattr(fq_cuda, "_WINDOW", 2**20)
    step = workloads.w1(groups=2, bf16=True)
    client.create_partition("p", step.schema, tasks=["train"], group_size=16)
    client.put("p", step.keys, workloads.to_torch(step).columns, tags=step.tags)
    b = client.get("p", step.keys, device="cuda:0")
    check_rows(step, b.keys, {f: _to_host(b[f]) for f in b.fields}, b.tags, "get(device=)")
    assert client.pinned_bytes == 2 * 2**20  # two windows, taking turns


@pytest.mark.gpu
@needs_cuda
def test_cuda_put_sends_the_bytes_a_cpu_put_sends():
    step = workloads.w1(groups=2, g=4)
    s = flightq.SchemaRegistry.default().get(VLM)
    cpu = workloads.to_torch(step)
    dev = _cuda_step(step)
    want = encode_chunks(s, cpu.columns, cpu.keys, cpu.tags, max_bytes=2**20)
    pool = PinnedPool()
    joinable = {f.name for f in s.fields if f.role in ("token", "tensor")}
    with stage(dev.columns, pool, joinable) as st:
        assert st.on_range is not None
        # A token column of a tensor per row crossed as one joined tensor; media did not.
        assert type(st.columns["input_ids"]) is PackedRows
        assert type(st.columns["pixel_values"]) is list
        got = encode_chunks(
            s, st.columns, dev.keys, dev.tags, max_bytes=2**20, on_range=st.on_range
        )
        assert len(got) == len(want) > 1
        for g, w in zip(got, want, strict=True):
            assert g.equals(w)
        # The shared image is one dictionary entry per group, as on the CPU.
        assert len(got[0].column("pixel_values").values.dictionary) == 1
    allocated = pool.allocated_bytes
    with stage(dev.columns, pool, joinable) as st:
        encode_chunks(s, st.columns, dev.keys, dev.tags, max_bytes=2**20, on_range=st.on_range)
    assert pool.allocated_bytes == allocated  # the pinned buffer was reused


@pytest.mark.gpu
@needs_cuda
def test_fp8_bf16_scalars_and_many_chunks_round_trip_on_the_gpu():
    schema = Schema(
        "gpu_dtypes",
        1,
        (
            Field("tok8", "float8_e4m3fn", "token", (None,), required=True),
            Field("t5", "float8_e5m2", "tensor", (None, 3)),
            Field("img", "bfloat16", "media", None),
            Field("score", "bfloat16", "scalar", ()),
            Field("n", "int32", "scalar", ()),
            Field("ok", "bool", "scalar", ()),
        ),
    )
    g = torch.Generator().manual_seed(0)
    n = 40
    keys = [f"k{i}" for i in range(n)]
    lens = torch.randint(1, 5000, (n,), generator=g)
    tok = [torch.randn(int(s), generator=g).to(torch.float8_e4m3fn) for s in lens]
    t5 = [torch.randn(int(s) % 7, 3, generator=g).to(torch.float8_e5m2) for s in lens]
    img = [[torch.randn(2, 64, 64, generator=g).to(torch.bfloat16)] * (i % 3) for i in range(n)]
    cols_cpu = {
        "tok8": tok,
        "t5": t5,
        "img": img,
        "score": torch.randn(n, generator=g).to(torch.bfloat16),
        "n": lens.to(torch.int32),
        "ok": lens % 2 == 0,
    }
    cols = _on_device(cols_cpu, "cuda:0")
    with (
        flightq.Server(max_batch_bytes=32 * 1024) as srv,
        flightq.connect(srv.location, max_batch_bytes=32 * 1024, timeout=TIMEOUT) as c,
    ):
        c.register_schema(schema)
        c.create_partition("p", schema, tasks=["train"])
        assert c.put("p", keys, cols) == n
        b = c.get("p", keys, device="cuda:0")
        assert len(b.parts) > 3  # many record batches
        for name in ("tok8", "t5"):
            rows = b[name]
            assert all(r.is_cuda and r.dtype == cols_cpu[name][0].dtype for r in rows)
            assert [raw(r.view(torch.uint8)) for r in rows] == [
                raw(x.view(torch.uint8)) for x in cols_cpu[name]
            ]
        for name in ("score", "n", "ok"):
            v = b[name]
            assert v.is_cuda and v.dtype == cols_cpu[name].dtype
            assert torch.equal(v.cpu().view(torch.uint8), cols_cpu[name].view(torch.uint8))
        got_img = b["img"]
        for i in range(n):
            assert len(got_img[i]) == i % 3
            for x, w in zip(got_img[i], img[i], strict=True):
                assert x.is_cuda and torch.equal(x.cpu().view(torch.int16), w.view(torch.int16))
        vals, offs = b.column("img").cat()
        assert vals.is_cuda and int(offs[-1]) == vals.shape[0] == sum(2 * (i % 3) for i in range(n))
        copied = c.claim("p", "train", n, timeout=TIMEOUT, device="cuda:0", copy=True)
        r0 = copied["tok8"][0]
        r0.view(torch.uint8).zero_()  # a writable copy of its own
        assert copied["tok8"][1].data_ptr() != r0.data_ptr()


@pytest.mark.gpu
@needs_cuda
def test_put_waits_for_work_queued_on_the_current_stream(client):
    # The values are written by the current stream behind a long matmul chain; the put's
    # side stream must copy them only after that.
    client.create_partition("p", TEXT)
    x = torch.empty(1 << 22, dtype=torch.int64, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    x.copy_(torch.full_like(x, 7) + (a[0, 0] * 0).long())
    odd = torch.arange(30, device="cuda", dtype=torch.int64).reshape(10, 3).t()[0]  # strided
    five = torch.arange(5, device="cuda")
    w = torch.ones(5, device="cuda", requires_grad=True) * 0.5  # part of a graph
    client.put(
        "p",
        ["a", "b", "c"],
        {"input_ids": [x, odd, five], "generation_logprobs": [None, None, w]},
    )
    b = client.get("p", ["a", "b", "c"], as_="numpy")
    assert (b["input_ids"][0] == 7).all()
    assert b["input_ids"][1].tolist() == list(range(0, 30, 3))
    assert b["generation_logprobs"][2].tolist() == [0.5] * 5


@pytest.mark.gpu
@needs_cuda
def test_mixed_cpu_and_cuda_rows_and_unsynchronised_get(client):
    keys = text_keys(1, 6)
    cols = text_columns(keys)
    mixed = dict(cols)
    mixed["input_ids"] = [
        torch.from_numpy(v).cuda() if i % 2 else torch.from_numpy(v)
        for i, v in enumerate(cols["input_ids"])
    ]
    mixed["total_reward"] = torch.from_numpy(cols["total_reward"]).cuda()
    client.create_partition("p", TEXT)
    client.put("p", keys, mixed)
    b = client.get("p", keys, device="cuda:0", sync=False)
    assert b.event is not None and b.stream is not None
    doubled = [r * 2 for r in b["input_ids"]]  # queued on the current stream, after the copies
    torch.cuda.current_stream().synchronize()
    assert [d.cpu().tolist() for d in doubled] == [(v * 2).tolist() for v in cols["input_ids"]]
    assert torch.equal(b["total_reward"].cpu(), torch.from_numpy(cols["total_reward"]))
    b.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_async_client_gets_into_cuda(server):
    keys = text_keys(1, 4)
    cols = text_columns(keys)

    async def main() -> flightq.Batch:
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("p", TEXT)
            await c.put("p", keys, _on_device(cols, "cuda:0"))
            return await c.get("p", keys, device="cuda:0")

    b = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert all(r.is_cuda for r in b["input_ids"])
    assert [r.cpu().tolist() for r in b["input_ids"]] == [v.tolist() for v in cols["input_ids"]]


@pytest.mark.gpu
@needs_cuda
def test_a_split_get_into_cuda_returns_the_rows_asked(client):
    client.min_stream_bytes = 1
    step = workloads.w1(groups=2, bf16=True)
    client.create_partition("p", step.schema, tasks=["train"], group_size=16)
    client.put("p", step.keys, workloads.to_torch(step).columns, tags=step.tags)
    client.get("p", step.keys[:2], device="cuda:0")  # learns the row size: one stream
    asked = step.keys[::-1]
    b = client.get("p", asked, device="cuda:0", sync=False)
    assert isinstance(b, DeviceBatch) and b.keys == asked
    assert b.received is not None and b.received.route == "device"
    assert client.transport.extra_connections == 3  # over 4 streams
    b.synchronize()
    want = client.get("p", asked)

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(map(same, x, y))
        return x == y

    assert b.fields == want.fields and b.tags == want.tags
    assert all(same(_to_host(b[f]), want[f]) for f in b.fields)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", ["jagged", "packed"])
def test_a_packed_or_jagged_cuda_column_crosses_whole_and_puts_what_a_cpu_put_does(client, form):
    step = workloads.w3(groups=4, g=4)
    cpu = workloads.to_torch(step)
    s = flightq.SchemaRegistry.default().get(step.schema)
    token = [n for n in cpu.columns if s[n].role == "token"]
    cols: dict[str, Any] = dict(cpu.columns)
    for n in token:
        rows = [r.to("cuda:0") for r in cpu.columns[n]]
        if form == "jagged":
            cols[n] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        else:
            lens = torch.tensor([len(r) for r in rows])
            cu = torch.zeros(len(rows) + 1, dtype=torch.int32, device="cuda:0")
            cu[1:] = torch.cumsum(lens, 0).to("cuda:0")
            cols[n] = flightq.Packed(torch.cat(rows), cu)
    torch.cuda.synchronize()
    want = encode_chunks(s, cpu.columns, cpu.keys, cpu.tags, max_bytes=2**20)
    from flightq.rows import columns_of

    with stage(columns_of(cols, s), PinnedPool()) as st:
        for n in token:  # one tensor in pinned host memory, still packed
            got_col = st.columns[n]
            assert type(got_col) is PackedRows, type(got_col)
            assert not getattr(got_col.values, "is_cuda", False)
        got = encode_chunks(
            s, st.columns, cpu.keys, cpu.tags, max_bytes=2**20, on_range=st.on_range
        )
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.equals(w)
    client.create_partition("p", step.schema, tasks=["train"])
    client.put("p", cpu.keys, cols, tags=cpu.tags)
    b = client.get("p", cpu.keys, as_="numpy")
    for n in token:
        for x, r in zip(b[n], cpu.columns[n], strict=True):
            assert np.array_equal(x, r.numpy())


@pytest.mark.gpu
@needs_cuda
def test_cuda_rows_join_only_where_they_can_and_bad_rows_fail_as_on_the_cpu(client):
    # Rows joined on the device must put what the rows would put one by one; where a column
    # cannot be joined (a None row, a CPU row among CUDA ones, rows unlike past dim 0) it
    # takes the per-row path, and a column of the wrong dtype fails as a CPU put does.
    client.create_partition("p", TEXT)
    keys = text_keys(1, 5)
    cols = text_columns(keys)
    ids = [torch.from_numpy(v).cuda() for v in cols["input_ids"]]
    ids[1] = torch.arange(40, device="cuda", dtype=torch.int64)[::2][: len(ids[1])]  # strided
    ids[2] = ids[2].expand(1, -1)[0]  # a view, joined all the same
    mask = [torch.from_numpy(v) for v in cols["token_mask"]]
    mask = [m.cuda() if i % 2 else m for i, m in enumerate(mask)]  # CPU and CUDA rows
    # Part of a graph: joined without recording one.
    adv = [torch.ones(len(r), device="cuda", requires_grad=True) * i for i, r in enumerate(ids)]
    lp: list[Any] = [torch.full((len(r),), 0.5, device="cuda") for r in ids]
    lp[3] = None
    put = {**cols, "input_ids": ids, "token_mask": mask, "advantages": adv}
    put["generation_logprobs"] = lp
    with stage(
        put, PinnedPool(), {"input_ids", "token_mask", "generation_logprobs", "advantages"}
    ) as st:
        assert type(st.columns["input_ids"]) is PackedRows
        assert type(st.columns["advantages"]) is PackedRows
        assert type(st.columns["token_mask"]) is list
        assert type(st.columns["generation_logprobs"]) is list
    client.put("p", keys, put)
    b = client.get("p", keys, as_="numpy")
    assert [r.tolist() for r in b["input_ids"]] == [r.cpu().tolist() for r in ids]
    assert [r.tolist() for r in b["token_mask"]] == [v.tolist() for v in cols["token_mask"]]
    assert [r.tolist() for r in b["advantages"]] == [[float(i)] * len(r) for i, r in enumerate(ids)]
    got = b["generation_logprobs"]
    assert got[3] is None and all(got[i].tolist() == [0.5] * len(ids[i]) for i in (0, 1, 2, 4))
    # Every row int32 where the schema says int64: joined, then refused, naming the field
    # and a row, with nothing stored, as the CPU put of the same rows is.
    bad = [r.to(torch.int32) for r in ids]
    other = text_keys(1, 5, prefix="q")
    errors = []
    for rows in (bad, [r.cpu() for r in bad]):
        with pytest.raises(flightq.DTypeError) as e:
            client.put("p", other, {**cols, "input_ids": rows})
        errors.append(e.value)
    assert errors[0].field == errors[1].field == "input_ids"
    assert errors[0].key == errors[1].key
    with pytest.raises(flightq.NotFoundError):
        client.list_keys("p", other[:1])
    # Rows alike in dtype but not past dim 0 do not join; the schema refuses them.
    two_d = [r.reshape(-1, 1) if i == 0 else r for i, r in enumerate(ids)]
    with stage({"input_ids": two_d}, PinnedPool(), {"input_ids"}) as st:
        assert type(st.columns["input_ids"]) is list
    # A row of 1 MiB or more crosses from its own memory: no device copy of its column.
    big = [torch.zeros(2**17, dtype=torch.int64, device="cuda"), *ids[1:]]
    with stage({"input_ids": big}, PinnedPool(), {"input_ids"}) as st:
        assert type(st.columns["input_ids"]) is list
