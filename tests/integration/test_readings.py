"""Rows an answer or a snapshot is reading stay counted in the memory budget while it is
under way, even where they are cleared, replaced or their partition dropped meanwhile: a
reader that stops reading cannot make the server hold what its budget no longer counts.

Real in-process servers on loopback; the paused readers are plain ``pyarrow.flight``
DoGets that read one record batch of a many-batch answer and stop.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TIMEOUT
from helpers_reliability import plain_error

import flightq
from flightq.protocol import ClaimTicket, GetTicket, ScanTicket
from flightq.registry import SchemaRegistry
from flightq.workloads import make

pytestmark = pytest.mark.timeout(120)

MIB = 2**20


def _until(check, seconds: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        if check():
            return True
        time.sleep(0.05)
    return False


class _Step:
    """W3's rows put ``copies`` times under keys of their own (more than gRPC takes into
    its buffers for a reader that stops: 10 MB a copy)."""

    def __init__(self, copies: int = 4) -> None:
        w3 = make("W3")
        self.schema = SchemaRegistry.default().get(w3.schema)
        self.columns, self.tags = w3.columns, w3.tags
        self.puts = [[f"{k}_{j}" for k in w3.keys] for j in range(copies)]
        self.keys = [k for keys in self.puts for k in keys]

    def put(self, c: flightq.Client, prefix: str = "", **kw: object) -> None:
        for keys in self.puts:
            c.put("p", [prefix + k for k in keys], self.columns, tags=self.tags, **kw)


@pytest.fixture
def served() -> Iterator[tuple[flightq.Server, flightq.Client, _Step]]:
    """A server with a 112 MiB budget (117 MB) answering in 1 MiB record batches, and
    partition 'p' of W3's schema holding W3's 512 rows four times over (about 42 MB)."""
    step = _Step()
    with (
        flightq.Server(memory_budget=112 * MIB, max_batch_bytes=MIB, shm=False) as srv,
        flightq.connect(srv.location, [step.schema], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", step.schema, tasks=["train"])
        step.put(c)
        yield srv, c, step


class _Paused:
    """A DoGet that has read its answer's first record batch and reads no more, until
    :meth:`cancel` (its client kept: a client let go would end the call)."""

    def __init__(self, location: str, ticket: bytes) -> None:
        self.client = fl.connect(location)
        self.reader = self.client.do_get(fl.Ticket(ticket))
        self.reader.read_chunk()

    def cancel(self) -> None:
        self.reader.cancel()
        self.client.close()


def _held(srv: flightq.Server) -> int:
    return srv.store.held()


@pytest.mark.parametrize("how", ["clear", "drop", "overwrite"])
def test_rows_let_go_under_a_paused_get_stay_counted_until_it_ends(served, how: str) -> None:
    srv, c, step = served
    full = _held(srv)
    assert full > 8 * MIB
    ticket = GetTicket(partition="p", keys=list(step.keys)).to_wire()
    reader = _Paused(srv.location, ticket)
    if how == "clear":
        c.clear("p", step.keys)
    elif how == "drop":
        c.drop("p")
    else:  # every row's fields written anew: the first puts' batches are no row's now
        step.put(c, overwrite=True)
    # What the paused answer keeps alive is still counted: the budget holds it all.
    assert _held(srv) >= full * (2 if how == "overwrite" else 1) * 0.95
    reader.cancel()
    want = full * 1.05 if how == "overwrite" else MIB
    assert _until(lambda: _held(srv) <= want), (_held(srv), full)


def test_a_put_waits_for_room_a_paused_scan_holds_and_is_stored_once_it_ends(served) -> None:
    srv, c, step = served
    full = _held(srv)  # about 42 MB
    reader = _Paused(srv.location, ScanTicket(partition="p").to_wire())
    c.clear("p", step.keys)
    step.put(c, "a")  # the scan's 42 MB and these 42 MB: 84 of the 117 MB
    with pytest.raises(flightq.ResourceExhaustedError):
        step.put(c, "b", timeout=0.5)  # 42 MB more: past the budget, with the scan's
    c.clear("p", [k for k in c.list_keys("p") if k.startswith("b")])  # what came in goes
    reader.cancel()
    assert _until(lambda: _held(srv) < full * 1.1), (_held(srv), full)
    step.put(c, "b")  # the room the scan held came back
    assert c.inspect("p")["rows"] == 2 * len(step.keys)


def test_a_get_read_to_its_end_keeps_nothing_counted(served) -> None:
    srv, c, step = served
    ticket = GetTicket(partition="p", keys=list(step.keys)).to_wire()
    table = fl.connect(srv.location).do_get(fl.Ticket(ticket)).read_all()
    assert table.num_rows == len(step.keys)
    small = c.get("p", step.keys[:4], as_="numpy")  # answered on the request stream

    assert small.keys == list(step.keys[:4])
    c.clear("p", step.keys)
    assert _until(lambda: _held(srv) <= MIB and srv.store.reading_count() == 0)


def test_rows_cleared_under_a_paused_claim_stay_counted_until_it_ends(served) -> None:
    srv, c, step = served
    full = _held(srv)
    ticket = ClaimTicket(partition="p", task="train", batch_size=len(step.keys), timeout=5.0)
    reader = _Paused(srv.location, ticket.to_wire())
    c.clear("p", step.keys)
    assert _held(srv) >= full * 0.95
    reader.cancel()
    assert _until(lambda: _held(srv) <= MIB and srv.store.reading_count() == 0), _held(srv)


def test_rows_cleared_while_a_snapshot_is_written_stay_counted_until_it_is(served) -> None:
    srv, _, step = served
    store = srv.store
    full = _held(srv)
    reading: list = []
    parts = store.capture(["p"], reading)
    assert [len(p.rows) for p in parts] == [len(step.keys)] and len(reading) == 1
    store.clear("p", step.keys)
    assert _held(srv) >= full * 0.95  # the captured rows, not yet written
    for rd in reading:
        store.end_reading(rd)
    assert _held(srv) <= MIB and store.reading_count() == 0


def test_media_buffers_under_a_paused_get_stay_counted_until_it_ends() -> None:
    step = make("W1")  # 8 images of 3.4 MB: more than gRPC takes in for a reader that stops
    schema = SchemaRegistry.default().get(step.schema)
    with (
        flightq.Server(memory_budget=256 * MIB, max_batch_bytes=MIB, shm=False) as srv,
        flightq.connect(srv.location, [schema], timeout=TIMEOUT) as c,
    ):
        c.create_partition("v", schema, tasks=["train"])
        c.put("v", step.keys, step.columns, tags=step.tags)
        full = _held(srv)
        ticket = GetTicket(partition="v", keys=list(step.keys)).to_wire()
        reader = _Paused(srv.location, ticket)
        c.clear("v", step.keys)
        assert c.stats()["partitions"]["v"]["held"] < MIB  # the partition let go
        assert _held(srv) >= full * 0.95  # and the server still counts it
        reader.cancel()
        assert _until(lambda: _held(srv) <= MIB), _held(srv)


def test_a_paused_get_of_plain_flight_is_refused_nothing_once_its_rows_go(served) -> None:
    # The answer it started is whole: what it reads after the clear is what it asked for.
    srv, c, step = served
    ticket = GetTicket(partition="p", keys=list(step.keys)).to_wire()
    reader = fl.connect(srv.location).do_get(fl.Ticket(ticket))
    first = reader.read_chunk().data
    c.clear("p", step.keys)
    rest = reader.read_all()
    keys = first.column("__key__").to_pylist() + rest.column("__key__").to_pylist()
    assert keys == list(step.keys)
    assert _until(lambda: _held(srv) <= MIB)
    with pytest.raises(fl.FlightError) as info:
        fl.connect(srv.location).do_get(fl.Ticket(ticket)).read_all()
    assert plain_error(info.value)[0] == "NotFoundError"


@pytest.mark.parametrize("how", ["overwrite", "compaction"])
def test_small_rows_replaced_under_a_reading_keep_their_own_bytes_counted(how: str) -> None:
    # Rows of 8 tokens: most of what they hold is their own (key, tags, objects), which a
    # replaced row keeps alive as long as an answer reads it.
    n = 8192
    schema = SchemaRegistry.default().get("rollout_text@1")
    keys = [f"g{i // 16}_{i % 16}" for i in range(n)]
    ids = np.arange(8 * n, dtype=np.int64).reshape(n, 8)
    cols = {"input_ids": list(ids)}
    tags = [{"weight_version": 0, "prompt_idx": i // 16} for i in range(n)]
    with (
        flightq.Server(memory_budget=1024 * MIB, shm=False) as srv,
        flightq.connect(srv.location, [schema], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", schema, tasks=["train"])
        c.put("p", keys, cols, tags=tags)
        store = srv.store
        full = store.held()
        reading: list = []
        store.scan("p", reading)
        if how == "overwrite":
            c.put("p", keys, cols, tags=[dict(t) for t in tags], overwrite=True)
            assert store.held() >= 2 * full * 0.95  # the old rows and the new ones
        else:  # 60% of each batch cleared: the rest copied out into rows of their own
            first = [k for i, k in enumerate(keys) if i % 5 < 3]
            store.clear("p", first)
            store.clear("p", [k for i, k in enumerate(keys) if i % 5 >= 3])
            assert store.held() >= full * 0.95
        for rd in reading:
            store.end_reading(rd)
        assert store.held() <= (full * 1.05 if how == "overwrite" else MIB)
