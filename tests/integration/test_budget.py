"""Every byte the server holds is counted against its memory budget or capped.

Each hostile put is crafted with plain ``pyarrow.flight``; each refusal is a
``ResourceExhaustedError`` naming the cap and what arrived, nothing of the put is stored,
and the server keeps serving. The servers run in this process so that the tests can read
what the store counts (``Server.store.held()``).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from helpers_budget import VLM, action, empty_maps, media_batch, with_keys, with_tags
from helpers_reliability import partition_state, plain_error, plain_put, put_command, text_batch

import flightq
from flightq.protocol import Clear
from flightq.schema import Schema
from flightq.server import actions, budget

TEXT = "rollout_text@1"


def _declare(location: str, ref: str = TEXT, **options: object) -> None:
    schema = flightq.SchemaRegistry.default().get(ref)
    body = {"partition": "p", "schema": schema.canonical_json, "tasks": ["train"]}
    action(location, "declare", body, **options)


def _refused(location: str, batches: list, match: str, **cmd: object) -> str:
    """The put is refused as ResourceExhaustedError; returns the message."""
    with pytest.raises(fl.FlightError) as info:
        plain_put(location, put_command("p", **cmd), batches)
    kind, message = plain_error(info.value)
    assert kind == "ResourceExhaustedError", (kind, message)
    assert match in message, message
    return message


def _unchanged(location: str, before: tuple) -> None:
    assert partition_state(location, "p") == before
    assert action(location, "health", {})["ok"]


def test_media_entries_no_row_uses_are_refused_and_nothing_is_stored():
    with flightq.Server(memory_budget=64 * 2**20) as srv:
        _declare(srv.location, VLM)
        before = partition_state(srv.location, "p")
        msg = _refused(srv.location, [media_batch(["a", "b"], unused=2**20)], "used by no row")
        assert "'pixel_values'" in msg and "1048576 bytes" in msg
        _unchanged(srv.location, before)
        assert srv.store.held() == 0
        # Slices of one batch share its dictionary, each using part of it: accepted.
        rb = media_batch(["a", "b"])
        assert plain_put(srv.location, put_command("p"), [rb.slice(0, 1), rb.slice(1, 1)]) == {
            "rows": 2
        }


def test_a_key_over_the_cap_is_refused_and_one_at_the_cap_is_stored():
    with flightq.Server() as srv:
        _declare(srv.location)
        before = partition_state(srv.location, "p")
        long = "k" * (budget.MAX_KEY_BYTES + 1)
        _refused(srv.location, [with_keys(text_batch(["x"]), [long])], "row key of 1025 bytes")
        _refused(srv.location, [with_keys(text_batch(["x"]), ["é" * 513])], "limit of 1024")
        _unchanged(srv.location, before)
        at_cap = "k" * budget.MAX_KEY_BYTES
        assert plain_put(srv.location, put_command("p"), [with_keys(text_batch(["x"]), [at_cap])])


def test_tags_over_the_cap_are_refused_and_tags_count_as_their_python_objects():
    with flightq.Server(memory_budget=64 * 2**20) as srv:
        _declare(srv.location)
        before = partition_state(srv.location, "p")
        big = empty_maps(budget.MAX_TAGS_BYTES + 100)
        _refused(srv.location, [with_tags(text_batch(["a"]), [big])], "tags of")
        _unchanged(srv.location, before)
        # Under the cap, 16 KiB of empty maps are about 1.1 MB of Python objects, held twice.
        tags = empty_maps(16 * 1024)
        plain_put(srv.location, put_command("p"), [with_tags(text_batch(["a"]), [tags])])
        assert srv.store.held() > 2 * 70 * 16 * 1024
        # The budget fills with rows of such tags long before their wire bytes would fill it.
        n = 0
        with pytest.raises(fl.FlightError) as info:
            for n in range(100):
                rb = with_tags(text_batch([f"b{n}"]), [tags])
                plain_put(srv.location, put_command("p"), [rb])
        assert plain_error(info.value)[0] == "ResourceExhaustedError"
        assert n < 40  # 64 MiB of budget, about 2.3 MB counted per row
        assert srv.store.held() <= 64 * 2**20


def test_tags_with_a_key_that_is_not_a_string_are_refused_from_plain_flight():
    with flightq.Server(memory_budget=64 * 2**20) as srv:
        _declare(srv.location)
        before = partition_state(srv.location, "p")
        held = srv.store.held()
        for n in (1, 12):  # row by row, and each distinct map once
            keys = [f"k{i}" for i in range(n)]
            odd = [msgpack.packb({b"raw": 1, "ok": i}, use_bin_type=True) for i in range(n)]
            with pytest.raises(fl.FlightError) as info:
                plain_put(srv.location, put_command("p"), [with_tags(text_batch(keys), odd)])
            kind, message = plain_error(info.value)
            assert kind == "EncodeError" and "must have string keys" in message, message
        _unchanged(srv.location, before)
        assert srv.store.held() == held


def test_a_server_told_a_larger_tags_cap_takes_tags_up_to_it_and_says_so():
    one_mib = 2**20
    with flightq.Server(max_tags_bytes=one_mib, memory_budget=256 * 2**20) as srv:
        _declare(srv.location)
        with flightq.connect(srv.location) as c:
            assert c.health()["max_tags_bytes"] == one_mib
        text = {"doc": "x" * (one_mib // 2)}  # past the default 64 KiB, within this cap
        rb = with_tags(text_batch(["a"]), [msgpack.packb(text)])
        assert plain_put(srv.location, put_command("p"), [rb]) == {"rows": 1}
        before = partition_state(srv.location, "p")
        big = empty_maps(one_mib + 100)
        _refused(srv.location, [with_tags(text_batch(["b"]), [big])], "limit of 1048576")
        _unchanged(srv.location, before)
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        assert c.health()["max_tags_bytes"] == budget.MAX_TAGS_BYTES
    for bad in (budget.MAX_TAGS_BYTES - 1, budget.MAX_TAGS_LIMIT + 1, 1.5, True):
        with pytest.raises(flightq.ProtocolError, match="max_tags_bytes"):
            flightq.Server(max_tags_bytes=bad)


def test_schema_metadata_over_the_cap_is_refused():
    with flightq.Server() as srv:
        _declare(srv.location)
        before = partition_state(srv.location, "p")
        rb = text_batch(["a"])
        md = {**rb.schema.metadata, b"junk": b"x" * budget.MAX_METADATA_BYTES}
        _refused(srv.location, [rb.replace_schema_metadata(md)], "bytes of metadata")
        _unchanged(srv.location, before)


def test_each_row_counts_a_fixed_overhead_so_tiny_rows_fill_the_budget():
    with flightq.Server(memory_budget=4 * 2**20) as srv:
        _declare(srv.location)
        rb = text_batch([f"k{i}" for i in range(1000)])
        plain_put(srv.location, put_command("p"), [rb])
        held = srv.store.held()
        payload = srv.store.partition("p").nbytes
        assert payload < 50_000 and held >= 1000 * budget.ROW_OVERHEAD
        # 4 MiB of budget: about 4000 such rows, though their payload is under 200 KB.
        with pytest.raises(fl.FlightError) as info:
            for j in range(1, 10):
                rb = text_batch([f"k{j}_{i}" for i in range(1000)])
                plain_put(srv.location, put_command("p"), [rb])
        assert plain_error(info.value)[0] == "ResourceExhaustedError"
        assert 3 <= j <= 4, j
        assert srv.store.held() <= 4 * 2**20


def _start_part(location: str, stage: str, rb, timeout: float) -> tuple:
    """Send part 0 of a put in 2 parts and leave it waiting for part 1."""
    c = fl.connect(location)
    cmd = put_command("p", stage=stage, part=0, parts=2, timeout=timeout)
    writer, reader = c.do_put(cmd, rb.schema)
    writer.write_batch(rb)
    writer.done_writing()
    return c, writer, reader


def test_staged_parts_count_while_they_wait_and_a_part_that_does_not_fit_is_refused():
    mib = 2**20
    with flightq.Server(memory_budget=8 * mib) as srv:
        _declare(srv.location)
        ids = [np.zeros(5 * mib // 8 // 4, np.int64) for _ in range(4)]  # 5 MiB in all
        schema = flightq.SchemaRegistry.default().get(TEXT)
        big = flightq.encode(schema, {"input_ids": ids}, [f"a{i}" for i in range(4)])
        waiting = _start_part(srv.location, "s1", big, timeout=30)
        deadline = time.monotonic() + 10
        while srv.store.held() < 5 * mib and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.store.held() >= 5 * mib, "a staged part counts while it waits"
        other = flightq.encode(schema, {"input_ids": ids}, [f"b{i}" for i in range(4)])
        t0 = time.monotonic()
        with pytest.raises(fl.FlightError) as info:
            plain_put(
                srv.location, put_command("p", stage="s2", part=0, parts=2, timeout=0.3), [other]
            )
        kind, msg = plain_error(info.value)
        assert kind == "ResourceExhaustedError" and "memory budget" in msg, msg
        assert time.monotonic() - t0 < 5
        action(srv.location, "abort_put", {"partition": "p", "stage": "s1", "parts": 2})
        with pytest.raises(fl.FlightError, match="gave up a part"):
            waiting[2].read()
            waiting[1].close()
        waiting[0].close()
        deadline = time.monotonic() + 10
        while srv.store.held() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.store.held() == 0, "an aborted put counts no more"
        assert plain_put(srv.location, put_command("p"), [other]) == {"rows": 4}


def test_a_put_in_parts_whose_last_part_finds_no_room_fails_for_that_reason():
    # Part 0 arrives and waits for part 1; part 1, sent a moment later with the same
    # timeout, waits for room the budget does not have. Every part fails with the budget's
    # error, not with "1 arrived" (the parts waiting give a missing part GRACE_S more).
    mib = 2**20
    schema = flightq.SchemaRegistry.default().get(TEXT)
    ids = [np.zeros(5 * mib // 8 // 4, np.int64) for _ in range(4)]  # 5 MiB
    with flightq.Server(memory_budget=8 * mib) as srv:
        _declare(srv.location)
        full = flightq.encode(schema, {"input_ids": ids}, [f"a{i}" for i in range(4)])
        assert plain_put(srv.location, put_command("p"), [full]) == {"rows": 4}
        small = flightq.encode(schema, {"input_ids": [np.arange(4)]}, ["s0"])
        waiting = _start_part(srv.location, "s3", small, timeout=1.0)
        time.sleep(0.3)
        big = flightq.encode(schema, {"input_ids": ids}, [f"b{i}" for i in range(4)])
        with pytest.raises(fl.FlightError) as info:
            plain_put(
                srv.location, put_command("p", stage="s3", part=1, parts=2, timeout=1.0), [big]
            )
        kind, msg = plain_error(info.value)
        assert kind == "ResourceExhaustedError" and "memory budget" in msg, msg
        with pytest.raises(fl.FlightError) as info:
            waiting[2].read()
            waiting[1].close()
        kind, msg = plain_error(info.value)
        assert kind == "ResourceExhaustedError" and "memory budget" in msg, msg
        waiting[0].close()
        assert _rows_stored(srv) == 4  # the first put's alone


def _rows_stored(srv: flightq.Server) -> int:
    with flightq.connect(srv.location) as c:
        return int(c.stats()["partitions"]["p"]["rows"])


def _schema_json(name: str, fields: int = 1) -> str:
    fs = [{"name": "input_ids", "dtype": "int64", "role": "token", "shape": [None]}]
    fs += [
        {
            "name": f"f{i:05d}",
            "dtype": "float32",
            "role": "tensor",
            "shape": [None],
            "required": False,
        }
        for i in range(fields - 1)
    ]
    return json.dumps({"name": name, "version": 1, "fields": fs})


def test_registered_schemas_are_capped_in_size_and_count():
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        loc = srv.location
        text = _schema_json("huge", fields=400)
        assert len(text) > budget.MAX_SCHEMA_BYTES
        with pytest.raises(fl.FlightError) as info:
            action(loc, "register_schema", {"schema": text})
        assert plain_error(info.value)[0] == "ResourceExhaustedError"
        room = budget.MAX_SCHEMAS - len(srv.registry)
        for i in range(room):  # each used by a partition
            action(loc, "register_schema", {"schema": _schema_json(f"s{i}")})
            c.create_partition(f"p{i}", Schema.from_json(_schema_json(f"s{i}")), tasks=["t"])
        with pytest.raises(fl.FlightError) as info:
            action(loc, "register_schema", {"schema": _schema_json("one_more")})
        kind, msg = plain_error(info.value)
        assert kind == "ResourceExhaustedError" and "its limit" in msg, msg
        assert "one_more" not in srv.registry.names()
        action(loc, "register_schema", {"schema": _schema_json("s0")})  # identical: accepted
        assert action(loc, "health", {})["ok"]
        # A schema just used (here by its partition, dropped now) is kept a while: a
        # client between registering and declaring is never cut off.
        c.drop("p1")
        c.drop("p0")
        with pytest.raises(fl.FlightError) as info:
            action(loc, "register_schema", {"schema": _schema_json("one_more")})
        assert "its limit" in plain_error(info.value)[1]


def test_a_full_registry_forgets_the_least_recently_used_schema_no_partition_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long-lived server whose runs register new versions is never cut off for good.
    monkeypatch.setattr(actions, "SCHEMA_IDLE_S", 0.0)
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        loc = srv.location
        shipped = set(srv.registry.names())
        room = budget.MAX_SCHEMAS - len(srv.registry)
        for i in range(room):  # each used by a partition
            action(loc, "register_schema", {"schema": _schema_json(f"s{i}")})
            c.create_partition(f"p{i}", Schema.from_json(_schema_json(f"s{i}")), tasks=["t"])
        c.drop("p1")
        c.drop("p0")
        action(loc, "register_schema", {"schema": _schema_json("one_more")})
        action(loc, "register_schema", {"schema": _schema_json("two_more")})
        names = set(srv.registry.names())
        assert {"one_more", "two_more"} <= names and not {"s0", "s1"} & names
        assert shipped <= names and {f"s{i}" for i in range(2, room)} <= names
        assert len(srv.registry) == budget.MAX_SCHEMAS
        # Least recently used first: "one_more" registered again is used after "two_more".
        action(loc, "register_schema", {"schema": _schema_json("one_more")})
        action(loc, "register_schema", {"schema": _schema_json("three_more")})
        assert "two_more" not in srv.registry.names() and "one_more" in srv.registry.names()
        # A forgotten ref comes back with its content only: released versions are immutable.
        with pytest.raises(fl.FlightError) as info:
            action(loc, "register_schema", {"schema": _schema_json("s0", fields=2)})
        kind, msg = plain_error(info.value)
        assert kind == "SchemaMismatchError" and "was registered with fingerprint" in msg, msg
        action(loc, "register_schema", {"schema": _schema_json("s0")})
        assert "s0" in srv.registry.names()
        # A registration refused for its content forgets nothing to make room for it.
        before = set(srv.registry.names())
        broken = json.loads(_schema_json("s2"))
        broken["version"], broken["fields"][0]["dtype"] = 2, "int32"  # breaks evolution
        with pytest.raises(fl.FlightError) as info:
            action(loc, "register_schema", {"schema": json.dumps(broken)})
        assert plain_error(info.value)[0] == "SchemaMismatchError"
        assert set(srv.registry.names()) == before


def test_with_tokens_registering_a_schema_needs_a_token():
    with flightq.Server(tokens=["s3cret"]) as srv:
        with pytest.raises(fl.FlightUnauthenticatedError):
            action(srv.location, "register_schema", {"schema": _schema_json("mine")})
        assert "mine" not in srv.registry.names()
        header = [(b"authorization", b"Bearer s3cret")]
        with fl.connect(srv.location) as c:
            body = msgpack.packb({"schema": _schema_json("mine")})
            opts = fl.FlightCallOptions(headers=header)
            list(c.do_action(fl.Action("register_schema", body), options=opts))
        assert "mine" in srv.registry.names()


def _kept_by_records(p: object) -> int:
    """Bytes of the key and put-id strings a partition's records of the past keep alive
    (its journal of writes, its ended claims, its put ids), walked here, not as counted."""
    journal = sum(sys.getsizeof(k) for e in p.journal if e[1] is not None for k in e[1])
    leases = sum(sys.getsizeof(k) for x in p.progress.ended.values() for k in x.keys)
    return journal + leases + sum(map(sys.getsizeof, p.recent_puts))


def test_records_of_the_past_count_against_the_budget_and_make_way_for_puts():
    # Rows of 1000-character keys put, claimed, acked and cleared by key: the partitions'
    # journals, ended claims and put ids keep the keys after the rows go. They count
    # while kept and the oldest go when the budget needs the room, so what they keep stays
    # within it (before: 49 MiB kept against an 8 MiB budget) and puts are never refused
    # for them.
    mib = 2**20
    with flightq.Server(memory_budget=8 * mib) as srv, flightq.connect(srv.location) as c:
        names = ["a", "b"]
        for name in names:
            c.create_partition(name, TEXT, tasks=["train"])
        claims = []
        for i in range(8):
            for name in names:
                keys = [f"{name}{i}_{j:04d}".ljust(1000, "k") for j in range(1024)]
                ids = [np.arange(4, dtype=np.int64)] * len(keys)
                c.put(name, keys, {"input_ids": ids}, put_id=f"{name}{i}".ljust(256, "p"))
                batch = c.claim(name, "train", len(keys), as_="numpy")
                c.ack(batch)
                claims.append((name, batch))
                c.clear(name, keys)
                kept = sum(_kept_by_records(srv.store.partition(n)) for n in names)
                assert kept <= srv.store.counted() - srv.store.held() <= 8 * mib, (i, kept)
        assert srv.store.held() == 0
        assert 2 * mib < srv.store.records() <= 8 * mib - srv.store.declared()
        # The latest claim is remembered: acking it again acknowledges nothing more; the
        # first was forgotten to make room, and an ack of it is refused by name.
        name, last = claims[-1]
        assert c.ack(last) == 0
        with pytest.raises(flightq.NotFoundError, match="memory budget needs the room"):
            c.ack(claims[0][1])
        # A put of all the budget but the declarations is stored: the records make way.
        room = 8 * mib - srv.store.declared() - 256 * 1024
        c.put("a", ["big"], {"input_ids": [np.zeros(room // 8, np.int64)]}, timeout=5)
        assert srv.store.counted() <= 8 * mib
        assert srv.store.records() < 256 * 1024
        assert c.get("a", ["big"], as_="numpy")["input_ids"][0].size == room // 8
        c.clear("a")
        c.drop("a")
        c.drop("b")
        assert srv.store.counted() == 0


def test_a_retry_whose_put_id_was_dropped_for_room_is_refused_and_says_it_was_stored():
    # A put whose answer was lost, two of its rows consumed and cleared, its put id then
    # dropped to make room (the oldest record): its retry can no longer be told from a new
    # put of those keys. It is refused, never stored twice, and the refusal says that an
    # earlier put of this same batch stored the rows and its put id is forgotten.
    mib = 2**20
    with flightq.Server(memory_budget=8 * mib) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["train"])
        c.create_partition("q", TEXT, tasks=["train"])
        keys, cols = ["k0", "k1", "k2", "k3"], {"input_ids": [np.arange(4, dtype=np.int64)] * 4}
        assert c.put("p", keys, cols, put_id="put-1") == 4
        got = c.claim("p", "train", 2, as_="numpy")
        c.ack(got)
        c.clear("p", got.keys)
        for i in range(2):  # newer records: the journal of clears of long keys
            long = [f"q{i}_{j:04d}".ljust(1000, "k") for j in range(1024)]
            c.put("q", long, {"input_ids": [np.arange(4, dtype=np.int64)] * len(long)})
            c.clear("q", long)
        assert "put-1" in srv.store.partition("p").recent_puts
        room = 8 * mib - srv.store.declared() - srv.store.held() - 256 * 1024
        c.put("q", ["big"], {"input_ids": [np.zeros(room // 8, np.int64)]}, timeout=5)
        assert "put-1" not in srv.store.partition("p").recent_puts  # dropped for room
        c.clear("q", ["big"])
        before = partition_state(srv.location, "p")
        with pytest.raises(flightq.ConflictError) as e:
            c.put("p", keys, cols, put_id="put-1")
        assert str(e.value).startswith(
            "row key 'k2' already has column 'input_ids' in partition 'p', stored by an "
            "earlier put of this same record batch (its rows cleared or rewritten in part "
            "since), and put id 'put-1' is not among those the partition remembers (its "
            "last 4096, fewer when the server's memory budget needs their room): if this "
            "put retries one whose answer was lost, that one was stored; count it as stored "
            "and do not send it again"
        ), e.value
        assert partition_state(srv.location, "p") == before  # nothing stored twice
        # Other content under those keys, its put id unknown: refused, saying what may be.
        other = {"input_ids": [np.arange(5, dtype=np.int64)] * 4}
        with pytest.raises(flightq.ConflictError, match="is refused so, never stored twice"):
            c.put("p", keys, other, put_id="put-2")
        assert partition_state(srv.location, "p") == before


def test_a_live_claim_counts_the_keys_it_keeps_so_clearing_its_rows_cannot_overfill():
    # A consumer claims rows of 1000-character keys and clears all but one of them
    # without an ack: its lease, alive while it holds that row, keeps every key it took,
    # which counts from the claim until the lease ends. Before, it counted nothing while
    # the claim lived, and each round kept 1 MiB more.
    mib = 2**20
    with flightq.Server(memory_budget=8 * mib) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["train"])
        rounds, refused = 0, None
        for i in range(40):
            keys = [f"r{i}_{j:04d}".ljust(1000, "k") for j in range(1024)]
            ids = [np.arange(4, dtype=np.int64)] * len(keys)
            try:
                c.put("p", keys, {"input_ids": ids}, timeout=1)
            except flightq.ResourceExhaustedError as e:
                refused = e
                break
            c.claim("p", "train", len(keys), as_="numpy", lease=600)  # kept, not acked
            c.clear("p", keys[1:])
            rounds += 1
            kept = rounds * 1024 * 1000  # the live leases' keys, at least
            assert srv.store.counted() - srv.store.held() >= kept, rounds
        assert refused is not None and rounds >= 2, rounds  # refused, not grown past it
        assert "live claims" in str(refused)
        c.drop("p")
        assert srv.store.counted() == 0


def _fill_with_rows(c: flightq.Client, partition: str, chunks: tuple[int, ...]) -> int:
    """Put one-token rows into ``partition``, ``chunks`` rows a put (each size until one
    is refused for room), until the budget is full; returns how many were stored."""
    n = 0
    for chunk in chunks:
        while True:
            keys = [f"{partition}{n + j:07d}" for j in range(chunk)]
            try:
                c.put(partition, keys, {"input_ids": [np.arange(4)] * chunk}, timeout=0)
            except flightq.ResourceExhaustedError:
                break
            n += chunk
    return n


def test_a_budget_full_of_rows_and_a_live_claim_keeps_its_newest_records():
    # A claim is never refused, so rows and a trainer's live claim may fill the budget
    # past its end; no record dropped could make room then. The newest, up to a share of
    # the budget, stay: a repeated ack of a claim that just ended still answers. Before,
    # every record of every partition went at once.
    budget = 8 * 2**20
    with flightq.Server(memory_budget=budget) as srv, flightq.connect(srv.location) as c:
        st = srv.store
        c.create_partition("a", TEXT, tasks=["train"])
        c.create_partition("fill", TEXT, tasks=["train"])
        c.put("a", ["a0", "a1", "a2"], {"input_ids": [np.arange(4)] * 3}, put_id="put-1")
        n = _fill_with_rows(c, "fill", (500,))
        live = c.claim("fill", "train", n, as_="numpy", lease=600)
        assert st.held() + st.declared() + srv.store._leased() > budget  # past it
        for _ in range(3):
            got = c.claim("a", "train", 1, as_="numpy")
            assert c.ack(got) == 1
            assert c.ack(got) == 0  # remembered: acknowledges nothing more
        assert 0 < st.records() <= budget // 16
        c.ack(live)
        assert st.counted() <= budget + budget // 16
        c.drop("a")
        c.drop("fill")
        assert st.counted() == 0


def test_records_made_while_rows_and_live_claims_fill_the_budget_stay_within_a_share():
    # Rows and a live claim past the budget: claims of the other rows given back, acks and
    # resets, and clears naming one key many times or none, each make records. They keep
    # to a sixteenth of the budget (before: counted grew past 30 budgets), a clear
    # journals each removed row once, and a lease counts the same from claim to end.
    budget = 8 * 2**20
    with flightq.Server(memory_budget=budget) as srv, flightq.connect(srv.location) as c:
        st = srv.store
        c.create_partition("p", TEXT, tasks=["train"])
        c.create_partition("q", TEXT, tasks=["train"])
        long = "q-".ljust(1000, "x")
        c.put("q", [long], {"input_ids": [np.arange(4)]})
        n = _fill_with_rows(c, "p", (1000, 100, 10))
        c.claim("p", "train", n // 2, as_="numpy", lease=600)  # the trainer's, kept
        assert st.held() + st.declared() + st._leased() > budget
        for i in range(60):
            got = c.claim("p", "train", n - n // 2, as_="numpy", lease=600)
            live = st.partition("p").progress.live_bytes
            c.nack(got, keys=got.keys[:10])  # a partial nack: the lease counts no more
            assert st.partition("p").progress.live_bytes == live
            c.nack(got)
            assert st.records() <= budget // 16, i
        before = len(st.partition("q").journal)
        # One message naming the row 4096 times (the client would name it once).
        c.transport.action(Clear(partition="q", keys=[long] * 4096))
        (_, removed, _, _) = st.partition("q").journal[-1]
        assert len(st.partition("q").journal) == before + 1 and list(removed) == [long]
        for _ in range(50):
            c.clear("q", [])  # removes nothing: no journal entry
        assert len(st.partition("q").journal) == before + 1
        assert st.records() <= budget // 16
        c.drop("p")
        c.drop("q")
        assert st.counted() == 0


def test_concurrent_refusals_leave_nothing_counted():
    with flightq.Server(memory_budget=2**20) as srv:
        _declare(srv.location, VLM)
        errors: list = []

        def hostile(i: int) -> None:
            try:
                plain_put(srv.location, put_command("p"), [media_batch([f"m{i}"], unused=2**19)])
            except fl.FlightError as e:
                errors.append(plain_error(e)[0])

        threads = [threading.Thread(target=hostile, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors and set(errors) == {"ResourceExhaustedError"}
        assert srv.store.held() == 0


def test_stats_and_inspect_report_what_the_budget_counts_beside_the_payload(capsys):
    mib = 2**20
    with (
        flightq.Server(memory_budget=8 * mib) as srv,
        flightq.connect(srv.location, timeout=30) as c,
    ):
        _declare(srv.location)
        c.create_partition("q", TEXT, tasks=["train"])
        tags = [{"step": i, "note": "x" * 200} for i in range(50)]
        keys = [f"a{i}" for i in range(50)]
        c.put("p", keys, {"input_ids": [np.arange(16)] * 50}, tags)
        c.put("q", ["b0"], {"input_ids": [np.arange(4096)]})
        st = c.stats()
        p, q = st["partitions"]["p"], st["partitions"]["q"]
        # Keys, tags and per-row objects count beyond the payload: 50 rows, at least 1 KiB each.
        assert p["held"] >= p["bytes"] + 50 * budget.ROW_OVERHEAD and p["bytes"] > 0
        assert q["held"] > q["bytes"] >= 4096 * 8
        assert st["held"] == p["held"] + q["held"]
        assert c.inspect("p")["held"] == p["held"]
        # The figure is the one the budget refuses by.
        schema = flightq.SchemaRegistry.default().get(TEXT)
        ids = [np.zeros(9 * mib // 8, np.int64)]
        msg = _refused(
            srv.location,
            [flightq.encode(schema, {"input_ids": ids}, ["big"])],
            "more than the server's whole memory budget",
            timeout=0.3,
        )
        declared = srv.store.declared()  # the two partitions' declarations
        ids = [np.zeros((8 * mib - declared - 16 * 1024) // 8, np.int64)]  # an empty server's
        msg = _refused(
            srv.location,
            [flightq.encode(schema, {"input_ids": ids}, ["big"])],
            "memory budget",
            timeout=0.3,
        )
        assert f"the server holds {st['held']} of its" in msg, msg
        # A part waiting for its put's other part counts for the server, in no partition.
        part = flightq.encode(schema, {"input_ids": [np.zeros(mib // 8, np.int64)]}, ["s"])
        waiting = _start_part(srv.location, "s1", part, timeout=30)
        deadline = time.monotonic() + 10
        while c.stats()["held"] < st["held"] + mib and time.monotonic() < deadline:
            time.sleep(0.05)
        now = c.stats()
        assert now["held"] >= st["held"] + mib, "the staged part is held"
        assert now["partitions"]["p"]["held"] == p["held"]
        action(srv.location, "abort_put", {"partition": "p", "stage": "s1", "parts": 2})
        with pytest.raises(fl.FlightError, match="gave up a part"):
            waiting[2].read()
            waiting[1].close()
        waiting[0].close()
        # Cleared rows count no more.
        assert c.clear("p") == 50
        deadline = time.monotonic() + 10
        while c.stats()["held"] != q["held"] and time.monotonic() < deadline:
            time.sleep(0.05)
        st = c.stats()
        assert st["partitions"]["p"]["held"] == 0 and st["held"] == q["held"]
        from flightq import tools

        capsys.readouterr()
        tools.inspect(srv.location, "q")
        assert (
            f"({tools.human_bytes(q['bytes'])} payload, {tools.human_bytes(q['held'])} held)"
            in (capsys.readouterr().out)
        )


def test_a_put_whose_message_holds_more_than_its_batch_counts_what_it_holds() -> None:
    # A hand-written FlightData whose one-row batch leaves 32 MiB between two buffers:
    # Arrow reads the batch, the server would hold the message whole, gap included.
    grpc = pytest.importorskip("grpc", reason="needs grpcio to write FlightData by hand")
    from helpers_flightdata import flight_data, gapped, schema_header

    batch = text_batch(["a"])
    header, body = gapped(batch, 32 << 20)
    assert pa.ipc.read_record_batch(
        pa.ipc.read_message(
            pa.py_buffer(b"\xff\xff\xff\xff" + len(header).to_bytes(4, "little") + header + body)
        ),
        batch.schema,
    ).equals(batch)  # the same batch to Arrow
    messages = [
        flight_data(schema_header(batch.schema), command=put_command("p", rows=1).command),
        flight_data(header, body),
    ]
    with flightq.Server(memory_budget=16 << 20) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", "rollout_text@1", tasks=["t"])
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            call = channel.stream_stream("/arrow.flight.protocol.FlightService/DoPut")
            with pytest.raises(grpc.RpcError) as e:
                list(call(iter(messages), timeout=30))
        assert "ResourceExhaustedError" in e.value.details()
        assert "whole memory budget" in e.value.details()
        p = c.stats()["partitions"]["p"]
        assert (p["rows"], p["held"]) == (0, 0)
        c.put("p", ["b"], {"input_ids": [np.arange(3)]})  # the server serves on
        assert c.get("p", ["b"], as_="numpy").keys == ["b"]


def _rows(n: int, tokens: int, start: int = 0) -> dict[str, list[np.ndarray]]:
    return {"input_ids": [np.full(tokens, start + i, np.int64) for i in range(n)]}


def test_a_batch_counts_whole_until_its_rows_are_few_then_they_are_copied_out() -> None:
    # 50 rows of 160 KB in one record batch. Clearing 20 frees nothing (the rows left keep
    # the batch's buffers alive), so the budget keeps counting the batch whole; once at
    # most half its rows are left they are copied into a batch of their own and the rest
    # of the memory goes, and so does its count.
    with flightq.Server(memory_budget=64 << 20) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        keys = [f"k{i}" for i in range(50)]
        c.put("p", keys, _rows(50, 20_000))
        whole = srv.store.held()
        assert whole >= 50 * 160_000
        assert c.clear("p", keys[:20]) == 20
        assert 0 < whole - srv.store.held() < 20 * 2_000  # the cleared rows' own bytes
        assert c.clear("p", keys[20:30]) == 10
        assert whole * 0.39 < srv.store.held() < whole * 0.41  # 20 rows of 50
        got = c.get("p", keys[30:], as_="numpy")["input_ids"]
        assert [int(x[0]) for x in got] == list(range(30, 50))
        assert all(len(x) == 20_000 for x in got)
        with c.claim("p", "t", 20, as_="numpy") as b:  # claims, acks, write-backs read the copies
            assert sorted(b.keys) == sorted(keys[30:])
        assert c.clear("p") == 20
        assert srv.store.held() == 0


def test_rows_kept_from_each_put_hold_only_themselves() -> None:
    # Keep one row of each put, clear the rest, repeat: each kept row is copied out of its
    # batch, which goes, so 40 such puts hold 40 rows, not 40 batches.
    with (
        flightq.Server(memory_budget=16 << 20) as srv,
        flightq.connect(srv.location, timeout=5.0) as c,
    ):
        c.create_partition("p", TEXT, tasks=["t"])
        for i in range(40):
            keys = [f"r{i}_{j}" for j in range(50)]
            c.put("p", keys, _rows(50, 5_000, 100 * i))  # 2 MB a put
            c.clear("p", keys[1:])
        assert srv.store.held() < 40 * 2 * 40_000
        kept = [f"r{i}_0" for i in range(40)]
        got = c.get("p", kept, as_="numpy")["input_ids"]
        assert [int(x[0]) for x in got] == [100 * i for i in range(40)]


def test_puts_whose_rows_are_mostly_kept_are_refused_once_their_batches_fill_it() -> None:
    # Keep 30 rows of each put of 50: too many to copy out, so each batch stays whole and
    # counts whole, and puts are refused once the batches fill the budget.
    budget_bytes = 16 << 20
    with (
        flightq.Server(memory_budget=budget_bytes) as srv,
        flightq.connect(srv.location, timeout=2.0) as c,
    ):
        c.create_partition("p", TEXT, tasks=["t"])
        stored = 0
        with pytest.raises(flightq.ResourceExhaustedError):
            for i in range(40):
                keys = [f"r{i}_{j}" for j in range(50)]
                c.put("p", keys, _rows(50, 5_000))  # 2 MB a put
                stored += 1
                c.clear("p", keys[30:])
                assert srv.store.held() <= budget_bytes
        assert 4 <= stored < 10  # 16 MiB holds 8 such batches, less what each row costs
        c.clear("p")
        assert srv.store.held() == 0
        c.put("p", ["again"], _rows(1, 10))  # room again, the server serves on


def test_a_batch_whose_column_a_write_back_replaced_counts_while_its_rows_live() -> None:
    # Overwriting a column frees none of the batch it came in: the rows' other column
    # keeps it alive. It counts until no row uses a cell of it.
    schema = flightq.Schema(
        "blobs",
        1,
        [
            flightq.Field("blob", "float32", "tensor", [None], required=True),
            flightq.Field("score", "float32", "scalar", ()),
        ],
    )
    keys = [f"k{i}" for i in range(8)]

    def blobs(n: int) -> list[np.ndarray]:
        return [np.full(n, 7, np.float32) for _ in keys]

    with flightq.Server(memory_budget=64 << 20) as srv, flightq.connect(srv.location) as c:
        c.register_schema(schema)
        c.create_partition("p", schema, tasks=["t"])
        c.put("p", keys, {"blob": blobs(100_000), "score": np.ones(8, np.float32)})
        first = srv.store.held()
        assert first >= 8 * 400_000
        c.put("p", keys, {"blob": blobs(4)}, overwrite=True)
        assert srv.store.held() > first  # the first batch (its scores are used), and this
        again = srv.store.held()
        c.put("p", keys, {"blob": blobs(4)}, overwrite=True)  # the last write-back's goes
        assert srv.store.held() == again
        c.put("p", keys, {"score": np.zeros(8, np.float32)}, overwrite=True)
        assert srv.store.held() < 100_000  # no row uses the first batch: it goes
        assert c.get("p", keys[:1], as_="numpy")["blob"][0].tolist() == [7.0] * 4


def test_declared_partitions_count_against_the_budget_and_are_capped() -> None:
    with flightq.Server(memory_budget=1 << 20) as srv, flightq.connect(srv.location) as c:
        tasks = [f"task{i}" for i in range(8)]
        made = 0
        with pytest.raises(flightq.ResourceExhaustedError, match="memory budget"):
            for i in range(1000):
                c.create_partition(f"p{i}", TEXT, tasks=tasks)
                made += 1
        cost = budget.declaration_cost("p0", tasks)
        assert (1 << 20) // cost - 2 <= made <= (1 << 20) // cost
        declared = sum(budget.declaration_cost(f"p{i}", tasks) for i in range(made))
        assert srv.store.counted() - srv.store.held() == declared
        c.drop("p0")  # room again
        c.create_partition("again", TEXT, tasks=tasks)
        c.drop("again")
        c.drop("p1")
        # A partition's name, its tasks and each task's name are capped.
        for kwargs, match in [
            ({"partition": "n" * (budget.MAX_NAME_CHARS + 1)}, "partition name of 257"),
            ({"tasks": [f"t{i}" for i in range(budget.MAX_TASKS + 1)]}, "65 tasks"),
            ({"tasks": ["t" * (budget.MAX_NAME_CHARS + 1)]}, "task name of 257"),
        ]:
            args = {"partition": "x", "tasks": ["t"], **kwargs}
            with pytest.raises(flightq.ResourceExhaustedError, match=match):
                c.create_partition(args["partition"], TEXT, tasks=args["tasks"])
        c.create_partition("n" * budget.MAX_NAME_CHARS, TEXT, tasks=["t" * 256] * 1)
        assert "n" * budget.MAX_NAME_CHARS in c.partitions()


def test_a_full_budget_of_rows_refuses_a_new_partition_until_rows_go() -> None:
    with flightq.Server(memory_budget=4_000_000) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        keys = [f"k{i}" for i in range(4)]
        c.put("p", keys, _rows(4, 124_000))  # 3.97 MB of the 4 MB
        with pytest.raises(flightq.ResourceExhaustedError, match="declare 'q'"):
            c.create_partition("q", TEXT, tasks=[f"t{i}" for i in range(64)])
        c.clear("p")
        c.create_partition("q", TEXT, tasks=[f"t{i}" for i in range(64)])


def _big_tags(i: int) -> dict[str, str]:
    return {f"t{i}_{j}": "x" * 1000 for j in range(50)}  # about 50 KB, under the cap


def test_rows_with_no_field_and_rewritten_tags_count_what_they_hold() -> None:
    # A row holds its key and tags map whatever cells it has: rows of tags alone, and tags
    # rewritten again and again into one row's map, fill the budget and are refused.
    opt = flightq.Schema("opt", 1, [flightq.Field("score", "float32", "scalar", ())])
    with (
        flightq.Server(memory_budget=8 << 20) as srv,
        flightq.connect(srv.location, timeout=2.0) as c,
    ):
        c.register_schema(opt)
        c.create_partition("a", opt, tasks=["t"])
        stored = 0
        with pytest.raises(flightq.ResourceExhaustedError):
            for i in range(40):  # 2.5 MB of tags a put, as Python objects more
                keys = [f"a{i}_{j}" for j in range(50)]
                c.put("a", keys, {}, [_big_tags(i * 50 + j) for j in range(50)])
                stored += 1
        assert 0 < stored < 4, stored
        c.clear("a")
        assert srv.store.held() == 0
        c.create_partition("b", TEXT, tasks=["t"])
        c.put("b", ["r"], {"input_ids": [np.arange(4)]})
        rewrites = 0
        with pytest.raises(flightq.ResourceExhaustedError):
            for i in range(300):  # each rewrite adds 50 tags to the row's map
                c.put("b", ["r"], {}, [_big_tags(10_000 + i)])
                rewrites += 1
        assert 10 < rewrites < 300, rewrites
        assert len(c.get("b", ["r"], as_="numpy").tags[0]) == 50 * rewrites


class _Frames:
    """A request stream a plain Flight client holds, sending puts as 'ipc' frames of
    several record batches (one block of memory on the server)."""

    def __init__(self, location: str) -> None:
        from flightq.frames import parse_frame
        from flightq.protocol import RequestsCommand

        self._parse = parse_frame
        self.client = fl.connect(location)
        desc = fl.FlightDescriptor.for_command(RequestsCommand().to_wire())
        self.w, self.r = self.client.do_exchange(desc)
        parse_frame(self.r.read_chunk().app_metadata, "hello")

    def put(self, batches: list[pa.RecordBatch]) -> dict | None:
        """One put of ``batches`` in one frame; None when stored, else the error."""
        from flightq.protocol import PutCommand

        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batches[0].schema) as wr:
            for b in batches:
                wr.write_batch(b.replace_schema_metadata(batches[0].schema.metadata))
        body = sink.getvalue()
        cmd = PutCommand(partition="p", timeout=0).to_wire()
        head = msgpack.packb(
            {"op": "put", "cmd": cmd, "body": "ipc", "batches": [body.size]}, use_bin_type=True
        )
        frame = len(head).to_bytes(4, "little") + head + body.to_pybytes()
        self.w.write_metadata(pa.py_buffer(frame))
        ans = self._parse(self.r.read_chunk().app_metadata, "answer").header
        return None if "ok" in ans else msgpack.unpackb(ans["error"])

    def clear(self, keys: list[str]) -> None:
        from flightq.frames import pack_frame

        cmd = msgpack.packb({"partition": "p", "keys": keys})
        self.w.write_metadata(pack_frame({"op": "act", "type": "clear", "cmd": cmd}))
        assert "ok" in self._parse(self.r.read_chunk().app_metadata, "answer").header

    def close(self) -> None:
        self.w.done_writing()
        self.client.close()


def test_batches_read_from_one_frame_count_while_any_of_them_is_stored() -> None:
    # One request-stream frame carrying two batches (4 rows of 900 KB, then 1 tiny row),
    # the first batch's rows cleared each round: the tiny row keeps the frame's memory
    # alive, so the budget keeps counting it, and refuses once the frames fill it.
    schema = flightq.SchemaRegistry.default().get(TEXT)
    with flightq.Server(memory_budget=16 << 20) as srv:
        _declare(srv.location)
        frames = _Frames(srv.location)
        refused, i = None, 0
        for i in range(40):
            a_keys = [f"a{i}_{j}" for j in range(4)]
            ids = [np.full(112_000, j, np.int64) for j in range(4)]
            a = flightq.encode(schema, {"input_ids": ids}, a_keys)
            b = flightq.encode(schema, {"input_ids": [np.arange(4)]}, [f"b{i}"])
            refused = frames.put([a, b])
            if refused is not None:
                break
            frames.clear(a_keys)
            assert srv.store.held() <= 16 << 20
        frames.close()
        assert refused is not None and refused["type"] == "ResourceExhaustedError", refused
        assert 2 <= i < 8, i  # 16 MiB holds 4 frames of 3.6 MB


def test_a_batch_no_row_uses_counts_while_its_frame_is_alive() -> None:
    # A frame of a new tiny row and 1 MB of tag-only rewrites equal to the stored tags: no
    # row uses the second batch, but the first keeps the frame (and so it) alive, so it
    # counts with the frame, and the frames fill the budget.
    schema = flightq.SchemaRegistry.default().get(TEXT)
    tkeys = [f"t{j}" for j in range(20)]
    tags = [_big_tags(j) for j in range(20)]
    with flightq.Server(memory_budget=16 << 20) as srv, flightq.connect(srv.location) as c:
        _declare(srv.location)
        c.put("p", tkeys, {"input_ids": [np.arange(4)] * 20}, tags)
        rewrite = flightq.encode(schema, {"input_ids": [None] * 20}, tkeys, tags)
        frames = _Frames(srv.location)
        refused, i = None, 0
        for i in range(60):
            new = flightq.encode(schema, {"input_ids": [np.arange(4)]}, [f"a{i}"])
            refused = frames.put([new, rewrite])
            if refused is not None:
                break
        frames.close()
        assert refused is not None and refused["type"] == "ResourceExhaustedError", refused
        assert 3 <= i < 30, i  # frames of about 1 MB each, and the rows' tags


def test_a_write_back_that_changes_a_tags_type_stores_it() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["t"])
        c.put("p", ["r"], {"input_ids": [np.arange(4)]}, [{"a": 1, "b": 0, "c": [1]}])
        c.put("p", ["r"], {}, [{"a": 1.0, "b": False, "c": [True]}])
        got = c.get("p", ["r"], as_="numpy").tags[0]
        assert got == {"a": 1.0, "b": False, "c": [True]}
        assert [type(got[k]) for k in "ab"] == [float, bool] and type(got["c"][0]) is bool


def test_caps_apply_to_new_partitions_and_a_put_past_what_declarations_leave_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flightq.server import store

    with flightq.Server(memory_budget=4 << 20) as srv, flightq.connect(srv.location) as c:
        c.create_partition("p", TEXT, tasks=["a", "b", "c"])
        monkeypatch.setattr(store, "MAX_TASKS", 2)  # as a partition declared before a cap
        assert c.create_partition("p", TEXT, tasks=["a", "b", "c"]) is False  # it stands
        with pytest.raises(flightq.ResourceExhaustedError, match="3 tasks"):
            c.create_partition("q", TEXT, tasks=["a", "b", "c"])
        monkeypatch.undo()
        tasks = [f"t{i}" for i in range(64)]
        for i in range(20):
            c.create_partition(f"d{i}", TEXT, tasks=tasks)
        declared = srv.store.counted() - srv.store.held()
        assert declared > 2 << 20
        rows = _rows(1, ((4 << 20) - declared + 100_000) // 8)  # fits the budget, not the room
        t0 = time.monotonic()
        with pytest.raises(flightq.ResourceExhaustedError, match="declarations hold; split it"):
            c.put("p", ["big"], rows, timeout=30)
        assert time.monotonic() - t0 < 10  # refused at once, not after the timeout


def test_a_large_reply_waits_for_room_and_is_refused_typed_while_small_ones_go_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Replies are built whole and held until sent; nothing bounded how many were built at
    # once (8 stats of 122 MiB raised a 64 MiB-budget server's peak by 16.6 budgets). A
    # large one now waits for room among those in flight; small ones never wait.
    from flightq.server import replies

    monkeypatch.setattr(replies, "REPLY_WAIT_S", 0.5)
    text = flightq.SchemaRegistry.default().get(TEXT).canonical_json
    tasks = [f"{t:02d}" + "\U0001f600" * 254 for t in range(64)]
    with flightq.Server(memory_budget=16 * 2**20) as srv:
        loc = srv.location
        for name in ("big", "big2"):
            action(loc, "declare", {"partition": name, "schema": text, "tasks": tasks})
        action(loc, "declare", {"partition": "small", "schema": text})
        assert plain_put(loc, put_command("small", rows=2), [text_batch(["a", "b"])])
        assert srv.store.declared() > replies.SMALL_REPLY_BYTES  # stats is a large reply
        room = srv.replies
        room._take(room.capacity, "another reply", 1.0)  # the room is full meanwhile
        try:
            with pytest.raises(fl.FlightError) as e:
                action(loc, "stats", {})
            assert plain_error(e.value)[0] == "ResourceExhaustedError"
            assert "stats: a reply of about" in str(e.value) and "found no room" in str(e.value)
            # Room comes once the replies in flight are sent: the same call may pass later.
            assert msgpack.unpackb(e.value.extra_info)["retry"] == "busy"
            # Ordinary replies go at once.
            assert action(loc, "list_keys", {"partition": "small"})["keys"] == ["a", "b"]
            assert action(loc, "describe", {"partition": "small"})["tasks"] == []
            assert action(loc, "health", {})["ok"]
        finally:
            room._give(room.capacity)
        # Once the room is free the same stats is answered, and gives its room back.
        assert set(action(loc, "stats", {})["partitions"]) == {"big", "big2", "small"}
        assert (room.used, room.replies) == (0, 0)
        # A reply larger than the whole room is built alone, never refused for its size.
        monkeypatch.setattr(room, "capacity", replies.SMALL_REPLY_BYTES)
        assert set(action(loc, "stats", {})["partitions"]) == {"big", "big2", "small"}
        assert (room.used, room.replies) == (0, 0)


def test_a_list_keys_waiting_for_room_holds_no_row_a_clear_frees() -> None:
    # list_keys picked its rows, then waited for room among large replies holding them:
    # rows cleared meanwhile kept their record batches alive, no longer counted, while
    # the budget took new puts. It now waits holding none and picks them again.
    import gc
    import weakref

    with flightq.Server(memory_budget=64 * 2**20) as srv:
        loc = srv.location
        text = flightq.SchemaRegistry.default().get(TEXT).canonical_json
        action(loc, "declare", {"partition": "p", "schema": text})
        keys = [f"k{i}" for i in range(200)]  # 200 rows of 6 KiB tags: a large reply
        assert plain_put(
            loc,
            put_command("p", rows=200),
            [with_tags(text_batch(keys), [msgpack.packb({"t": "x" * 6000})] * 200)],
        )
        row = srv.store.partition("p").rows["k0"]
        piece = weakref.ref(next(iter(row.cells.values()))[0])
        del row
        room = srv.replies
        room._take(room.capacity, "another reply", 1.0)  # the room is full meanwhile
        listed: dict[str, object] = {}
        t = threading.Thread(
            target=lambda: listed.update(action(loc, "list_keys", {"partition": "p"}))
        )
        t.start()
        try:
            deadline = time.monotonic() + 10
            while not room.waiting:  # list_keys has picked its rows and waits for room
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert action(loc, "clear", {"partition": "p"})["cleared"] == 200
            gc.collect()
            assert piece() is None, "a cleared row's data is kept alive by a waiting list_keys"
        finally:
            room._give(room.capacity)
            t.join(10)
        assert listed["keys"] == []  # picked again once it had room: none left


def test_each_media_copy_counts_its_objects_and_many_tiny_ones_fill_the_budget():
    segments = 2000  # distinct 4-byte images in one row: a copy each on the server
    with (
        flightq.Server(memory_budget=8 * 2**20, shm=False) as srv,
        flightq.connect(srv.location, timeout=30) as c,
    ):
        c.create_partition("v", "rollout_vlm@1", tasks=["train"])
        before = srv.store.held()

        def put(n: int, timeout: float = 30) -> None:
            imgs = [np.full(1, float(n * segments + i), np.float32) for i in range(segments)]
            c.put(
                "v",
                [f"r{n}"],
                {"input_ids": [np.arange(4)], "pixel_values": [imgs]},
                timeout=timeout,
            )

        put(0)
        assert srv.store.held() - before >= segments * budget.COPY_OVERHEAD
        stored = 1
        with pytest.raises(flightq.ResourceExhaustedError):
            while stored < 20:  # 20 x 2000 copies pass 8 MiB once their objects count
                put(stored, timeout=0.2)
                stored += 1
        assert stored < 9
        c.clear("v")
        assert srv.store.held() == before


def test_puts_waiting_for_room_hold_at_most_half_the_budget_the_rest_are_refused_at_once():
    def cols(n: int) -> dict:
        return {"input_ids": [np.arange(n * 1000 + i, (n + 1) * 1000 + i) for i in range(190)]}

    with (
        flightq.Server(memory_budget=8 * 2**20, shm=False) as srv,
        flightq.connect(srv.location, timeout=30) as c,
    ):
        c.create_partition("p", "rollout_text@1", tasks=["train"])
        full = 0
        with pytest.raises(flightq.ResourceExhaustedError):
            while full < 10:  # about 1.5 MB a put, until the budget is full
                c.put("p", [f"f{full}_{i}" for i in range(190)], cols(full), timeout=0.1)
                full += 1
        outcome: dict[int, str] = {}

        def put(n: int) -> None:
            try:
                c.put("p", [f"w{n}_{i}" for i in range(190)], cols(n), timeout=20)
                outcome[n] = "stored"
            except flightq.ResourceExhaustedError as e:
                outcome[n] = "refused" if "wait for room already" in str(e) else str(e)

        threads = [threading.Thread(target=put, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while sum(v == "refused" for v in outcome.values()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(outcome.values()) == ["refused"] * 4, outcome  # at once, not at 20 s
        assert c.inspect("p")["waiting_puts"] == 2
        c.clear("p", [k for k in c.list_keys("p") if k.startswith("f")])
        for t in threads:
            t.join(30)
        assert sorted(outcome.values()) == ["refused"] * 4 + ["stored"] * 2
