"""Claims are leases: what a consumer claims is acknowledged, given back or comes back.

Real servers on loopback port 0, real clients, real child processes killed with SIGKILL,
and plain ``pyarrow.flight`` with messages built by hand, as a client in another language
would build them. Every lease here is short (a second or two) and every wait is bounded:
a claim's ``timeout``, or :func:`helpers_waiting.stat_until` on the server's counters.
Nothing decodes to torch unless the test is about torch, so the module runs the same in
an install without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import (  # noqa: F401
    ROOT,
    TEXT,
    TIMEOUT,
    cli_server,
    client_fixture,
    python_env,
    server_fixture,
    text_columns,
    text_keys,
)
from fixtures_shard import inproc_shards
from helpers_reliability import plain_error
from helpers_waiting import stat_until
from helpers_wire import HAS_TORCH

import flightq
import flightq.aio
from flightq.protocol import (
    CLAIM_METADATA,
    Ack,
    ClaimGrant,
    ClaimTicket,
    SessionCommand,
    SessionReply,
)
from flightq.sharding.router import Router

pytestmark = pytest.mark.timeout(60)

HAS_TENSORDICT = HAS_TORCH and importlib.util.find_spec("tensordict") is not None

#: Seconds a claim in these tests waits for rows that must come: far below the default
#: lease (600 s), so a claim that gets them shows they came back before any lease ran out.
SOON = 10.0


def _keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _declare(c: flightq.Client, name: str, n: int, **kw: Any) -> list[str]:
    """Partition ``name`` (text, task 'train' unless told) holding rows k0..k{n-1}."""
    kw.setdefault("tasks", ["train"])
    keys = _keys(n)
    c.create_partition(name, TEXT, **kw)
    c.put(name, keys, text_columns(keys))
    return keys


def _claim(c: Any, name: str, n: int, **kw: Any) -> flightq.Batch:
    kw.setdefault("timeout", SOON)
    kw.setdefault("as_", "numpy")
    return c.claim(name, "train", n, **kw)


def _counts(c: Any, name: str, task: str = "train") -> dict[str, int]:
    """The partition's lease counters for ``task``, and its claims holding rows."""
    s = c.stats()["partitions"][name]
    out = {k: s[k][task] for k in ("delivered", "acked", "leased", "dead")}
    out["claims"] = s["claims"]
    return out


def _nothing_ready(c: Any, name: str, task: str = "train") -> None:
    """No row of ``name`` is ready for ``task``: a claim of one times out."""
    with pytest.raises(flightq.ClaimTimeoutError, match=r": 0 rows ready"):
        c.claim(name, task, 1, timeout=0.0, as_="numpy")


# --------------------------------------------------------------------------- processes


