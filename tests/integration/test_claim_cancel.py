"""Stopping a waiting claim by the name its caller gave it (``call_id``, ``cancel_claim``).

A claim blocks its thread until rows come or its timeout passes; before ``cancel_claim``
a caller that gave up on one (an asyncio ``wait_for``, a trainer shutting down) could
not free that thread, and four cancelled asyncio claims held every thread of the client's
pool for their whole timeout (a put after them waited 19.8 s). Real servers on loopback,
the cancel sent from the flightq client and from plain ``pyarrow.flight``.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import (  # noqa: F401
    TEXT,
    TIMEOUT,
    cli_server,
    client_fixture,
    server_fixture,
)
from fixtures_shard import inproc_shards
from helpers_proxy import relayed
from helpers_waiting import stat_until

import flightq
from flightq.client.client import STOP_S
from flightq.protocol import ClaimTicket

pytestmark = pytest.mark.timeout(60)

#: A claim's wait in these tests: far longer than any test, so that only a cancel ends it.
LONG = 50.0


def _put(c: Any, keys: list[str]) -> None:
    c.put("p", keys, {"input_ids": [np.arange(3) for _ in keys]})


def _claim_in_thread(
    c: Any, call: str | None, n: int = 1, partition: str = "p"
) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["batch"] = c.claim(partition, "train", n, as_="numpy", timeout=LONG, call_id=call)
        except BaseException as e:  # the test looks at it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_waiting_claim_cancelled_from_another_thread_fails_typed_and_takes_no_rows(client):
    client.create_partition("p", TEXT, tasks=["train"])
    call = uuid.uuid4().hex
    t, out = _claim_in_thread(client, call)
    stat_until(client, "p", "waiting", {"train": 1})
    assert client.cancel_claim("p", call) == 1
    t.join(TIMEOUT)
    assert not t.is_alive(), "the cancelled claim still waits"
    e = out.get("error")
    assert isinstance(e, flightq.ClaimCancelledError), out
    assert e.partition == "p"
    assert "cancelled by its caller; no rows were taken" in str(e)
    stat_until(client, "p", "waiting", {"train": 0})
    _put(client, ["k0"])  # a row put after the cancel is the next claim's, first delivery
    got = client.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT)
    assert got.keys == ["k0"] and got.claim.deliveries == (1,)
    assert client.cancel_claim("p", call) == 0  # nothing waits under that name now


def test_a_cancel_that_comes_before_its_claim_refuses_the_claim_at_once(client):
    client.create_partition("p", TEXT, tasks=["train"])
    call = uuid.uuid4().hex
    assert client.cancel_claim("p", call) == 0
    _put(client, ["k0"])  # even with rows ready: the caller gave up on this claim
    with pytest.raises(flightq.ClaimCancelledError, match=r"cancelled by its caller"):
        client.claim("p", "train", 1, as_="numpy", timeout=LONG, call_id=call)
    # The name is used up: the same name claims again (a caller's retry after the cancel).
    again = client.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT, call_id=call)
    assert again.keys == ["k0"] and again.claim.deliveries == (1,)


def test_a_cancel_after_the_claim_took_its_rows_leaves_them_with_it(client):
    client.create_partition("p", TEXT, tasks=["train"])
    _put(client, ["k0", "k1"])
    call = uuid.uuid4().hex
    got = client.claim("p", "train", 2, as_="numpy", timeout=TIMEOUT, call_id=call)
    assert client.cancel_claim("p", call) == 0
    assert client.inspect("p")["leased"] == {"train": 2}
    assert client.ack(got) == 2


def test_claim_names_belong_to_their_partition(client):
    # Names were the server's alone: a claim of the same name waiting on another
    # partition took the name over (the cancel of the first missed it, which then waited
    # its whole timeout), and a cancel naming another partition refused a later claim.
    client.create_partition("p", TEXT, tasks=["train"])
    client.create_partition("q", TEXT, tasks=["train"])
    tp, outp = _claim_in_thread(client, "step-7", partition="p")
    stat_until(client, "p", "waiting", {"train": 1})
    tq, outq = _claim_in_thread(client, "step-7", partition="q")
    stat_until(client, "q", "waiting", {"train": 1})
    assert client.cancel_claim("p", "step-7") == 1
    tp.join(TIMEOUT)
    assert isinstance(outp.get("error"), flightq.ClaimCancelledError), outp
    assert client.inspect("q")["waiting"] == {"train": 1}  # q's claim of that name waits on
    assert client.cancel_claim("q", "other") == 0
    _put(client, ["k0"])
    # Not refused: the cancel of "other" named q.
    got = client.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT, call_id="other")
    assert got.keys == ["k0"]
    assert client.cancel_claim("q", "step-7") == 1
    tq.join(TIMEOUT)
    assert isinstance(outq.get("error"), flightq.ClaimCancelledError), outq
    with pytest.raises(flightq.NotFoundError, match=r"unknown partition 'zz'"):
        client.cancel_claim("zz", "step-7")


def test_a_cancel_coming_while_the_claim_is_retried_after_a_dropped_link_stops_it():
    # The link drops under a claim waiting on the request stream; the client asks again
    # per call under the same name while the server still holds the first (it has not
    # seen the stream go). A cancel then stopped the stale claim alone, answering 1,
    # and the retry waited its whole timeout, or took rows a second later, leased to a
    # caller told "stopped, no rows taken" (a helper's probe, 5 of 5 runs).
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location, [TEXT], timeout=TIMEOUT) as direct,
        relayed(srv.location) as relay,
        flightq.connect(relay.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        direct.create_partition("p", TEXT, tasks=["train"])
        _put(c, ["a0"])
        c.ack(c.claim("p", "train", 1, as_="numpy"))  # the next claim takes the stream
        call = uuid.uuid4().hex
        t, out = _claim_in_thread(c, call)
        stat_until(direct, "p", "waiting", {"train": 1})
        relay.cut()
        for _ in range(3):  # the cut connection fails the first call; gRPC then reconnects
            try:
                c.cancel_claim("p", call)
                break
            except flightq.UnavailableError:
                time.sleep(0.2)
        else:
            pytest.fail("cancel_claim never got through the relay")
        _put(direct, ["b0"])
        t.join(TIMEOUT)
        assert not t.is_alive(), "the claim still waits"
        assert isinstance(out.get("error"), flightq.ClaimCancelledError), out
        stat_until(direct, "p", "waiting", {"train": 0})
        assert direct.inspect("p")["leased"] == {"train": 0}
        got = direct.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT)
        assert got.keys == ["b0"] and got.claim.deliveries == (1,)


def test_a_sharded_claim_waiting_on_its_shards_is_cancelled_on_each():
    with inproc_shards(2) as servers:
        locations = [s.location for s in servers]
        with flightq.connect_sharded(locations, [TEXT], timeout=TIMEOUT) as c:
            c.create_partition("p", TEXT, tasks=["train"])
            call = uuid.uuid4().hex
            t, out = _claim_in_thread(c, call, n=2)
            stat_until(c.shard_clients[0], "p", "waiting", {"train": 1})
            # The claim waits on one shard at a time; every shard hears the cancel.
            assert c.cancel_claim("p", call) in (0, 1)
            t.join(TIMEOUT)
            assert not t.is_alive(), "the cancelled sharded claim still waits"
            assert isinstance(out.get("error"), flightq.ClaimCancelledError), out
            for s in c.shard_clients:
                assert s.inspect("p")["waiting"] == {"train": 0}
                assert s.inspect("p")["leased"] == {"train": 0}


def test_a_per_call_claim_from_plain_flight_is_cancelled_by_the_action(client):
    client.create_partition("p", TEXT, tasks=["train"])
    ticket = ClaimTicket(partition="p", task="train", batch_size=1, timeout=LONG, call="c1")
    out: dict[str, Any] = {}
    with fl.connect(client.location) as plain:

        def run() -> None:
            try:
                plain.do_get(fl.Ticket(ticket.to_wire())).read_all()
            except fl.FlightError as e:
                out["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        stat_until(client, "p", "waiting", {"train": 1})
        body = msgpack.packb({"partition": "p", "call": "c1"})
        reply = list(plain.do_action(fl.Action("cancel_claim", body)))
        t.join(TIMEOUT)
    assert msgpack.unpackb(reply[0].body.to_pybytes()) == {"cancelled": 1}
    assert "ClaimCancelledError" in str(out.get("error")), out


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"partition": "p"}, r"cancel_claim: missing 'call'"),
        ({"partition": "p", "call": "x" * 65}, r"'call'"),
        ({"partition": "p", "call": 7}, r"'call'"),
        ({"partition": "p", "call": ""}, r"'call' must be a non-empty string"),
        ({"partition": "p", "call": "c", "extra": 1}, r"extra"),
    ],
)
def test_a_malformed_cancel_is_refused_typed_and_the_server_serves_on(client, body, message):
    client.create_partition("p", TEXT, tasks=["train"])
    with fl.connect(client.location) as plain, pytest.raises(fl.FlightError, match=message) as e:
        list(plain.do_action(fl.Action("cancel_claim", msgpack.packb(body))))
    assert "ProtocolError" in str(e.value)
    _put(client, ["k0"])
    assert client.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT).keys == ["k0"]


def test_cancels_for_claims_that_never_come_are_forgotten_oldest_first(client):
    # Each cancel of a name no claim waits under is kept for a claim that may still
    # come; a client sending thousands keeps the server's memory of them bounded (1024).
    client.create_partition("p", TEXT, tasks=["train"])
    with fl.connect(client.location) as plain:
        for i in range(1100):
            body = msgpack.packb({"partition": "p", "call": f"n{i}"})
            list(plain.do_action(fl.Action("cancel_claim", body)))
    _put(client, ["k0", "k1"])
    # The first names were forgotten: a claim under one of them goes through...
    first = client.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT, call_id="n0")
    assert first.keys == ["k0"]
    # ...and the latest is still refused.
    with pytest.raises(flightq.ClaimCancelledError):
        client.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT, call_id="n1099")


#: A claim named by its caller, and one not (the client names it: protocol 2).
NAMES = [
    pytest.param(lambda: uuid.uuid4().hex, id="named"),
    pytest.param(lambda: None, id="unnamed"),
]


@pytest.mark.parametrize("name", NAMES)
def test_closing_the_client_stops_its_claims_waiting_in_other_threads(server, name):
    # close() returned at once and left such a claim waiting out its whole timeout (an
    # unnamed one until protocol 2, where the client names every claim).
    c = flightq.connect(server.location, [TEXT], timeout=TIMEOUT)
    c.create_partition("p", TEXT, tasks=["train"])
    t, out = _claim_in_thread(c, name())
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as watcher:
        stat_until(watcher, "p", "waiting", {"train": 1})
        c.close()
        t.join(TIMEOUT)
        assert not t.is_alive(), "the claim still waits after its client closed"
        assert isinstance(out.get("error"), flightq.ClaimCancelledError), out
        assert watcher.inspect("p")["waiting"] == {"train": 0}


@pytest.mark.parametrize("name", NAMES)
def test_closing_a_sharded_client_stops_its_claim_on_every_shard(name):
    with inproc_shards(2) as servers:
        locations = [s.location for s in servers]
        c = flightq.connect_sharded(locations, [TEXT], timeout=TIMEOUT)
        c.create_partition("p", TEXT, tasks=["train"])
        t, out = _claim_in_thread(c, name(), n=2)
        with flightq.connect(locations[0], [TEXT], timeout=TIMEOUT) as watcher:
            stat_until(watcher, "p", "waiting", {"train": 1})
            c.close()
            t.join(TIMEOUT)
        assert not t.is_alive(), "the sharded claim still waits after its client closed"
        assert isinstance(out.get("error"), flightq.ClaimCancelledError), out


def test_a_client_cancels_and_closes_only_its_own_claims_of_a_name(server):
    # Names were the partition's: a rank's close (or cancel) stopped another rank's claim
    # of the same name and kept that name refused for a minute.
    with (
        flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as b,
        flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as watcher,
    ):
        a = flightq.connect(server.location, [TEXT], timeout=TIMEOUT)
        watcher.create_partition("p", TEXT, tasks=["train"])
        ta, outa = _claim_in_thread(a, "step-1")
        tb, outb = _claim_in_thread(b, "step-1")
        stat_until(watcher, "p", "waiting", {"train": 2})
        a.close()
        ta.join(TIMEOUT)
        assert isinstance(outa.get("error"), flightq.ClaimCancelledError), outa
        stat_until(watcher, "p", "waiting", {"train": 1})  # b's claim waits on
        assert tb.is_alive()
        assert watcher.cancel_claim("p", "step-1") == 0  # the watcher's own: none
        assert b.cancel_claim("p", "step-1") == 1
        tb.join(TIMEOUT)
        assert isinstance(outb.get("error"), flightq.ClaimCancelledError), outb
        _put(watcher, ["k0"])
        assert b.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT).keys == ["k0"]


def test_closing_a_client_of_a_stalled_server_stops_its_claims_within_one_bound():
    # Each named claim's cancel waited its own 5 s in turn: 15 s for three claims.
    with cli_server() as (location, proc):
        c = flightq.connect(location, [TEXT], timeout=TIMEOUT)
        c.create_partition("p", TEXT, tasks=["train"])
        threads = [_claim_in_thread(c, call) for call in (uuid.uuid4().hex, None, None)]
        stat_until(c, "p", "waiting", {"train": 3})
        proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            c.close()
            took = time.monotonic() - started
        finally:
            proc.send_signal(signal.SIGCONT)
        for t, _ in threads:
            t.join(TIMEOUT)
        assert took < 3 * STOP_S - 1, f"close took {took:.1f} s"
        odd = [
            (i, t.is_alive(), type(out.get("error")).__name__, repr(out)[-300:])
            for i, (t, out) in enumerate(threads)
            if not isinstance(out.get("error"), flightq.FlightqError)
        ]
        assert not odd, odd
