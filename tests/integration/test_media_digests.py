"""Media sent once across puts: content-addressed, reference-counted, against real servers.

A generator that puts each row as it finishes (W5) sends its group's image with the first
row only; later rows reference it by digest and hint. The server keeps one copy per
partition, counted once, and serves a copy to another put only once its bytes hashed to
the digest asked for. Payloads that do not recur are hashed by neither side.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest

import flightq
from flightq import workloads
from flightq.digest import HASH, MediaRefs, digest_of, hashed_bytes, hint_of, split_claims
from flightq.protocol import PutCommand
from flightq.server.media import MAX_HASHED, MAX_LOOKED_AT

pytestmark = pytest.mark.timeout(120)

#: A W1-like step small enough for tests: 3 groups of 4 rows, an [8, 64] float32 image each.
GROUPS, G = 3, 4


def _step(copies: bool = False) -> workloads.Step:
    step = workloads.w1(0, groups=GROUPS, g=G)
    rng = np.random.default_rng(1)
    images = [rng.standard_normal((64, 1176), dtype=np.float32) for _ in range(GROUPS)]
    step.columns["pixel_values"] = [
        [images[i // G].copy() if copies else images[i // G]] for i in range(step.rows)
    ]
    return step


def _image_bytes(step: workloads.Step) -> int:
    return sum(step.columns["pixel_values"][g * G][0].nbytes for g in range(GROUPS))


def _row(step: workloads.Step, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in step.columns.items()}


def _put_rows(client: flightq.Client, name: str, step: workloads.Step, rows) -> None:
    for i in rows:
        client.put(name, step.keys[i : i + 1], _row(step, i), step.tags[i : i + 1])


def _received(client: flightq.Client) -> int:
    return client.stats()["counters"]["bytes_received"]


def _hashed(client: flightq.Client) -> int:
    """Media bytes the server hashed."""
    return client.stats()["counters"]["media_hashed_bytes"]


#: Bytes of the grids hashed: a group's grid (24 bytes) is equal to the others', so it
#: is hashed to keep it once. Well below one image (301,056 bytes).
GRIDS = 1024


def _check_rows(batch: flightq.Batch, step: workloads.Step) -> None:
    index = {k: i for i, k in enumerate(step.keys)}
    for j, k in enumerate(batch.keys):
        want = step.columns["pixel_values"][index[k]][0]
        assert np.array_equal(batch["pixel_values"][j][0], want), k
        assert np.array_equal(batch["input_ids"][j], step.columns["input_ids"][index[k]])


def _interleaved(step: workloads.Step) -> list[int]:
    return [int(i) for i in np.random.default_rng(3).permutation(step.rows)]


def _distinct(step: workloads.Step) -> int:
    """Payload bytes with each distinct image (and grid) once, by content."""
    return _step().nbytes(distinct_media=True)


@pytest.mark.parametrize("copies", [False, True], ids=["shared", "copies"])
def test_streamed_one_row_puts_store_and_send_each_image_once(copies):
    step = _step(copies)
    distinct = _distinct(step)
    image = step.columns["pixel_values"][0][0].nbytes
    # Room for the rows and one copy of each image, not for a second copy of one.
    with flightq.Server(memory_budget=distinct + image // 2 + (512 << 10)) as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, _interleaved(step))
        held = c.stats()["partitions"]["p"]["bytes"]
        # Each image's payload once (scalar columns count in the step, not in stats).
        assert distinct - 4096 < held <= distinct
        assert c.inspect("p")["bytes"] == held
        # On the wire: each image once, the rows' text, and the framing.
        assert _received(c) < 1.1 * distinct
        batch = c.claim("p", "train", step.rows, as_="numpy")
        _check_rows(batch, step)
        got = sum(len(p.record_batch.column("pixel_values").values.dictionary) for p in batch.parts)
        assert got == GROUPS  # the answer carries each image once


def test_clearing_some_rows_keeps_the_image_and_the_last_frees_it():
    step = _step()
    image = step.columns["pixel_values"][0][0].nbytes
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, range(G))  # group 0, a row a put
        c.clear("p", step.keys[: G - 1])
        left = c.stats()["partitions"]["p"]["bytes"]
        assert image < left < 2 * image  # the last row holds the image, once
        batch = c.get("p", step.keys[G - 1 : G], as_="numpy")
        _check_rows(batch, step)
        c.clear("p", step.keys[G - 1 : G])
        assert c.stats()["partitions"]["p"]["bytes"] == 0


def test_a_digest_the_server_no_longer_holds_is_sent_again_transparently():
    step = _step()
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, [0])
        other = flightq.connect(srv.location)
        other.clear("p")  # another client frees the image this one remembers
        sent = _received(c)
        _put_rows(c, "p", step, [1])  # named by digest, refused, sent again whole
        image = step.columns["pixel_values"][1][0].nbytes
        assert _received(c) - sent > image
        _check_rows(c.get("p", step.keys[1:2], as_="numpy"), step)
        assert c.stats()["counters"]["refusals"]["MediaUnknownError"] == 1
        # Remembered again: the next row of the group names it by digest alone.
        sent = _received(c)
        _put_rows(c, "p", step, [2])
        assert _received(c) - sent < image // 4


def test_a_restarted_server_gets_the_payloads_again():
    step = _step()
    with flightq.Server() as srv:
        location = srv.location
        c = flightq.connect(location)
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, [0])
    try:
        again = flightq.Server(location)
    except Exception:  # pragma: no cover - the port was taken meanwhile
        pytest.skip("the port was taken by another process before the restart")
    with again:
        # The same client, its connection to the same address back: it remembers the
        # image the old server held, is told it is unknown, and sends it again.
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, [1])
        _check_rows(c.get("p", step.keys[1:2], as_="numpy"), step)
        assert c.stats()["counters"]["refusals"]["MediaUnknownError"] == 1


def _plain_put(location: str, batch: pa.RecordBatch, meta: bytes | None) -> fl.FlightError:
    schema, _ = split_claims(batch.schema)
    cmd = PutCommand(partition="p", rows=batch.num_rows)
    with fl.connect(location) as plain:
        writer, reader = plain.do_put(fl.FlightDescriptor.for_command(cmd.to_wire()), schema)
        with pytest.raises(fl.FlightError) as e, writer:
            if meta is None:
                writer.write_batch(batch)
            else:
                writer.write_with_metadata(batch, pa.py_buffer(meta))
            writer.done_writing()
            reader.read()
    return e.value


def _encoded(step: workloads.Step, i: int, image: np.ndarray, known=()) -> pa.RecordBatch:
    cols = _row(step, i)
    cols["pixel_values"] = [[image]]
    schema = flightq.SchemaRegistry.default().get(step.schema)
    return flightq.encode(schema, cols, step.keys[i : i + 1], media=MediaRefs(known=known))


def test_a_payload_that_lies_about_its_digest_is_refused_and_nothing_stored():
    step = _step()
    a = step.columns["pixel_values"][0][0]
    b = step.columns["pixel_values"][G][0]
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        batch = _encoded(step, 0, b)  # the bytes of B ...
        assert split_claims(batch.schema)[1] is None  # (new: sent bare)
        m = {"hash": HASH, "fields": {"pixel_values": [digest_of(a)]}}  # ... claimed to be A
        e = _plain_put(srv.location, batch, msgpack.packb(m))
        info = msgpack.unpackb(e.extra_info)
        assert info["type"] == "MediaDigestError"
        assert info["field"] == "pixel_values"
        assert "nothing was stored" in info["message"]
        assert c.stats()["partitions"]["p"]["rows"] == 0
        assert c.stats()["partitions"]["p"]["bytes"] == 0
        # A's own writer is not poisoned: its rows get A.
        _put_rows(c, "p", step, [0, 1])
        _check_rows(c.get("p", step.keys[:2], as_="numpy"), step)


def test_a_reference_to_an_unknown_digest_is_refused_typed():
    step = _step()
    a = step.columns["pixel_values"][0][0]
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        name = ("pixel_values", hint_of(a), a.shape)
        batch = _encoded(step, 0, a, known={name})
        assert len(batch.column("pixel_values").values.dictionary[0].as_py()) == 0
        _, claims = split_claims(batch.schema)
        e = _plain_put(srv.location, batch, claims.to_pybytes())
        info = msgpack.unpackb(e.extra_info)
        assert info["type"] == "MediaUnknownError"
        assert info["actual"] == [digest_of(a).hex()]
        assert c.stats()["partitions"]["p"]["rows"] == 0
        # Without digests, an empty entry is an empty payload: its shape says otherwise.
        e = _plain_put(srv.location, batch, None)
        assert msgpack.unpackb(e.extra_info)["type"] == "ShapeError"
        # A reference whose shape differs from the stored copy's names nothing held.
        _put_rows(c, "p", step, [0])
        flat = a.reshape(-1)
        other = _encoded(step, 1, flat, known={("pixel_values", hint_of(a), flat.shape)})
        _, claims = split_claims(other.schema)
        e = _plain_put(srv.location, other, claims.to_pybytes())
        assert msgpack.unpackb(e.extra_info)["type"] == "MediaUnknownError"
        assert c.stats()["partitions"]["p"]["rows"] == 1
        # A reference is a digest and a hint; a hint goes with no payload.
        digest_alone = {"hash": HASH, "fields": {"pixel_values": [digest_of(a)]}}
        e = _plain_put(srv.location, batch, msgpack.packb(digest_alone))
        assert msgpack.unpackb(e.extra_info)["type"] == "ProtocolError"
        with_hint = {"hash": HASH, "fields": {"pixel_values": [digest_of(a) + hint_of(a)]}}
        e = _plain_put(srv.location, _encoded(step, 2, a), msgpack.packb(with_hint))
        assert msgpack.unpackb(e.extra_info)["type"] == "ProtocolError"
        assert c.stats()["partitions"]["p"]["rows"] == 1


def test_a_budget_refusal_stores_nothing_and_leaves_the_copies_counted_right():
    step = _step()
    image = step.columns["pixel_values"][0][0].nbytes
    with flightq.Server(memory_budget=image + (256 << 10)) as srv:
        # A put waits for room for most of its timeout before it is refused: a short one.
        c = flightq.connect(srv.location, timeout=3.0)
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, [0, 1])  # group 0: one image, two rows
        held = c.stats()["partitions"]["p"]["bytes"]
        with pytest.raises(flightq.ResourceExhaustedError):
            _put_rows(c, "p", step, [G])  # group 1's image does not fit
        assert c.stats()["partitions"]["p"]["bytes"] == held
        assert c.stats()["partitions"]["p"]["rows"] == 2
        _put_rows(c, "p", step, [2])  # group 0's image by digest: fits
        c.clear("p")
        assert c.stats()["partitions"]["p"]["bytes"] == 0
        _put_rows(c, "p", step, [G, G + 1])  # the room is back
        _check_rows(c.get("p", step.keys[G : G + 2], as_="numpy"), step)


def test_a_snapshot_keeps_each_image_once_across_a_restore(tmp_path):
    step = _step(copies=True)
    with flightq.Server(snapshot_dir=tmp_path) as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        _put_rows(c, "p", step, _interleaved(step))
        held = c.stats()["partitions"]["p"]["bytes"]
        c.snapshot("s")
    with flightq.Server(restore=tmp_path / "s") as srv:
        c = flightq.connect(srv.location)
        assert c.stats()["partitions"]["p"]["bytes"] == held
        _check_rows(c.get("p", step.keys, as_="numpy"), step)
        c.clear("p", step.keys[:G])
        _put_rows(c, "p", step, [0])  # a new client: sends the payload
        _check_rows(c.get("p", step.keys[:1], as_="numpy"), step)


def test_a_sharded_put_keeps_one_copy_per_shard():
    step = _step()
    with flightq.Server() as a, flightq.Server() as b:
        sc = flightq.connect_sharded([a.location, b.location])
        sc.create_partition("p", step.schema, tasks=["train"], group_size=None)
        for i in _interleaved(step):
            sc.put("p", step.keys[i : i + 1], _row(step, i), step.tags[i : i + 1])
        batch = sc.get("p", step.keys, as_="numpy")
        _check_rows(batch, step)
        total = 0
        for loc in (a.location, b.location):
            total += flightq.connect(loc).stats()["partitions"]["p"]["bytes"]
        text = step.nbytes() - sum(x[0].nbytes for x in step.columns["pixel_values"])
        # Each image once on every shard that holds rows of its group.
        assert total <= text + 2 * _image_bytes(step)


def _read_only(step: workloads.Step) -> workloads.Step:
    """``step`` with its images read-only: a client caches their digests (a writable
    array may change unseen, so it is hashed on every put that needs its digest)."""
    for row in step.columns["pixel_values"]:
        row[0].flags.writeable = False
    return step


def _look_alike(image: np.ndarray, k: int = 1) -> np.ndarray:
    """Other bytes with ``image``'s hint: changed between the hint's samples."""
    out = image.copy()
    out.view(np.uint8).reshape(-1)[10_000] ^= k
    assert hint_of(out) == hint_of(image) and not np.array_equal(out, image)
    return out


def _bare_put(location: str, step: workloads.Step, key: str, image: np.ndarray) -> None:
    """A plain pyarrow writer's put of one row, its payload bare (no claim)."""
    cols = _row(step, 0)
    cols["pixel_values"] = [[image]]
    schema = flightq.SchemaRegistry.default().get(step.schema)
    batch = flightq.encode(schema, cols, [key])
    cmd = PutCommand(partition="p", rows=1)
    with fl.connect(location) as plain:
        writer, reader = plain.do_put(fl.FlightDescriptor.for_command(cmd.to_wire()), batch.schema)
        with writer:
            writer.write_batch(batch)
            writer.done_writing()
            reader.read()