@contextlib.contextmanager
def _child(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -c code args...``; SIGKILLed on the way out if it still runs."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=TIMEOUT)


def _claimed_then_killed(proc: subprocess.Popen[str]) -> list[str]:
    """The keys the child printed once it claimed, after SIGKILLing it there."""
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by pytest-timeout if the child hangs
    if not line:
        _, err = proc.communicate(timeout=TIMEOUT)
        pytest.fail(f"the consumer exited with {proc.returncode} before claiming: {err}")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
    return line.split()


#: A flightq consumer: claims, says which rows, then hangs (until SIGKILLed) without acking.
FLIGHTQ_CONSUMER = """
    import sys, time
    import flightq
    location, partition, n = sys.argv[1:]
    c = flightq.connect(location, ["rollout_text@1"], timeout=30)
    b = c.claim(partition, "train", int(n), as_="numpy", timeout=30)
    print(" ".join(b.keys), flush=True)
    time.sleep(600)
"""

#: A plain Flight consumer: a claim ticket without a session, the answer read in full.
PLAIN_CONSUMER = """
    import sys, time
    import msgpack, pyarrow.flight as fl
    location, partition, n, lease = sys.argv[1:]
    ticket = {"op": "claim", "partition": partition, "task": "train",
              "batch_size": int(n), "timeout": 30.0, "lease": float(lease)}
    client = fl.connect(location)
    table = client.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
    print(" ".join(table.column("__key__").to_pylist()), flush=True)
    time.sleep(600)
"""


def test_a_sigkilled_consumers_rows_are_claimable_at_once_when_its_session_ends(client):
    keys = _declare(client, "p", 8)  # the partition's lease: the default 600 s
    with _child(FLIGHTQ_CONSUMER, client.transport.location, "p", "4") as proc:
        taken = _claimed_then_killed(proc)
    assert taken == keys[:4]
    # Its session (a DoExchange its process held open) ended with the process: the rows
    # are ready again at once, not after the lease; within SOON seconds, far below 600.
    got = _claim(client, "p", 8)
    assert sorted(got.keys) == sorted(keys)  # none lost, none twice
    assert got.keys == keys[4:] + keys[:4]  # given back: behind the rows ready already
    by_key = dict(zip(got.keys, got.claim.deliveries, strict=True))
    assert by_key == {k: 2 if k in taken else 1 for k in keys}
    assert client.ack(got) == 8
    _nothing_ready(client, "p")
    assert _counts(client, "p") == {"delivered": 8, "acked": 8, "leased": 0, "dead": 0, "claims": 0}


def test_a_sigkilled_plain_consumer_without_a_session_gets_its_rows_back_after_the_lease(client):
    keys = _declare(client, "p", 8)
    with _child(PLAIN_CONSUMER, client.transport.location, "p", "4", "3.0") as proc:
        taken = _claimed_then_killed(proc)
    assert taken == keys[:4]
    # Nothing ties the claim to the dead process: its rows stay leased...
    assert _counts(client, "p")["leased"] == 4
    fresh = _claim(client, "p", 4)
    assert fresh.keys == keys[4:] and fresh.claim.deliveries == (1, 1, 1, 1)
    # ...until the 3-second lease runs out: a claim waiting for them gets them then.
    back = _claim(client, "p", 4)
    assert back.keys == taken and back.claim.deliveries == (2, 2, 2, 2)
    assert client.ack(fresh) + client.ack(back) == 8
    _nothing_ready(client, "p")
    assert _counts(client, "p") == {"delivered": 8, "acked": 8, "leased": 0, "dead": 0, "claims": 0}


# --------------------------------------------------------------------------- no row lost


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed: see the notorch run")
def test_a_torch_get_without_torch_reads_keys_and_tags_and_refuses_columns_typed(client):
    keys = _declare(client, "p", 4)
    got = client.get("p", keys)  # as_="torch", the default: nothing is taken by a get
    assert got.keys == keys and len(got.tags) == 4
    for read in (lambda: got["input_ids"], lambda: got.column("input_ids"), got.to_dict):
        with pytest.raises(flightq.DecodeError, match="decoding to torch needs torch"):
            read()
    assert client.get("p", keys, as_="numpy")["input_ids"][0].dtype.kind == "i"


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed: see the notorch run")
def test_a_torch_claim_without_torch_is_refused_before_claiming_and_loses_no_row(client):
    keys = _declare(client, "p", 4)
    for kw in ({"as_": "torch"}, {}, {"as_": "tensordict"}):  # {}: torch is the default
        with pytest.raises(flightq.FlightqError) as e:
            client.claim("p", "train", 4, timeout=SOON, **kw)
        if kw.get("as_") != "tensordict":
            assert isinstance(e.value, flightq.DecodeError)
            assert "decoding to torch needs torch" in str(e.value)
        assert _counts(client, "p") == {
            "delivered": 0,
            "acked": 0,
            "leased": 0,
            "dead": 0,
            "claims": 0,
        }
    got = _claim(client, "p", 4, as_="numpy")
    assert got.keys == keys and got.claim.deliveries == (1, 1, 1, 1)
    assert client.ack(got) == 4


def test_a_poison_row_goes_to_the_dead_letters_and_the_rest_of_its_claim_is_delivered(client):
    keys = _declare(client, "p", 6, max_failures=2)
    bad = "k2"
    acked: list[str] = []
    for _ in range(4):  # 6 rows, 3 at a time: k2 fails twice, the others are delivered
        ready = client.inspect("p")["ready"]["train"]
        if not ready:
            break
        try:
            with _claim(client, "p", min(3, ready)) as batch:
                if bad in batch.keys:
                    raise flightq.DecodeError(f"row {bad!r} does not decode", key=bad)
                acked += batch.keys
        except flightq.DecodeError as e:
            assert e.key == bad
    assert sorted(acked) == sorted(k for k in keys if k != bad)  # each good row once
    dead = client.dead_letters("p", "train")
    assert dead == {"keys": [bad], "why": ["failed"], "deliveries": [2], "total": 1}
    assert _counts(client, "p") == {"delivered": 5, "acked": 5, "leased": 0, "dead": 1, "claims": 0}
    assert client.inspect("p")["dead"] == {"train": 1}
    _nothing_ready(client, "p")  # the dead row blocks nothing and is not offered again
    # It is still stored, and reset revives it, its deliveries forgotten.
    assert client.get("p", [bad], as_="numpy").keys == [bad]
    assert client.reset("p", "train", [bad]) == 1
    assert client.dead_letters("p", "train")["total"] == 0
    again = _claim(client, "p", 1)
    assert again.keys == [bad] and again.claim.deliveries == (1,)
    assert client.ack(again) == 1


def test_an_exception_without_a_row_gives_the_whole_claim_back_and_counts_no_failure(client):
    keys = _declare(client, "p", 2, max_failures=1)
    with pytest.raises(RuntimeError, match="trainer step failed"), _claim(client, "p", 2):
        raise RuntimeError("trainer step failed")
    assert _counts(client, "p")["leased"] == 0
    got = _claim(client, "p", 2)  # with max_failures=1 a counted failure would kill them
    assert got.keys == keys and got.claim.deliveries == (2, 2)
    assert client.ack(got) == 2


# --------------------------------------------------------------------------- ack and nack


def test_acked_rows_are_never_delivered_again_and_acking_again_is_harmless(client):
    keys = _declare(client, "p", 4, lease=0.5)
    got = _claim(client, "p", 2)
    assert client.ack(got) == 2
    assert client.ack(got) == 0
    assert client.ack(got.claim, ["k0"]) == 0
    rest = _claim(client, "p", 2)
    assert rest.keys == keys[2:]
    # Once rest's 0.5-second lease runs out its rows come back; the acked ones never do.
    back = _claim(client, "p", 2, lease=600.0)
    assert back.keys == keys[2:] and back.claim.deliveries == (2, 2)
    with pytest.raises(flightq.ClaimTimeoutError):
        _claim(client, "p", 1, timeout=1.0)  # past the acked rows' lease: still not back
    assert _counts(client, "p")["acked"] == 2


def test_nacked_rows_are_ready_again_behind_the_rows_ready_already(client):
    keys = _declare(client, "p", 5)
    first = _claim(client, "p", 2)
    assert client.nack(first) == 2
    assert client.nack(first) == 0  # it holds nothing any more
    got = _claim(client, "p", 5)
    assert got.keys == keys[2:] + keys[:2]
    assert got.claim.deliveries == (1, 1, 1, 2, 2)
    assert client.nack(got, ["k4"]) == 1  # one row of a claim
    assert _counts(client, "p")["leased"] == 4
    again = _claim(client, "p", 1)
    assert again.keys == ["k4"] and again.claim.deliveries == (2,)
    assert client.ack(got) == 4  # the row it gave back is not its own to ack any more
    assert client.ack(again) == 1
    assert _counts(client, "p") == {"delivered": 5, "acked": 5, "leased": 0, "dead": 0, "claims": 0}


def test_a_nack_naming_a_key_twice_gives_it_back_once_and_counts_one_failure(client):
    # It raised KeyError half way (the first keys given back, their failures counted, the
    # lease never settled), untyped, with the server's traceback in a plain client's error.
    _declare(client, "p", 3, max_failures=2)
    got = _claim(client, "p", 3)
    assert client.nack(got, ["k1", "k0", "k0"], failed=True) == 2
    assert _counts(client, "p") == {"delivered": 1, "acked": 0, "leased": 1, "dead": 0, "claims": 1}
    with fl.connect(client.location) as plain:  # the same from plain Flight
        body = {"partition": "p", "claim": got.claim.id, "keys": ["k2", "k2"], "failed": False}
        reply = list(plain.do_action(fl.Action("nack", msgpack.packb(body))))
    assert msgpack.unpackb(reply[0].body.to_pybytes())["released"] == 1
    again = _claim(client, "p", 3)
    assert sorted(again.keys) == ["k0", "k1", "k2"]
    assert dict(zip(again.keys, again.claim.deliveries, strict=True)) == {"k0": 2, "k1": 2, "k2": 2}
    assert client.nack(again, ["k0", "k0"], failed=True) == 1  # its second failure: dead
    assert client.dead_letters("p", "train")["keys"] == ["k0"]


def test_a_failed_nack_counts_a_failed_delivery_and_the_last_one_goes_dead(client):
    _declare(client, "p", 2, max_failures=2)
    first = _claim(client, "p", 2)
    assert client.nack(first, failed=True) == 2
    assert client.dead_letters("p", "train")["total"] == 0  # one failure of two
    second = _claim(client, "p", 2)
    assert second.claim.deliveries == (2, 2)
    assert client.nack(second, ["k0"], failed=True) == 1  # its second failure: dead
    assert client.nack(second, ["k1"]) == 1  # given back without a failure: ready
    dead = client.dead_letters("p", "train")
    assert dead == {"keys": ["k0"], "why": ["failed"], "deliveries": [2], "total": 1}
    third = _claim(client, "p", 1)
    assert third.keys == ["k1"]
    assert client.ack(third) == 1
    _nothing_ready(client, "p")
    assert _counts(client, "p") == {"delivered": 1, "acked": 1, "leased": 0, "dead": 1, "claims": 0}


def test_rows_a_lease_keeps_failing_on_go_dead_as_expired(client):
    _declare(client, "p", 1, lease=0.3, max_failures=2)
    _claim(client, "p", 1)
    again = _claim(client, "p", 1)  # after the first lease ran out
    assert again.claim.deliveries == (2,)
    stat_until(client, "p", "dead", {"train": 1}, timeout=SOON)
    dead = client.dead_letters("p", "train")
    assert dead == {"keys": ["k0"], "why": ["expired"], "deliveries": [2], "total": 1}
    with pytest.raises(flightq.LeaseExpiredError, match=r"rows 'k0' were claimed again or went"):
        client.ack(again)


def test_a_late_ack_acknowledges_the_rows_no_other_claim_took(client):
    keys = _declare(client, "p", 3, lease=0.3)
    late = _claim(client, "p", 3)
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)  # the lease ran out
    assert client.ack(late) == 3  # ready again, and nobody took them: acknowledged
    _nothing_ready(client, "p")
    assert _counts(client, "p")["acked"] == 3 and late.keys == keys


