"""Shared memory that cannot be turned against anyone (``connect(..., shm=<dir>)``).

Real servers on loopback, real files in a private directory under /dev/shm. Each test
plays one hostile or careless party: a file named like a segment that is no regular file,
a consumer writing into a returned tensor, a writer shrinking or rewriting its segment
after the ack.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TIMEOUT, assert_rows_match
from helpers_budget import action
from helpers_reliability import plain_error, plain_shm_put
from helpers_waiting import stat_until

import flightq
from flightq import shm, workloads

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(name="server")
def server_fixture(shm_dir: str) -> Iterator[flightq.Server]:
    with flightq.Server(shm=shm_dir) as srv:
        yield srv
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            for name in c.stats()["partitions"]:
                c.drop(name)
    gc.collect()


@pytest.fixture(name="client")
def client_fixture(server: flightq.Server, shm_dir: str) -> Iterator[flightq.Client]:
    step = workloads.w2(groups=1)
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c:
        c.shm_min_bytes = 0
        yield c


def _name(n: int) -> str:
    return f"flightq-{os.getpid()}-0badf00d-{n}"


# --------------------------------------------------------------------------- opening


def _dead_pid() -> int:
    """The pid of a process that has ended (a dead owner of segments)."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(dead.stdout)


def test_a_fifo_a_symlink_and_a_directory_named_like_a_segment_are_refused_at_once(shm_dir):
    fifo, link, folder = (os.path.join(shm_dir, _name(i)) for i in (1, 2, 3))
    os.mkfifo(fifo, 0o600)
    target = os.path.join(shm_dir, "elsewhere")
    with open(target, "wb") as f:
        f.write(b"\0" * 8192)
    os.symlink(target, link)
    os.mkdir(folder)
    refusals = {
        fifo: r"ProtocolError: .* is not a regular file \(mode p",
        link: r"ProtocolError: .* is a symlink, not a regular file",
        folder: r"ProtocolError: .* is not a regular file \(mode d",
    }
    server = flightq.Server(shm=shm_dir).start()
    try:
        with flightq.connect(server.location, timeout=TIMEOUT) as c:
            c.create_partition("p", workloads.w2(groups=1).schema)
            for path, message in refusals.items():
                t0 = time.monotonic()
                with pytest.raises(fl.FlightServerError, match=message):
                    plain_shm_put(server.location, {"path": path, "gen": 1, "nbytes": 10})
                assert time.monotonic() - t0 < 5.0, path
            assert c.health()["ok"]  # the server keeps serving
        # The handshake's probe gets no echo from a FIFO, and at once.
        t0 = time.monotonic()
        assert shm.probe_reply(shm_dir, {"shm_probe": fifo}) == {"dir": shm_dir, "probe": None}
        assert time.monotonic() - t0 < 5.0
    finally:
        assert server.stop(deadline=5.0) is True  # no thread is stuck in an open
    # The sweep of dead owners' segments opens nothing and leaves these alone.
    dead_fifo = os.path.join(shm_dir, f"flightq-{_dead_pid()}-0badf00d-1")
    os.mkfifo(dead_fifo, 0o600)
    shm.SegmentPool(shm_dir).close()
    assert os.path.exists(dead_fifo) and os.path.exists(fifo)


#: inotify's event for a file opened (linux/inotify.h).
_IN_OPEN = 0x20
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, len bytes