@pytest.mark.parametrize("copies", [False, True], ids=["shared", "copies"])
def test_a_put_of_new_images_hashes_nothing_on_either_side(copies):
    step = _read_only(_step(copies))
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        before = hashed_bytes()  # this process: the client and the server's threads
        c.put("p", step.keys, step.columns, step.tags)  # whole groups, every image new
        assert _hashed(c) == 0  # one put: the client sent each grid once
        held = c.stats()["partitions"]["p"]["bytes"]
        assert _distinct(step) - 4096 < held <= _distinct(step)
        images = sum(x[0].nbytes for x in step.columns["pixel_values"])
        if copies:  # equal copies of one put share a hint: hashed once each, sent once
            assert images <= hashed_bytes() - before < images + GRIDS
        else:
            assert hashed_bytes() - before < GRIDS
        _check_rows(c.get("p", step.keys, as_="numpy"), step)


@pytest.mark.parametrize("copies", [False, True], ids=["shared", "copies"])
def test_a_recurring_image_is_hashed_once_per_side(copies):
    step = _read_only(_step(copies))
    image = step.columns["pixel_values"][0][0].nbytes
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        before = hashed_bytes()
        _put_rows(c, "p", step, range(G))  # group 0 streamed: the image, then references
        # The server: its copy, once, at the first reference.
        assert image <= _hashed(c) < image + GRIDS
        # The client: the tensor once (its digest cached), or each copy object once.
        client = hashed_bytes() - before - _hashed(c)
        want = (G - 1) * image if copies else image
        assert want <= client < want + GRIDS
        assert _received(c) < image + G * (64 << 10)
        _check_rows(c.get("p", step.keys[:G], as_="numpy"), step)