def test_a_late_ack_after_another_claim_took_the_rows_names_them(client):
    _declare(client, "p", 3, lease=0.3)
    late = _claim(client, "p", 3)
    other = _claim(client, "p", 2, lease=600.0)  # waits for the lease to run out
    assert other.keys == ["k0", "k1"] and other.claim.deliveries == (2, 2)
    with pytest.raises(flightq.LeaseExpiredError, match=r"rows 'k0', 'k1' were claimed") as e:
        client.ack(late)
    assert e.value.key == "k0" and e.value.actual == 2 and e.value.partition == "p"
    assert "1 rows were acknowledged" in str(e.value)  # k2: nobody took it
    assert isinstance(e.value, flightq.ConflictError)
    assert client.ack(other) == 2  # the claim that holds them acks them
    assert _counts(client, "p") == {"delivered": 3, "acked": 3, "leased": 0, "dead": 0, "claims": 0}


def test_a_late_ack_after_another_claim_acked_the_rows_names_them(client):
    # The rows another claim took and acknowledged since were processed twice: the late
    # ack said nothing of them before (0, no error), as a trainer whose DataLoader held
    # a batch past its lease saw.
    _declare(client, "p", 3, lease=0.3)
    late = _claim(client, "p", 3)
    other = _claim(client, "p", 2, lease=600.0)  # waits for the lease to run out
    assert client.ack(other) == 2
    with pytest.raises(flightq.LeaseExpiredError, match=r"rows 'k0', 'k1' were claimed") as e:
        client.ack(late)
    assert "1 rows were acknowledged" in str(e.value)  # k2: nobody took it
    # Again: the rows it lost are named again, k2 (its own, acknowledged) is no news.
    with pytest.raises(flightq.LeaseExpiredError, match=r"rows 'k0', 'k1' were .*; 0 rows"):
        client.ack(late)
    assert client.ack(late, ["k2"]) == 0
    assert _counts(client, "p") == {"delivered": 3, "acked": 3, "leased": 0, "dead": 0, "claims": 0}


