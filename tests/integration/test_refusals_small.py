"""Every refusal is typed and small: cut messages, no partition lists, bounded seconds,
typed snapshot and restore failures, and a warning for tokens in clear text.

Real servers on loopback port 0; wire messages crafted with plain ``pyarrow.flight`` and
msgpack, as a client in another language would send them.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, cli_server, text_columns
from helpers_reliability import plain_error, plain_put, put_command, text_batch
from helpers_waiting import stat_until

import flightq
from flightq.protocol import MAX_ERROR_MESSAGE

pytestmark = pytest.mark.timeout(90)


def _action(location: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    with fl.connect(location) as c:
        (res,) = list(c.do_action(fl.Action(kind, msgpack.packb(body))))
    return msgpack.unpackb(res.body.to_pybytes())


def _declare(location: str, name: str, tasks: list[str] | None = None) -> None:
    schema = flightq.SchemaRegistry.default().get(TEXT).canonical_json
    _action(location, "declare", {"partition": name, "schema": schema, "tasks": tasks or []})


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    with flightq.Server() as srv:
        yield srv


# --------------------------------------------------------------------------- long messages


@pytest.mark.parametrize("char", ["x", "é", "\x01"])
def test_a_100_kb_message_reaches_a_plain_client_and_flightq_as_its_class(server, char):
    name = char * 100_000  # the partition is named in the message and in an attribute
    with fl.connect(server.location) as c, pytest.raises(fl.FlightServerError) as err:
        list(c.do_action(fl.Action("clear", msgpack.packb({"partition": name}))))
    kind, message = plain_error(err.value)
    assert kind == "NotFoundError"
    assert message.startswith("unknown partition " + repr(char * 8)[:-1])
    assert message.endswith(" more bytes)")
    assert len(message.encode()) <= MAX_ERROR_MESSAGE + 32
    detail = msgpack.unpackb(err.value.extra_info)
    assert len(detail["partition"].encode()) <= 128 + 32
    assert len(str(err.value).encode()) < 2 * MAX_ERROR_MESSAGE

    with flightq.connect(server.location, timeout=TIMEOUT) as client:
        with pytest.raises(flightq.NotFoundError, match=r"^unknown partition .*more bytes\)$"):
            client.clear(name)
        assert client.stats()["partitions"] == {}  # and the server keeps serving


# --------------------------------------------------------------------------- no lists


def test_an_unknown_partition_names_a_few_close_ones_never_every_partition(server):
    for name in ["rollouts", "rollouts_v2", "alice_private", "bob_private"]:
        _declare(server.location, name)
    with fl.connect(server.location) as c:
        with pytest.raises(fl.FlightServerError) as err:
            list(c.do_action(fl.Action("clear", msgpack.packb({"partition": "rollout"}))))
        assert plain_error(err.value) == (
            "NotFoundError",
            "unknown partition 'rollout'; did you mean 'rollouts', 'rollouts_v2'?",
        )
        with pytest.raises(fl.FlightServerError) as err:
            c.get_flight_info(fl.FlightDescriptor.for_path("nope"))
        assert plain_error(err.value) == ("NotFoundError", "unknown partition 'nope'")
        for i in range(30):
            _declare(server.location, f"user{i}_rollouts")
        with pytest.raises(fl.FlightServerError) as err:
            list(c.do_action(fl.Action("drop", msgpack.packb({"partition": "user_rollouts"}))))
        _, message = plain_error(err.value)
        assert message.count("'user") <= 4  # the name asked and at most 3 close ones


def test_close_names_are_searched_outside_the_stores_lock_over_a_bounded_few(server, monkeypatch):
    # difflib over names a client chose can be made to take seconds per error: searched
    # under the store's lock, one unknown name asked for held every other call that long.
    from flightq.server import store as store_module

    for i in range(300):
        _declare(server.location, f"{'x' * 200}{i:04d}")
    seen: list[tuple[bool, int, int]] = []
    real = store_module.difflib.get_close_matches

    def watched(word: str, possibilities: list[str], **kw: Any) -> list[str]:
        free = server.store._lock.acquire(blocking=False)
        if free:
            server.store._lock.release()
        seen.append((free, len(possibilities), max(map(len, [word, *possibilities]))))
        return real(word, possibilities, **kw)

    monkeypatch.setattr(store_module.difflib, "get_close_matches", watched)
    with fl.connect(server.location) as c, pytest.raises(fl.FlightServerError) as err:
        list(c.do_action(fl.Action("clear", msgpack.packb({"partition": "x" * 201}))))
    kind, message = plain_error(err.value)
    assert kind == "NotFoundError" and "; did you mean 'xxx" in message
    assert seen == [(True, 256, 48)]  # the lock free; 256 names of their first 48 characters


def test_an_unknown_task_of_many_names_a_few_close_ones(server):
    tasks = [f"task_{i:02d}" for i in range(40)]
    _declare(server.location, "p", tasks)
    ticket = {"op": "claim", "partition": "p", "task": "tsak_07", "batch_size": 1, "timeout": 0}
    with fl.connect(server.location) as c, pytest.raises(fl.FlightServerError) as err:
        c.do_get(fl.Ticket(msgpack.packb(ticket))).read_all()
    kind, message = plain_error(err.value)
    assert kind == "NotFoundError"
    assert message.startswith("partition 'p' declares no task 'tsak_07'; did you mean ")
    assert message.count("'task_") <= 3
    assert len(msgpack.unpackb(err.value.extra_info)["expected"]) == 9  # 8 and "... (32 more)"


# --------------------------------------------------------------------------- seconds


@pytest.mark.parametrize("timeout", [1e10, math.inf, 86400.5])
def test_a_put_timeout_over_a_day_is_a_protocol_error(server, timeout):
    _declare(server.location, "p")
    with pytest.raises(fl.FlightServerError) as err:
        plain_put(server.location, put_command("p", timeout=timeout), [text_batch(["k"])])
    kind, message = plain_error(err.value)
    assert (kind, message.split(", got")[0]) == (
        "ProtocolError",
        "put descriptor: 'timeout' must be at most 86400 seconds",
    )


def test_a_claim_timeout_over_a_day_is_refused_but_inf_waits_without_limit(server):
    _declare(server.location, "p", ["train"])
    plain_put(server.location, put_command("p"), [text_batch(["k"])])
    claim = {"op": "claim", "partition": "p", "task": "train", "batch_size": 1}
    with fl.connect(server.location) as c:
        with pytest.raises(fl.FlightServerError) as err:
            c.do_get(fl.Ticket(msgpack.packb({**claim, "timeout": 1e10}))).read_all()
        assert plain_error(err.value) == (
            "ProtocolError",
            "claim ticket: 'timeout' must be at most 86400 seconds (inf: no limit), got 1e+10",
        )
        got = c.do_get(fl.Ticket(msgpack.packb({**claim, "timeout": math.inf}))).read_all()
        assert got.num_rows == 1


def test_a_refused_part_fails_its_put_in_parts_at_once(server):
    _declare(server.location, "p")
    errors: list[BaseException] = []
    rb = text_batch(["a"])

    def part0() -> None:
        cmd = put_command("p", stage="s", part=0, parts=2, timeout=60.0)
        try:
            plain_put(server.location, cmd, [rb])
        except fl.FlightServerError as e:
            errors.append(e)

    t = threading.Thread(target=part0)
    t.start()
    with flightq.connect(server.location, timeout=TIMEOUT) as client:
        stat_until(client, "p", "staged_parts", 1)
        bad = put_command("p", stage="s", part=1, parts=2, timeout=1e10)
        with pytest.raises(fl.FlightServerError, match=r"'timeout' must be at most 86400"):
            plain_put(server.location, bad, [text_batch(["b"])])
        t.join(10)
        assert not t.is_alive(), "part 0 still waits for a put that can never be whole"
        assert plain_error(errors[0])[0] == "ProtocolError"
        # The last part, fixed, comes too late: the put was decided, nothing is stored.
        good = put_command("p", stage="s", part=1, parts=2, timeout=1.0)
        with pytest.raises(fl.FlightServerError, match=r"ProtocolError"):
            plain_put(server.location, good, [text_batch(["b"])])
        p = client.stats()["partitions"]["p"]
        assert p["rows"] == 0 and p["staged_parts"] == 0


# --------------------------------------------------------------------------- GetFlightInfo


def test_a_non_utf8_flight_info_path_is_refused_and_the_server_keeps_serving(server):
    # gRPC's protobuf layer refuses a path that is not UTF-8 (FlightDescriptor.path is a
    # proto3 string) before any handler runs: there is no flightq detail to send.
    with fl.connect(server.location) as c:
        with pytest.raises(fl.FlightError):
            c.get_flight_info(fl.FlightDescriptor.for_path(b"\xff\xfeab"))
        _declare(server.location, "p")
        assert c.get_flight_info(fl.FlightDescriptor.for_path("p")).total_records == 0


def test_a_non_utf8_path_that_reaches_the_handler_is_a_protocol_error(server):
    # A transport that lets the bytes through (another protobuf build) meets the handler's
    # own check, called here as Flight calls it.
    with pytest.raises(fl.FlightServerError) as err:
        server.get_flight_info(None, fl.FlightDescriptor.for_path(b"\xff\xfeab"))
    kind, message = plain_error(err.value)
    assert kind == "ProtocolError"
    assert message.startswith(r"descriptor: the path b'\xff\xfeab' is not UTF-8")


# --------------------------------------------------------------------------- snapshots


def _snapshot_server(root: Path) -> flightq.Server:
    return flightq.Server(snapshot_dir=root)


def test_two_snapshots_of_one_name_at_once_one_wins_the_other_conflicts(tmp_path):
    with _snapshot_server(tmp_path) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT)
        keys = [f"k{i}" for i in range(200)]
        c.put("p", keys, text_columns(keys))
        results: list[Any] = []
        barrier = threading.Barrier(6)

        def snap() -> None:
            with flightq.connect(srv.location, timeout=TIMEOUT) as mine:
                barrier.wait()
                try:
                    results.append(mine.snapshot("same"))
                except flightq.FlightqError as e:
                    results.append(e)

        threads = [threading.Thread(target=snap) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        won = [r for r in results if isinstance(r, dict)]
        lost = [r for r in results if not isinstance(r, dict)]
        assert len(won) == 1 and len(lost) == 5
        assert all(isinstance(e, flightq.ConflictError) for e in lost), lost
        assert all("snapshot 'same' exists already" in str(e) for e in lost)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]  # no temp folder left
    with flightq.Server(restore=tmp_path / "same") as srv, flightq.connect(srv.location) as c:
        assert c.stats()["partitions"]["p"]["rows"] == 200


@pytest.mark.parametrize("name", ["s\n", "s\nx", "\ns", "s/x", "..", "a..b", ""])
def test_a_snapshot_name_is_matched_in_full(tmp_path, name):
    with (
        _snapshot_server(tmp_path) as srv,
        fl.connect(srv.location) as c,
        pytest.raises(fl.FlightServerError) as err,
    ):
        list(c.do_action(fl.Action("snapshot", msgpack.packb({"name": name}))))
    kind, message = plain_error(err.value)
    assert kind == "ProtocolError" and message.startswith(f"snapshot: name {name!r} must be")
    assert list(tmp_path.iterdir()) == []


def test_a_restore_whose_state_file_is_missing_names_the_file(tmp_path):
    with _snapshot_server(tmp_path) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT)
        c.put("p", ["a"], text_columns(["a"]))
        c.snapshot("s")
    (tmp_path / "s" / "p0.state.arrows").unlink()
    with pytest.raises(
        flightq.DecodeError, match=r"snapshot file 'p0.state.arrows' of 'p' cannot be read"
    ):
        flightq.Server(restore=tmp_path / "s")


def test_put_ids_survive_a_snapshot_so_a_retry_after_restore_is_not_stored_twice(tmp_path):
    with _snapshot_server(tmp_path) as srv:
        _declare(srv.location, "p", ["train"])
        cmd = put_command("p", put_id="gen-7-step-3", rows=2)
        assert plain_put(srv.location, cmd, [text_batch(["a", "b"])]) == {"rows": 2}
        _action(srv.location, "clear", {"partition": "p", "keys": None})  # trained on
        _action(srv.location, "snapshot", {"name": "s"})
    with flightq.Server(restore=tmp_path / "s") as srv:
        # The generator never saw its ack and retries: acknowledged, nothing stored.
        assert plain_put(srv.location, cmd, [text_batch(["a", "b"])]) == {"rows": 2}
        assert _action(srv.location, "inspect", {"partition": "p"})["rows"] == 0


def test_a_killed_snapshots_temp_folder_is_removed_at_the_next_start(tmp_path):
    stale = tmp_path / ".s1.tmp-k9x2"
    stale.mkdir()
    (stale / "p0.rows.arrows").write_bytes(b"half written")
    (tmp_path / "kept").mkdir()
    (tmp_path / ".hidden").mkdir()
    with _snapshot_server(tmp_path) as srv, flightq.connect(srv.location) as c:
        assert not stale.exists()
        c.create_partition("p", TEXT)
        assert c.snapshot("s1")["partitions"] == {"p": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "kept", "s1"]


def _mount_tiny_tmpfs(path: Path) -> bool:
    if os.geteuid() != 0:
        return False
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
        capture_output=True,
        timeout=10,
    )
    return out.returncode == 0


def test_a_full_disk_is_a_typed_refusal_and_leaves_no_temp_folder():
    with tempfile.TemporaryDirectory() as where:
        root = Path(where)
        if not _mount_tiny_tmpfs(root):
            pytest.skip("needs root and tmpfs to make a 1 MiB disk")
        try:
            with _snapshot_server(root) as srv, flightq.connect(srv.location) as c:
                c.create_partition("p", TEXT)
                keys = [f"k{i}" for i in range(8)]
                big = {"input_ids": [np.arange(40_000, dtype=np.int64) for _ in keys]}
                c.put("p", keys, big)  # 2.5 MB of payload, more than the disk holds
                with pytest.raises(flightq.ResourceExhaustedError, match=r"disk .* is full"):
                    c.snapshot("s")
                assert list(root.iterdir()) == []
                assert c.stats()["partitions"]["p"]["rows"] == 8  # the server keeps serving
        finally:
            subprocess.run(["umount", str(root)], check=True, timeout=30)


# --------------------------------------------------------------------------- tokens


def test_serve_with_a_token_file_and_no_tls_warns_on_stderr(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    with cli_server("--token-file", str(tokens)) as (location, proc):
        assert location.startswith("grpc://127.0.0.1:")
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "warning: bearer tokens without TLS travel in clear text" in err
    assert "s3cret" not in err

    with cli_server() as (_, quiet):
        pass
    assert quiet.stderr is not None and "warning" not in quiet.stderr.read()
