"""Direct reads: a put through shared memory whose payloads the server reads straight out
of the writer's memory (``flightq.shm.direct``), and every way to abuse that.

Real servers on loopback (in this process, and one in its own process), real segments in
a private directory under /dev/shm, real ``process_vm_readv``. The hostile parties speak
plain ``pyarrow.flight``: a put naming another process, memory its writer does not map,
ranges that lie about the segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TIMEOUT, assert_rows_match, cli_server, python_env
from helpers_reliability import plain_error, plain_shm_put
from helpers_stall import direct_segment

import flightq
from flightq import shm, workloads
from flightq.protocol import MAX_FILLS, Health
from flightq.shm import direct

HELPERS = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="direct reads use Linux's process_vm_readv"
    ),
]


@pytest.fixture(name="server")
def server_fixture(shm_dir: str) -> Iterator[flightq.Server]:
    with flightq.Server(shm=shm_dir) as srv:
        yield srv
    gc.collect()


def _counters(location: str) -> dict[str, Any]:
    with flightq.connect(location, timeout=TIMEOUT) as c:
        return c.stats()["counters"]


def _rows(location: str) -> int:
    with flightq.connect(location, timeout=TIMEOUT) as c:
        return c.stats()["partitions"].get("p", {}).get("rows", 0)


# --------------------------------------------------------------------------- the path


def test_a_put_through_shared_memory_is_read_out_of_the_writers_memory_once():
    # A server of its own process: the payload bytes come from the writer's memory (the
    # server's counter), nothing of them through the writer's segment, and the rows read
    # back, over shared memory and the socket, are the step's.
    step = workloads.w2(groups=1)
    with (
        cli_server() as (location, _),
        flightq.connect(location, [step.schema], timeout=TIMEOUT, shm=True) as c,
    ):
        assert c.shm_direct == (None, "")
        c.create_partition("p", step.schema, tasks=["t"])
        assert c.put("p", step.keys, step.columns, tags=step.tags).route == "shm"
        assert c.shm_direct == (True, "")
        got = c.get("p", step.keys, as_="numpy")
        assert_rows_match(got, step)
        with flightq.connect(location, timeout=TIMEOUT) as plain:
            assert_rows_match(plain.get("p", step.keys, as_="numpy"), step)
        # Every pixel crossed from the writer's memory (large columns are read there;
        # the few bytes of small ones travel in the segment).
        pixels = sum(x.nbytes for row in step.columns["pixel_values"] for x in row)
        assert _counters(location)["shm_direct_bytes"] >= pixels


def test_the_bytes_stored_are_those_a_copy_would_store(server, shm_dir):
    # The same step put both ways: direct, then copied (the client told the server
    # refused), read back equal; only the first counts as read from the writer.
    step = workloads.w1(groups=2, g=4)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c:
        c.create_partition("a", step.schema, tasks=["t"])
        c.create_partition("b", step.schema, tasks=["t"])
        c.put("a", step.keys, step.columns, tags=step.tags)
        after_direct = _counters(server.location)["shm_direct_bytes"]
        assert after_direct > 0
        c._segments.direct = False  # as if the probe had said no
        c.put("b", step.keys, step.columns, tags=step.tags)
        assert _counters(server.location)["shm_direct_bytes"] == after_direct
        a, b = c.get("a", step.keys, as_="numpy"), c.get("b", step.keys, as_="numpy")
        assert_rows_match(a, step)
        assert_rows_match(b, step)


def test_a_refused_direct_put_is_copied_and_sent_again(server, shm_dir):
    # While reads are stuck the server reads no writer's memory: the client's direct put is
    # refused, the client copies the payloads into its segment, sends it again, and asks
    # again at its next put (which the server then also refuses to read directly).
    step = workloads.w1(groups=1, g=4)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c:
        c.create_partition("p", step.schema, tasks=["t"])
        c.put("p", step.keys[:2], {k: v[:2] for k, v in step.columns.items()}, tags=step.tags[:2])
        assert c.shm_direct == (True, "")
        before = _counters(server.location)
        saved = direct._stuck
        direct._stuck = direct.MAX_STUCK
        try:
            c.put(
                "p", step.keys[2:], {k: v[2:] for k, v in step.columns.items()}, tags=step.tags[2:]
            )
            assert c.shm_direct == (None, "")  # ask again next time
            refused = _counters(server.location)["refusals"].get("ProtocolError", 0)
            assert refused == before["refusals"].get("ProtocolError", 0) + 1
            c.drop("p")
            c.create_partition("p", step.schema, tasks=["t"])
            c.put("p", step.keys, step.columns, tags=step.tags)
            direct_on, why = c.shm_direct
            assert direct_on is False and "stuck" in why
        finally:
            direct._stuck = saved
        assert_rows_match(c.get("p", step.keys, as_="numpy"), step)


def test_a_probe_naming_the_wrong_address_or_process_gets_no_direct_reads(server, shm_dir):
    kept = np.frombuffer(os.urandom(32), dtype=np.uint8).copy()
    name = os.path.join(shm_dir, f"flightq-{os.getpid()}-0badf00d-9")
    with open(name, "wb") as f:
        f.write(kept.tobytes())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        client = fl.connect(server.location)
        try:

            def ask(reader: list[int]) -> dict[str, Any]:
                body = Health(shm_probe=name, shm_reader=reader).to_wire()
                (res,) = list(client.do_action(fl.Action("health", body)))
                return msgpack.unpackb(res.body.to_pybytes())["shm"]

            good = ask([os.getpid(), kept.ctypes.data])
            assert good["direct"] is True, good
            wrong = ask([os.getpid(), kept.ctypes.data + 1])
            assert wrong["direct"] is False and "does not hold the token" in wrong["direct_why"]
            elsewhere = ask([other.pid, kept.ctypes.data])
            assert elsewhere["direct"] is False
            assert "does not hold the connection" in elsewhere["direct_why"]
        finally:
            client.close()
    finally:
        other.kill()
        other.wait()


# --------------------------------------------------------------------------- hostile puts


@contextlib.contextmanager
def _hostile(location: str, shm_dir: str, step: workloads.Step) -> Iterator[tuple[dict, bytes]]:
    """Partition 'p' for ``step``, and a writer's segment of it with the fills that name its
    payloads in this process (:func:`helpers_stall.direct_segment`); the segment's pool is
    closed on exit."""
    with flightq.connect(location, [step.schema], timeout=TIMEOUT) as c:
        c.create_partition("p", step.schema, tasks=["t"])
    pool, ref, fills = direct_segment(shm_dir, step)
    try:
        yield ref, fills
    finally:
        pool.close()


def test_a_put_naming_another_process_is_refused_and_nothing_is_stored(server, shm_dir):
    # The server reads only the memory of the process holding the put's connection: a
    # plain client naming a process that holds none (its own child here) is refused.
    step = workloads.w1(groups=1, g=2)
    with _hostile(server.location, shm_dir, step) as (ref, fills):
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(fl.FlightError, match="does not hold the connection"):
                plain_shm_put(server.location, {**ref, "pid": other.pid, "fills": fills}, rows=2)
            assert _rows(server.location) == 0
            plain_shm_put(server.location, {**ref, "pid": os.getpid(), "fills": fills}, rows=2)
            assert _rows(server.location) == 2
        finally:
            other.kill()
            other.wait()


def test_fills_the_writer_does_not_map_are_refused_and_nothing_is_stored(server, shm_dir):
    step = workloads.w1(groups=1, g=2)
    with _hostile(server.location, shm_dir, step) as (ref, fills):
        f = np.frombuffer(fills, dtype="<i8").reshape(-1, 3).copy()
        f[-1, 1] = 4096  # the first page is never mapped
        with pytest.raises(fl.FlightError, match="Bad address"):
            plain_shm_put(
                server.location, {**ref, "pid": os.getpid(), "fills": f.tobytes()}, rows=2
            )
        assert _rows(server.location) == 0
        assert direct.stuck() == 0
        plain_shm_put(server.location, {**ref, "pid": os.getpid(), "fills": fills}, rows=2)
        assert _rows(server.location) == 2


def test_a_failed_direct_read_leaves_no_reference_cycle_behind():
    # Its error, kept in a list that its own traceback's frames held, made a cycle that
    # kept the read's frames (and the segment's let-go) until a cyclic collection, which
    # `flightq serve` makes rare.
    fills = np.array([[0, 4096, 64]], dtype=np.int64)  # the first page is never mapped
    busy = direct._pool_busy
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        wait = direct.read_fills(os.getpid(), fills, np.zeros(64, np.uint8), "test", lambda: None)
        with pytest.raises(flightq.ProtocolError, match="Bad address"):
            wait()
        del wait
        deadline = time.monotonic() + TIMEOUT  # its threads back in the pool, holding nothing
        while direct._pool_busy > busy and time.monotonic() < deadline:
            time.sleep(0.01)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, flightq.ProtocolError)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if collecting:
            gc.enable()
    assert cyclic == []


def _lie(fills: bytes, how: str, nbytes: int) -> bytes:
    f = np.frombuffer(fills, dtype="<i8").reshape(-1, 3).copy()
    if how == "not triples":
        return fills[:-8]
    if how == "empty range":
        f[0, 2] = 0
    elif how == "past the segment":
        f[-1, 2] = nbytes
    elif how == "overlapping":
        f[1, 0] = f[0, 0]
    elif how == "out of order":
        f = f[::-1].copy()
    elif how == "negative offset":
        f[0, 0] = -64
    elif how == "length that wraps":
        f[0, 0], f[0, 2] = 1, 2**63 - 1  # offset + length passes int64
    elif how == "address that wraps":
        f[0, 1] = 2**63 - 8
    elif how == "too many":
        f = np.tile(f[:1], (MAX_FILLS + 1, 1))
    return f.tobytes()


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("not triples", "whole"),
        ("empty range", "non-empty, in order, apart"),
        ("past the segment", "inside the segment"),
        ("overlapping", "apart"),
        ("out of order", "in order"),
        ("negative offset", "inside the segment"),
        ("length that wraps", "inside the segment"),
        ("address that wraps", "end of the address space"),
        ("too many", "at most"),
    ],
)
def test_fills_that_lie_about_the_segment_are_refused(server, shm_dir, how, problem):
    step = workloads.w2(groups=1)  # several images: several fills
    with _hostile(server.location, shm_dir, step) as (ref, fills):
        assert len(fills) >= 48
        bad = _lie(fills, how, ref["nbytes"])
        with pytest.raises(fl.FlightError, match=problem):
            plain_shm_put(server.location, {**ref, "pid": os.getpid(), "fills": bad}, rows=8)
        assert _rows(server.location) == 0
        with pytest.raises(fl.FlightError, match="without the writer's pid"):
            plain_shm_put(server.location, {**ref, "fills": fills}, rows=8)
        plain_shm_put(server.location, {**ref, "pid": os.getpid(), "fills": fills}, rows=8)
        assert _rows(server.location) == 8


# --------------------------------------------------------------------------- budget


def test_the_segment_a_put_is_copied_into_is_counted_before_the_copy(shm_dir):
    # The server counts the segment it copies a shared-memory put into before it takes
    # one: a put that the budget has no room for is refused before any byte is read, and
    # a stored put counts the whole file its rows lie in.
    step = workloads.w1(groups=1, g=2)
    with (
        flightq.Server(shm=shm_dir) as srv,
        flightq.connect(srv.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c,
    ):
        c.create_partition("p", step.schema, tasks=["t"])
        assert c.put("p", step.keys, step.columns, tags=step.tags).route == "shm"
        assert c.shm_direct == (True, "")
        pool = shm.STORES.hold(shm_dir)
        try:
            (seg,) = pool.segments()
            one = srv.store.held()
            assert one >= shm.HEADER + seg.capacity  # the whole file, not the stream alone
        finally:
            shm.STORES.let_go(shm_dir, pool)
        read = _counters(srv.location)["shm_direct_bytes"]
        assert read > 0
        srv.store.memory_budget = one + one // 2  # room for half a put more
        with pytest.raises(flightq.ResourceExhaustedError, match="no space was cleared") as e:
            c.put("p", [f"{k}+" for k in step.keys], step.columns, tags=step.tags, timeout=0.3)
        assert e.value.retry == "full"  # a consumer's clear makes room
        srv.store.memory_budget = one // 2  # not even one put
        with pytest.raises(flightq.ResourceExhaustedError, match="whole memory budget") as e:
            c.put("p", [f"{k}-" for k in step.keys], step.columns, tags=step.tags, timeout=0.3)
        assert e.value.retry is None  # no wait lifts it
        assert _counters(srv.location)["shm_direct_bytes"] == read  # nothing was read
        assert srv.store.held() == one and _rows(srv.location) == step.rows
        srv.store.memory_budget = srv.store.counted() + one  # room for one put more
        c.put("p", [f"{k}+" for k in step.keys], step.columns, tags=step.tags)
        assert _rows(srv.location) == 2 * step.rows


def test_a_plain_client_put_past_the_budget_takes_no_segment(shm_dir):
    # The same refusal for a put a plain pyarrow.flight client names: no segment is
    # taken, nothing is stored, nothing stays counted.
    step = workloads.w1(groups=1, g=2)
    writer, ref, _ = direct_segment(shm_dir, step)
    try:
        with flightq.Server(shm=shm_dir, memory_budget=2**20) as srv:
            with flightq.connect(srv.location, [step.schema], timeout=TIMEOUT) as c:
                c.create_partition("p", step.schema, tasks=["t"])
            with pytest.raises(fl.FlightError) as info:
                plain_shm_put(srv.location, ref, rows=step.rows)
            kind, message = plain_error(info.value)
            assert kind == "ResourceExhaustedError" and "whole memory budget" in message
            assert _rows(srv.location) == 0 and srv.store.held() == 0
            pool = shm.STORES.hold(shm_dir)
            try:
                assert pool.segments() == []
            finally:
                shm.STORES.let_go(shm_dir, pool)
    finally:
        writer.close()


@pytest.mark.parametrize("why", ["whole", "timeout"])
def test_a_put_refused_while_its_rows_are_counted_leaves_nothing_counted(shm_dir, why):
    # Ten thousand one-token rows count more (their fixed cost per row) than the segment
    # counted before the copy: the rest waits for room, and is refused (more than the
    # whole budget; no room within the put's timeout). Nothing stays counted after.
    budget = (8 if why == "whole" else 32) * 2**20
    with (
        flightq.Server(shm=shm_dir, memory_budget=budget) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as sock,
        flightq.connect(srv.location, timeout=TIMEOUT, shm=shm_dir) as c,
    ):
        c.shm_min_bytes = 0
        c.create_partition("p", "rollout_text@1", tasks=["t"])
        if why == "timeout":  # most of the budget taken by rows put over the socket
            sock.create_partition("fill", "rollout_text@1", tasks=["t"])
            sock.put("fill", [f"f{i}" for i in range(20)], {"input_ids": [np.arange(2**17)] * 20})
        before = srv.store.held()
        n = 10_000
        for _ in range(3):
            with pytest.raises(flightq.ResourceExhaustedError):
                c.put(
                    "p", [f"k{i}" for i in range(n)], {"input_ids": [np.arange(1)] * n}, timeout=0.3
                )
            gc.collect()
            assert srv.store.held() == before
        assert c.put("p", ["one"], {"input_ids": [np.arange(1)]}) == 1


def test_a_put_whose_images_the_partition_holds_keeps_no_segment_alive(shm_dir):
    # The same group's rows put again under new keys (a generator streaming its rows):
    # the images are stored once, and each later put's rows are copied out of its
    # segment, which goes with the put instead of keeping a second copy of the images.
    step = workloads.w1(groups=1, g=8)
    with (
        flightq.Server(shm=shm_dir, memory_budget=2**30) as srv,
        flightq.connect(srv.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c,
    ):
        c.shm_min_bytes = 0
        c.create_partition("p", step.schema, tasks=["t"])
        steps = [dataclasses.replace(step, keys=[f"{k}#{i}" for k in step.keys]) for i in range(4)]
        held = []
        for s in steps:
            assert c.put("p", s.keys, s.columns, tags=s.tags).route == "shm"
            gc.collect()
            held.append(srv.store.held())
        pool = shm.STORES.hold(shm_dir)
        try:
            files = [shm.HEADER + seg.capacity for seg in pool.segments()]
        finally:
            shm.STORES.let_go(shm_dir, pool)
        # The first put's segment (the images' home) and one freed, kept warm for reuse.
        assert len(files) == 2, files
        assert held[0] >= max(files)  # the whole file the images lie in is counted
        assert held[-1] - held[0] < held[0] / 2, held  # later puts: their rows alone
        for s in steps:
            assert_rows_match(c.get("p", s.keys, as_="numpy"), s)


# --------------------------------------------------------------------------- stalls


@contextlib.contextmanager
def _stalling(location: str, shm_dir: str, mode: str = "put") -> Iterator[dict[str, Any]]:
    """A writer process whose memory stalls every read (helpers_stall.py); yields what it
    said, kills it on exit and waits for every read of it to return."""
    writer = subprocess.Popen(
        [sys.executable, str(HELPERS / "helpers_stall.py"), location, shm_dir, mode],
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    try:
        assert writer.stdout is not None
        said = json.loads(writer.stdout.readline())
        if "skip" in said:
            pytest.skip(f"no memory that stalls its readers here: {said['skip']}")
        yield said
    finally:
        writer.kill()
        writer.wait()
        deadline = time.monotonic() + TIMEOUT
        while direct.stuck() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert direct.stuck() == 0


def test_a_writer_whose_memory_stalls_the_read_cannot_freeze_the_server(
    server, shm_dir, monkeypatch
):
    # The writer's image lies in memory no one serves (userfaultfd): the server's read of
    # it waits. The server gives the read up after its deadline (shortened here), refuses
    # the put, keeps serving everyone and offers no direct reads while too many are stuck.
    # The read's segment is set aside: a put copied meanwhile (its segment pool told to
    # reuse anything at once) does not land in it, so when the writer goes and the read
    # returns (zero pages), it writes into nothing anyone stored.
    monkeypatch.setattr(direct, "deadline", lambda nbytes: 0.5)
    monkeypatch.setattr(direct, "MAX_STUCK", 1)
    step = workloads.w1(groups=1, g=4)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c:
        c.create_partition("p", step.schema, tasks=["t"])
        c.create_partition("q", step.schema, tasks=["t"])
        c.put("q", step.keys, step.columns, tags=step.tags)  # the server's pool exists
        pool = shm.STORES.hold(shm_dir)
        monkeypatch.setattr(pool, "lease_s", 0.0)
        shm.STORES.let_go(shm_dir, pool)
        c.drop("q")
        assert c.stats()["held"] == 0
        with _stalling(server.location, shm_dir) as said:
            assert "took over 0.5 s" in said["refused"], said
            assert "nothing is stored" in said["refused"]
            assert direct.stuck() == 1
            # The stuck read's segment stays counted against the budget: nothing stored.
            stuck_held = c.stats()["held"]
            assert stuck_held >= said["nbytes"]
            # Refused (field "fills": the client copies), then turned down at the probe.
            c.put("p", step.keys, step.columns, tags=step.tags)
            assert c.shm_direct == (None, "")
            c.create_partition("r", step.schema, tasks=["t"])
            c.put("r", step.keys, step.columns, tags=step.tags)
            direct_on, why = c.shm_direct
            assert direct_on is False and "stuck" in why
            assert_rows_match(c.get("p", step.keys, as_="numpy"), step)
        assert_rows_match(c.get("p", step.keys, as_="numpy"), step)
        assert c.stats()["partitions"]["p"]["rows"] == 4  # the writer's put stored nothing
        # The read returned: its segment counts no more.
        c.drop("p")
        c.drop("r")
        assert c.stats()["held"] == 0


def test_a_probe_whose_token_stalls_is_answered_in_time_without_direct_reads(server, shm_dir):
    with _stalling(server.location, shm_dir, "probe") as said:
        assert said["s"] < TIMEOUT / 2
        assert said["shm"]["direct"] is False and "took over" in said["shm"]["direct_why"]
        assert direct.stuck() == 1
        with flightq.connect(server.location, timeout=TIMEOUT) as c:
            assert c.stats()["partitions"] == {}  # served meanwhile


def test_direct_reads_past_those_in_flight_are_refused_and_copied(server, shm_dir, monkeypatch):
    # One read in flight at most here, and it is stuck: the next direct put waits a second
    # for it, is refused, and the client copies the payloads and sends the put again.
    monkeypatch.setattr(direct, "deadline", lambda nbytes: 0.5)
    monkeypatch.setattr(direct, "MAX_STUCK", 10)
    monkeypatch.setattr(direct, "_slots", threading.BoundedSemaphore(1))
    step = workloads.w1(groups=1, g=4)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c:
        c.create_partition("p", step.schema, tasks=["t"])
        c.create_partition("q", step.schema, tasks=["t"])
        c.put("q", step.keys, step.columns, tags=step.tags)
        assert c.shm_direct == (True, "")
        with _stalling(server.location, shm_dir) as said:
            assert "took over" in said["refused"]
            before = _counters(server.location)["shm_direct_bytes"]
            c.put("p", step.keys, step.columns, tags=step.tags)
            assert c.shm_direct == (None, "")  # refused: asks again next put
            assert _counters(server.location)["shm_direct_bytes"] == before
        assert_rows_match(c.get("p", step.keys, as_="numpy"), step)


# --------------------------------------------------------------------------- whose socket

_HOLD = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.connect(("127.0.0.1", int(sys.argv[2])))
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_a_process_sharing_only_the_callers_address_and_port_does_not_pass():
    # A victim's socket bound to the same local address and port as the caller's
    # connection (SO_REUSEADDR), but connected to another service, is not the caller's
    # connection: only the process whose socket runs from the caller's end to this
    # process's end passes.
    service, ours = socket.socket(), socket.socket()
    for s in (service, ours):
        s.bind(("127.0.0.1", 0))
        s.listen()
    procs: list[subprocess.Popen[str]] = []
    try:

        def hold(port: int, to: socket.socket) -> tuple[subprocess.Popen[str], int]:
            p = subprocess.Popen(
                [sys.executable, "-c", _HOLD, str(port), str(to.getsockname()[1])],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            assert p.stdout is not None
            return p, int(p.stdout.readline())

        # Not accepted: the other service's end stays in its queue, no socket of ours.
        victim, port = hold(0, service)
        caller, same = hold(port, ours)
        assert same == port
        conn, addr = ours.accept()
        peer = f"ipv4:127.0.0.1:{addr[1]}"
        direct.owner_check(peer, caller.pid, "test")
        with pytest.raises(flightq.ProtocolError, match="does not hold the connection"):
            direct.owner_check(peer, victim.pid, "test")
        conn.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        service.close()
        ours.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_segment_counts_whole_while_any_of_its_batches_rows_is_stored(
    shm_dir, direct, monkeypatch
):
    # One put through shared memory, cut into 4 record batches that the server copies
    # into one segment: the segment lives while a row of any of them does, so clearing
    # the first batch's rows leaves it counted whole; clearing them all frees it.
    monkeypatch.setattr(shm, "PUT_BATCH_BYTES", 2 << 20)  # a put's batches through shm
    keys = [f"k{i}" for i in range(40)]
    rows = {"input_ids": [np.full(25_000, i, np.int64) for i in range(40)]}  # 200 KB each
    with (
        flightq.Server(shm=shm_dir, memory_budget=2**30) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT, shm=shm_dir, max_batch_bytes=2 << 20) as c,
    ):
        c.shm_min_bytes = 0
        c.shm_direct = direct
        c.create_partition("p", "rollout_text@1", tasks=["t"])
        assert c.put("p", keys, rows).route == "shm"
        gc.collect()
        whole = srv.store.held()
        assert whole >= 40 * 200_000
        batches = c.get("p", keys, as_="numpy").received.record_batches  # answered as stored
        assert batches >= 4, batches
        assert c.clear("p", keys[:20]) == 20  # the first batches' rows, whole
        # Their rows' own bytes go; the batches lie in the segment, which stays counted.
        assert whole - srv.store.held() < 20 * 2_000
        assert c.get("p", keys[-1:], as_="numpy")["input_ids"][0][0] == 39
        assert c.clear("p") == 20
        assert srv.store.held() == 0