def test_an_ack_never_acknowledges_a_row_put_again_under_a_cleared_key(client):
    keys = _declare(client, "p", 4, lease=0.3)
    got = _claim(client, "p", 2)
    client.clear("p", keys[:2])
    client.put("p", keys[:2], text_columns(keys[:2], seed=1))  # the next step's rows
    # Cleared: acknowledged. The new rows under the same keys are not the claim's.
    assert client.ack(got) == 0
    late = _claim(client, "p", 2)  # k2, k3; its lease runs out
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)
    client.clear("p", keys[2:])
    client.put("p", keys[2:], text_columns(keys[2:], seed=2))
    taken = _claim(client, "p", 4, lease=600.0)  # every new row, k2 and k3 included
    assert client.ack(late) == 0  # nothing lost: its rows were cleared
    assert taken.claim.deliveries == (1, 1, 1, 1)
    assert client.ack(taken) == 4
    assert _counts(client, "p") == {"delivered": 4, "acked": 4, "leased": 0, "dead": 0, "claims": 0}


def test_an_ack_of_keys_the_claim_did_not_take_acks_nothing(client):
    _declare(client, "p", 4)
    got = _claim(client, "p", 2)
    for call in (client.ack, client.nack):
        with pytest.raises(flightq.NotFoundError, match=r"did not take row key 'k3'") as e:
            call(got, ["k0", "k3"])
        assert e.value.key == "k3"
        with pytest.raises(flightq.NotFoundError, match=r"did not take row key 'nope'"):
            call(got, ["nope"])
    assert _counts(client, "p")["acked"] == 0 and _counts(client, "p")["leased"] == 2
    assert client.ack(got) == 2


def test_an_ack_of_an_unknown_claim_is_not_found(client):
    _declare(client, "p", 1)
    got = _claim(client, "p", 1)
    lie = flightq.Claim("p", "train", "0" * 32, got.claim.keys, (1,), 600.0, math.inf)
    for call in (client.ack, client.nack):
        with pytest.raises(flightq.NotFoundError, match=r"knows no claim '0{32}'") as e:
            call(lie)
        assert e.value.key == "0" * 32
    with pytest.raises(flightq.ProtocolError, match=r"this batch was not claimed"):
        client.ack(client.get("p", ["k0"], as_="numpy"))
    assert client.ack(got) == 1


def test_clearing_rows_acknowledges_them_and_a_later_ack_is_harmless(client):
    keys = _declare(client, "p", 4)
    got = _claim(client, "p", 4)
    assert client.clear("p", keys[:2]) == 2
    assert _counts(client, "p") == {"delivered": 2, "acked": 0, "leased": 2, "dead": 0, "claims": 1}
    assert client.ack(got) == 2  # the rows still there
    # A trainer that clears the whole partition inside its with-block: leaving it acks.
    assert client.clear("p") == 2
    client.put("p", keys, text_columns(keys))
    with _claim(client, "p", 4) as batch:
        assert client.clear("p") == 4
    assert client.ack(batch) == 0
    assert _counts(client, "p") == {"delivered": 0, "acked": 0, "leased": 0, "dead": 0, "claims": 0}


