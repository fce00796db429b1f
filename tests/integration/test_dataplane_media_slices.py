"""Rows served from part of a put carry only their own media, against a real server.

A put of several prompt groups is stored as record batches whose media dictionaries hold
every group's image. Arrow IPC sends a record batch's dictionary whole, so each answer
that serves some of those rows (a claim of one group, a get split over parallel streams)
must carry a dictionary cut to the entries its rows use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import msgpack
import numpy as np
import pyarrow.compute as pc
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import assert_rows_match, client_fixture, server_fixture  # noqa: F401

import flightq
from flightq import workloads
from flightq.server import assemble

pytestmark = pytest.mark.timeout(60)


def _media_entries(batch: flightq.Batch, field: str) -> list[int]:
    """Per record batch received, the entries of the field's media dictionary."""
    parts = batch.parts
    return [len(p.record_batch.column(field).values.dictionary) for p in parts]


def _media_bytes(batch: flightq.Batch, field: str) -> int:
    """Payload bytes of the field's media dictionaries received."""
    parts = batch.parts
    dicts = [p.record_batch.column(field).values.dictionary for p in parts]
    return sum(pc.sum(pc.binary_length(d)).as_py() or 0 for d in dicts)


@contextlib.contextmanager
def _splitting(server, step: workloads.Step, streams: int) -> Iterator[flightq.Client]:
    """A client splitting gets over up to ``streams`` streams, ``step`` stored in "s" and
    its rows' size known (one row read), so its next get of many rows is split."""
    with flightq.connect(
        server.location, [step.schema], get_streams=streams, min_stream_bytes=1
    ) as c:
        c.create_partition("s", step.schema, tasks=["t"], group_size=step.group_size)
        c.put("s", step.keys, step.columns, step.tags)
        c.get("s", step.keys[:1])
        yield c


@pytest.fixture
def vlm(client):
    """Four W1 groups of 4 rows (one image per group) stored by one put."""
    step = workloads.w1(0, groups=4, g=4)
    client.create_partition("vlm", step.schema, tasks=["train"], group_size=step.group_size)
    client.put("vlm", step.keys, step.columns, step.tags)
    return step


@pytest.mark.torch
def test_a_claim_of_one_group_carries_its_image_and_no_other(client, vlm):
    image = vlm.columns["pixel_values"][0][0].nbytes
    for g in range(4):
        batch = client.claim("vlm", "train", batch_size=4)
        assert batch.keys == vlm.group(g).keys
        assert _media_entries(batch, "pixel_values") == [1]
        assert _media_bytes(batch, "pixel_values") == image
        assert_rows_match(batch, vlm)


def test_claims_of_part_of_a_stored_batch_slice_its_kept_answer_form(
    server, client, vlm, monkeypatch
):
    # A trainer claims a prompt group at a time: the put made its stored batch's answer
    # form, and each claim's answer is a slice of it with the dictionary cut to the
    # group's image, not rows gathered one by one; rows from one stored batch out of
    # order are gathered as before.
    gathered: list[int] = []
    by_row = assemble._cut_media_rows

    def counted(rows, *a, **k):
        gathered.append(len(rows))
        return by_row(rows, *a, **k)

    monkeypatch.setattr(assemble, "_cut_media_rows", counted)
    rows = server.store.partition("vlm").rows.values()
    (piece,) = {id(r.home[0]): r.home[0] for r in rows}.values()
    assert piece.answer_whole is not None and piece.answer_whole.kept  # made by the put
    image = vlm.columns["pixel_values"][0][0].nbytes
    for g in range(3):
        batch = client.claim("vlm", "train", batch_size=4, as_="numpy")
        assert batch.keys == vlm.group(g).keys
        assert _media_entries(batch, "pixel_values") == [1]
        assert _media_bytes(batch, "pixel_values") == image
        assert_rows_match(batch, vlm)
    assert gathered == []
    keys = vlm.keys[12:16] + vlm.keys[0:4]  # two runs of one stored batch
    batch = client.get("vlm", keys, as_="numpy")
    assert batch.keys == keys and gathered == [8]
    assert sum(_media_entries(batch, "pixel_values")) == 2
    assert_rows_match(batch, vlm)