@contextlib.contextmanager
def _opened(directory: str) -> Iterator[Callable[[], set[str]]]:
    """A function giving the names of ``directory``'s entries that any process opened
    since the last call, as the kernel reports them (inotify)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        pytest.skip(f"inotify: {os.strerror(ctypes.get_errno())}")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_OPEN) < 0:
            pytest.skip(f"inotify: {os.strerror(ctypes.get_errno())}")

        def names() -> set[str]:
            out: set[str] = set()
            while True:
                try:
                    raw = os.read(fd, 1 << 16)
                except BlockingIOError:
                    return out - {""}  # "": the directory itself (a sweep lists it)
                at = 0
                while at < len(raw):
                    *_, n = _EVENT.unpack_from(raw, at)
                    at += _EVENT.size
                    out.add(os.fsdecode(raw[at : at + n].rstrip(b"\0")))
                    at += n

        yield names
    finally:
        os.close(fd)


def test_a_fifo_or_a_directory_named_like_a_segment_is_refused_without_being_opened(
    server, shm_dir
):
    # Opening a special file can act (a FIFO's writer waiting in open() is let through; a
    # terminal may become the opener's): its kind is checked before it is opened.
    fifo, folder, probe = (os.path.join(shm_dir, _name(i)) for i in (1, 2, 3))
    os.mkfifo(fifo, 0o600)
    os.mkdir(folder)
    with open(probe, "wb") as f:
        f.write(b"token")
    with flightq.connect(server.location, timeout=TIMEOUT) as c:
        c.create_partition("p", "rollout_text@1")
    with _opened(shm_dir) as opened:
        for path, mode in ((fifo, "p"), (folder, "d")):
            with pytest.raises(fl.FlightServerError, match=rf"is not a regular file \(mode {mode}"):
                plain_shm_put(server.location, {"path": path, "gen": 1, "nbytes": 10})
            assert action(server.location, "health", {"shm_probe": path})["shm"]["probe"] is None
        # A regular file is opened (and echoed): the kernel reports opens here.
        echo = action(server.location, "health", {"shm_probe": probe})["shm"]["probe"]
        assert bytes.fromhex(echo) == b"token"
        assert opened() == {os.path.basename(probe)}


def test_a_name_like_a_segments_but_for_a_trailing_newline_is_no_segment(server, shm_dir):
    rb = flightq.encode(
        flightq.SchemaRegistry.default().get("rollout_text@1"), {"input_ids": [np.arange(4)]}, ["a"]
    )
    own = shm.SegmentPool(shm_dir)
    try:
        ref = own.write(rb.schema, [rb], "test")
        newline = {**ref, "path": ref["path"] + "\n"}
        os.link(ref["path"], newline["path"])  # the very same segment, under that name
        with flightq.connect(server.location, timeout=TIMEOUT) as c:
            c.create_partition("p", "rollout_text@1")
            with pytest.raises(fl.FlightServerError) as info:
                plain_shm_put(server.location, newline)
            assert plain_error(info.value) == (
                "ProtocolError",
                f"put to 'p': shared-memory segment {newline['path']!r} is not a flightq "
                f"segment in {shm_dir}",
            )
            health = action(server.location, "health", {"shm_probe": newline["path"]})
            assert health["shm"]["probe"] is None
            assert c.stats()["partitions"]["p"]["rows"] == 0
            plain_shm_put(server.location, ref)  # under its own name it is one
            assert c.stats()["partitions"]["p"]["rows"] == 1
    finally:
        own.close()
    # Nor does a sweep of dead owners' segments take such a file for one of theirs.
    stray = os.path.join(shm_dir, f"flightq-{_dead_pid()}-0badf00d-1\n")
    with open(stray, "wb") as f:
        f.write(b"not flightq's")
    shm.SegmentPool(shm_dir).close()
    assert os.path.exists(stray)


def test_a_nul_byte_in_a_segment_path_is_refused_typed_and_the_server_serves_on(server, shm_dir):
    # Python's path functions raise ValueError on a NUL: the client got the server's
    # traceback as an untyped ArrowInvalid.
    with flightq.connect(server.location, timeout=TIMEOUT) as c:
        c.create_partition("p", "rollout_text@1")
        for bad in (f"{shm_dir}\0/{_name(1)}", f"{shm_dir}/{_name(1)}\0"):
            with pytest.raises(fl.FlightServerError) as info:
                plain_shm_put(server.location, {"path": bad, "gen": 1, "nbytes": 10})
            assert plain_error(info.value) == (
                "ProtocolError",
                f"put to 'p': shared-memory segment {bad!r} is not a flightq segment in {shm_dir}",
            )
            # A probe of a path the server cannot read gets no echo.
            health = action(server.location, "health", {"shm_probe": bad})
            assert health["shm"]["dir"] == shm_dir and health["shm"]["probe"] is None
        assert c.health()["ok"]  # the server keeps serving


def test_a_segment_of_the_wrong_size_is_refused_typed(shm_dir):
    path = os.path.join(shm_dir, _name(9))
    with open(path, "wb") as f:
        f.write(b"\0" * 100)
    with pytest.raises(flightq.ProtocolError, match=r"holds 100 bytes, 4106 announced"):
        shm.map_data({"path": path, "gen": 1, "nbytes": 10}, shm_dir, "get")


# --------------------------------------------------------------------------- consumers

_SECOND_CONSUMER = """
import hashlib, sys, flightq, numpy as np
from flightq import workloads
step = workloads.w2(groups=1)
with flightq.connect(sys.argv[1], [step.schema], shm=sys.argv[2]) as c:
    c.shm_min_bytes = 0
    b = c.get("m", step.keys, as_="numpy")
    assert b.received.route == "shm", b.received
    row = next(r for r in b["pixel_values"] if r)
    print(hashlib.sha256(np.ascontiguousarray(row[0]).tobytes()).hexdigest())