def test_stats_count_delivered_acked_leased_dead_and_claims(client):
    _declare(client, "p", 6, tasks=["train", "ref"], max_failures=1)
    a, b = _claim(client, "p", 2), _claim(client, "p", 2)
    s = client.stats()["partitions"]["p"]
    assert s["delivered"] == {"train": 4, "ref": 0} and s["leased"] == {"train": 4, "ref": 0}
    assert s["claims"] == 2 and s["acked"] == {"train": 0, "ref": 0}
    client.ack(a)
    client.nack(b, ["k2"], failed=True)  # max_failures=1: dead at once
    s = client.inspect("p")
    assert s["delivered"] == {"train": 3, "ref": 0}
    assert s["acked"] == {"train": 2, "ref": 0}
    assert s["leased"] == {"train": 1, "ref": 0}
    assert s["dead"] == {"train": 1, "ref": 0}
    assert s["claims"] == 1
    assert s["ready"] == {"train": 2, "ref": 6}  # the tasks' leases are their own
    client.ack(b)
    assert client.stats()["partitions"]["p"]["claims"] == 0


def test_an_expired_lease_in_a_grouped_partition_gives_back_whole_groups_then_the_rest(client):
    keys = text_keys(3, 4)
    client.create_partition("g", TEXT, tasks=["train"], group_size=4, lease=0.5)
    client.put("g", keys, text_columns(keys))
    first = client.claim("g", "train", 8, timeout=SOON, as_="numpy")
    assert first.keys == keys[:8]
    client.ack(first, keys[:2])  # part of the first group done; the rest runs out
    got = client.claim("g", "train", 4, timeout=SOON, as_="numpy", lease=600.0)
    assert got.keys == keys[8:]  # the one group never claimed, first
    back = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    assert back.keys == keys[4:8] and back.claim.deliveries == (2, 2, 2, 2)  # the whole group
    # The first group, acked in part, is not stranded: its rest comes alone, short.
    rest = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    assert rest.keys == keys[2:4] and rest.claim.deliveries == (2, 2)
    assert client.ack(rest) == 2 and client.ack(got) == 4 and client.ack(back) == 4
    assert client.inspect("g")["acked"] == {"train": 12}


def test_the_rest_of_a_group_given_back_in_part_waits_for_the_part_still_out(client):
    keys = text_keys(2, 4)
    client.create_partition("g", TEXT, tasks=["train"], group_size=4)
    client.put("g", keys, text_columns(keys))
    first = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    client.nack(first, first.keys[:2])  # two rows back, two still leased
    got = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    assert got.keys == keys[4:]  # the other group; never half of one still out
    with pytest.raises(flightq.ClaimTimeoutError):
        client.claim("g", "train", 4, timeout=0.2, as_="numpy")
    client.ack(first)  # the two it still held are done: the two given back are the rest
    rest = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    assert rest.keys == keys[:2] and rest.claim.deliveries == (2, 2)


def test_a_dead_row_leaves_the_rest_of_its_group_claimable(client):
    keys = text_keys(1, 4)
    client.create_partition("g", TEXT, tasks=["train"], group_size=4, max_failures=1)
    client.put("g", keys, text_columns(keys))
    first = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    client.nack(first, keys[1:2], failed=True)  # one failed delivery: dead at once
    client.nack(first)  # the rest back, no failure counted
    assert client.inspect("g")["dead"] == {"train": 1}
    rest = client.claim("g", "train", 4, timeout=SOON, as_="numpy")
    assert rest.keys == [keys[0], keys[2], keys[3]]


def test_a_group_with_a_cleared_row_is_delivered_without_it(client):
    keys = text_keys(2, 4)
    client.create_partition("g", TEXT, tasks=["train"], group_size=4)
    client.put("g", keys, text_columns(keys))
    client.clear("g", keys[:1])
    # Whole groups first, then the rest of the cleared one, short of the 8 asked.
    got = client.claim("g", "train", 8, timeout=SOON, as_="numpy")
    assert got.keys == keys[4:] + keys[1:4]


def test_a_waiting_claim_wakes_when_a_lease_expires(client):
    keys = _declare(client, "p", 2, lease=0.5)
    _claim(client, "p", 2)
    stat_until(client, "p", "leased", {"train": 2}, timeout=SOON)
    # Nothing is put, cleared or given back: only the lease's end can wake this claim.
    got = _claim(client, "p", 2, timeout=SOON)
    assert got.keys == keys and got.claim.deliveries == (2, 2)
    assert client.ack(got) == 2


def test_a_claims_lease_is_its_own_or_the_partitions(client):
    _declare(client, "p", 3, lease=30.0)
    assert _claim(client, "p", 1).claim.lease == 30.0
    assert _claim(client, "p", 1, lease=5.0).claim.lease == 5.0
    assert _claim(client, "p", 1, lease=math.inf).claim.lease == math.inf
    assert client.describe("p")["lease"] == 30.0
    for bad in (0.0, -1.0, math.nan, 1e10):
        with pytest.raises(flightq.ProtocolError, match=r"'lease'"):
            client.create_partition("q", TEXT, tasks=["train"], lease=bad)


# --------------------------------------------------------------------------- client lifetime


def test_closing_a_client_gives_its_unacked_rows_back_at_once(server):
    with flightq.connect(server.location, [TEXT], timeout=TIMEOUT) as other:
        keys = _declare(other, "p", 4)
        consumer = flightq.connect(server.location, [TEXT], timeout=TIMEOUT)
        got = _claim(consumer, "p", 3)
        consumer.ack(got, ["k0"])
        consumer.close()
        stat_until(other, "p", "leased", {"train": 0}, timeout=SOON)  # lease: 600 s
        back = _claim(other, "p", 3)
        assert back.keys == [keys[3], "k1", "k2"]
        assert back.claim.deliveries == (1, 2, 2)
        assert other.ack(back) == 3


