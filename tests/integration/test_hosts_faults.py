"""Faults across a link: shards on hosts of a testbed (network namespaces, 100 Mbit/s links).

A client process on ``h0`` holds one sharded client over shards on ``h1`` and ``h2``
(and ``h3`` for the snapshot test). A link set down in the middle of a put or a claim
makes that call fail within the client's timeout, naming the shard; the other shard keeps
serving; when the link comes back, the same client carries on. A shard killed and
restarted from its snapshot serves the same client again with the same rows.

Skipped where a testbed cannot be built (not root, no ``ip``/``tc``, no namespaces): the
reason says which. Every test is bounded in time; the testbed removes its namespaces and
processes however the module ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flightq_bench import hosts
from helpers_hosts import Agent, AgentError

from flightq.client.transport import keepalive_options

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(bool(hosts.problem()), reason=f"no testbed: {hosts.problem()}"),
]

#: The client's timeout per call: a shard behind a dead link must fail within it.
FAST = 3.0
#: The keepalive flightq's client derives from that timeout (a quarter of it, at least
#: 1 s: seconds between pings, and to wait for the answer). Without keepalive a put whose
#: stream is blocked on a dead link's full window never returns: pyarrow's
#: ``write_batch`` ignores the call's deadline there (measured: still blocked after 100 s
#: with a 3 s timeout, bare pyarrow Flight too); the keepalive drops the connection.
KEEPALIVE = dict(keepalive_options(FAST))["grpc.keepalive_time_ms"] / 1000
#: Slow enough that a put or claim of two W1 groups (8 MB) is still on the wire 0.15 s in.
LINK = "100mbit"
G = 16


@pytest.fixture(name="bed", scope="module")
def bed_fixture() -> Iterator[hosts.Testbed]:
    with hosts.Testbed(4, LINK) as tb:
        yield tb


@pytest.fixture(name="shards", scope="module")
def shards_fixture(bed: hosts.Testbed) -> Iterator[list[hosts.Server]]:
    servers = [bed.serve(1), bed.serve(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(name="agent")
def agent_fixture(bed: hosts.Testbed, shards: list[hosts.Server]) -> Iterator[Agent]:
    with Agent(bed.hosts[0].ns) as a:
        a("connect", [s.location for s in shards], FAST)
        yield a


def _lost(fn: Callable[[], Any], within: float = 20.0) -> AgentError:
    """The ``LeaseExpiredError`` ``fn()`` raises once the link lets it through (other
    failures tried again every 0.2 s, at most ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        try:
            got = fn()
        except AgentError as e:
            if "LeaseExpiredError" in e.kinds:
                return e
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        else:
            raise AssertionError(f"a late ack of rows another consumer acked answered {got!r}")


def _until(fn: Callable[[], Any], within: float = 20.0) -> Any:
    """``fn()`` once it stops failing (every 0.2 s, at most ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return fn()
        except AgentError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _groups_by_shard(a: Agent, prefix: str, groups: int) -> dict[int, list[int]]:
    """Group indices of a W1 step of ``groups`` groups, by the shard they route to."""
    by: dict[int, list[int]] = {}
    for i, shard in enumerate(a("shards_of", prefix, groups).values()):
        by.setdefault(shard, []).append(i)
    return by


def _two_each(a: Agent, prefix: str) -> tuple[list[int], dict[int, list[int]]]:
    """Two groups on each of the two shards, out of a step of 12."""
    by = _groups_by_shard(a, prefix, 12)
    assert len(by.get(0, [])) >= 2 and len(by.get(1, [])) >= 2, by
    return sorted(by[0][:2] + by[1][:2]), by


def _fails_fast_naming(e: pytest.ExceptionInfo[AgentError], location: str) -> None:
    err = e.value
    assert {"UnavailableError", "FlightqTimeoutError"} & set(err.kinds), err
    assert f"shard {location}" in err.message, err.message
    assert err.seconds < FAST + 2 * KEEPALIVE + 2, f"took {err.seconds:.1f}s"


def test_a_link_down_in_a_put_fails_it_fast_naming_the_shard_and_the_other_shard_serves(
    bed: hosts.Testbed, shards: list[hosts.Server], agent: Agent
) -> None:
    a, p = agent, "put-fault"
    a("create", p)
    only, by = _two_each(a, "a")
    a.send("put", p, "a", 12, only=only, put_id="a1")
    time.sleep(0.15)
    bed.link_down(1)  # shard 0's host
    try:
        with pytest.raises(AgentError) as e:
            a.result(timeout=30)
        _fails_fast_naming(e, shards[0].location)
        # The other shard keeps serving: a put and a get of rows that live there.
        other = a("put", p, "b", 12, only=by[1][:1])
        assert a("get", p, list(other)) == other
    finally:
        bed.link_up(1)
    # The same client, once the link is back: the put retried by its put_id lands, each
    # row once (the shard that rolled its part back forgot the id).
    want = _until(lambda: a("put", p, "a", 12, only=only, put_id="a1"))
    assert a("get", p, list(want)) == want
    assert a("rows", p) == len(want) + len(other)


def test_a_link_down_in_a_claim_fails_it_fast_naming_the_shard_and_the_other_shard_serves(
    bed: hosts.Testbed, shards: list[hosts.Server], agent: Agent
) -> None:
    a, p = agent, "claim-fault"
    a("create", p)
    only, by = _two_each(a, "c")
    put = a("put", p, "c", 12, only=only)
    a.send("claim", p, len(put), FAST)
    time.sleep(0.15)
    bed.link_down(1)
    try:
        with pytest.raises(AgentError) as e:
            a.result(timeout=30)
        _fails_fast_naming(e, shards[0].location)
        # The other shard's rows were given back by the failed claim and are claimable.
        got = a("claim", p, 2 * G, FAST)
        assert sorted(got) == sorted(_rows_of(put, by[1][:2], "c")), got
    finally:
        bed.link_up(1)
    # The same client reads the far shard's rows again once the link is back.
    far = _rows_of(put, by[0][:2], "c")
    assert _until(lambda: a("get", p, far)) == {k: put[k] for k in far}


def _rows_of(put: dict[str, int], groups: list[int], prefix: str) -> list[str]:
    """The keys of W1 groups ``groups`` (as ``_step`` names them) among ``put``."""
    heads = {f"{prefix}p{g}_" for g in groups}
    return [k for k in put if any(k.startswith(h) for h in heads)]


def test_rows_of_a_claim_broken_by_a_link_come_back_once_each_after_the_lease(
    bed: hosts.Testbed, shards: list[hosts.Server], agent: Agent
) -> None:
    a, p = agent, "lease-fault"
    a("create", p, lease=2.0)
    only, by = _two_each(a, "l")
    put = a("put", p, "l", 12, only=only)
    a.send("claim", p, len(put), FAST)
    time.sleep(0.15)
    bed.link_down(1)
    try:
        with pytest.raises(AgentError):
            a.result(timeout=30)
        first = a("claim", p, 2 * G, FAST)
        assert sorted(first) == sorted(_rows_of(put, by[1][:2], "l"))
        assert a("ack") == len(first)
    finally:
        bed.link_up(1)
    # The far shard's rows, leased to the broken claim, are ready again after the lease:
    # delivered a second time, the broken claim's delivery counted.
    second = _until(lambda: a("claim", p, 2 * G, 5.0))
    assert set(a("deliveries").values()) == {2}
    assert a("ack") == len(second)
    assert sorted(first + second) == sorted(put), "a row lost or delivered twice"
    # Acked once each: nothing comes back, not even after another lease.
    with pytest.raises(AgentError) as e:
        a("claim", p, G, 3.0)
    assert "ClaimTimeoutError" in e.value.kinds


#: The lease of the rows a cut-off consumer holds, in the test below.
LEASE = 4.0


def test_held_rows_come_back_after_the_lease_when_a_link_fails_and_at_once_when_a_consumer_dies(
    bed: hosts.Testbed, shards: list[hosts.Server], agent: Agent
) -> None:
    """Prints how long the rows took to come back (``pytest -s``): docs/deploy.md."""
    a, locations = agent, [s.location for s in shards]
    with Agent(bed.hosts[3].ns) as other:
        other("connect", locations, FAST)
        # A link that fails leaves the server's end of the connection open (it sends
        # nothing on an idle session, and has no keepalive of its own): the lease, or the
        # session's beats falling silent (test below), end the claim. Here the lease
        # (LEASE seconds after the claim) comes first: the session_timeout is 15 s.
        a("create", "held-lease", lease=LEASE)
        put = a("put", "held-lease", "h", 2)
        a("claim", "held-lease", len(put), FAST)
        claimed = time.monotonic()
        bed.link_down(0)  # the consumer's host
        try:
            with pytest.raises(AgentError):
                a("rows", "held-lease")  # the client gives its connections up
            got = other("claim", "held-lease", len(put), 3 * LEASE)
            by_lease = time.monotonic() - claimed
            assert sorted(got) == sorted(put)
            assert set(other("deliveries").values()) == {2}
            assert other("ack") == len(put)
        finally:
            bed.link_up(0)
        # The cut-off consumer's late ack acknowledges nothing, and names the rows as lost:
        # the other consumer processed them too (and acknowledged them).
        assert "0 rows were acknowledged" in _lost(lambda: a("ack")).message

        # A consumer that dies on a live link: its kernel closes the connection, the
        # session ends, and the rows are ready at once, long before the lease (600 s).
        with Agent(bed.hosts[0].ns) as doomed:
            doomed("connect", locations, FAST)
            doomed("create", "held-session")
            put = doomed("put", "held-session", "k", 2)
            doomed("claim", "held-session", len(put), FAST)
            doomed.proc.kill()  # SIGKILL
            died = time.monotonic()
            got = other("claim", "held-session", len(put), 30.0)
            by_session = time.monotonic() - died
        assert sorted(got) == sorted(put)
        assert set(other("deliveries").values()) == {2}
        assert other("ack") == len(put)
    print(
        f"\nredelivered: lease {LEASE:g}s, link down: {by_lease:.2f}s after the claim; "
        f"consumer killed, link up: {by_session:.2f}s after the kill"
    )


#: The session_timeout of the cut-off consumer below (seconds).
SILENCE = 3.0


def test_a_consumer_cut_off_by_its_link_gives_its_rows_back_after_its_session_timeout(
    bed: hosts.Testbed, shards: list[hosts.Server]
) -> None:
    """Prints how long the rows took to come back (``pytest -s``): docs/deploy.md."""
    locations = [s.location for s in shards]
    with Agent(bed.hosts[0].ns) as cut, Agent(bed.hosts[3].ns) as other:
        cut("connect", locations, FAST, session_timeout=SILENCE)
        other("connect", locations, FAST)
        # The default lease (600 s): only the session's silence can end this claim soon.
        cut("create", "held-beats")
        put = cut("put", "held-beats", "b", 2)
        cut("claim", "held-beats", len(put), FAST)
        bed.link_down(0)  # the consumer's host: its beats stop reaching the shards
        down = time.monotonic()
        try:
            got = other("claim", "held-beats", len(put), 30.0)
            by_beats = time.monotonic() - down
            assert sorted(got) == sorted(put)
            assert set(other("deliveries").values()) == {2}
            assert other("ack") == len(put)
        finally:
            bed.link_up(0)
        # Back on its link, the cut-off consumer's late ack acknowledges nothing (it names
        # the rows as lost), and it claims again (a new session on each shard).
        assert "0 rows were acknowledged" in _lost(lambda: cut("ack")).message
        put = _until(lambda: cut("put", "held-beats", "c", 1))
        assert sorted(cut("claim", "held-beats", len(put), FAST)) == sorted(put)
        assert cut("ack") == len(put)
    # About one silence after the link went down (the shards look every 0.75 s), far
    # below the lease.
    assert SILENCE * 0.8 < by_beats < SILENCE + 10, f"{by_beats:.2f}s"
    print(f"\nredelivered: session_timeout {SILENCE:g}s, link down: {by_beats:.2f}s after it")


def test_a_shard_killed_and_restarted_from_its_snapshot_serves_the_same_client_again(
    bed: hosts.Testbed, shards: list[hosts.Server], tmp_path: Path
) -> None:
    snaps = str(tmp_path / "h3")
    (tmp_path / "h1").mkdir()
    (tmp_path / "h3").mkdir()
    # Two shards that can snapshot: one beside a module shard on h1, one on h3.
    kept = bed.serve(1, port=8816, args=["--snapshot-dir", str(tmp_path / "h1")])
    killed = bed.serve(3, args=["--snapshot-dir", snaps])
    locations = [kept.location, killed.location]
    with Agent(bed.hosts[0].ns) as a:
        a("connect", locations, FAST)
        p = "snap-fault"
        a("create", p)
        only, by = _two_each(a, "s")
        put = a("put", p, "s", 12, only=only)
        a("call", "snapshot", "s1")
        killed.kill()  # SIGKILL: the server's memory is gone
        far, near = _rows_of(put, by[1][:2], "s"), _rows_of(put, by[0][:2], "s")
        with pytest.raises(AgentError) as e:
            a("get", p, far)
        _fails_fast_naming(e, killed.location)
        assert a("get", p, near) == {k: put[k] for k in near}
        restored = bed.serve(3, args=["--snapshot-dir", snaps, "--restore", f"{snaps}/s1"])
        try:
            assert _until(lambda: a("get", p, far)) == {k: put[k] for k in far}
            assert a("rows", p) == len(put)
            assert sorted(a("claim", p, len(put), FAST)) == sorted(put)
        finally:
            restored.stop()
            kept.stop()


def test_a_testbed_whose_run_was_killed_is_removed_by_the_next() -> None:
    code = (
        "import os, signal\n"
        "from flightq_bench.hosts import Testbed\n"
        "tb = Testbed(2, '1gbit')\n"
        "s = tb.serve(1)\n"
        "print(os.getpid(), s.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pid, server = (int(x) for x in out.stdout.split())
    left = [n for n in os.listdir("/run/netns") if n.startswith(f"{hosts.PREFIX}-{pid}-")]
    assert sorted(left) == sorted(f"{hosts.PREFIX}-{pid}-{r}" for r in ("h0", "h1", "sw"))
    removed = hosts.remove_stale()
    assert set(left) <= set(removed)
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"{hosts.PREFIX}-{pid}-")]
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(server), "the server of the killed run still runs"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