def test_a_look_alike_held_unverified_is_never_served_to_another_writer():
    step = _read_only(_step())
    a = step.columns["pixel_values"][0][0]
    image = a.nbytes
    look = _look_alike(a)
    with flightq.Server() as srv:
        honest = flightq.connect(srv.location)
        honest.create_partition("p", step.schema, tasks=["train"])
        _put_rows(honest, "p", step, [0])  # A, bare and unhashed
        flightq.connect(srv.location).clear("p")  # A is gone; its writer remembers its hint
        _bare_put(srv.location, step, step.keys[1], look)  # held unverified, under A's hint
        assert _hashed(honest) < GRIDS
        # A reference to A finds only the look-alike: hashed, no match, refused.
        ref = _encoded(step, 2, a, known={("pixel_values", hint_of(a), a.shape)})
        e = _plain_put(srv.location, ref, split_claims(ref.schema)[1].to_pybytes())
        assert msgpack.unpackb(e.extra_info)["type"] == "MediaUnknownError"
        assert image <= _hashed(honest) < image + GRIDS
        # The honest writer's reference is refused too; it sends A again, digest beside it.
        _put_rows(honest, "p", step, [3])
        assert honest.stats()["counters"]["refusals"]["MediaUnknownError"] == 2
        # A checked on receipt; the look-alike not again.
        assert 2 * image <= _hashed(honest) < 2 * image + GRIDS
        got = honest.get("p", [step.keys[1], step.keys[3]], as_="numpy")
        assert np.array_equal(got["pixel_values"][0][0], look)  # its writer's own bytes
        assert np.array_equal(got["pixel_values"][1][0], a)
        _put_rows(honest, "p", step, [2])  # now A, checked, serves the reference
        _check_rows(honest.get("p", step.keys[2:4], as_="numpy"), step)
        assert honest.stats()["counters"]["refusals"]["MediaUnknownError"] == 2


