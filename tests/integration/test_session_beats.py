"""Consumer sessions beat: a consumer the server stops hearing gives its rows back.

A session's stream ends when its client's process dies, but not when its host dies or its
link is cut: the server then holds a half-open connection. A client asks the server to end
its session after ``session_timeout`` seconds without a beat, and beats. These tests stop a
real consumer process (SIGSTOP: it is alive, its socket open, and it says nothing, as a
frozen or cut-off host), and speak the session's wire form with plain ``pyarrow.flight``:
a silent session, a beating one, hostile messages on the stream, bad silences. The same
over a cut link between two network namespaces: test_hosts_faults.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import ROOT, TEXT, TIMEOUT, cli_server, python_env, text_columns
from helpers_reliability import plain_error
from helpers_waiting import stat_until

import flightq
from flightq.client.session import DEFAULT_SESSION_TIMEOUT, beat_interval
from flightq.protocol import ClaimTicket, SessionBeat, SessionCommand, SessionReply
from flightq.server.flight import MIN_BEAT_GAP

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the idle watch is Linux only"),
]

#: The silence these tests ask for (seconds): short, so a silent session ends soon.
SILENCE = 1.0
#: Seconds a claim waits for rows that must come back: far below the 600 s lease.
SOON = 10.0


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    with flightq.Server() as srv:
        yield srv


@pytest.fixture(name="client")
def client_fixture(server: flightq.Server) -> Iterator[flightq.Client]:
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
        yield c


def _keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def _declare(c: flightq.Client, n: int) -> list[str]:
    """Partition 'p' (text, task 'train', the default lease of 600 s) with rows k0..."""
    keys = _keys(n)
    c.create_partition("p", TEXT, tasks=["train"])
    c.put("p", keys, text_columns(keys))
    return keys


def _leased(c: flightq.Client) -> int:
    return int(c.stats()["partitions"]["p"]["leased"]["train"])


def _claim(c: flightq.Client, n: int, timeout: float = SOON) -> flightq.Batch:
    return c.claim("p", "train", n, as_="numpy", timeout=timeout)


def _until_cut(c: flightq.Client, n: int) -> None:
    """Wait (bounded) until the server counts ``n`` idle cuts."""
    deadline = time.monotonic() + SOON
    while (got := c.stats()["counters"]["idle_cuts"]) != n:
        assert time.monotonic() < deadline, f"idle_cuts stayed {got}, not {n}"
        time.sleep(0.02)


# --------------------------------------------------------------------------- processes

#: A consumer: connects with the given session_timeout, claims, prints the keys and
#: whether its session beats, then waits without acking (until stopped or killed).
CONSUMER = """
    import sys, time
    import flightq
    location, n, timeout = sys.argv[1:]
    silence = None if timeout == "none" else float(timeout)
    c = flightq.connect(location, ["rollout_text@1"], timeout=30, session_timeout=silence)
    b = c.claim("p", "train", int(n), as_="numpy", timeout=30)
    print(" ".join(b.keys), c.session.beating, flush=True)
    sys.stdin.readline()  # then claim again (after a SIGCONT, its session long ended)
    b = c.claim("p", "train", int(n), as_="numpy", timeout=30)
    print(" ".join(b.keys), c.session.beating, flush=True)
    time.sleep(600)
"""


@contextlib.contextmanager
def _consumer(
    location: str, n: int, timeout: str
) -> Iterator[tuple[subprocess.Popen[str], list[str], bool]]:
    """The consumer above, once it claimed: (its process, its keys, whether it beats);
    SIGKILLed (after a SIGCONT) on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CONSUMER), location, str(n), timeout],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by pytest-timeout if the child hangs
        if not line:
            _, err = proc.communicate(timeout=TIMEOUT)
            pytest.fail(f"the consumer exited with {proc.returncode} before claiming: {err}")
        *keys, beating = line.split()
        yield proc, keys, beating == "True"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        with contextlib.suppress(OSError):
            proc.communicate(timeout=TIMEOUT)


def test_a_stopped_consumers_rows_come_back_after_its_session_timeout(client):
    keys = _declare(client, 8)
    with _consumer(client.transport.location, 4, str(SILENCE)) as (proc, taken, beating):
        assert taken == keys[:4] and beating
        # Alive and beating: its leases hold for several silences.
        time.sleep(3 * SILENCE)
        assert _leased(client) == 4
        # Frozen (its process and socket alive, nothing sent): a claim for every row
        # gets them after about one silence, not after the 600 s lease.
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        got = _claim(client, 8)
        waited = time.monotonic() - start
        assert sorted(got.keys) == sorted(keys)  # none lost, none twice
        by_key = dict(zip(got.keys, got.claim.deliveries, strict=True))
        assert by_key == {k: 2 if k in taken else 1 for k in keys}
        assert SILENCE * 0.5 < waited < SOON
        _until_cut(client, 1)  # then its connection, cut once
        assert client.ack(got, got.keys[:4]) == 4
        assert client.nack(got, got.keys[4:]) == 4
        # Woken, it claims again: its old session is gone, a new one opens and beats.
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        *again, beating = proc.stdout.readline().split()
        assert beating == "True"
        assert sorted(again) == sorted(got.keys[4:])
        assert _leased(client) == 4


