"""Direct reads: a put through shared memory whose payloads the server reads straight out
of the writer's memory (``flightq.shm.direct``), and every way to abuse that.

Real servers on loopback (in this process, and one in its own process), real segments in
a private directory under /dev/shm, real ``process_vm_readv``. The hostile parties speak
plain ``pyarrow.flight``: a put naming another process, memory its writer does not map,
ranges that lie about the segment.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TIMEOUT, assert_rows_match, cli_server, python_env
from helpers_reliability import plain_shm_put
from helpers_stall import direct_segment

import flightq
from flightq import workloads
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


def test_a_put_naming_another_process_is_refused_and_nothing_is_stored(server, shm_dir):
    # The server reads only the memory of the process holding the put's connection: a
    # plain client naming a process that holds none (its own child here) is refused.
    step = workloads.w1(groups=1, g=2)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT) as c:
        c.create_partition("p", step.schema, tasks=["t"])
    pool, ref, fills = direct_segment(shm_dir, step)
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
        pool.close()


def test_fills_the_writer_does_not_map_are_refused_and_nothing_is_stored(server, shm_dir):
    step = workloads.w1(groups=1, g=2)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT) as c:
        c.create_partition("p", step.schema, tasks=["t"])
    pool, ref, fills = direct_segment(shm_dir, step)
    try:
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
    finally:
        pool.close()


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
        ("too many", "at most"),
    ],
)
def test_fills_that_lie_about_the_segment_are_refused(server, shm_dir, how, problem):
    step = workloads.w2(groups=1)  # several images: several fills
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT) as c:
        c.create_partition("p", step.schema, tasks=["t"])
    pool, ref, fills = direct_segment(shm_dir, step)
    try:
        assert len(fills) >= 48
        bad = _lie(fills, how, ref["nbytes"])
        with pytest.raises(fl.FlightError, match=problem):
            plain_shm_put(server.location, {**ref, "pid": os.getpid(), "fills": bad}, rows=8)
        assert _rows(server.location) == 0
        with pytest.raises(fl.FlightError, match="without the writer's pid"):
            plain_shm_put(server.location, {**ref, "fills": fills}, rows=8)
        plain_shm_put(server.location, {**ref, "pid": os.getpid(), "fills": fills}, rows=8)
        assert _rows(server.location) == 8
    finally:
        pool.close()


# --------------------------------------------------------------------------- stalls


def test_a_writer_whose_memory_stalls_the_read_cannot_freeze_the_server(
    server, shm_dir, monkeypatch
):
    # The writer's image lies in memory no one serves (userfaultfd): the server's read of
    # it waits. The server gives the read up after its deadline (shortened here), refuses
    # the put, keeps serving everyone, offers no direct reads while too many are stuck,
    # and lets the read's segment go once the writer is gone and the read returns.
    monkeypatch.setattr(direct, "deadline", lambda nbytes: 0.5)
    monkeypatch.setattr(direct, "MAX_STUCK", 1)
    step = workloads.w1(groups=1, g=4)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c:
        c.create_partition("p", step.schema, tasks=["t"])
        writer = subprocess.Popen(
            [sys.executable, str(HELPERS / "helpers_stall.py"), server.location, shm_dir],
            stdout=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        try:
            assert writer.stdout is not None
            said = json.loads(writer.stdout.readline())
            if "skip" in said:
                pytest.skip(f"no memory that stalls its readers here: {said['skip']}")
            assert "took over 0.5 s" in said["refused"] and "nothing is stored" in said["refused"]
            assert direct.stuck() == 1
            # Everyone else is served meanwhile; the next probe turns direct reads down.
            c.put("p", step.keys, step.columns, tags=step.tags)
            direct_on, why = c.shm_direct
            assert direct_on is False and "stuck" in why
            assert_rows_match(c.get("p", step.keys, as_="numpy"), step)
        finally:
            writer.kill()
            writer.wait()
        deadline = time.monotonic() + TIMEOUT
        while direct.stuck() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert direct.stuck() == 0
        assert c.stats()["partitions"]["p"]["rows"] == 4  # the writer's put stored nothing