def test_a_flood_of_look_alikes_costs_the_server_no_more_hashing_than_it_brings():
    step = _read_only(_step())
    a = step.columns["pixel_values"][0][0]
    image = a.nbytes
    flood = MAX_LOOKED_AT + 4
    with flightq.Server() as srv:
        honest = flightq.connect(srv.location)
        honest.create_partition("p", step.schema, tasks=["train"])
        _put_rows(honest, "p", step, [0])
        for k in range(flood):  # distinct payloads, every one under A's hint
            _bare_put(srv.location, step, f"flood-{k}", _look_alike(a, k + 1))
        # Each payload hashed once in its life (A at the first look-alike): never more
        # than the payload bytes the server received.
        flooded = _hashed(honest)
        assert (flood + 1) * image <= flooded < (flood + 1) * image + GRIDS
        assert flooded <= _received(honest)
        # A reference to a digest none has hashes nothing more (at most MAX_HASHED).
        ref = _encoded(step, 1, _look_alike(a, 255), known={("pixel_values", hint_of(a), a.shape)})
        e = _plain_put(srv.location, ref, split_claims(ref.schema)[1].to_pybytes())
        assert msgpack.unpackb(e.extra_info)["type"] == "MediaUnknownError"
        assert _hashed(honest) - flooded < MAX_HASHED * image
        assert _hashed(honest) - flooded < GRIDS
        # A is older than the newest look-alikes a lookup looks at: its writer's reference
        # is refused, and it sends A again; its rows get A, never a look-alike.
        _put_rows(honest, "p", step, [1])
        _check_rows(honest.get("p", step.keys[:2], as_="numpy"), step)
        assert honest.stats()["partitions"]["p"]["rows"] == flood + 2