def test_a_stopped_consumer_without_beats_keeps_its_rows_until_it_dies(client):
    # The control: session_timeout=None, so nothing but its stream's end gives them back.
    keys = _declare(client, 8)
    with _consumer(client.transport.location, 4, "none") as (proc, taken, beating):
        assert taken == keys[:4] and not beating
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3 * SILENCE)
        assert _leased(client) == 4
        fresh = _claim(client, 4)
        assert fresh.keys == keys[4:]
    # Killed: its stream ends, and its rows come back.
    back = _claim(client, 4)
    assert back.keys == taken and back.claim.deliveries == (2, 2, 2, 2)
    assert client.ack(fresh) + client.ack(back) == 8


def test_a_beating_client_keeps_its_leases_and_acks_them(server):
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT, session_timeout=SILENCE) as c:
        keys = _declare(c, 4)
        got = _claim(c, 4)
        assert c.session.beating
        time.sleep(4 * SILENCE)
        assert _leased(c) == 4
        assert c.ack(got) == 4
        assert c.session.beating
    assert c.session.beating is False  # closed: the beats stop with the session
    assert keys == got.keys


def test_the_default_session_timeout_beats(client):
    _declare(client, 2)
    _claim(client, 2)
    assert client.session.beating
    assert DEFAULT_SESSION_TIMEOUT == 15.0 and beat_interval(DEFAULT_SESSION_TIMEOUT) == 1.0
    assert beat_interval(SILENCE) == pytest.approx(0.1)


def test_a_server_without_an_idle_watch_asks_for_no_beats():
    with (
        flightq.Server(idle_timeout=0) as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT, session_timeout=SILENCE) as c,
    ):
        _declare(c, 2)
        got = _claim(c, 2)
        assert not c.session.beating
        time.sleep(2 * SILENCE)
        assert _leased(c) == 2
        assert c.ack(got) == 2


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_session_timeout_none_or_zero_sends_no_beats(server, off):
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT, session_timeout=off) as c:
        _declare(c, 2)
        got = _claim(c, 2)
        assert not c.session.beating
        assert c.ack(got) == 2


@pytest.mark.parametrize("bad", [0.1, -1.0, 1e9, math.inf, math.nan, "5", True])
def test_a_bad_session_timeout_is_refused_before_connecting(server, bad):
    with pytest.raises(ValueError, match=r"session_timeout must be"):
        flightq.connect(server.location, [TEXT], timeout=TIMEOUT, session_timeout=bad)


# --------------------------------------------------------------------------- plain Flight


@pytest.fixture(name="plain")
def plain_fixture(server: flightq.Server) -> Iterator[fl.FlightClient]:
    c = fl.connect(server.location)
    yield c
    c.close()


def _open(plain: fl.FlightClient, silence: Any) -> tuple[Any, Any, dict[str, Any]]:
    """A session asking for ``silence`` with plain Flight: (writer, reader, its reply)."""
    desc = fl.FlightDescriptor.for_command(msgpack.packb({"op": "session", "silence": silence}))
    writer, reader = plain.do_exchange(desc)
    first = reader.read_chunk()
    assert first.data is None
    return writer, reader, msgpack.unpackb(first.app_metadata.to_pybytes())


def _plain_claim(plain: fl.FlightClient, sid: str, n: int) -> list[str]:
    t = ClaimTicket(partition="p", task="train", batch_size=n, timeout=5.0, session=sid)
    return plain.do_get(fl.Ticket(t.to_wire())).read_all().column("__key__").to_pylist()


def _end(writer: Any, reader: Any) -> None:
    reader.cancel()
    with contextlib.suppress(fl.FlightError, pa.ArrowException):
        writer.close()


def test_a_silent_plain_session_ends_and_its_rows_come_back(plain, client):
    _declare(client, 4)
    writer, reader, reply = _open(plain, SILENCE)
    assert reply == {"session": reply["session"], "silence": SILENCE}
    assert SessionReply.parse(msgpack.packb(reply)).silence == SILENCE
    assert _plain_claim(plain, reply["session"], 3) == ["k0", "k1", "k2"]
    start = time.monotonic()
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)  # the lease is 600 s
    assert time.monotonic() - start > SILENCE * 0.5
    # The session is gone (its id refused) and its connection was cut.
    with pytest.raises(fl.FlightError) as e:
        _plain_claim(plain, reply["session"], 1)
    kind, message = (
        plain_error(e.value)
        if not isinstance(e.value, fl.FlightUnavailableError)
        else ("UnavailableError", "")
    )
    assert kind in ("NotFoundError", "UnavailableError"), message
    _end(writer, reader)
    assert _claim(client, 4).keys == ["k3", "k0", "k1", "k2"]


