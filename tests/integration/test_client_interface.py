"""One interface for every client, and the route each transfer took, through the public API.

Client, ShardedClient and AsyncClient offer the same methods with the same parameters
(:class:`flightq.DataPlane`); a get's ``received.route`` and a put's receipt say whether
the bytes took one socket stream, parallel streams or shared memory.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, text_columns, text_keys

import flightq
import flightq.aio
from flightq import workloads

pytestmark = pytest.mark.timeout(120)

METHODS = sorted(
    name
    for name, _ in inspect.getmembers(flightq.DataPlane, inspect.isfunction)
    if not name.startswith("_")
)


def _params(cls: type, name: str) -> list[tuple[str, object, object]]:
    sig = inspect.signature(getattr(cls, name))
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", METHODS)
def test_every_client_offers_each_method_with_the_same_parameters(name: str) -> None:
    want = _params(flightq.DataPlane, name)
    for cls in (flightq.Client, flightq.ShardedClient, flightq.aio.AsyncClient):
        assert _params(cls, name) == want, f"{cls.__name__}.{name}"


def test_the_async_client_has_a_coroutine_for_each_method() -> None:
    for name in METHODS:
        assert inspect.iscoroutinefunction(getattr(flightq.aio.AsyncClient, name)), name


def test_both_blocking_clients_are_data_planes() -> None:
    with flightq.Server() as a, flightq.Server() as b:
        with flightq.connect(a.location) as c:
            assert isinstance(c, flightq.DataPlane)
        s = flightq.connect_sharded([a.location, b.location])
        try:
            assert isinstance(s, flightq.DataPlane)
        finally:
            s.close()


def test_a_put_receipt_is_the_row_count() -> None:
    r = flightq.PutReceipt(16, "streams=2", ["grpc://a:1"])
    assert r == 16 and r + 1 == 17 and r.rows == 16 and type(r.rows) is int
    assert repr(r) == "16" and r.route == "streams=2" and r.shards == ("grpc://a:1",)
    back = pickle.loads(pickle.dumps(r))
    assert back == 16 and back.route == "streams=2" and back.shards == ("grpc://a:1",)


# --------------------------------------------------------------------------- routes


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    with flightq.Server() as srv:
        yield srv


def _route(batch: flightq.Batch) -> str:
    assert batch.received is not None
    return batch.received.route


@pytest.mark.torch
def test_small_transfers_take_one_socket_stream(server) -> None:
    keys = text_keys(2, 4)
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
        c.create_partition("t", TEXT, tasks=["train"])
        receipt = c.put("t", keys, text_columns(keys))
        assert receipt == 8 and receipt.route == "socket" and receipt.shards == ()
        assert _route(c.get("t", keys)) == "socket"
        assert _route(c.get("t", keys)) == "socket"  # known small: still one stream
        assert _route(c.claim("t", "train", 8, timeout=TIMEOUT)) == "socket"


def test_large_transfers_split_over_parallel_streams(server) -> None:
    keys = text_keys(4, 4)
    cols = text_columns(keys)
    with flightq.connect(
        server.location,
        [TEXT],
        timeout=TIMEOUT,
        get_streams=2,
        put_streams=3,
        max_batch_bytes=64,  # a batch or so per group: enough batches for 3 streams
        min_stream_bytes=1,
    ) as c:
        c.create_partition("t", TEXT, tasks=["train"])
        receipt = c.put("t", keys, cols)
        assert receipt == 16 and receipt.route == "streams=3"
        first = c.get("t", keys, as_="numpy")  # the partition's first get: one stream
        assert _route(first) == "socket"
        got = c.get("t", keys, as_="numpy")
        assert _route(got) == "streams=2" and got.keys == keys
        assert all(
            np.array_equal(a, b) for a, b in zip(got["input_ids"], cols["input_ids"], strict=True)
        )


@pytest.mark.torch
def test_large_transfers_of_a_shm_client_go_through_shared_memory(server) -> None:
    step = workloads.w2(groups=1)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=True) as c:
        c.create_partition("m", step.schema, tasks=["t"], group_size=step.group_size)
        assert c.put("m", step.keys, step.columns, tags=step.tags).route == "shm"
        assert _route(c.get("m", step.keys)) == "shm"
        assert _route(c.claim("m", "t", step.rows, timeout=TIMEOUT)) == "shm"


def test_a_sharded_put_names_the_shards_it_wrote_to() -> None:
    with flightq.Server() as a, flightq.Server() as b:
        s = flightq.connect_sharded([a.location, b.location], [TEXT], timeout=TIMEOUT)
        try:
            s.create_partition("t", TEXT, tasks=["train"], group_size=4)
            # 32 groups: each lands on a shard by its key's hash with the shards' random
            # ports; with 8, all on one shard came about once in 40 runs.
            keys = text_keys(32, 4)
            receipt = s.put("t", keys, text_columns(keys), put_id="p1")
            assert receipt == 128 and receipt.route == "socket"
            assert sorted(receipt.shards) == sorted([a.location, b.location])
            assert s.put("t", keys, text_columns(keys), put_id="p1") == 128  # a retry
            assert s.stats()["rows"] == 128
            got = s.get("t", keys[::-1], as_="numpy")
            assert got.keys == keys[::-1] and _route(got) == "socket"
            one = s.put("t", keys[:4], text_columns(keys[:4]), overwrite=True)
            assert len(one.shards) == 1  # a group lives on one shard
        finally:
            s.close()


@pytest.mark.torch
def test_the_async_client_drives_a_sharded_client_too() -> None:
    async def main(c: flightq.aio.AsyncClient) -> tuple[int, list[str]]:
        await c.create_partition("t", TEXT, tasks=["train"], group_size=4)
        keys = text_keys(2, 4)
        receipt = await c.put("t", keys, text_columns(keys))
        got = await c.claim("t", "train", 8, timeout=TIMEOUT)
        await c.close()
        return receipt, got.keys

    with flightq.Server() as a, flightq.Server() as b:
        s = flightq.connect_sharded([a.location, b.location], [TEXT], timeout=TIMEOUT)
        rows, keys = asyncio.run(main(flightq.aio.AsyncClient(s)))
    assert rows == 8 and sorted(keys) == sorted(text_keys(2, 4))


# --------------------------------------------------------------------------- malloc

_RETURNED = """
import sys
import numpy as np
import flightq
kwargs = {"keep_freed_memory": True} if sys.argv[1] == "opt-in" else {}
flightq.connect(sys.argv[2], **kwargs).close()
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) * 1024
np.empty(16 * 2**20, np.uint8)  # one block freed: glibc's own threshold rises to it
blocks = [np.ones(16 * 2**20, np.uint8) for _ in range(16)]  # what a get leaves
held = rss()
del blocks
print(held - rss())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")
def test_connect_leaves_the_processs_malloc_alone_unless_asked(server) -> None:
    def returned(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _RETURNED, mode, server.location],
            check=True,
            capture_output=True,
            text=True,
        )
        return int(out.stdout)

    assert returned("default") > 128 * 2**20  # freed memory goes back to the kernel
    assert returned("opt-in") < 32 * 2**20  # kept for the next step