def test_a_shared_memory_put_of_new_images_is_hashed_by_neither_side():
    step = _read_only(_step())
    with flightq.Server() as srv, flightq.connect(srv.location, shm=True) as c:
        c.shm_min_bytes = 0
        c.create_partition("p", step.schema, tasks=["train"])
        before = hashed_bytes()
        c.put("p", step.keys, step.columns, step.tags)
        assert hashed_bytes() - before < GRIDS and _hashed(c) < GRIDS
        _check_rows(c.get("p", step.keys, as_="numpy"), step)
        c.drop("p")


def test_a_client_that_clears_a_partition_sends_its_next_put_bare():
    step = _read_only(_step())
    with flightq.Server() as srv:
        c = flightq.connect(srv.location)
        c.create_partition("p", step.schema, tasks=["train"])
        c.put("p", step.keys, step.columns, step.tags)
        c.clear("p")  # it knows the partition holds nothing now
        before, sent = hashed_bytes(), _received(c)
        c.put("p", step.keys, step.columns, step.tags)  # the same images again
        assert hashed_bytes() - before < GRIDS and _hashed(c) < GRIDS
        assert c.stats()["counters"]["refusals"].get("MediaUnknownError", 0) == 0
        assert _received(c) - sent < 1.1 * _distinct(step)  # sent once, no refused try
        _check_rows(c.get("p", step.keys, as_="numpy"), step)