def test_a_beating_plain_session_keeps_its_leases_until_the_beats_stop(plain, client):
    _declare(client, 4)
    writer, reader, reply = _open(plain, SILENCE)
    sid = reply["session"]
    assert _plain_claim(plain, sid, 2) == ["k0", "k1"]
    for _ in range(int(4 * SILENCE / 0.2)):  # 4 silences of beats, 5 per silence
        writer.write_metadata(pa.py_buffer(SessionBeat().to_wire()))
        time.sleep(0.2)
    assert _leased(client) == 2
    # Silent from now on: the rows come back after about one silence.
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)
    _end(writer, reader)
    got = _claim(client, 4)
    assert got.keys == ["k2", "k3", "k0", "k1"] and got.claim.deliveries == (1, 1, 2, 2)


def test_beats_flooded_faster_than_the_gap_are_read_one_per_gap_and_the_session_lives(
    plain, client
):
    _declare(client, 4)
    writer, reader, reply = _open(plain, SILENCE)
    assert _plain_claim(plain, reply["session"], 2) == ["k0", "k1"]
    before = client.stats()["counters"]
    start = time.monotonic()
    beat = pa.py_buffer(SessionBeat().to_wire())
    for _ in range(400):  # as fast as the stream takes them: 4 s of reads at the gap
        writer.write_metadata(beat)
    time.sleep(2 * SILENCE)  # past the silence: the beats read late keep the session
    after = client.stats()["counters"]
    took = time.monotonic() - start
    heard = after["beats"] - before["beats"]
    assert 0 < heard <= took / MIN_BEAT_GAP + 1, (heard, took)  # one read per gap at most
    assert after["beats_slowed"] - before["beats_slowed"] >= heard - 1
    assert _leased(client) == 2 and client.health()  # alive, and the server serves
    _end(writer, reader)
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)
    assert _claim(client, 4).keys == ["k2", "k3", "k0", "k1"]


def _ends_typed(client: flightq.Client, writer: Any, reader: Any, send: Any, cause: str) -> None:
    """``send`` on a session holding k0 and k1 ends it with a ProtocolError matching
    ``cause``, and the rows come back at once (not after a silence), after k2 and k3."""
    send(writer)
    with pytest.raises(fl.FlightError) as e:
        reader.read_chunk()
    kind, message = plain_error(e.value)
    assert kind == "ProtocolError" and re.search(cause, message), message
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)
    _end(writer, reader)
    assert _claim(client, 4).keys == ["k2", "k3", "k0", "k1"]


def _batch() -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array([1, 2, 3])})


@pytest.mark.parametrize(
    ("send", "cause"),
    [
        (lambda w: w.begin(_batch().schema) or w.write_batch(_batch()), r"beats only"),
        (lambda w: w.write_metadata(pa.py_buffer(b"\x80" * 100)), r"at most 64 bytes, got 100"),
        (lambda w: w.write_metadata(pa.py_buffer(msgpack.packb({"op": "claim"}))), r"session beat"),
        (lambda w: w.write_metadata(pa.py_buffer(b"\xc1")), r"session beat"),
        (
            lambda w: w.write_metadata(pa.py_buffer(msgpack.packb({"op": "beat", "x": 1}))),
            r"unknown key 'x'",
        ),
    ],
    ids=["a-record-batch", "too-long", "another-op", "not-msgpack", "an-unknown-key"],
)
def test_a_session_message_that_is_not_a_beat_ends_it_typed(plain, client, send, cause):
    _declare(client, 4)
    writer, reader, reply = _open(plain, 30.0)  # a long silence: only the message ends it
    assert _plain_claim(plain, reply["session"], 2) == ["k0", "k1"]
    _ends_typed(client, writer, reader, send, cause)


@pytest.mark.parametrize(
    ("silence", "cause"),
    [
        (0.1, r"'silence' must be at least 0.5 seconds, got 0.1"),
        (0, r"'silence' must be at least 0.5 seconds, got 0"),
        (-1.0, r"'silence' must be a non-negative number"),
        (1e9, r"'silence' must be at most 86400 seconds, got 1e\+09"),
        (math.inf, r"'silence' must be at most 86400 seconds"),
        (math.nan, r"'silence' is NaN"),
        ("5", r"'silence'"),
        (True, r"'silence'"),
    ],
)
def test_a_session_with_a_bad_silence_is_refused_typed_and_opens_nothing(
    plain, client, silence, cause
):
    _declare(client, 2)
    with pytest.raises(fl.FlightError) as e:
        _open(plain, silence)
    kind, message = plain_error(e.value)
    assert kind == "ProtocolError" and re.search(cause, message), message
    assert "session command" in message
    assert _claim(client, 2).keys == ["k0", "k1"]  # the server serves on


