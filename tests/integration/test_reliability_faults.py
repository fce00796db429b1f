"""Faults: stalled and dead servers, abandoned claims, retried puts, shutdown, snapshots.

Servers that must be stopped or killed run as ``flightq serve`` child processes; the
rest run in-process. Every wait is bounded and every process is cleaned up on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, cli_server, raw, text_columns
from helpers_proxy import relayed
from helpers_reliability import plain_put, put_command, text_batch
from helpers_waiting import stat_until

import flightq
from flightq import workloads
from flightq.server.store import Store

pytestmark = pytest.mark.timeout(180)

#: Seconds a call to a stalled server may take before it must fail typed.
SHORT = 0.5


@contextlib.contextmanager
def stopped(proc: subprocess.Popen[str]) -> Iterator[None]:
    """SIGSTOP the process for the block (once the kernel shows it stopped); SIGCONT it
    afterwards, even on failure."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + TIMEOUT
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.01)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def _killed(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=TIMEOUT)


# --------------------------------------------------------------------------- timeouts


def test_every_call_to_a_stalled_then_dead_server_fails_typed_within_its_timeout():
    keys = ["a0", "a1"]
    with cli_server() as (location, proc):
        # Set up with a patient client; the calls under test use the short default timeout.
        with flightq.connect(location, [TEXT], timeout=TIMEOUT) as setup:
            setup.create_partition("p", TEXT, tasks=["train"])
            setup.put("p", keys, text_columns(keys))
        c = flightq.connect(location, [TEXT], timeout=SHORT)
        try:
            calls = {
                "health": lambda: c.health(),
                "stats": lambda: c.stats(),
                "inspect": lambda: c.inspect("p"),
                "describe": lambda: c.describe("p"),
                "get": lambda: c.get("p", keys, as_="numpy"),
                "put": lambda: c.put("p", ["b0"], text_columns(["b0"])),
                "clear": lambda: c.clear("p", ["zz"]),
                "reset": lambda: c.reset("p", "train"),
                "partitions": lambda: c.partitions(),
                "claim": lambda: c.claim("p", "train", 1, as_="numpy", timeout=0.1),
                "connect": lambda: flightq.connect(location, [TEXT], timeout=SHORT),
            }
            with stopped(proc):
                for name, call in calls.items():
                    with pytest.raises(
                        (flightq.FlightqTimeoutError, flightq.UnavailableError),
                        match=r"timed out|unavailable|Deadline",
                    ) as exc:
                        call()
                    assert not isinstance(exc.value, flightq.ClaimTimeoutError), name
            # Continued: it serves again, and nothing was lost or half-done meanwhile.
            assert c.health(timeout=TIMEOUT)["ok"] is True
            # The put that timed out may or may not have landed: retrying it is safe.
            assert c.put("p", ["b0"], text_columns(["b0"]), timeout=TIMEOUT) == 1
            assert c.get("p", [*keys, "b0"], as_="numpy").keys == [*keys, "b0"]
            assert c.stats()["rows"] == 3
            _killed(proc)
            for name in ("health", "get", "put", "claim", "connect"):
                with pytest.raises(flightq.UnavailableError, match=r"server unavailable"):
                    calls[name]()
        finally:
            c.close()