def test_a_server_stops_on_sigterm_while_a_consumer_session_is_open():
    with cli_server() as (location, proc), flightq.connect(location, [TEXT]) as c:
        _declare(c, "p", 1)
        _claim(c, "p", 1)  # opens the session: a DoExchange the server holds open
        proc.terminate()
        assert proc.wait(timeout=SOON) == 0  # no wait for the session to end first


def test_a_claim_after_the_server_restarted_opens_a_new_session():
    with contextlib.ExitStack() as closing:
        with cli_server() as (location, _):
            c = closing.enter_context(flightq.connect(location, [TEXT], timeout=TIMEOUT))
            _declare(c, "p", 2)
            first = _claim(c, "p", 1)
            old = c.session.id()
        # The server stopped (SIGTERM) and starts again on its port; the client stays.
        with cli_server("--port", location.rsplit(":", 1)[1]) as (again, _):
            assert again == location
            _declare(c, "p", 2)  # the same client: its connection comes back
            got = _claim(c, "p", 2)  # its ticket names the old session first
            assert got.keys == ["k0", "k1"] and got.claim.deliveries == (1, 1)
            assert c.session.id() != old
            with pytest.raises(flightq.NotFoundError, match=r"knows no claim"):
                c.ack(first)  # leases do not survive a restart
            with flightq.connect(location, timeout=TIMEOUT) as watcher:
                # The new session is the one the server ends when the client closes.
                c.close()
                stat_until(watcher, "p", "leased", {"train": 0}, timeout=SOON)


# --------------------------------------------------------------------------- plain Flight


@pytest.fixture(name="plain")
def plain_fixture(server: flightq.Server, client: flightq.Client) -> Iterator[fl.FlightClient]:
    """A plain Flight client to ``server``, whose partition 'p' holds k0..k3 (lease 600 s)."""
    _declare(client, "p", 4)
    with fl.connect(server.location) as c:
        yield c


def _plain_claim(
    plain: fl.FlightClient, n: int = 2, **extra: Any
) -> tuple[ClaimGrant, list[str], dict[str, Any]]:
    ticket = {"op": "claim", "partition": "p", "task": "train", "batch_size": n, "timeout": 5.0}
    reader = plain.do_get(fl.Ticket(msgpack.packb({**ticket, **extra})))
    raw = reader.schema.metadata[CLAIM_METADATA]
    table = reader.read_all()
    return ClaimGrant.parse(raw), table.column("__key__").to_pylist(), msgpack.unpackb(raw)


def _plain_action(plain: fl.FlightClient, kind: str, body: Any) -> dict[str, Any]:
    packed = body if isinstance(body, bytes) else msgpack.packb(body)
    (res,) = list(plain.do_action(fl.Action(kind, packed)))
    return msgpack.unpackb(res.body.to_pybytes())


def test_a_plain_claims_grant_is_in_its_schema_metadata_and_acks_by_its_id(plain):
    grant, keys, wire = _plain_claim(plain)
    assert keys == ["k0", "k1"]
    assert wire == {"claim": grant.claim, "lease": 600.0, "deliveries": [1, 1]}
    body = {"partition": "p", "claim": grant.claim, "keys": ["k1"], "failed": False}
    assert _plain_action(plain, "nack", body) == {"released": 1, "dead": 0}
    ack = Ack(partition="p", claim=grant.claim).to_wire()
    assert _plain_action(plain, "ack", ack) == {"acked": 1, "lost": []}
    grant, keys, _ = _plain_claim(plain, 3, lease=7.5)
    assert keys == ["k2", "k3", "k1"] and grant.deliveries == [1, 1, 2] and grant.lease == 7.5
    assert _plain_action(plain, "ack", {"partition": "p", "claim": grant.claim})["acked"] == 3


#: A key left out of the message.
DROP = object()