def test_a_stopping_server_ends_a_beating_session_within_its_deadline():
    srv = flightq.Server().start()
    c = flightq.connect(srv.location, [TEXT], timeout=TIMEOUT, session_timeout=30.0)
    try:
        _declare(c, 2)
        _claim(c, 2)
        assert c.session.beating
        start = time.monotonic()
        assert srv.stop(4.0)  # the beats never stop by themselves
        assert time.monotonic() - start < 4.0
    finally:
        c.close()


@pytest.mark.parametrize(
    ("send", "cause"),
    [
        (lambda w: w.begin(_batch().schema) or w.write_batch(_batch()), r"beats only"),
        (
            lambda w: w.write_metadata(pa.py_buffer(b"\x80" * (4 << 20))),
            r"at most 64 bytes, got 4194304",
        ),
    ],
    ids=["a-record-batch", "4-mib-of-metadata"],
)
def test_a_message_on_a_session_without_a_silence_is_read_and_refused_typed(
    plain, client, send, cause
):
    # Such a session asks for no beats; what its client sends anyway is read (not left
    # in the connection's buffers, outside the budget) and anything but a beat ends it.
    _declare(client, 4)
    desc = fl.FlightDescriptor.for_command(SessionCommand().to_wire())
    # A deadline: a server that leaves the message unread never answers.
    writer, reader = plain.do_exchange(desc, options=fl.FlightCallOptions(timeout=SOON))
    reply = msgpack.unpackb(reader.read_chunk().app_metadata.to_pybytes())
    assert "silence" not in reply
    assert _plain_claim(plain, reply["session"], 2) == ["k0", "k1"]
    _ends_typed(client, writer, reader, send, cause)


def test_a_session_without_a_silence_whose_client_closes_its_side_lives_on(plain, client):
    _declare(client, 2)
    writer, reader = plain.do_exchange(fl.FlightDescriptor.for_command(SessionCommand().to_wire()))
    reply = msgpack.unpackb(reader.read_chunk().app_metadata.to_pybytes())
    assert _plain_claim(plain, reply["session"], 2) == ["k0", "k1"]
    writer.done_writing()
    time.sleep(0.5)
    assert _leased(client) == 2  # the leases hold until the call ends
    _end(writer, reader)
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)


def test_beats_on_a_session_opened_without_a_silence_harm_nothing(plain, client):
    # A session opened without a silence reads nothing: a client that beats anyway is
    # not cut, and its leases hold (the stream's end still ends them).
    _declare(client, 2)
    desc = fl.FlightDescriptor.for_command(SessionCommand().to_wire())
    writer, reader = plain.do_exchange(desc)
    reply = msgpack.unpackb(reader.read_chunk().app_metadata.to_pybytes())
    assert "silence" not in reply
    assert _plain_claim(plain, reply["session"], 2) == ["k0", "k1"]
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            with contextlib.suppress(Exception):
                writer.write_metadata(pa.py_buffer(SessionBeat().to_wire()))

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join()
    assert _leased(client) == 2
    _end(writer, reader)
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)


def test_closing_a_beating_client_of_a_frozen_server_returns_at_once():
    # The server is SIGSTOPped: its socket takes the beats without reading them. Closing
    # the client never waits for the connection's keepalive (30 s at a 60 s timeout).
    with cli_server() as (location, proc):
        c = flightq.connect(location, [TEXT], timeout=60.0, session_timeout=SILENCE)
        try:
            _declare(c, 2)
            _claim(c, 2)
            assert c.session.beating
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(3 * SILENCE)  # 30 beats into the frozen server's socket
            start = time.monotonic()
            c.close()
            assert time.monotonic() - start < 10.0
            assert not c.session.beating
        finally:
            os.kill(proc.pid, signal.SIGCONT)


def test_closing_a_client_ends_its_beat_thread_before_it_returns(server):
    # A beat thread left to end on its own may drop the stream's writer while the
    # interpreter shuts down; the writer's C++ destructor then cannot take the GIL back and
    # the process aborts ("terminate called without an active exception", exit -6).
    for _ in range(5):
        with flightq.connect(server.location, [TEXT], timeout=TIMEOUT, session_timeout=30) as c:
            _declare(c, 2)
            c.ack(_claim(c, 2))
            assert c.session.beating
            c.drop("p")
            beat = c.session._beater._thread  # type: ignore[union-attr]
            assert beat.is_alive()
        assert not beat.is_alive()