"""


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _in_a_segment(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a flightq segment file."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi and len(parts) >= 6:
                return os.path.basename(parts[5]).startswith("flightq-")
    return False


def _first_tile(batch: flightq.Batch) -> np.ndarray:
    return next(r for r in batch["pixel_values"] if r)[0]


def _put_w2(client: flightq.Client) -> workloads.Step:
    step = workloads.w2(groups=1)
    client.create_partition("m", step.schema, group_size=step.group_size)
    assert client.put("m", step.keys, step.columns, tags=step.tags).route == "shm"
    return step


def _second_consumer(server: flightq.Server, shm_dir: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _SECOND_CONSUMER, server.location, shm_dir],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


def test_a_consumer_writing_into_a_returned_array_changes_only_its_own_pages(
    server, client, shm_dir
):
    step = _put_w2(client)
    batch = client.get("m", step.keys, as_="numpy")
    assert batch.received is not None and batch.received.route == "shm"
    tile = _first_tile(batch)
    original = _digest(tile)
    # numpy hands views out read-only, as over the socket (np.array(view) or copy=True
    # for a writeable one). The pages under them are a private copy-on-write mapping:
    # code that writes through the address anyway (a C extension, ctypes) changes this
    # process's pages only; through the old read-only mapping this was a SIGSEGV.
    assert not tile.flags.writeable
    ctypes.memset(tile.ctypes.data, 0xFF, tile.nbytes)
    assert _digest(tile) != original
    assert _second_consumer(server, shm_dir) == original  # another process
    again = client.get("m", step.keys, as_="numpy")  # a fresh answer in this process
    assert _digest(_first_tile(again)) == original
    assert assert_rows_match(again, step) > 0
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT) as plain:
        assert assert_rows_match(plain.get("m", step.keys, as_="numpy"), step) > 0


def test_add_on_a_returned_tensor_changes_only_that_tensor(server, client, shm_dir, torch):
    step = _put_w2(client)
    batch = client.get("m", step.keys)
    tensor = next(r for r in batch["pixel_values"] if r)[0]
    original = _digest(tensor.numpy())
    tensor.add_(1)  # through a read-only mapping this was a SIGSEGV
    assert _digest(tensor.numpy()) != original
    assert _second_consumer(server, shm_dir) == original
    again = client.get("m", step.keys)
    assert _digest(next(r for r in again["pixel_values"] if r)[0].numpy()) == original


def _private_dirty_kb(address: int) -> int:
    """Kilobytes of this process's own copies in the mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Private_Dirty:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_reading_a_returned_array_copies_no_page_and_a_write_copies_only_its_own(server, client):
    step = _put_w2(client)
    batch = client.get("m", step.keys, as_="numpy")
    tile = _first_tile(batch)
    address = tile.ctypes.data
    assert tile.nbytes > 2**20
    # Every page read: still the server's pages (populating a writable private mapping
    # for writing copied them all, at the get).
    assert assert_rows_match(batch, step) > 0
    assert _private_dirty_kb(address) == 0
    ctypes.memset(address, 0, 4096)  # one page written: that page is copied, only it
    assert 0 < _private_dirty_kb(address) <= 8
    assert assert_rows_match(client.get("m", step.keys, as_="numpy"), step) > 0