def test_a_write_back_to_stored_rows_makes_no_answer_form(server, client, monkeypatch):
    # A worker adds a column to rows a generator put: no answer reads that piece whole
    # (the rows are no longer as either put wrote them), so no form is made for it.
    from flightq.server import media

    monkeypatch.setattr(media, "KEEP_ANSWER_BYTES", 0)  # every piece counts enough
    monkeypatch.setattr(media, "KEPT_COLUMN_BYTES", 0)
    ref = workloads.w1(groups=1)
    client.create_partition("wb", ref.schema, tasks=["t"], group_size=ref.group_size)
    client.put("wb", ref.keys, ref.columns, ref.tags)
    lp = workloads.logprobs_for(ref)
    client.put("wb", ref.keys, {"prev_logprobs": lp})
    rows = server.store.partition("wb").rows.values()
    pieces = {id(pc): pc for r in rows for pc, _ in r.cells.values()}.values()
    written = [pc for pc in pieces if "prev_logprobs" in pc.batch.schema.names]
    assert written and all(pc.answer_whole is None for pc in written)
    assert all(r.home is None for r in rows)  # rows written twice have no home


@pytest.mark.torch
def test_a_get_of_some_rows_carries_the_images_of_those_rows(client, vlm):
    keys = vlm.keys[4:12]  # groups 1 and 2
    batch = client.get("vlm", keys)
    assert batch.keys == keys
    assert sum(_media_entries(batch, "pixel_values")) == 2
    assert_rows_match(batch, vlm)
    shared = batch["pixel_values"]
    # A group's rows still view its one image.
    assert shared[0][0].data_ptr() == shared[3][0].data_ptr() != shared[4][0].data_ptr()


@pytest.mark.torch
def test_a_get_split_over_streams_sends_each_image_once(server):
    step = workloads.w1(0, groups=4, g=4)
    with _splitting(server, step, streams=4) as c:
        batch = c.get("s", step.keys)  # a group per stream
        assert batch.received is not None and batch.received.route == "streams=4"
        assert len(batch.parts) == 4
        assert _media_entries(batch, "pixel_values") == [1, 1, 1, 1]
        assert_rows_match(batch, step)


@pytest.mark.torch
def test_a_get_split_over_streams_leaves_out_the_tag_values_it_is_told_to(server):
    base = workloads.w1(0, groups=4, g=4)
    docs = [{**t, "doc:text": "y" * 300 + str(i)} for i, t in enumerate(base.tags)]
    step = dataclasses.replace(base, tags=docs)
    hidden = dataclasses.replace(base, tags=[{**t, "doc:text": None} for t in base.tags])
    with _splitting(server, step, streams=4) as c:
        batch = c.get("s", step.keys, as_="numpy", hide_tag_values="doc:")
        assert batch.received is not None and batch.received.route == "streams=4"
        assert _media_entries(batch, "pixel_values") == [1, 1, 1, 1]
        assert_rows_match(batch, hidden)
        # Some rows of two groups, out of order: each image once, beside its rows.
        keys = [step.keys[9], step.keys[2], step.keys[1]]
        some = c.get("s", keys, as_="numpy", hide_tag_values="doc:")
        assert some.keys == keys
        assert_rows_match(some, hidden)
        assert_rows_match(c.get("s", step.keys, as_="numpy"), step)  # stored whole