REFUSALS = [
    # DoGet claim tickets.
    ("lease-zero", "get", {"lease": 0.0}, "ProtocolError", r"'lease' must be a positive number"),
    ("lease-negative", "get", {"lease": -1.0}, "ProtocolError", r"'lease' must be a positive"),
    ("lease-nan", "get", {"lease": math.nan}, "ProtocolError", r"'lease' is NaN"),
    ("lease-1e10", "get", {"lease": 1e10}, "ProtocolError", r"'lease' must be at most 86400"),
    ("lease-a-string", "get", {"lease": "1"}, "ProtocolError", r"'lease' has type str"),
    ("batch-zero", "get", {"batch_size": 0}, "ProtocolError", r"'batch_size' in \[1, 1048576\]"),
    ("batch-2**40", "get", {"batch_size": 2**40}, "ProtocolError", r"'batch_size' in \[1, 10"),
    ("no-session", "get", {"session": "f" * 32}, "NotFoundError", r"session 'f{32}' is not open"),
    ("session-long", "get", {"session": "s" * 65}, "ProtocolError", r"'session'"),
    ("session-an-int", "get", {"session": 7}, "ProtocolError", r"'session' has type int"),
    # ack and nack bodies.
    ("ack-lying-id", "ack", {"claim": "0" * 32}, "NotFoundError", r"knows no claim '0{32}'"),
    ("nack-lying-id", "nack", {"claim": "x"}, "NotFoundError", r"knows no claim 'x'"),
    ("ack-long-id", "ack", {"claim": "c" * 65}, "ProtocolError", r"ack: .*'claim'"),
    ("ack-no-id", "ack", {"claim": DROP}, "ProtocolError", r"ack: .*'claim'"),
    ("ack-id-none", "ack", {"claim": None}, "ProtocolError", r"ack: .*'claim'"),
    ("ack-id-an-int", "ack", {"claim": 3}, "ProtocolError", r"ack: .*'claim' has type int"),
    ("ack-keys-a-str", "ack", {"keys": "k0"}, "ProtocolError", r"ack: .*'keys'"),
    ("ack-keys-ints", "ack", {"keys": [0, 1]}, "ProtocolError", r"ack: keys must be strings"),
    ("ack-other-keys", "ack", {"keys": ["k3"]}, "NotFoundError", r"did not take row key 'k3'"),
    ("nack-unknown-key", "nack", {"keys": ["zz"]}, "NotFoundError", r"did not take row key 'zz'"),
    ("nack-failed-int", "nack", {"failed": 1}, "ProtocolError", r"'failed' must be true or false"),
    ("ack-unknown-key", "ack", {"claims": "c"}, "ProtocolError", r"ack: unknown key 'claims'"),
    ("ack-not-a-map", "ack", [1, 2], "ProtocolError", r"ack"),
    ("nack-no-partition", "nack", {"partition": "q"}, "NotFoundError", r"unknown partition 'q'"),
    ("dead-letters-limit", "dead_letters", {"limit": 0}, "ProtocolError", r"'limit' in \[1, "),
]