def test_a_private_copy_shares_nothing(server, client):
    step = _put_w2(client)
    batch = client.get("m", step.keys, as_="numpy", copy=True)
    tile = _first_tile(batch)
    assert not _in_a_segment(tile.ctypes.data)  # heap memory of this process
    assert assert_rows_match(batch, step) > 0
    shared = client.get("m", step.keys, as_="numpy")
    assert _in_a_segment(_first_tile(shared).ctypes.data)


# --------------------------------------------------------------------------- writers


def test_a_writer_shrinking_or_rewriting_its_segment_after_the_ack_changes_nothing(server, client):
    step = _put_w2(client)
    (path,) = client.shm_pool.paths()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # rewrite every byte after the header
        f.seek(shm.HEADER)
        f.write(b"\xa5" * (size - shm.HEADER))
    assert assert_rows_match(client.get("m", step.keys, as_="numpy"), step) > 0
    os.truncate(path, 0)  # through a mapping of this file the server died of SIGBUS
    gc.collect()
    assert assert_rows_match(client.get("m", step.keys, as_="numpy"), step) > 0
    with flightq.connect(server.location, [step.schema], timeout=TIMEOUT) as plain:
        assert assert_rows_match(plain.get("m", step.keys, as_="numpy"), step) > 0
    assert client.health()["ok"]


def test_a_segment_shrunk_under_its_announcement_is_refused_and_nothing_is_stored(
    server, client, shm_dir
):
    step = workloads.w2(groups=1)
    client.create_partition("p", step.schema, group_size=step.group_size)
    rb = flightq.encode(
        flightq.SchemaRegistry.default().get(step.schema),
        {k: v[:1] for k, v in step.columns.items()},
        step.keys[:1],
    )
    own = shm.SegmentPool(shm_dir)
    try:
        ref = own.write(rb.schema, [rb], "test")
        os.truncate(ref["path"], shm.HEADER + 8)
        with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* holds \d+ bytes"):
            plain_shm_put(server.location, ref)
    finally:
        own.close()
    assert client.stats()["partitions"]["p"]["rows"] == 0


def _mapped_unlinked(directory: str) -> list[str]:
    """The files of ``directory`` that this process maps though they are unlinked."""
    with open("/proc/self/maps") as f:
        lines = [line.rstrip("\n") for line in f]
    return [line for line in lines if f" {directory}/" in line and line.endswith(" (deleted)")]