@pytest.mark.torch
def test_a_get_split_over_streams_that_do_not_divide_its_groups_sends_each_image_once(server):
    # 4 groups over 3 streams: cut by key count (rows 5 and 10), two groups' images
    # would travel twice; the server cuts between groups instead.
    step = workloads.w1(0, groups=4, g=4)
    with _splitting(server, step, streams=3) as c:
        batch = c.get("s", step.keys)
        assert batch.received is not None and batch.received.route == "streams=3"
        sizes = [len(p) for p in batch.parts]
        assert len(sizes) == 3 and all(n > 0 and n % 4 == 0 for n in sizes)
        assert _media_entries(batch, "pixel_values") == [n // 4 for n in sizes]
        assert _media_bytes(batch, "pixel_values") == sum(
            step.columns["pixel_values"][4 * g][0].nbytes for g in range(4)
        )
        assert_rows_match(batch, step)


@pytest.mark.torch
def test_a_split_get_of_one_group_sends_its_image_once(server):
    step = workloads.w1(0, groups=1, g=8)
    with _splitting(server, step, streams=4) as c:
        batch = c.get("s", step.keys)
        assert batch.received is not None and batch.received.route == "streams=4"
        assert batch.keys == step.keys
        # Every row shares the image: no cut is worth sending it twice; 3 streams answer
        # no rows.
        assert sum(_media_entries(batch, "pixel_values")) == 1
        assert sorted(len(p) for p in batch.parts) == [0, 0, 0, 8]
        assert_rows_match(batch, step)
        # The client learned that the server keeps these 8 rows together: one stream.
        again = c.get("s", step.keys)
        assert again.received is not None and again.received.route == "socket"
        assert_rows_match(again, step)
        # Whole columns over the parts that answered no rows: as from one stream.
        two = workloads.w1(1, groups=2, g=8)
        for as_ in ("numpy", "torch"):
            c.create_partition(as_, two.schema, tasks=["t"], group_size=two.group_size)
            c.put(as_, two.keys, two.columns, two.tags)
            c.get(as_, two.keys[:1])
            split = c.get(as_, two.keys, as_=as_)
            assert split.received is not None and split.received.route == "streams=4"
            assert 0 in [len(p) for p in split.parts]
            c.get_streams = 1
            whole = c.get(as_, two.keys, as_=as_)
            c.get_streams = 4
            # 16 rows kept 8 together: 2 streams from now on, both with rows.
            halves = c.get(as_, two.keys, as_=as_)
            assert halves.received is not None and halves.received.route == "streams=2"
            assert [len(p) for p in halves.parts] == [8, 8]
            for name in ("pixel_values", "image_grid_thw"):
                (a, ao), (b, bo) = split.column(name).cat(), whole.column(name).cat()
                assert a.shape == b.shape and (a == b).all() and (ao == bo).all()
            (a, ao), (b, bo) = (
                split.column("input_ids").packed(),
                whole.column("input_ids").packed(),
            )
            assert a.shape == b.shape and (a == b).all() and (ao == bo).all()


@pytest.mark.torch
def test_a_split_get_whose_parts_miss_its_keys_runs_again_as_one_stream(server, monkeypatch):
    # Rows written between two streams' requests make the server cut them differently;
    # here every part answers every row, so the parts' keys are not the ones asked.
    from flightq.server.assemble import PartCuts

    monkeypatch.setattr(PartCuts, "rows", lambda self, ticket, p, rows, names: rows)
    step = workloads.w1(0, groups=4, g=4)
    with _splitting(server, step, streams=4) as c:
        batch = c.get("s", step.keys)
        assert batch.received is not None and batch.received.route == "socket"
        assert batch.keys == step.keys
        assert_rows_match(batch, step)


@pytest.mark.torch
def test_a_server_that_refuses_gets_in_parts_is_read_as_one_stream(server, monkeypatch):
    # A server older than gets in parts refuses the ticket's keys as a parse would.
    from flightq.protocol import GetTicket

    def old(t: GetTicket) -> None:
        if t.parts is not None:
            raise flightq.ProtocolError(
                "get ticket: unknown keys 'part', 'parts'; expected partition, keys, "
                "fields, shm, op"
            )

    monkeypatch.setattr(GetTicket, "check_parts", old)
    step = workloads.w1(0, groups=4, g=4)
    with _splitting(server, step, streams=4) as c:
        refused = []
        for _ in range(2):  # the first finds out, the second does not ask in parts again
            batch = c.get("s", step.keys)
            assert batch.received is not None and batch.received.route == "socket"
            assert_rows_match(batch, step)
            refused.append(c.stats()["counters"]["refusals"].get("ProtocolError", 0))
        assert 1 <= refused[0] == refused[1] <= 4


def test_a_plain_flight_client_gets_each_part_of_a_split_get_once_in_order(server):
    step = workloads.w1(0, groups=4, g=4)
    with flightq.connect(server.location, [step.schema]) as c:
        c.create_partition("s", step.schema, tasks=["t"], group_size=step.group_size)
        c.put("s", step.keys, step.columns, step.tags)

    def ticket(**extra: object) -> fl.Ticket:
        return fl.Ticket(msgpack.packb({"op": "get", "partition": "s", "keys": step.keys, **extra}))

    with fl.connect(server.location) as plain:
        got = []
        for part in range(3):
            table = plain.do_get(ticket(part=part, parts=3)).read_all()
            got.append(table.column("__key__").to_pylist())
        assert [k for keys in got for k in keys] == step.keys
        assert all(keys and len(keys) % 4 == 0 for keys in got)
        for bad, named in [
            ({"part": 0}, "'part' and 'parts' go together"),
            ({"parts": 2}, "'part' and 'parts' go together"),
            ({"part": 2, "parts": 2}, "part 2, parts 2"),
            ({"part": 0, "parts": 1}, "'parts'"),
            ({"part": 0, "parts": 17}, "'parts'"),
            ({"part": -1, "parts": 2}, "'part'"),
        ]:
            with pytest.raises(fl.FlightServerError, match=named):
                plain.do_get(ticket(**bad)).read_all()
        # The server keeps serving.
        assert plain.do_get(ticket()).read_all().num_rows == 16


def test_a_gets_later_streams_take_its_first_streams_cuts_until_its_rows_change(server):
    step = workloads.w1(0, groups=4, g=4)
    with flightq.connect(server.location, [step.schema]) as c:
        c.create_partition("s", step.schema, tasks=["t"], group_size=step.group_size)
        c.put("s", step.keys, step.columns, step.tags)
        worked = server.part_cuts.worked

        def parts() -> list[list[str]]:
            with fl.connect(server.location) as plain:
                out = []
                for part in range(4):
                    t = {"op": "get", "partition": "s", "keys": step.keys, "part": part, "parts": 4}
                    got = plain.do_get(fl.Ticket(msgpack.packb(t))).read_all()
                    out.append(got.column("__key__").to_pylist())
                return out

        assert parts() == [step.keys[4 * g : 4 * g + 4] for g in range(4)]
        assert server.part_cuts.worked == worked + 1  # once for the four streams
        assert parts() == [step.keys[4 * g : 4 * g + 4] for g in range(4)]
        assert server.part_cuts.worked == worked + 1  # the same rows: the same cuts
        # A write-back to the first group's rows changes their bytes: cut afresh.
        ids = step.columns["input_ids"][:4]
        grow = {"prev_logprobs": [np.zeros(len(x), np.float32) for x in ids]}
        c.put("s", step.keys[:4], grow)
        again = parts()
        assert server.part_cuts.worked == worked + 2
        assert [k for keys in again for k in keys] == step.keys


@pytest.mark.torch
def test_answers_cut_smaller_than_a_stored_batch_keep_each_group_whole() -> None:
    # Answer batches hold a little more than one group: a batch cut after the row that
    # passes the limit would carry the next group's first row, and that group's image
    # would travel in two batches.
    step = workloads.w1(0, groups=4, g=4)
    group_bytes = max(step.group(g).nbytes(distinct_media=True) for g in range(4))
    limit = group_bytes + group_bytes // 4
    with (
        flightq.Server(max_batch_bytes=limit) as srv,
        flightq.connect(srv.location, [step.schema]) as c,
    ):
        c.create_partition("s", step.schema, tasks=["t"], group_size=step.group_size)
        c.put("s", step.keys, step.columns, step.tags)
        batch = c.get("s", step.keys)
    parts = batch.parts
    assert [len(p) for p in parts] == [4, 4, 4, 4]
    assert _media_entries(batch, "pixel_values") == [1, 1, 1, 1]
    assert all(p.record_batch.nbytes <= limit for p in parts)
    assert_rows_match(batch, step)


@pytest.mark.torch
def test_rows_without_media_keep_their_place_in_a_trimmed_slice(client):
    step = workloads.w1(0, groups=4, g=4)
    pixels, grids = step.columns["pixel_values"], step.columns["image_grid_thw"]
    for i in (5, 9):  # rows that lack the field (null) and a row with no segments
        pixels[i] = grids[i] = None
    pixels[6] = grids[6] = []
    client.create_partition("mixed", step.schema, tasks=["t"], group_size=step.group_size)
    client.put("mixed", step.keys, step.columns, step.tags)
    keys = step.keys[5:11]  # starts and ends inside groups, across a null and an empty row
    batch = client.get("mixed", keys)
    assert batch.keys == keys
    assert_rows_match(batch, step)
    assert batch["pixel_values"][0] is None and batch["pixel_values"][1] == []
    # One record batch of slices 5 | 6-8 | 9 | 10 (a row that lacks the field ends a
    # slice), its dictionary the images of its rows once: 7 is in group 1, 8 and 10 in 2.
    assert _media_entries(batch, "pixel_values") == [2]
    # The whole put (rows lacking a field are not as a whole put made them, so it is cut
    # row by row): the null and the empty row as they were, each image once.
    whole = client.get("mixed", step.keys)
    assert_rows_match(whole, step)
    assert whole["pixel_values"][5] is None and whole["pixel_values"][6] == []
    assert len(whole.parts) == 1 and _media_entries(whole, "pixel_values") == [4]


def test_overwriting_a_groups_image_replaces_it_and_counts_bytes_once(client):
    step = workloads.w1(0, groups=2, g=3)
    old = [np.full((2, 3), g, dtype=np.float32) for g in range(2)]
    step.columns["pixel_values"] = [[old[i // 3]] for i in range(step.rows)]
    client.create_partition("ow", step.schema, tasks=["t"], group_size=step.group_size)
    client.put("ow", step.keys, step.columns, step.tags)
    before = client.stats()["partitions"]["ow"]["bytes"]
    new = np.arange(20, dtype=np.float32).reshape(4, 5)  # group 0's new image, shared
    keys = step.keys[:3]
    client.put("ow", keys, {"pixel_values": [[new]] * 3}, overwrite=True)
    after = client.stats()["partitions"]["ow"]["bytes"]
    assert after - before == new.nbytes - old[0].nbytes  # the image counts once per group
    batch = client.get("ow", step.keys, as_="numpy")
    px = batch["pixel_values"]
    assert all(np.array_equal(px[i][0], new) for i in range(3))
    assert all(np.array_equal(px[i][0], old[1]) for i in range(3, 6))
    client.clear("ow")
    assert client.stats()["partitions"]["ow"]["bytes"] == 0


def test_a_get_of_a_whole_put_answers_with_its_stored_batch_each_distinct_payload_once(server):
    # Every row's grid is its own tensor, all of equal content (as when a processor runs
    # once per image). Through shared memory the writer sends each as an entry of its own
    # and the server files them as one copy: the answer of the whole put (its stored
    # batch, sent as it is) carries that copy once; each image is its own.
    step = workloads.w1(0, groups=2, g=8)
    rng = np.random.default_rng(3)
    step.columns["pixel_values"] = [[rng.random((4, 6), dtype=np.float32)] for _ in step.keys]
    step.columns["image_grid_thw"] = [[np.array([[1, 2, 2]], dtype=np.int64)] for _ in step.keys]
    with flightq.connect(server.location, [step.schema], shm=True) as c:
        c.shm_min_bytes = 1  # a small put through shared memory too
        c.create_partition("whole", step.schema, tasks=["t"], group_size=step.group_size)
        assert c.put("whole", step.keys, step.columns, step.tags).route == "shm"
        for shm in (True, False):
            with flightq.connect(server.location, [step.schema], shm=shm) as reader:
                batch = reader.get("whole", step.keys, as_="numpy")
            assert len(batch.parts) == 1
            assert _media_entries(batch, "image_grid_thw") == [1]
            assert _media_entries(batch, "pixel_values") == [16]
            assert_rows_match(batch, step)
        # A get of the rows in another order is cut row by row: the same entries.
        keys = step.keys[::-1]
        batch = c.get("whole", keys, as_="numpy")
        assert batch.keys == keys
        assert _media_entries(batch, "image_grid_thw") == [1]
        assert_rows_match(batch, step)


def test_rows_put_one_at_a_time_sharing_an_image_carry_it_once_per_answer_batch(client):
    # One put per row, as a generator streams them (W5): each put is a stored batch of
    # its own, and the rows share one copy of their group's image, found by content. An
    # answer cut at the stored batches would carry it once per row.
    step = workloads.w1(0, groups=1, g=4)
    image = np.random.default_rng(4).random((512, 600), dtype=np.float32)  # over 1 MiB
    step.columns["pixel_values"] = [[image.copy()] for _ in step.keys]
    client.create_partition("stream", step.schema, tasks=["t"])  # rows come one by one
    for i in range(step.rows):
        one = {k: v[i : i + 1] for k, v in step.columns.items()}
        client.put("stream", [step.keys[i]], one, [step.tags[i]])
    batch = client.get("stream", step.keys, as_="numpy")
    assert _media_entries(batch, "pixel_values") == [1]
    assert _media_bytes(batch, "pixel_values") == image.nbytes
    assert_rows_match(batch, step)


@pytest.mark.torch
def test_a_written_back_step_is_cut_between_prompt_groups_each_image_once() -> None:
    # After a write-back the rows are no longer as their put made them and are cut row by
    # row. The limit here lets the third group's image and two of its rows in after two
    # groups, not its third row: a cut there would send that image in two batches.
    step = workloads.w1(0, groups=4, g=4)
    lp = workloads.logprobs_for(step)
    tokens = ("input_ids", "generation_logprobs", "token_mask", "mm_token_type_ids")
    row = [sum(step.columns[f][i].nbytes for f in tokens) + lp[i].nbytes for i in range(16)]
    image = step.columns["pixel_values"][0][0].nbytes
    grid = step.columns["image_grid_thw"][0][0].nbytes
    limit = 2 * image + grid + sum(row[:8]) + image + row[8] + row[9] + row[10] // 2
    with (
        flightq.Server(max_batch_bytes=limit) as srv,
        flightq.connect(srv.location, [step.schema]) as c,
    ):
        c.create_partition("s", step.schema, tasks=["t"], group_size=step.group_size)
        c.put("s", step.keys, step.columns, step.tags)
        c.put("s", step.keys, {"prev_logprobs": lp})
        batch = c.get("s", step.keys)
    assert [len(p) for p in batch.parts] == [8, 8]
    assert _media_entries(batch, "pixel_values") == [2, 2]
    assert_rows_match(batch, step, extra={"prev_logprobs": lp})
