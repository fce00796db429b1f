"""flightq put + get round trip over a real loopback server (``flightq.Server`` on port 0).

The server runs in this process (a thread), so client and server share the GIL: the
cross-process figures are ``flightq bench``'s. Each round trip puts a workload, gets it
back by key, rebuilds every field's tensors and clears; the rows are checked bit for bit.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
from flightq_bench.payload import check_rows
from helpers_bench import make_step, record_throughput

from flightq.workloads import to_torch

_HAVE_SERVER = all(
    importlib.util.find_spec(m) is not None
    for m in ("flightq.server.flight", "flightq.client.client")
)
pytestmark = pytest.mark.skipif(
    not _HAVE_SERVER, reason="flightq.Server / flightq.connect not available in this checkout yet"
)

WORKLOADS = ["W1", "W1-bf16", "W2", "W3", "W4"]
SCHEMAS = ["rollout_vlm@1", "rollout_vlm_bf16@1", "rollout_text@1"]


@pytest.fixture(scope="module")
def location() -> Iterator[str]:
    import flightq

    with flightq.Server(location="grpc://127.0.0.1:0") as srv:
        yield srv.location


@pytest.fixture(scope="module")
def client(location: str) -> Iterator[Any]:
    import flightq

    c = flightq.connect(location, schemas=SCHEMAS)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("name", WORKLOADS)
def test_put_get_roundtrip(benchmark: Any, reduced: bool, client: Any, name: str) -> None:
    step = make_step(name, reduced)
    rows = to_torch(step)
    part = f"bench-{name}"
    client.create_partition(part, schema=step.schema, tasks=["train"], group_size=step.group_size)

    def roundtrip() -> tuple[Any, dict[str, Any]]:
        client.put(part, rows.keys, rows.columns, tags=rows.tags)
        batch = client.get(part, rows.keys)
        cols = {f: batch[f] for f in batch.fields}
        client.clear(part)
        return batch, cols

    try:
        batch, cols = benchmark(roundtrip)
    finally:
        client.drop(part)
    check_rows(step, batch.keys, cols, batch.tags, f"flightq {name}")
    record_throughput(benchmark, step.nbytes())