class ClaimWatchingServer(flightq.Server):
    """A real server that reports how each DoGet's claim ended."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gets: queue.Queue[str] = queue.Queue()

    def do_get(self, context, ticket):  # type: ignore[no-untyped-def]
        try:
            out = super().do_get(context, ticket)
        except BaseException as e:
            self.gets.put(f"refused: {e}")
            raise
        self.gets.put("answered")
        return out


@pytest.mark.torch
def test_a_claim_its_caller_abandoned_stops_waiting_and_takes_no_rows():
    ticket = {"op": "claim", "partition": "p", "task": "train", "batch_size": 1}
    ticket.update(fields=None, timeout=TIMEOUT)
    with ClaimWatchingServer() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["train"])
        with fl.connect(srv.location) as plain, pytest.raises(fl.FlightTimedOutError):
            options = fl.FlightCallOptions(timeout=0.3)
            plain.do_get(fl.Ticket(msgpack.packb(ticket)), options=options).read_all()
        # The server notices the caller left and stops waiting (well before TIMEOUT).
        outcome = srv.gets.get(timeout=TIMEOUT / 2)
        assert "FlightqTimeoutError: claim from 'p' for task 'train' was cancelled" in outcome
        # Counted as a call whose client had gone, not as a refusal (a preempted trainer
        # would otherwise raise the refusal counters that alerts watch).
        counters = c.stats()["counters"]
        assert counters["cancelled"] == 1 and counters["refusals"] == {}
        c.put("p", ["k0"], text_columns(["k0"]))
        assert c.inspect("p")["delivered"] == {"train": 0}
        assert c.claim("p", "train", 1, timeout=TIMEOUT).keys == ["k0"]


def test_calls_to_a_restarted_server_not_answering_yet_end_near_their_timeout() -> None:
    # The server dies and comes back on its port, stalled (accepting connections, saying
    # nothing): a call that opens a stream without a deadline (the request stream's)
    # waited for gRPC's 20 s connection attempt (18 s of a 2 s timeout). Each call now
    # ends within its timeout plus the documented greeting wait, typed; once the server
    # runs, the client reaches it again by itself.
    keys = ["a0", "a1"]
    with cli_server() as (location, first):
        port = location.rsplit(":", 1)[1]
        c = flightq.connect(location, [TEXT], timeout=2.0)
        try:
            c.create_partition("p", TEXT, tasks=["train"])
            c.put("p", keys, text_columns(keys))  # the request stream is open
            c.ack(c.claim("p", "train", 2, as_="numpy"))
            _killed(first)
            with cli_server("--port", port) as (again, second):
                assert again == location
                with stopped(second):
                    for name, call in {
                        "create": lambda: c.create_partition("p", TEXT, tasks=["train"]),
                        "put": lambda: c.put("p", ["b0"], text_columns(["b0"])),
                        "stats": lambda: c.stats(),
                        # its consumer session opens again (a stream without a deadline)
                        "claim": lambda: c.claim("p", "train", 1, as_="numpy", timeout=1.0),
                    }.items():
                        started = time.monotonic()
                        with pytest.raises((flightq.FlightqTimeoutError, flightq.UnavailableError)):
                            call()
                        took = time.monotonic() - started
                        # timeout 2 s + 0.5 s + a greeting's 5 s at most (18 s before;
                        # a claim's limit is its wait + 5 s: 11 s before)
                        assert took < 10.0, (name, took)
                deadline = time.monotonic() + TIMEOUT
                while True:
                    try:
                        c.create_partition("p", TEXT, tasks=["train"])
                        break
                    except (flightq.FlightqTimeoutError, flightq.UnavailableError):
                        assert time.monotonic() < deadline, "the client never came back"
                        time.sleep(0.1)
                assert c.put("p", ["b0"], text_columns(["b0"])) == 1
        finally:
            c.close()


def test_a_claim_waiting_on_the_request_stream_when_the_link_drops_ends_near_its_timeout():
    # The link drops 2 s into a 4 s claim waiting on the request stream (the server keeps
    # running): the claim goes per call, and again under a new consumer session, each
    # with what is left of its wait, not the whole wait again (6.1 s before).
    wait, cut_at = 4.0, 2.0
    with (
        flightq.Server() as srv,
        relayed(srv.location) as relay,
        flightq.connect(relay.location, [TEXT], timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", TEXT, tasks=["train"])
        c.put("p", ["a0", "a1"], text_columns(["a0", "a1"]))
        c.ack(c.claim("p", "train", 2, as_="numpy"))  # the next claim takes the stream
        cutter = threading.Timer(cut_at, relay.cut)
        cutter.start()
        started = time.monotonic()
        try:
            with pytest.raises(flightq.ClaimTimeoutError):
                c.claim("p", "train", 1, as_="numpy", timeout=wait)
            took = time.monotonic() - started
        finally:
            cutter.join()
        assert took < wait + 1.5, took
        c.put("p", ["b0"], text_columns(["b0"]))
        assert c.claim("p", "train", 1, as_="numpy", timeout=TIMEOUT).keys == ["b0"]


def test_store_claim_polls_its_cancellation_callable():
    store = Store()
    store.declare("p", flightq.SchemaRegistry.default().get(TEXT), ["train"], None)
    with pytest.raises(flightq.FlightqTimeoutError, match=r"cancelled by its caller"):
        store.claim("p", "train", 1, None, float("inf"), cancelled=lambda: True)


# --------------------------------------------------------------------------- retries


def test_retrying_a_put_with_identical_content_is_acknowledged_and_stores_nothing_twice(
    tmp_path,
):
    keys = ["a0", "a1", "a2", "a3"]
    cols = text_columns(keys)
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["train"], group_size=2)
        tags = [{"step": 1}] * 4
        assert c.put("p", keys, cols, tags) == 4
        before = c.inspect("p")
        assert c.put("p", keys, cols, tags) == 4  # the retry of a put whose ack was lost
        assert c.inspect("p") == before
        # A write-back retried, too.
        lp = [np.full(len(x), -0.5, np.float32) for x in cols["input_ids"]]
        assert c.put("p", keys, {"prev_logprobs": lp}) == 4
        assert c.put("p", keys, {"prev_logprobs": lp}) == 4
        # A lost acknowledgement from a plain client: it never reads the ack.
        with fl.connect(srv.location) as plain:
            batch = text_batch(["b0", "b1"])
            writer, _ = plain.do_put(put_command("p", rows=2), batch.schema)
            writer.write_batch(batch)
            writer.done_writing()
            writer.close()
        assert plain_put(srv.location, put_command("p", rows=2), [batch]) == {"rows": 2}
        # Same keys, other content: not a retry, a conflict.
        with pytest.raises(flightq.ConflictError, match=r"row key 'b0' already has column"):
            c.put_batch("p", text_batch(["b0", "b1"], seed=7))
        got = c.claim("p", "train", 6, timeout=TIMEOUT, as_="numpy")
        assert sorted(got.keys) == sorted([*keys, "b0", "b1"])
        with pytest.raises(flightq.ClaimTimeoutError, match=r"0 rows ready"):
            c.claim("p", "train", 2, as_="numpy", timeout=0.2)


@pytest.mark.torch
def test_retrying_a_put_by_its_id_after_the_rows_were_consumed_stores_nothing():
    keys = ["a0", "a1"]
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=TIMEOUT) as c:
        c.create_partition("p", TEXT, tasks=["train"])
        assert c.put("p", keys, text_columns(keys), put_id="gen3-step7-group0") == 2
        assert c.claim("p", "train", 2, timeout=TIMEOUT).keys == keys
        assert c.clear("p", keys) == 2  # consumed and cleared before the retry arrives
        assert c.put("p", keys, text_columns(keys), put_id="gen3-step7-group0") == 2
        assert c.stats()["rows"] == 0
        assert c.put("p", keys, text_columns(keys), put_id="gen3-step8-group0") == 2
        assert c.stats()["rows"] == 2


# --------------------------------------------------------------------------- shutdown


def test_graceful_shutdown_finishes_in_flight_puts_and_releases_waiting_claims():
    srv = flightq.Server().start()
    outcome: list[object] = []
    stopped_in_time: list[bool] = []
    try:
        c = flightq.connect(srv.location, timeout=TIMEOUT)
        c.create_partition("p", TEXT, tasks=["train"])
        claim_started = threading.Event()

        def waiting_claim() -> None:
            claim_started.set()
            try:
                outcome.append(c.claim("p", "train", 99, as_="numpy", timeout=float("inf")))
            except flightq.FlightqError as e:
                outcome.append(e)

        claimer = threading.Thread(target=waiting_claim, daemon=True)
        claimer.start()
        claim_started.wait(TIMEOUT)
        stat_until(c, "p", "waiting", {"train": 1})  # the claim waits on the server
        # Stopped, the server lets go of its partitions: keep this one to count its rows.
        part = srv.store.partition("p")
        whole = text_batch(["n0", "n1", "n2", "n3"])
        plain = fl.connect(srv.location)
        writer, reader = plain.do_put(put_command("p", rows=4), whole.schema)
        writer.write_batch(whole.slice(0, 2))  # a put in flight when shutdown begins
        stopper = threading.Thread(
            target=lambda: stopped_in_time.append(srv.stop(deadline=TIMEOUT)), daemon=True
        )
        stopper.start()
        claimer.join(TIMEOUT)
        assert len(outcome) == 1 and isinstance(outcome[0], flightq.UnavailableError)
        assert "the server is shutting down" in str(outcome[0])
        writer.write_batch(whole.slice(2, 2))
        writer.done_writing()
        ack = reader.read()
        writer.close()
        plain.close()
        assert msgpack.unpackb(ack.to_pybytes()) == {"rows": 4}
        stopper.join(TIMEOUT)
        assert stopped_in_time == [True]
        assert len(part.rows) == 4  # the put in flight was stored before the server went
        assert srv.store.stats()["rows"] == 0
        c.close()
    finally:
        srv.stop(deadline=TIMEOUT)


# --------------------------------------------------------------------------- snapshots


def _rows_by_key(batch: flightq.Batch) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for i, k in enumerate(batch.keys):
        row: dict[str, object] = {"__tags__": batch.tags[i]}
        for name in batch.fields:
            v = batch[name][i]
            if batch.schema[name].role == "media":
                row[name] = None if v is None else [raw(s) for s in v]
            else:
                row[name] = None if v is None else raw(v)
        out[k] = row
    return out


@pytest.mark.torch
def test_snapshot_then_sigkill_then_restore_keeps_every_acknowledged_row_and_claim(tmp_path):
    snaps = tmp_path / "snaps"
    step = workloads.w1(groups=2, g=4)
    lp = workloads.logprobs_for(step)
    with cli_server("--snapshot-dir", str(snaps)) as (location, proc):
        with flightq.connect(location, [VLM], timeout=TIMEOUT) as c:
            c.create_partition("vlm", VLM, tasks=["prev_lp", "train"], group_size=4)
            c.create_partition("empty", TEXT)
            assert c.put("vlm", step.keys, step.columns, step.tags) == 8
            assert c.put("vlm", step.keys[:4], {"prev_logprobs": lp[:4]}) == 4
            first = c.claim("vlm", "prev_lp", 4, ["input_ids"], timeout=TIMEOUT)
            assert c.ack(first) == 4  # acknowledged: done for good, snapshot included
            c.clear("vlm", [step.keys[7]])
            before = _rows_by_key(c.get("vlm", step.keys[:7], as_="numpy"))
            inspected = c.inspect("vlm")
            out = c.snapshot("s1")
            assert out["partitions"] == {"vlm": 7, "empty": 0}
            assert Path(out["path"]) == snaps / "s1"
            with pytest.raises(flightq.ConflictError, match=r"snapshot 's1' exists already"):
                c.snapshot("s1")
            with pytest.raises(flightq.ProtocolError, match=r"name '\.\./x' must be"):
                c.snapshot("../x")
            # Acknowledged after the snapshot: not in it.
            c.put("vlm", ["late_g0", "late_g1", "late_g2", "late_g3"], step.group(0).columns)
        _killed(proc)

    # Nothing pickled: a JSON manifest and Arrow IPC streams only.
    manifest = json.loads((snaps / "s1" / "manifest.json").read_text())
    assert manifest["format"] == 1
    for f in (snaps / "s1").iterdir():
        if f.name != "manifest.json":
            assert f.suffix == ".arrows"
            with pa.OSFile(str(f)) as src:
                pa.ipc.open_stream(src).read_all()
    assert not [p for p in snaps.iterdir() if p.name.startswith(".")]  # no temp dir left

    restored = cli_server("--snapshot-dir", str(snaps), "--restore", str(snaps / "s1"))
    with restored as (loc, _), flightq.connect(loc, [VLM], timeout=TIMEOUT) as c:
        assert sorted(c.partitions()) == ["empty", "vlm"]
        assert c.create_partition("vlm", VLM, ["prev_lp", "train"], 4) is False
        after = c.inspect("vlm")
        # What the budget counts depends on how the rows' record batches were cut (the
        # snapshot's, not the puts'): close, not equal.
        held, held_before = after.pop("held"), inspected.pop("held")
        assert abs(held - held_before) <= 0.01 * held_before
        assert after == inspected
        assert _rows_by_key(c.get("vlm", step.keys[:7], as_="numpy")) == before
        with pytest.raises(flightq.NotFoundError, match=r"no row key 'late_g0'"):
            c.get("vlm", ["late_g0"])
        # Consumption state survived: prev_lp already had group 0; group 1 lost a row, so
        # its rest comes alone, and nothing after it.
        rest = c.claim("vlm", "prev_lp", 4, ["input_ids"], timeout=TIMEOUT)
        assert rest.keys == step.keys[4:7]
        c.ack(rest)
        with pytest.raises(flightq.ClaimTimeoutError, match=r"0 rows ready"):
            c.claim("vlm", "prev_lp", 4, ["input_ids"], timeout=0.2)
        got = c.claim("vlm", "train", 4, timeout=TIMEOUT)
        assert got.keys == first.keys == step.keys[:4]
        # The restored server takes new writes.
        fresh = [f"new_g{i}" for i in range(4)]
        assert c.put("vlm", fresh, step.group(1).columns, step.group(1).tags) == 4
        assert c.claim("vlm", "prev_lp", 4, ["input_ids"], timeout=TIMEOUT).keys == fresh


def test_a_corrupt_or_missing_snapshot_refuses_to_restore(tmp_path):
    with flightq.Server(snapshot_dir=tmp_path) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT)
        c.put("p", ["a"], text_columns(["a"]))
        c.snapshot("s")
    rows = next((tmp_path / "s").glob("*.rows.arrows"))
    data = bytearray(rows.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rows.write_bytes(bytes(data))
    with pytest.raises(flightq.DecodeError, match=r"snapshot file 'p0.rows.arrows' is corrupt"):
        flightq.Server(restore=tmp_path / "s")
    with pytest.raises(flightq.DecodeError, match=r"is not a readable flightq snapshot"):
        flightq.Server(restore=tmp_path / "nope")
    with (
        flightq.Server() as srv,
        flightq.connect(srv.location) as c,
        pytest.raises(flightq.ProtocolError, match=r"this server has no snapshot directory"),
    ):
        c.snapshot("s")
    assert not os.path.exists(tmp_path / "nope")


def test_a_lease_run_out_before_a_snapshot_counts_its_failed_delivery_once_restored(tmp_path):
    # No call looks at the lease between its end and the snapshot: the snapshot does.
    with (
        flightq.Server(snapshot_dir=tmp_path, shm=False) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
    ):
        c.create_partition("p", "rollout_text@1", tasks=["t"], max_failures=1)
        c.put("p", ["r0"], {"input_ids": [np.arange(4, dtype=np.int64)]})
        c.claim("p", "t", 1, as_="numpy", lease=0.5)
        time.sleep(0.8)
        c.snapshot("snap")
    with (
        flightq.Server(restore=tmp_path / "snap", shm=False) as srv,
        flightq.connect(srv.location, timeout=TIMEOUT) as c,
    ):
        assert c.dead_letters("p", "t")["keys"] == ["r0"]
        with pytest.raises(flightq.ClaimTimeoutError):
            c.claim("p", "t", 1, as_="numpy", timeout=0.2)