@pytest.mark.parametrize(
    ("call", "extra", "kind", "cause"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_a_malformed_lease_message_is_refused_by_type_and_the_server_serves_on(
    plain, client, call, extra, kind, cause
):
    grant, _, _ = _plain_claim(plain)  # k0 and k1, leased
    before = _counts(client, "p")
    with pytest.raises(fl.FlightError) as e:
        if call == "get":
            _plain_claim(plain, **extra)
        elif isinstance(extra, dict):
            body = {"partition": "p", "claim": grant.claim}
            if call == "dead_letters":
                body = {"partition": "p", "task": "train"}
            merged = {**body, **extra}
            _plain_action(plain, call, {k: v for k, v in merged.items() if v is not DROP})
        else:
            _plain_action(plain, call, extra)
    got_kind, message = plain_error(e.value)
    assert got_kind == kind, message
    assert re.search(cause, message), message
    assert _counts(client, "p") == before  # nothing claimed, acked or given back
    # The server serves on: the claim is still good, the other rows claimable.
    assert _plain_action(plain, "ack", {"partition": "p", "claim": grant.claim})["acked"] == 2
    _, keys, _ = _plain_claim(plain)
    assert keys == ["k2", "k3"]


def test_a_plain_flight_session_ends_its_leases_when_its_stream_ends(plain, client):
    desc = fl.FlightDescriptor.for_command(msgpack.packb({"op": "session"}))
    writer, reader = plain.do_exchange(desc)
    first = reader.read_chunk()
    assert first.data is None
    sid = SessionReply.parse(first.app_metadata.to_pybytes()).session
    assert msgpack.unpackb(first.app_metadata.to_pybytes()) == {"session": sid}
    t = ClaimTicket(partition="p", task="train", batch_size=3, timeout=5.0, session=sid)
    table = plain.do_get(fl.Ticket(t.to_wire())).read_all()
    assert table.column("__key__").to_pylist() == ["k0", "k1", "k2"]
    assert _counts(client, "p")["leased"] == 3
    reader.cancel()
    with contextlib.suppress(fl.FlightError, pa.ArrowException):
        writer.close()
    stat_until(client, "p", "leased", {"train": 0}, timeout=SOON)  # the lease is 600 s
    # The ended session's id is refused, typed, its key the id.
    with pytest.raises(fl.FlightError) as e:
        plain.do_get(fl.Ticket(t.to_wire())).read_all()
    assert plain_error(e.value) == (
        "NotFoundError",
        f"claim from 'p': session {sid!r} is not open (the connection that opened it is "
        "gone); open a new one",
    )
    assert msgpack.unpackb(e.value.extra_info)["key"] == sid
    _, keys, wire = _plain_claim(plain, 4)
    assert keys == ["k3", "k0", "k1", "k2"] and wire["deliveries"] == [1, 2, 2, 2]


@pytest.mark.parametrize(
    ("descriptor", "cause"),
    [
        (fl.FlightDescriptor.for_path("p"), r"DoExchange: expected a command descriptor"),
        (fl.FlightDescriptor.for_command(msgpack.packb({"op": "frob"})), r"session command"),
        (fl.FlightDescriptor.for_command(msgpack.packb({"op": "session", "x": 1})), r"'x'"),
        (fl.FlightDescriptor.for_command(b"\xc1not msgpack"), r""),
        (fl.FlightDescriptor.for_command(SessionCommand().to_wire()[:-1]), r""),
    ],
    ids=["a-path", "another-op", "an-unknown-key", "not-msgpack", "cut-short"],
)
def test_a_doexchange_with_a_wrong_command_is_refused_and_the_server_serves_on(
    plain, client, descriptor, cause
):
    with pytest.raises(fl.FlightError) as e:
        writer, reader = plain.do_exchange(descriptor)
        with writer:
            reader.read_chunk()
    kind, message = plain_error(e.value)
    assert kind == "ProtocolError" and re.search(cause, message), message
    assert client.stats()["partitions"]["p"]["rows"] == 4
    assert _claim(client, "p", 4).keys == _keys(4)


# --------------------------------------------------------------------------- other clients


def _groups_on_each_shard(locations: list[str], per_shard: int) -> list[str]:
    """Keys of ``per_shard`` groups of two on each shard (placement follows the ports)."""
    router = Router(locations)
    taken: dict[int, list[str]] = {i: [] for i in range(len(locations))}
    for p in range(10_000):
        group = [f"p{p}_g0", f"p{p}_g1"]
        shard = router.shard_of(group[0])
        if len(taken[shard]) < 2 * per_shard:
            taken[shard] += group
        if all(len(t) == 2 * per_shard for t in taken.values()):
            return [k for t in taken.values() for k in t]
    raise AssertionError(f"no balanced groups over {locations}")


def test_a_sharded_claim_acks_and_gives_back_on_every_shard():
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(inproc_shards(2))
        locations = [s.location for s in servers]
        keys = _groups_on_each_shard(locations, 4)
        c = stack.enter_context(flightq.connect_sharded(locations, [TEXT], timeout=SOON))
        shards = [stack.enter_context(flightq.connect(loc, [TEXT])) for loc in locations]
        c.create_partition("s", TEXT, tasks=["train"], group_size=2, lease=600.0)
        c.put("s", keys, text_columns(keys))
        held = [shard.stats()["partitions"]["s"]["rows"] for shard in shards]
        assert all(held) and sum(held) == 16, held  # both shards hold groups
        got = c.claim("s", "train", 16, timeout=SOON, as_="numpy")
        assert sorted(got.keys) == sorted(keys)
        parts = got.claim.parts
        assert {p.shard for p in parts} == {0, 1}  # a shard may give in several
        assert sorted(k for p in parts for k in p.keys) == sorted(keys)
        assert got.claim.deliveries == (1,) * 16
        assert [_counts(s, "s")["leased"] for s in shards] == held
        # nack of a few rows: each shard gives back its own.
        one = {p.shard: p.keys[:2] for p in parts}
        assert c.nack(got, one[0] + one[1]) == 4
        assert [_counts(s, "s")["leased"] for s in shards] == [h - 2 for h in held]
        with pytest.raises(flightq.NotFoundError, match=r"did not take row key 'zz'"):
            c.ack(got, ["zz"])
        assert c.ack(got) == 12
        assert [_counts(s, "s")["acked"] for s in shards] == [h - 2 for h in held]
        with c.claim("s", "train", 4, timeout=SOON, as_="numpy") as again:
            assert sorted(again.keys) == sorted(one[0] + one[1])
            assert again.claim.deliveries == (2, 2, 2, 2)
        assert [_counts(s, "s")["acked"] for s in shards] == held
        assert sum(_counts(s, "s")["leased"] for s in shards) == 0
        assert c.dead_letters("s", "train")["total"] == 0


def test_an_async_client_acks_and_gives_back(server):
    async def main() -> tuple[int, int, int, list[int]]:
        async with await flightq.aio.connect(server.location, [TEXT], timeout=TIMEOUT) as c:
            await c.create_partition("a", TEXT, tasks=["train"])
            await c.put("a", _keys(3), text_columns(_keys(3)))
            first = await c.claim("a", "train", 3, timeout=SOON, as_="numpy")
            released = await c.nack(first, ["k2"])
            acked = await c.ack(first)
            again = await c.claim("a", "train", 1, timeout=SOON, as_="numpy")
            failed = await c.nack(again, failed=True)
            dead = await c.dead_letters("a", "train")
            return released, acked, failed, [*again.claim.deliveries, dead["total"]]

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT)) == (1, 2, 1, [2, 0])


@pytest.mark.skipif(not HAS_TENSORDICT, reason="tensordict is not installed")
def test_a_tensordict_claim_is_acked_through_the_client(client):
    keys = _declare(client, "p", 4)
    td = client.claim("p", "train", 2, timeout=SOON, as_="tensordict")
    assert list(td["__key__"]) == keys[:2]
    assert td._flightq_claim.keys == tuple(keys[:2])
    assert client.nack(td, [keys[1]]) == 1
    assert client.ack(td) == 1
    rest = client.claim("p", "train", 3, timeout=SOON, as_="tensordict")
    assert list(rest["__key__"]) == [keys[2], keys[3], keys[1]]
    assert client.ack(rest) == 3
    assert _counts(client, "p") == {"delivered": 4, "acked": 4, "leased": 0, "dead": 0, "claims": 0}
