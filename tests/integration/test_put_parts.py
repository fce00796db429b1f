"""One put over parallel DoPut streams (``put_streams``), stored all or nothing.

Real servers on loopback; the parts travel on real connections. A part that fails, or
never comes, fails the whole put: nothing is stored and the server keeps serving.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, text_columns, text_keys
from helpers_waiting import WAIT_S, stat_until

import flightq
from flightq.encode import encode
from flightq.errors import ProtocolError
from flightq.protocol import AbortPut
from flightq.server.staging import Staging

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    with flightq.Server() as srv:
        yield srv


@pytest.fixture(name="client")
def client_fixture(server: flightq.Server) -> flightq.Client:
    """A client that sends every put of 3 or more batches over 3 streams."""
    with flightq.connect(
        server.location,
        [TEXT],
        timeout=TIMEOUT,
        put_streams=3,
        max_batch_bytes=64,
        min_stream_bytes=1,
    ) as c:
        c.create_partition("p", TEXT, tasks=["train"])
        yield c


def _rows(n: int) -> tuple[list[str], dict[str, object]]:
    keys = text_keys(n // 4, 4)
    return keys, text_columns(keys)


@pytest.mark.torch
def test_a_put_in_parts_lands_whole_and_in_order(client):
    keys, cols = _rows(12)
    receipt = client.put("p", keys, cols)
    assert receipt == 12 and receipt.route == "streams=3"
    got = client.get("p", keys, as_="numpy")
    assert got.keys == keys
    assert all(
        np.array_equal(a, b) for a, b in zip(got["input_ids"], cols["input_ids"], strict=True)
    )
    assert client.claim("p", "train", 12, timeout=TIMEOUT).keys == keys  # one put's order


def test_a_bad_row_in_a_later_part_is_refused_before_any_part_is_sent(client):
    keys, cols = _rows(12)
    cols["input_ids"][10] = cols["input_ids"][10][:-1]  # token lengths disagree
    with pytest.raises(flightq.ShapeError, match=r"sequence length .* \(row key 'p2_g2'\)"):
        client.put("p", keys, cols)
    assert client.stats()["partitions"]["p"]["rows"] == 0
    keys, cols = _rows(12)
    assert client.put("p", keys, cols) == 12  # the server keeps serving


def test_a_retried_put_in_parts_with_its_put_id_is_stored_once(client):
    keys, cols = _rows(12)
    assert client.put("p", keys, cols, put_id="step-7") == 12
    assert client.put("p", keys, cols, put_id="step-7") == 12
    assert client.stats()["partitions"]["p"]["rows"] == 12


def _part(
    location: str, cmd: dict[str, object], rb: pa.RecordBatch, timeout: float | None = None
) -> None:
    c = fl.connect(location)
    try:
        desc = fl.FlightDescriptor.for_command(msgpack.packb(cmd))
        writer, reader = c.do_put(desc, rb.schema, options=fl.FlightCallOptions(timeout=timeout))
        with writer:
            writer.write_batch(rb)
            writer.done_writing()
            reader.read()
    finally:
        c.close()


def _cmd(**extra: object) -> dict[str, object]:
    return {"op": "put", "partition": "p", "timeout": 1.0, "rows": 4, **extra}


def _batch(client: flightq.Client, keys: list[str]) -> pa.RecordBatch:
    return encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(keys), keys)


def test_a_part_that_never_comes_fails_the_put_after_its_timeout(server, client):
    rb = _batch(client, text_keys(1, 4))
    with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* 1 arrived within 2 s"):
        _part(server.location, _cmd(stage="s1", part=0, parts=2), rb)
    assert client.stats()["partitions"]["p"]["rows"] == 0
    # Its late twin fails at once: the put was decided.
    with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* arrived within"):
        _part(server.location, _cmd(stage="s1", part=1, parts=2), rb)


def test_a_part_the_server_refuses_fails_every_part_with_its_error(server, client):
    errors: dict[int, BaseException] = {}

    def send(part: int, rows: int) -> None:
        keys = text_keys(1, 4, prefix=f"r{part}")
        cmd = _cmd(stage="s3", part=part, parts=2, timeout=30.0, rows=rows)
        try:
            _part(server.location, cmd, _batch(client, keys))
        except fl.FlightServerError as e:
            errors[part] = e

    good = threading.Thread(target=send, args=(0, 4))
    good.start()
    stat_until(client, "p", "staged_parts", 1)  # part 0 is here and waits for part 1
    send(1, 5)  # announces 5 rows, sends 4
    good.join(10)
    assert set(errors) == {0, 1}
    assert all("stream ended after 4 of the 5 rows" in str(e) for e in errors.values())
    p = client.stats()["partitions"]["p"]
    assert p["rows"] == 0 and p["staged_parts"] == 0


def test_a_put_in_parts_refused_for_room_says_so_to_every_part_typed(server, client):
    # Kept as class and message only, the decided error lost its attributes: the row
    # limit's refusal reached the caller without `retry`, and a Writer gave up on puts it
    # would have waited out.
    client.create_partition("m", TEXT, tasks=["train"], max_rows=4)
    keys, cols = _rows(4)
    client.put("m", keys, cols)
    more = [f"{k}+" for k in keys]
    with pytest.raises(flightq.ResourceExhaustedError, match="4-row limit") as info:
        client.put("m", more, text_columns(more), timeout=0.5)
    assert info.value.retry == "full" and info.value.room_may_come
    assert info.value.partition == "m"
    (kept,) = [p for p in server._staging._decided.values() if p.error is not None]
    assert kept.attrs["retry"] == "full"  # what every part's caller is answered with


def test_an_aborted_put_wakes_its_waiting_parts(server, client):
    rb = _batch(client, text_keys(1, 4))
    errors: list[BaseException] = []

    def waiting() -> None:
        try:
            _part(server.location, _cmd(stage="s2", part=0, parts=2, timeout=30.0), rb)
        except fl.FlightServerError as e:
            errors.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    stat_until(client, "p", "staged_parts", 1)
    client.transport.action(AbortPut(partition="p", stage="s2", parts=2))
    t.join(10)
    assert not t.is_alive() and "the client gave up a part" in str(errors[0])
    p = client.stats()["partitions"]["p"]
    assert p["rows"] == 0 and p["staged_parts"] == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"part": 2, "parts": 2, "stage": "x"}, r"'part' must be in \[0, parts\)"),
        ({"part": 0, "parts": 99, "stage": "x"}, r"'parts' in \[1, 16\]"),
        ({"part": 0, "parts": 2}, "needs a 'stage'"),
    ],
)
def test_malformed_part_fields_are_refused(server, client, extra, message):
    rb = _batch(client, text_keys(1, 4))
    with pytest.raises(fl.FlightServerError, match=rf"ProtocolError: .*{message}"):
        _part(server.location, _cmd(**extra), rb)
    assert client.stats()["partitions"]["p"]["rows"] == 0


def test_once_every_part_is_here_only_the_commit_decides():
    # The store may wait for space longer than the parts' own timeout, and an abort may
    # come meanwhile: every part still answers with what the commit did.
    staging = Staging()
    started, release = threading.Event(), threading.Event()

    def slow_commit(every: list[object]) -> int:
        started.set()
        release.wait(10)
        return len(every)

    answers: dict[int, int] = {}
    timeout = 0.5

    def part(i: int) -> None:
        answers[i] = staging.join("p", "s", i, 2, [f"piece{i}"], slow_commit, timeout)

    first = threading.Thread(target=part, args=(0,))
    first.start()
    deadline = time.monotonic() + WAIT_S
    while staging.staged() != {"p": 1}:
        assert time.monotonic() < deadline, f"part 0 never staged: {staging.staged()}"
        first.join(0.01)
    seen = time.monotonic()  # part 0's own deadline is before seen + timeout
    last = threading.Thread(target=part, args=(1,))
    last.start()
    assert started.wait(10)
    assert staging.staged() == {}  # every part is here: none waits for another
    first.join(max(0.0, seen + timeout - time.monotonic()) + 0.1)
    assert first.is_alive()  # past its own timeout, part 0 waits for the commit
    staging.fail("p", "s", 2, ProtocolError("the client gave up a part"))
    release.set()
    first.join(10)
    last.join(10)
    assert answers == {0: 2, 1: 2}


def test_a_part_the_client_cannot_send_aborts_the_others_at_once(client, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"grpc://127.0.0.1:{s.getsockname()[1]}"
    main, lost = client.transport.connection(0), fl.connect(dead)
    monkeypatch.setattr(client.transport, "connection", lambda i=0: lost if i else main)
    answers: dict[int, BaseException] = {}
    put = client.transport.put

    def recorded(*args: object, connection: int = 0, **kwargs: object) -> int:
        try:
            return put(*args, connection=connection, **kwargs)
        except flightq.FlightqError as e:
            answers[connection] = e
            raise

    monkeypatch.setattr(client.transport, "put", recorded)
    keys, cols = _rows(12)
    with pytest.raises(flightq.UnavailableError):
        client.put("p", keys, cols)
    # Part 0 reached the server and was answered with the abort, not its own timeout.
    assert isinstance(answers[0], flightq.ProtocolError)
    assert "the client gave up a part" in str(answers[0])
    p = client.stats()["partitions"]["p"]
    assert p["rows"] == 0 and p["staged_parts"] == 0


def test_a_decided_put_keeps_its_errors_class_and_message_not_the_error():
    """The error of a failed part carries a traceback whose frames hold the part's record
    batches: a decided put, kept for its late parts, keeps only the class and message."""
    import gc
    import weakref

    staging = Staging()

    class Batches:  # stands for what a part's frames held
        pass

    def failing(held: Batches) -> None:
        raise ProtocolError("the stream ended after 1 of the 999 rows announced")

    held = Batches()
    alive = weakref.ref(held)
    try:
        failing(held)
    except ProtocolError as e:
        staging.fail("p", "s", 2, e)
    del held
    gc.disable()  # what `flightq serve` leaves to rare collections must go without one
    try:
        assert alive() is None, "the decided put keeps the failed part's frames"
    finally:
        gc.enable()
    with pytest.raises(ProtocolError, match="999 rows announced"):  # its late part
        staging.join("p", "s", 1, 2, [], lambda every: pytest.fail("committed"), 5.0)


def test_the_decided_puts_kept_are_bounded_and_the_latest_still_answer():
    from flightq.server.staging import MAX_DECIDED

    staging = Staging()
    for i in range(MAX_DECIDED + 500):
        staging.fail("p", f"s{i}", 2, ProtocolError(f"gave up {i}"))
    assert len(staging._puts) <= MAX_DECIDED + 1
    last = MAX_DECIDED + 499
    with pytest.raises(ProtocolError, match=f"gave up {last}$"):
        staging.join("p", f"s{last}", 1, 2, [], lambda every: pytest.fail("committed"), 5.0)
    # A partition name no partition can have is not remembered at all.
    staging.fail("x" * 100_000, "s", 2, ProtocolError("gave up"))
    assert all(len(k[0]) < 1000 for k in staging._puts)


def test_abort_put_of_a_partition_that_does_not_exist_is_not_found(server, client):
    plain = fl.connect(server.location)
    try:
        for name in ("nope", "n" * (1 << 20)):
            body = msgpack.packb({"partition": name, "stage": "s", "parts": 2})
            with pytest.raises(fl.FlightServerError, match="NotFoundError") as e:
                list(plain.do_action(fl.Action("abort_put", body)))
            assert len(str(e.value)) < 2000  # a 1 MiB name is not echoed back whole
    finally:
        plain.close()
    assert client.stats()["partitions"]["p"]["rows"] == 0  # serves on


def test_a_refused_part_quoting_megabytes_is_answered_and_remembered_in_short(server, client):
    # A descriptor refused for an unknown key of 1 MiB still names its put in parts, which
    # fails and is remembered for its late parts: neither the answer nor the decision
    # keeps the key whole (4 096 decisions of 1 MiB would be 4 GiB outside the budget).
    rb = _batch(client, text_keys(1, 4))
    huge = "x" * (1 << 20)
    with pytest.raises(fl.FlightServerError, match="unknown key") as e:
        _part(server.location, _cmd(stage="s9", part=0, parts=2, **{huge: 1}), rb)
    assert len(str(e.value)) < 4000
    kind, message = server._staging._puts[("p", "s9")].error
    assert kind is ProtocolError and "unknown key" in message and len(message) < 1100
    with pytest.raises(fl.FlightServerError, match="unknown key"):  # its late part
        _part(server.location, _cmd(stage="s9", part=1, parts=2), rb)


def test_a_stage_used_again_is_refused_never_acknowledged_with_the_put_it_missed(server, client):
    # A put in parts whose stage was stored already answered the next put of that stage
    # with the first one's acknowledgement, and stored nothing of it.
    first, second = text_keys(1, 4, prefix="a"), text_keys(1, 4, prefix="b")
    _part(server.location, _cmd(stage="S", part=0, parts=1), _batch(client, first))
    for cmd in (_cmd(stage="S", part=0, parts=1), _cmd(stage="S", part=1, parts=2)):
        with pytest.raises(
            fl.FlightServerError, match=r"ProtocolError: .*stored without it .*nothing of it"
        ):
            _part(server.location, cmd, _batch(client, second))
    assert sorted(client.list_keys("p")) == sorted(first)


def test_parts_wait_no_longer_than_the_idle_timeout_once_no_part_streams():
    # A client that sends one part of two with a day's timeout and never the other held
    # a data-call slot for that day; now the parts here wait idle_timeout once no other
    # part's stream is open.
    with (
        flightq.Server(idle_timeout=1.0) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        started = time.monotonic()
        with pytest.raises(fl.FlightServerError, match=r"parts \[1\] did not start within 1 s"):
            _part(
                srv.location,
                _cmd(stage="i", part=0, parts=2, timeout=86400.0),
                _batch(c, text_keys(1, 4)),
                timeout=WAIT_S,  # the call's own deadline: fails, never hangs, before
            )
        assert time.monotonic() - started < WAIT_S
        assert c.stats()["partitions"]["p"]["staged_parts"] == 0


def test_a_part_still_on_its_way_keeps_the_others_waiting_past_the_idle_timeout():
    # The idle clock of the parts here runs only while no part's stream is open: part 1
    # sends a batch every 1.6 s (each within the stream's own idle timeout of 3 s), 3.2 s
    # in all after part 0 arrived, and the put is stored whole.
    keys = text_keys(2, 4)
    with (
        flightq.Server(idle_timeout=3.0) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        errors: list[BaseException] = []

        def first() -> None:
            try:
                _part(
                    srv.location,
                    _cmd(stage="w", part=0, parts=2, timeout=30.0),
                    _batch(c, keys[:4]),
                )
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=first)
        t.start()
        stat_until(c, "p", "staged_parts", 1)
        rb = _batch(c, keys[4:])
        conn = fl.connect(srv.location)
        try:
            cmd = _cmd(stage="w", part=1, parts=2, timeout=30.0)
            writer, reader = conn.do_put(
                fl.FlightDescriptor.for_command(msgpack.packb(cmd)), rb.schema
            )
            with writer:
                for i in range(2):
                    time.sleep(1.6)
                    writer.write_batch(rb.slice(2 * i, 2))
                writer.done_writing()
                reader.read()
        finally:
            conn.close()
        t.join(WAIT_S)
        assert not errors
        assert c.list_keys("p") and sorted(c.list_keys("p")) == sorted(keys)


def test_a_part_whose_client_went_away_fails_the_put_and_frees_its_slot(tmp_path):
    # Its client killed while part 0 waits for part 1 (idle timeout off, the put's
    # timeout a day): the part's handler sees its call cancelled and the put fails,
    # instead of holding a data-call slot for the day.
    script = tmp_path / "part.py"
    script.write_text(
        "import sys, msgpack, pyarrow as pa, pyarrow.flight as fl\n"
        "rb = pa.ipc.open_stream(open(sys.argv[2], 'rb')).read_next_batch()\n"
        "cmd = {'op': 'put', 'partition': 'p', 'timeout': 86400.0, 'rows': 4,\n"
        "       'stage': 'gone', 'part': 0, 'parts': 2}\n"
        "w, r = fl.connect(sys.argv[1]).do_put(\n"
        "    fl.FlightDescriptor.for_command(msgpack.packb(cmd)), rb.schema)\n"
        "w.write_batch(rb); w.done_writing(); r.read()\n"
    )
    with (
        flightq.Server(idle_timeout=None, max_calls=2) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        rb = _batch(c, text_keys(1, 4))
        ipc = tmp_path / "rb.arrow"
        with pa.ipc.new_stream(ipc, rb.schema) as w:
            w.write_batch(rb)
        proc = subprocess.Popen([sys.executable, str(script), srv.location, str(ipc)])
        try:
            stat_until(c, "p", "staged_parts", 1)
        finally:
            proc.kill()
            proc.wait(WAIT_S)
        stat_until(c, "p", "staged_parts", 0)
        deadline = time.monotonic() + WAIT_S
        while srv.limits.in_flight()[0]:  # the part's slot among the data calls is free
            assert time.monotonic() < deadline, srv.limits.in_flight()
            time.sleep(0.05)
        assert (
            c.put("p", text_keys(1, 4, prefix="x"), text_columns(text_keys(1, 4, prefix="x"))) == 4
        )