def test_puts_refused_for_a_segment_shrinking_under_the_copy_leave_nothing_mapped(shm_dir):
    # Each refusal kept the server's copy of the segment mapped, unlinked, until a cyclic
    # collection (views of it in a reference cycle through the refusal's traceback), which
    # `flightq serve` makes rare: 1.3 GB of /dev/shm after 40 refusals. Each put here waits
    # for room under the budget with the writer's file open, which shrinks meanwhile.
    n = 24 << 20
    fill = {"input_ids": [np.zeros(5 << 20, np.int64)]}  # 40 MiB: no room for the copy
    own = shm.SegmentPool(shm_dir)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with (
            flightq.Server(memory_budget=64 << 20, shm=shm_dir) as srv,
            flightq.connect(srv.location, timeout=TIMEOUT) as c,
            ThreadPoolExecutor(1) as puts,
        ):
            c.create_partition("p", "rollout_text@1")
            for _ in range(3):
                c.put("p", ["fill"], fill)
                ref = own.write_bytes([(0, b"\xff" * 64)], n, "test")
                put = puts.submit(plain_shm_put, srv.location, ref, 1, TIMEOUT)
                stat_until(c, "p", "waiting_puts", 1)
                os.truncate(ref["path"], shm.HEADER + n // 2)
                c.clear("p", ["fill"])
                with pytest.raises(
                    fl.FlightServerError,
                    match=rf"ProtocolError: .* shrank to {shm.HEADER + n // 2} bytes while the "
                    "server read it; nothing is stored",
                ):
                    put.result()
            assert _mapped_unlinked(shm_dir) == []
            assert c.stats()["partitions"]["p"]["rows"] == 0
    finally:
        own.close()
        if collecting:
            gc.enable()


class _Shrinking:
    """A budget hold (:class:`flightq.shm.mapping.Hold`) during which the writer's file
    shrinks to ``size`` bytes: the server has checked it and is about to copy it."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size

    def hold(self, total: int) -> None:
        os.truncate(self.path, self.size)

    def share(self) -> Callable[[], None]:
        return lambda: None


def test_a_refusal_for_a_segment_shrinking_under_the_copy_holds_no_view_of_the_copy(shm_dir):
    # Whoever keeps the refusal with its traceback (a log, a caller) keeps no mapping: the
    # server's copy is unmapped as the put is refused, not once the refusal is let go.
    n = 24 << 20
    own = shm.SegmentPool(shm_dir)
    try:
        ref = own.write_bytes([(0, b"\xff" * 64)], n, "test")
        shrinking = _Shrinking(ref["path"], shm.HEADER + n // 2)
        with pytest.raises(flightq.ProtocolError, match="shrank to") as refusal:
            shm.store_copy(ref, shm_dir, "put to 'p'", hold=shrinking)
        assert refusal.value.__traceback__ is not None  # kept, with its frames
        assert _mapped_unlinked(shm_dir) == []
    finally:
        own.close()


def _framed(header: bytes, body: bytes = b"") -> bytes:
    """One IPC stream message: continuation marker, header length, header padded to 8."""
    header += b"\0" * (-(8 + len(header)) % 8)
    return b"\xff\xff\xff\xff" + len(header).to_bytes(4, "little") + header + body


def test_a_segment_whose_batch_leaves_a_gap_counts_the_gap_against_the_budget(shm_dir):
    # The writer's stream places a one-row batch's last buffer 32 MiB after the others:
    # Arrow reads the same batch, and the server's copy of the segment holds the gap too.
    from helpers_flightdata import gapped, schema_header

    rb = flightq.encode(
        flightq.SchemaRegistry.default().get("rollout_text@1"),
        {"input_ids": [np.arange(4)], "input_lengths": np.array([4], np.int32)},
        ["a"],
    )
    header, body = gapped(rb, 32 << 20)
    stream = _framed(schema_header(rb.schema)) + _framed(header, body) + b"\xff\xff\xff\xff\0\0\0\0"
    with pa.ipc.open_stream(stream) as r:
        assert r.read_next_batch().equals(rb)  # the same batch to Arrow
    budget = flightq.Server(memory_budget=16 << 20, shm=shm_dir)
    with budget as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", "rollout_text@1", tasks=["t"])
        own = shm.SegmentPool(shm_dir)
        try:
            ref = own.write_bytes([(0, stream)], len(stream), "test")
            with pytest.raises(fl.FlightError, match=r"ResourceExhaustedError: .* whole memory"):
                plain_shm_put(srv.location, ref)
        finally:
            own.close()
        p = c.stats()["partitions"]["p"]
        assert (p["rows"], p["held"]) == (0, 0)  # nothing half-stored
        c.put("p", ["b"], {"input_ids": [np.arange(3)]})  # the server serves on
        assert c.get("p", ["b"], as_="numpy").keys == ["b"]


# --------------------------------------------------------------------------- answers


def _unread_gets(location: str, keys: list[str], n: int) -> list[bool]:
    """``n`` gets asking for a shared-memory answer, none of which maps it (a reader that
    never comes); per get, whether it was answered in shared memory."""
    from flightq.protocol import GetTicket
    from flightq.shm.segments import MARKER

    plain = fl.connect(location)
    try:
        out = []
        for _ in range(n):
            ticket = fl.Ticket(GetTicket(partition="p", keys=keys, shm=True).to_wire())
            out.append(plain.do_get(ticket).read_all().schema.names == [MARKER])
        return out
    finally:
        plain.close()


def _unread_files(shm_dir: str, server: flightq.Server) -> int:
    assert server.shm_pool is not None
    return server.shm_pool.unread_bytes()


@contextlib.contextmanager
def _rows_over_socket(
    shm_dir: str, budget: int, n: int
) -> Iterator[tuple[flightq.Server, flightq.Client, flightq.Client, list[str], dict]]:
    """A server with ``budget`` holding 4 text rows of ``n`` tokens in partition "p", put
    over the socket (so a shared-memory answer needs a segment of the server's); yields
    it, the writer, a shared-memory reader, the keys and the columns."""
    keys = [f"r{i}" for i in range(4)]
    cols = {"input_ids": [np.arange(n) + i for i in range(4)]}
    with (
        flightq.Server(shm=shm_dir, memory_budget=budget) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as writer,
        flightq.connect(srv.location, timeout=TIMEOUT, shm=shm_dir) as c,
    ):
        c.shm_min_bytes = 0
        writer.create_partition("p", "rollout_text@1", tasks=["t"])
        writer.put("p", keys, cols)
        yield srv, writer, c, keys, cols


def test_answers_no_reader_takes_count_against_the_budget_then_go_over_the_socket(shm_dir):
    # Rows put over the socket are answered through a segment the server writes, which
    # waits for its reader. Gets whose reader never comes cannot fill the host's shared
    # memory: the budget counts what waits, at most a quarter of it, and past that the
    # answers go over the socket; a put finds the room they take taken.
    budget = 32 * 2**20
    with _rows_over_socket(shm_dir, budget, 50_000) as (srv, writer, c, keys, cols):  # 1.6 MB
        rows_held = srv.store.held()
        ways = _unread_gets(srv.location, keys, 12)
        assert ways[0] and ways[1] and not ways[-1], ways  # in shared memory, then the socket
        unread = _unread_files(shm_dir, srv)
        assert 2 * 2**20 < unread <= budget // 4
        assert srv.store.held() == rows_held + unread
        declined = c.stats()["counters"]["shm_answers_declined"]
        assert declined == ways.count(False)
        # One row that fits the budget beside the rows, not beside the unread answers too.
        big = {"input_ids": [np.zeros((budget - rows_held - 2**20) // 8, dtype=np.int64)]}
        with pytest.raises(flightq.ResourceExhaustedError, match="memory budget"):
            writer.put("p", ["big"], big, timeout=1.0)
        # A reader that does come still gets its rows, over the socket.
        got = c.get("p", keys, as_="numpy")
        assert got.received is not None and got.received.route == "socket"
        assert [r.tolist() for r in got["input_ids"]] == [r.tolist() for r in cols["input_ids"]]
        # Declined twice: on the request stream first, where its 1.6 MB are more than the
        # stream carries, then per call.
        assert c.stats()["counters"]["shm_answers_declined"] == declined + 2


def test_without_a_budget_answers_waiting_for_their_reader_are_bounded(shm_dir, monkeypatch):
    from flightq.server import flight

    monkeypatch.setattr(flight, "MAX_UNREAD_ANSWER_BYTES", 24 * 2**20)
    step = workloads.w1(groups=1, g=8)
    with (
        flightq.Server(shm=shm_dir) as srv,
        flightq.connect(srv.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c,
    ):
        c.shm_min_bytes = 0
        with flightq.connect(srv.location, [step.schema], timeout=TIMEOUT) as writer:
            writer.create_partition("p", step.schema, tasks=["t"])
            writer.put("p", step.keys, step.columns, tags=step.tags)
        ways = _unread_gets(srv.location, list(step.keys), 20)
        assert ways[0] and not ways[-1], ways
        assert _unread_files(shm_dir, srv) <= 24 * 2**20
        assert_rows_match(c.get("p", step.keys, as_="numpy"), step)


def test_under_a_budget_the_free_segments_kept_warm_are_a_quarter_of_it(shm_dir):
    # Segments freed by cleared rows stay warm for the next put, outside the budget: at
    # most a quarter of it (3 MiB here). Two puts held at once, cleared, then a small put
    # that reuses one of the freed segments: the other is more than the pool may keep.
    step = workloads.w1(groups=1, g=8)
    small = workloads.w1(groups=1, g=1)
    with (
        flightq.Server(shm=shm_dir, memory_budget=12 * 2**20) as srv,
        flightq.connect(srv.location, [step.schema], timeout=TIMEOUT, shm=shm_dir) as c,
    ):
        c.shm_min_bytes = 0
        for name in ("a", "b"):
            c.create_partition(name, step.schema, tasks=["t"])
            assert c.put(name, step.keys, step.columns, tags=step.tags).route == "shm"
        pool = shm.STORES.hold(shm_dir)
        try:
            big = [s.capacity for s in pool.segments()]
            assert len(big) == 2 and min(big) > 3 * 2**20, big
            c.drop("a")
            c.drop("b")
            gc.collect()
            c.create_partition("c", small.schema, tasks=["t"])
            c.put("c", small.keys, small.columns, tags=small.tags)
            caps = [s.capacity for s in pool.segments()]
        finally:
            shm.STORES.let_go(shm_dir, pool)
        assert len(caps) == 1 and caps[0] in big, (caps, big)  # reused; the other unlinked


def test_an_answer_that_does_not_reach_its_client_frees_its_segment(shm_dir):
    # The stream of an answer written into shared memory ends before its client has it
    # (its batch taken, its send failed: the client went away): the segment goes back to
    # the pool and out of the budget at once, instead of after its 300 s wait for a reader.
    from flightq.protocol import GetTicket

    with _rows_over_socket(shm_dir, 64 * 2**20, 50_000) as (srv, _, _, keys, _):
        rows_held = srv.store.held()
        t = GetTicket(partition="p", keys=keys, shm=True)

        def answer() -> Iterator[pa.RecordBatch]:
            part, rows, names = srv.store.rows_for_get("p", keys, None)
            return srv._shm_reply(t, *srv._assemble(t, part, rows, names, True), None)[1]

        for started in (True, False):  # a client gone before the first batch asks none
            sent = answer()
            if started:
                next(sent)
            assert _unread_files(shm_dir, srv) > 0 and srv.store.held() > rows_held
            del sent  # the stream ends there
            gc.collect()
            assert _unread_files(shm_dir, srv) == 0 and srv.store.held() == rows_held
        # One sent whole keeps its segment for its reader.
        assert len(list(answer())) == 1
        assert _unread_files(shm_dir, srv) > 0


def test_a_reader_taking_each_answer_keeps_getting_them_in_shared_memory(shm_dir):
    # Answers of more than half what may wait (a quarter of the budget): the reader takes
    # each, so the segment is free for the next, which reuses it.
    with _rows_over_socket(shm_dir, 256 * 2**20, 1_250_000) as (_, _, c, keys, _):  # 40 MB
        routes = []
        for _ in range(4):
            got = c.get("p", keys, as_="numpy")
            assert got.received is not None
            routes.append(got.received.route)
            del got
            gc.collect()
        assert routes == ["shm"] * 4
        assert c.stats()["counters"]["shm_answers_declined"] == 0


def test_an_answer_declined_takes_no_shared_memory(shm_dir):
    # An answer larger than may wait for its reader (a quarter of a 64 MiB budget) goes
    # over the socket, and no segment is made for it first.
    with _rows_over_socket(shm_dir, 64 * 2**20, 625_000) as (srv, _, c, keys, _):  # 20 MB
        for _ in range(2):
            got = c.get("p", keys, as_="numpy")
            assert got.received is not None and got.received.route == "socket"
        assert srv.shm_pool is None or srv.shm_pool.paths() == []


@contextlib.contextmanager
def _small_tmpfs(size: int) -> Iterator[str]:
    """A tmpfs of ``size`` bytes this test mounts and always unmounts (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    import tempfile

    where = tempfile.mkdtemp(prefix="flightq-small-tmpfs-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True
    )
    if mounted.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        os.rmdir(where)


def _fill(directory: str, leave: int) -> None:
    """Another process's file takes all but ``leave`` bytes of ``directory``'s tmpfs."""
    st = os.statvfs(directory)
    with open(os.path.join(directory, "another-process"), "ab") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))


def test_a_full_shared_memory_directory_sends_puts_and_answers_over_the_socket_never_crashes():
    # /dev/shm is shared by every process of the host (and 64 MiB in a container): a
    # segment sized with ftruncate alone is sparse, and the server's first write into a
    # page tmpfs cannot give killed it with SIGBUS, and every row it held with it.
    n = 1_500_000  # 12 MB of int64 tokens
    with _small_tmpfs(32 * 2**20) as d:
        code = "import sys, time, flightq\n" + (
            "srv = flightq.Server(shm=sys.argv[1]).start()\n"
            "print(srv.location, flush=True)\ntime.sleep(120)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code, d], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            location = proc.stdout.readline().strip()
            with flightq.connect(location, timeout=TIMEOUT) as plain:
                plain.create_partition("r", "rollout_text@1", tasks=["train"])
                plain.put("r", ["a"], {"input_ids": [np.arange(n, dtype=np.int64)]})
                _fill(d, 4 * 2**20)  # an answer's segment of 12 MB cannot be had
                with flightq.connect(location, timeout=TIMEOUT, shm=d) as c:
                    got = c.get("r", ["a"], as_="numpy")
                    assert got.received is not None and got.received.route == "socket"
                    assert np.array_equal(got["input_ids"][0], np.arange(n, dtype=np.int64))
                    os.unlink(os.path.join(d, "another-process"))
                    _fill(d, 16 * 2**20)  # the writer's segment fits, the server's copy not
                    ids = np.arange(n, dtype=np.int64) * 3
                    # Refused there, the put goes over the socket, stored once.
                    assert c.put("r", ["b"], {"input_ids": [ids]}).route == "socket"
                    _fill(d, 2**20)  # not even the writer's own segment
                    assert c.put("r", ["c"], {"input_ids": [ids + 1]}).route == "socket"
                    text = flightq.SchemaRegistry.default().get("rollout_text@1")
                    batch = flightq.encode(text, {"input_ids": [ids + 2]}, ["d"])
                    assert c.put_batch("r", batch).route == "socket"
                assert proc.poll() is None  # alive
                got = plain.get("r", ["a", "b", "c", "d"], as_="numpy")
                want = [np.arange(n, dtype=np.int64), ids, ids + 1, ids + 2]
                assert all(
                    np.array_equal(g, w) for g, w in zip(got["input_ids"], want, strict=True)
                )
        finally:
            proc.kill()
            proc.wait()


def test_a_reader_truncating_its_answer_segment_crashes_nothing(shm_dir):
    # Answer segments are writable by their reader (it marks them taken). A page of the
    # server's mapping past a truncated file's end is SIGBUS: the server now reads and
    # writes their headers through the descriptor and never fills a shortened one again.
    n = 400_000  # 3.2 MB a row, put over the socket: an answer needs a segment
    code = "import sys, time, flightq\n" + (
        "srv = flightq.Server(shm=sys.argv[1]).start()\n"
        "print(srv.location, flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, shm_dir], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        location = proc.stdout.readline().strip()
        rows = {"input_ids": [np.arange(n, dtype=np.int64) + i for i in range(3)]}
        with flightq.connect(location, timeout=TIMEOUT) as plain:
            plain.create_partition("r", "rollout_text@1")
            plain.put("r", ["a", "b", "c"], rows)
            with flightq.connect(location, timeout=TIMEOUT, shm=shm_dir) as c:
                first = c.get("r", ["a"], as_="numpy")
                assert first.received is not None and first.received.route == "shm"
                segments = [f for f in os.listdir(shm_dir) if f"-{proc.pid}-" in f]
                assert segments
                for name in segments:
                    os.truncate(os.path.join(shm_dir, name), 0)
                del first
                for key, want in (("b", rows["input_ids"][1]), ("c", rows["input_ids"][2])):
                    got = c.get("r", [key], as_="numpy")
                    assert np.array_equal(got["input_ids"][0], want)
            assert proc.poll() is None  # alive, and serving
            assert sorted(plain.list_keys("r")) == ["a", "b", "c"]
    finally:
        proc.kill()
        proc.wait()
