"""Same-host transfers through shared memory (``connect(..., shm=True)``).

Real servers on loopback, real files under /dev/shm; nothing is mocked. Each test checks
the bytes, the validation, and that no segment of this process outlives its owner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, assert_rows_match, text_columns, text_keys
from helpers_reliability import plain_shm_put
from helpers_wire import replace_column

import flightq
from flightq import shm, workloads
from flightq.batch import encode_chunks, split_batch
from flightq.server import media
from flightq.shm import segments
from flightq.shm import table as shmtable

pytestmark = pytest.mark.timeout(120)

SHM = shm.DEFAULT_DIR
#: pyarrow releases a stopped Flight server's Python object from 26 on.
_PYARROW_MAJOR = int(pa.__version__.split(".")[0])


def _mine(directory: str | None = None) -> list[str]:
    """Segment files this test process owns (its server and clients run in it)."""
    prefix = f"flightq-{os.getpid()}-"
    return sorted(n for n in os.listdir(directory or SHM) if n.startswith(prefix))


def _mapped_files(address: int) -> list[str]:
    """Files whose mapping in this process contains ``address``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi and len(parts) >= 6:
                out.append(parts[5])
    return out


def _drop_all(srv: flightq.Server) -> None:
    """Drop every partition: the server's copies of puts through shared memory go with
    their rows (it unlinks a stored segment once no row uses it)."""
    with flightq.connect(srv.location, timeout=TIMEOUT) as c:
        for name in c.stats()["partitions"]:
            c.drop(name)


#: The segment directory of the running test's server (its own, under /dev/shm).
_DIR = SHM


def _stores() -> list[str]:
    """The stored segments this test's server maps: shm.STORES is the process's, one pool
    per directory, and an earlier test's server may still hold its pool of /dev/shm."""
    return sorted(p for p in shm.STORES.paths() if os.path.dirname(p) == _DIR)


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    # A directory of its own: only what this test's server and clients made is in it.
    global _DIR
    _DIR = tempfile.mkdtemp(prefix="flightq-test-", dir=SHM)
    try:
        with flightq.Server(shm=_DIR) as srv:
            yield srv
            _drop_all(srv)
        gc.collect()
        assert _mine(_DIR) == []
    finally:
        shutil.rmtree(_DIR, ignore_errors=True)
        _DIR = SHM


@pytest.fixture(name="client")
def client_fixture(server: flightq.Server) -> Iterator[flightq.Client]:
    with flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT, shm=_DIR) as c:
        c.shm_min_bytes = 0  # every transfer through shared memory, however small
        yield c


@pytest.mark.torch
def test_small_transfers_of_a_shm_client_take_the_socket_and_large_ones_a_segment(server):
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    step = workloads.w2(groups=1)
    with flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT, shm=_DIR) as c:
        assert c.shm_min_bytes == flightq.client.client.SHM_MIN_BYTES == 2**20
        c.create_partition("t", TEXT, tasks=["train"], group_size=4)
        assert c.put("t", keys, cols).route == "socket"  # no segment for a put of a few KiB
        first = c.get("t", keys, as_="numpy")  # nothing known of the rows yet: shm
        assert first.received is not None and first.received.route == "shm"
        assert (
            assert_rows_match(first, workloads.Step("t", TEXT, keys, cols, [{} for _ in keys], 4))
            > 0
        )
        again = c.get("t", keys, as_="numpy")  # known small now: the socket
        assert again.received is not None and again.received.route == "socket"
        got = c.claim("t", "train", 8, timeout=TIMEOUT, as_="numpy")
        assert got.received is not None and got.received.route == "socket"
        assert got.keys == keys
        assert all(
            np.array_equal(a, b) for a, b in zip(got["input_ids"], cols["input_ids"], strict=True)
        )
        c.create_partition("m", step.schema, group_size=step.group_size)
        # Megabytes of tiles: through a segment, both ways.
        assert c.put("m", step.keys, step.columns, tags=step.tags).route == "shm"
        c.get("m", step.keys[:1])  # learns the rows' size
        big = c.get("m", step.keys, as_="numpy")
        assert big.received is not None and big.received.route == "shm"
        assert assert_rows_match(big, step) > 0


# --------------------------------------------------------------------------- round trips


def test_w2_round_trips_bit_exact_and_the_tensors_are_views_into_a_mapped_segment(client):
    step = workloads.w2(groups=1)
    client.create_partition("w2", step.schema, tasks=["train"], group_size=step.group_size)
    assert client.put("w2", step.keys, step.columns, tags=step.tags) == step.rows
    batch = client.get("w2", step.keys, as_="numpy")
    assert assert_rows_match(batch, step) > 0
    row = next(r for r in batch["pixel_values"] if r)
    files = _mapped_files(row[0].__array_interface__["data"][0])
    assert files and os.path.basename(files[0]).startswith("flightq-"), files
    assert not row[0].flags.writeable  # numpy marks views of the answer read-only


def test_a_get_through_shared_memory_leaves_out_the_tag_values_it_is_told_to(client):
    base = workloads.w2(groups=1)
    docs = [{**t, "doc:text": "z" * 200 + str(i)} for i, t in enumerate(base.tags)]
    step = dataclasses.replace(base, tags=docs)
    hidden = dataclasses.replace(base, tags=[{**t, "doc:text": None} for t in base.tags])
    client.create_partition("w2", step.schema, tasks=["train"], group_size=step.group_size)
    client.put("w2", step.keys, step.columns, tags=step.tags)
    batch = client.get("w2", step.keys, as_="numpy", hide_tag_values="doc:")
    assert batch.received is not None and batch.received.route == "shm"
    assert assert_rows_match(batch, hidden) > 0
    again = client.get("w2", step.keys, as_="numpy")  # the stored values, whole
    assert again.received is not None and again.received.route == "shm"
    assert assert_rows_match(again, step) > 0


def test_reads_through_shared_memory_are_asked_on_the_request_stream(client):
    # The answer only names where the rows lie: a message the client's request stream
    # carries, instead of a DoGet each; a client without the stream reads per call.
    step = workloads.w2(groups=1)
    client.create_partition("w2", step.schema, tasks=["train"], group_size=step.group_size)
    client.put("w2", step.keys, step.columns, tags=step.tags)
    calls = client.stats()["counters"]["gets"]
    served = client.requests.served
    got = client.get("w2", step.keys, as_="numpy")
    assert got.received is not None and got.received.route == "shm"
    assert client.requests.served == served + 1
    assert assert_rows_match(got, step) > 0
    claimed = client.claim("w2", "train", step.group_size, timeout=TIMEOUT, as_="numpy")
    assert claimed.received is not None and claimed.received.route == "shm"
    assert client.requests.served == served + 2 and claimed.claim is not None
    client.ack(claimed)
    client.stream_max_bytes = 0  # no request stream: the same read per call
    again = client.get("w2", step.keys, as_="numpy")
    assert again.received is not None and again.received.route == "shm"
    assert client.requests.served == served + 3  # the ack went on the stream; the get not
    assert assert_rows_match(again, step) > 0
    assert client.stats()["counters"]["gets"] == calls + 2


def test_the_servers_copy_of_a_large_put_split_over_threads_is_bit_exact(
    server, client, monkeypatch
):
    from flightq.shm import mapping

    step = workloads.w2(groups=1)
    assert step.nbytes() > 8 * 2**20
    monkeypatch.setattr(mapping, "COPY_PIECE_BYTES", 2**20)  # many pieces, every thread
    client.create_partition("w2", step.schema, group_size=step.group_size)
    assert client.put("w2", step.keys, step.columns, tags=step.tags) == step.rows
    with _socket_client(server) as plain:  # the server's own bytes, read over the socket
        assert assert_rows_match(plain.get("w2", step.keys, as_="numpy"), step) > 0


@pytest.mark.torch
def test_w1_round_trips_bit_exact_through_torch(client):
    step = workloads.w1(groups=1)
    client.create_partition("w1", step.schema, group_size=step.group_size)
    client.put("w1", step.keys, workloads.to_torch(step).columns, tags=step.tags)
    assert assert_rows_match(client.get("w1", step.keys), step) > 0


@pytest.mark.torch
def test_a_claim_over_shm_delivers_whole_groups_once(client):
    keys = text_keys(2, 4)
    client.create_partition("c", TEXT, tasks=["train"], group_size=4)
    client.put("c", keys, text_columns(keys))
    got = client.claim("c", "train", 4, timeout=TIMEOUT, as_="numpy")
    assert got.keys == keys[:4]
    assert client.claim("c", "train", 4, timeout=TIMEOUT).keys == keys[4:]
    with pytest.raises(flightq.ClaimTimeoutError):
        client.claim("c", "train", 4, timeout=0.2)
    assert client.reset("c", "train") == 8


def _socket_client(server: flightq.Server) -> flightq.Client:
    return flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT)


def test_a_claim_whose_answer_cannot_be_written_comes_over_the_socket(server, client, tmp_path):
    # Rows that came over the socket (more than travels inline) need a server segment.
    keys = text_keys(2, 4)
    n = 40_000
    cols = {
        "input_ids": [np.arange(n) + i for i in range(8)],
        "token_mask": [np.ones(n, np.int64) for _ in keys],
        "input_lengths": np.full(8, n, np.int32),
        "total_reward": np.zeros(8, np.float32),
    }
    client.create_partition("c", TEXT, tasks=["train"], group_size=4)
    with _socket_client(server) as plain:
        plain.put("c", keys, cols)
    declined = client.stats()["counters"]["shm_answers_declined"]
    server.shm_dir = str(tmp_path / "gone")  # the server can no longer create segments
    got = client.claim("c", "train", 4, as_="numpy", timeout=TIMEOUT)
    assert got.received is not None and got.received.route == "socket"
    # Asked on the request stream first: declined there, its 2.5 MB over what the stream
    # carries, the rows went back and the claim went per call, declined again.
    assert client.stats()["counters"]["shm_answers_declined"] == declined + 2
    server.shm_dir = _DIR
    rest = client.claim("c", "train", 4, timeout=TIMEOUT, as_="numpy")
    assert rest.received is not None and rest.received.route == "shm"
    assert got.keys + rest.keys == keys
    assert all(
        np.array_equal(a, b)
        for a, b in zip(got["input_ids"] + rest["input_ids"], cols["input_ids"], strict=True)
    )
    assert len(server.shm_pool.paths()) == 1


def test_a_read_maps_the_servers_copy_of_the_put_and_copies_nothing_more(server, client):
    step = workloads.w2(groups=1)
    client.create_partition("m", step.schema, group_size=step.group_size)
    client.put("m", step.keys, step.columns, tags=step.tags)
    (put_seg,) = _stores()  # the server's copy, not the writer's segment
    assert put_seg not in client.shm_pool.paths()
    batch = client.get("m", step.keys, as_="numpy")
    assert assert_rows_match(batch, step) > 0
    # Size tensors too: equal ones share one stored copy, so the distinct ones are
    # scattered among the put's entries; the answer names them where the put left them.
    for field in ("pixel_values", "input_ids", "imgs_sizes", "num_frames"):
        row = next(r for r in batch[field] if r is not None and len(r))
        view = row[0] if isinstance(row, list) else row
        assert _mapped_files(view.__array_interface__["data"][0]) == [put_seg], field
    assert server.shm_pool.paths() == []  # no answer needed a segment of its own


def _counted(counts: dict[str, int], name: str, f):
    """``f``, each call counted in ``counts[name]``."""

    def g(*a, **k):
        counts[name] += 1
        return f(*a, **k)

    return g


def _pieces(server: flightq.Server, partition: str) -> list:
    rows = server.store.partition(partition).rows.values()
    return list({id(r.home[0]): r.home[0] for r in rows if r.home is not None}.values())


def test_a_stored_batch_read_again_is_answered_from_its_kept_description(
    server, client, monkeypatch
):
    # A step is read by several workers: the answer form of each stored batch read whole
    # (media dictionaries, buffer table) is worked out once, kept on the piece, and
    # numbered afresh for each answer; a segment that went since is located afresh.
    described = {"batches": 0, "kept": 0}  # batches described buffer by buffer, kept
    by_buffer, keep = shmtable._Describer.batch, shmtable._Template.__init__

    def counted_batch(self, b):
        described["batches"] += 1
        return by_buffer(self, b)

    def counted_keep(self, b):
        described["kept"] += 1
        keep(self, b)

    monkeypatch.setattr(shmtable._Describer, "batch", counted_batch)
    monkeypatch.setattr(shmtable._Template, "__init__", counted_keep)
    step = workloads.w2(groups=2)
    client.create_partition("k", step.schema, group_size=step.group_size)
    client.put("k", step.keys, step.columns, tags=step.tags)
    first = client.get("k", step.keys, as_="numpy")
    assert assert_rows_match(first, step) > 0
    pieces = _pieces(server, "k")
    assert pieces and all(pc.answer_whole is not None for pc in pieces)
    kept = [pc.answer_whole.described for pc in pieces]
    assert all(d is not None for d in kept)
    assert described["kept"] == len(pieces)  # each kept form described once
    described.update(batches=0, kept=0)
    (put_seg,) = _stores()
    for _ in range(2):
        again = client.get("k", step.keys, as_="numpy")
        assert assert_rows_match(again, step) > 0
        row = next(r for r in again["pixel_values"] if r)
        assert _mapped_files(row[0].__array_interface__["data"][0]) == [put_seg]
    assert [pc.answer_whole.described for pc in pieces] == kept  # the same, kept
    assert described == {"batches": 0, "kept": 0}  # nothing described afresh
    # A subset of the rows is no stored batch whole: described buffer by buffer.
    half = client.get("k", step.keys[::2], as_="numpy")
    assert half.keys == step.keys[::2]
    assert described["batches"] == len(half.parts) and described["kept"] == 0
    described.update(batches=0)
    # The file goes (a process that may write in the directory unlinked it): the kept
    # description names a segment no reader can open, so the answer copies the bytes.
    written = len(server.shm_pool.paths())
    os.unlink(put_seg)
    gone = client.get("k", step.keys, as_="numpy")
    assert assert_rows_match(gone, step) > 0
    row = next(r for r in gone["pixel_values"] if r)
    assert put_seg not in _mapped_files(row[0].__array_interface__["data"][0])
    assert len(server.shm_pool.paths()) == written + 1  # the answer's own segment
    assert described["batches"] == len(pieces)  # located afresh, buffer by buffer


def test_a_put_through_shared_memory_prepares_the_answer_of_its_first_reader(
    server, client, monkeypatch
):
    # The next to read a step a same-host writer put is a same-host reader of all of it:
    # its answer form is made before the put is acknowledged, so that first get
    # describes nothing (as every later one). A put over the socket makes the form (a
    # claim of part of a batch slices it) but describes nothing for shared memory.
    made = {"whole": 0, "batches": 0, "kept": 0}
    whole, by_buffer = media.piece_answer, shmtable._Describer.batch
    keep = shmtable._Template.__init__

    def counted(name, f):
        return _counted(made, name, f)

    monkeypatch.setattr(media, "piece_answer", counted("whole", whole))
    monkeypatch.setattr(shmtable._Describer, "batch", counted("batches", by_buffer))
    monkeypatch.setattr(shmtable._Template, "__init__", counted("kept", keep))
    step = workloads.w2(groups=2)
    client.create_partition("k", step.schema, group_size=step.group_size)
    assert client.put("k", step.keys, step.columns, tags=step.tags).route == "shm"
    pieces = _pieces(server, "k")
    assert pieces and all(pc.answer_whole is not None for pc in pieces)
    assert all(pc.answer_whole.kept and pc.answer_whole.described for pc in pieces)
    n = len(pieces)  # each described once, as a kept form
    assert made == {"whole": n, "batches": 0, "kept": n}
    made.update(whole=0, kept=0)
    # The answers whose table is worked out: none (the step's was, at the put).
    monkeypatch.setattr(shmtable, "_described", counted("tables", shmtable._described))
    made["tables"] = 0
    for _ in range(2):
        got = client.get("k", step.keys, as_="numpy")
        assert got.received is not None and got.received.route == "shm"
        assert assert_rows_match(got, step) > 0
    assert made == {"whole": 0, "batches": 0, "kept": 0, "tables": 0}
    with flightq.connect(server.location, [VLM], timeout=TIMEOUT) as plain:
        plain.create_partition("s", step.schema, group_size=step.group_size)
        assert plain.put("s", step.keys, step.columns, tags=step.tags).route != "shm"
    formed = [pc.answer_whole for pc in _pieces(server, "s") if pc.answer_whole is not None]
    assert formed and all(w.kept and w.described is None for w in formed)
    assert made["batches"] == made["kept"] == 0


def test_claims_of_prompt_groups_are_described_from_the_kept_form(server, client, monkeypatch):
    # A trainer claims a prompt group at a time: each answer is a slice of its stored
    # batch's answer form, described from the form's kept description (the media columns,
    # cut to the group's entries, afresh), its images mapped where the put left them.
    described = {"batches": 0, "arrays": 0, "kept": 0}
    by_batch, by_array = shmtable._Describer.batch, shmtable._Describer.array
    keep = shmtable._Template.__init__

    def counted(name, f):
        return _counted(described, name, f)

    step = workloads.w2(groups=3)
    client.create_partition("c", step.schema, tasks=["train"], group_size=step.group_size)
    assert client.put("c", step.keys, step.columns, tags=step.tags).route == "shm"
    (put_seg,) = _stores()
    monkeypatch.setattr(shmtable._Describer, "batch", counted("batches", by_batch))
    monkeypatch.setattr(shmtable._Describer, "array", counted("arrays", by_array))
    monkeypatch.setattr(shmtable._Template, "__init__", counted("kept", keep))
    for g in range(3):
        before = described["arrays"]
        got = client.claim("c", "train", step.group_size, timeout=TIMEOUT, as_="numpy")
        assert got.keys == step.group(g).keys and len(got.parts) == 1
        assert assert_rows_match(got, step) > 0
        for row in got["pixel_values"]:
            for image in row or ():
                assert _mapped_files(image.__array_interface__["data"][0]) == [put_seg]
        # Each media column described afresh: the list, its dictionary array, that one's
        # indices and entries.
        media_fields = [f for f in got.fields if got.schema[f].role == "media"]
        assert media_fields and described["arrays"] - before == 4 * len(media_fields)
        client.ack(got)
    assert described["batches"] == described["kept"] == 0
    assert server.shm_pool.paths() == []  # no answer needed a segment of its own


def test_a_claim_through_shared_memory_of_rows_put_over_the_socket_copies_their_bytes_once(
    server, client, monkeypatch
):
    # Rows a put over the socket left in the server's heap: a claim's answer through
    # shared memory copies what it names into bytes of its own; a slice of the kept form
    # takes along only its own columns' bytes, not the form's media bytes as well, and of
    # a buffer it slices only the part it uses: the group's image, not the put's four.
    step = workloads.w1(0, groups=4, g=4)
    with flightq.connect(server.location, [VLM], timeout=TIMEOUT) as plain:
        plain.create_partition("q", step.schema, tasks=["train"], group_size=step.group_size)
        assert plain.put("q", step.keys, step.columns, tags=step.tags).route != "shm"
    assert client.get("q", step.keys, as_="numpy").keys == step.keys  # described whole
    (piece,) = _pieces(server, "q")
    assert piece.answer_whole is not None and piece.answer_whole.described is not None
    images = sum(c.nbytes for c in piece.media["pixel_values"])
    copied: list[int] = []
    described = shmtable._described

    def counted(batches, wholes):
        d, table = described(batches, wholes)
        copied.append(d.extra_bytes)
        return d, table

    monkeypatch.setattr(shmtable, "_described", counted)
    got = client.claim("q", "train", step.group_size, timeout=TIMEOUT, as_="numpy")
    assert got.keys == step.group(0).keys and assert_rows_match(got, step) > 0
    image = step.columns["pixel_values"][0][0].nbytes
    assert images == 4 * image and len(copied) == 1 and image <= copied[0] < 2 * image


def test_a_put_whose_answer_forms_fail_to_be_made_is_stored_all_the_same(
    server, client, monkeypatch
):
    # The forms are made once the rows are stored: a failure there (memory under the
    # server's cap) leaves the first reader more to do, never a put refused but stored.
    from flightq.server import flight as server_flight

    def fails(pc, roles):
        raise MemoryError("no room for an answer form")

    monkeypatch.setattr(server_flight, "prepare_answer", fails)
    step = workloads.w2(groups=1)
    client.create_partition("f", step.schema, group_size=step.group_size)
    assert client.put("f", step.keys, step.columns, tags=step.tags).rows == step.rows
    assert all(pc.answer_whole is None for pc in _pieces(server, "f"))
    assert assert_rows_match(client.get("f", step.keys, as_="numpy"), step) > 0


def test_rows_that_count_little_themselves_keep_no_answer_form(server, client):
    # A prompt group streamed a row per put, each referencing the image the first put
    # brought: such a row counts a few kB, so what an answer form keeps beside it (tens of
    # kB of objects) would go uncounted many times over. Only the first is kept.
    step = workloads.w1(groups=1)
    client.create_partition("s", step.schema, tasks=["train"])
    for i, key in enumerate(step.keys):
        row = {name: col[i : i + 1] for name, col in step.columns.items()}
        client.put("s", [key], row, tags=step.tags[i : i + 1])
    for key in step.keys:
        assert client.get("s", [key], as_="numpy").keys == [key]
    pieces = sorted(_pieces(server, "s"), key=lambda pc: -pc.brings)
    assert len(pieces) == step.rows and pieces[0].brings > 0
    assert pieces[0].answer_whole is not None
    assert all(pc.brings == 0 and pc.answer_whole is None for pc in pieces[1:])


def test_a_claim_of_rows_two_puts_wrote_copies_no_image(server, client):
    # A generator put a prompt group's rows in two puts, as they finished (or one put's
    # record batches split the group): the claim's answer is cut where the images move
    # to the second put's dictionary, each part's images named where their put left
    # them; joining them would copy every image into a segment of the server's own.
    step = workloads.w2(groups=1)
    client.create_partition("two", step.schema, tasks=["train"])  # rows come as they end
    for lo, hi in ((0, 5), (5, step.rows)):
        cols = {name: col[lo:hi] for name, col in step.columns.items()}
        client.put("two", step.keys[lo:hi], cols, tags=step.tags[lo:hi])
    stored = _stores()
    got = client.claim("two", "train", step.rows, timeout=TIMEOUT, as_="numpy")
    assert got.keys == step.keys and len(got.parts) == 2
    assert assert_rows_match(got, step) > 0
    for row in got["pixel_values"]:
        for image in row or ():
            (where,) = _mapped_files(image.__array_interface__["data"][0])
            assert where in stored
    assert server.shm_pool.paths() == []  # no answer needed a segment of its own
    client.ack(got)


def test_rows_written_over_the_socket_read_back_over_shm(server, client):
    # Small answers travel inline in the table; large ones through one server segment.
    step = workloads.w1(groups=1)
    client.create_partition("s", step.schema, group_size=step.group_size)
    with _socket_client(server) as plain:
        plain.put("s", step.keys, step.columns, tags=step.tags)
    batch = client.get("s", step.keys, as_="numpy")
    assert assert_rows_match(batch, step) > 0
    assert len(server.shm_pool.paths()) == 1
    ids = client.get("s", step.keys, fields=["input_lengths"], as_="numpy")["input_lengths"]
    assert ids.tolist() == [len(x) for x in step.columns["input_ids"]]


def test_a_write_back_over_the_socket_joins_rows_put_through_shm(server, client):
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    client.create_partition("w", TEXT, tasks=["train"], group_size=4)
    client.put("w", keys, cols)
    lp = [np.full(len(x), 0.5, np.float32) for x in cols["input_ids"]]
    with _socket_client(server) as plain:
        plain.put("w", keys, {"prev_logprobs": lp})
    got = client.claim("w", "train", 8, timeout=TIMEOUT, wait_for=["prev_logprobs"], as_="numpy")
    assert got.keys == keys
    assert all(np.array_equal(a, b) for a, b in zip(got["prev_logprobs"], lp, strict=True))
    assert all(
        np.array_equal(a, b) for a, b in zip(got["input_ids"], cols["input_ids"], strict=True)
    )


@pytest.mark.torch
def test_segments_are_reused_across_puts_and_reads(server, client):
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    client.create_partition("r", TEXT, group_size=4)
    for _ in range(3):
        client.put("r", keys, cols)
        batch = client.get("r", keys)
        del batch
        client.clear("r")
        gc.collect()
    assert len(client.shm_pool.paths()) == 1
    assert server.shm_pool.paths() == []


def test_the_writers_segment_is_free_at_the_ack_and_the_servers_copy_is_reused(server, client):
    keys = text_keys(1, 4)
    cols = text_columns(keys)
    client.create_partition("v", TEXT, group_size=4)
    client.put("v", keys, cols)
    (seg,) = client.shm_pool.segments()
    assert seg.state() == shm.FREE and seg.lock()  # the server holds its own copy
    seg.unlock()
    assert len(_stores()) == 1  # the server's own copy of the put
    ids = client.get("v", keys, as_="numpy")["input_ids"][0]  # a view of that copy
    client.clear("v")
    gc.collect()
    client.put("v", keys, cols)
    assert client.shm_pool.segments() == [seg]  # the writer fills the same segment again
    assert len(_stores()) == 2  # the consumer's view holds the first copy
    assert np.array_equal(ids, cols["input_ids"][0])  # whose pages stay valid
    copies = _stores()
    del ids
    client.clear("v")
    gc.collect()
    client.put("v", keys, cols)
    assert _stores() == copies  # no view left: the server reuses a warm segment


def test_a_reference_to_a_segment_filled_again_is_refused():
    with contextlib.closing(shm.SegmentPool()) as pool:
        rb = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["k"]), ["k"])
        ref = pool.write(rb.schema, [rb], "test")
        (seg,) = pool.segments()
        struct_free(seg)
        held = pool.acquire(ref["nbytes"])  # the owner fills it again: exclusive lock held
        assert held is seg
        with pytest.raises(flightq.ProtocolError, match="being filled again by its owner"):
            shm.map_data(ref, SHM, "get")
        pool.written(seg, ref["nbytes"])
        with pytest.raises(flightq.ProtocolError, match=f"is not generation {ref['gen']} of"):
            shm.map_data(ref, SHM, "get")
        with pytest.raises(flightq.ProtocolError, match=r"bytes \[0, 99999\) lie outside"):
            shm.map_data({**ref, "gen": seg.gen}, SHM, "get", 0, 99999)


def struct_free(seg: segments.Segment) -> None:
    """Mark a written segment as taken by a reader that has gone (its lock with it)."""
    import struct

    struct.pack_into("<q", seg.mm, 8, shm.TAKEN)


def test_a_malformed_answer_table_is_refused(server, client):
    keys = text_keys(1, 4)
    client.create_partition("t", TEXT, group_size=4)
    client.put("t", keys, text_columns(keys))
    ticket = {"op": "get", "partition": "t", "keys": keys, "fields": None, "shm": True}
    reader = fl.connect(server.location).do_get(fl.Ticket(msgpack.packb(ticket)))
    (rb,) = [c.data for c in reader]
    body = msgpack.unpackb(rb.column(0)[0].as_py())
    col = body["batches"][0]["c"][2]  # input_ids: validity, offsets, data
    col["b"][1][2] = 8  # offsets cut short: the rows would read past them
    bad = pa.record_batch([pa.array([msgpack.packb(body)], pa.binary())], names=[shm.MARKER])
    with pytest.raises(flightq.ProtocolError, match="shared-memory answer is malformed"):
        shmtable.take([bad], _DIR, "get")
    body["batches"][0]["c"][2]["b"][2][0] = 7
    bad = pa.record_batch([pa.array([msgpack.packb(body)], pa.binary())], names=[shm.MARKER])
    with pytest.raises(flightq.ProtocolError, match="names segment 7 of"):
        shmtable.take([bad], _DIR, "get")


# --------------------------------------------------------------------------- validation


def _with_payload(rb: pa.RecordBatch, column: str, row: int, data: bytes) -> pa.RecordBatch:
    values = rb.column(column).to_pylist()
    values[row] = data
    return replace_column(rb, column, pa.array(values, type=rb.schema.field(column).type))


def test_a_crafted_int32_payload_is_refused_like_a_streamed_put_and_nothing_is_stored(client):
    before = set(_mine())
    client.create_partition("g", TEXT, group_size=4)
    keys = text_keys(2, 4)
    cols = text_columns(keys)
    good = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), cols, keys)
    bad = _with_payload(good, "input_ids", 6, cols["input_ids"][6].astype(np.int32).tobytes())
    n = len(cols["input_ids"][6])
    with pytest.raises(
        flightq.ShapeError,
        match=rf"column 'input_ids': shape \({n},\) needs {8 * n} bytes of int64, payload has "
        rf"{4 * n} \(row key 'p1_g2'\)",
    ):
        client.put_batch("g", bad)
    assert client.stats()["partitions"]["g"]["rows"] == 0
    wrong = replace_column(good, "input_lengths", pa.array(range(8), pa.int64()))
    with pytest.raises(
        flightq.DecodeError, match="column 'input_lengths': expected Arrow type int32"
    ):
        client.put_batch("g", wrong)
    assert client.stats()["partitions"]["g"]["rows"] == 0
    # The client's segment (kept or replaced) and nothing more.
    assert len(set(_mine()) - before) <= 2
    assert client.put_batch("g", good) == 8


def test_a_reference_outside_the_segment_directory_is_refused(server, client):
    client.create_partition("p", TEXT)
    with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* not a flightq segment"):
        plain_shm_put(server.location, {"path": "/etc/passwd", "gen": 1, "nbytes": 10})
    with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* is gone"):
        plain_shm_put(
            server.location, {"path": f"{_DIR}/flightq-1-00000000-1", "gen": 1, "nbytes": 9}
        )


# --------------------------------------------------------------------------- opting in


def test_shm_is_refused_for_a_location_off_this_host():
    with pytest.raises(flightq.ProtocolError, match=r"10\.1\.2\.3:8815 is not loopback"):
        flightq.connect("grpc://10.1.2.3:8815", shm=True)
    assert shm.is_local("grpc://127.0.0.2:1") and shm.is_local("grpc://[::1]:1")
    assert shm.is_local("grpc+unix:///tmp/s") and not shm.is_local("grpc://[2001:db8::1]:1")


def test_a_server_with_shm_disabled_refuses_it_at_connect():
    with flightq.Server(shm=False) as srv:
        assert flightq.connect(srv.location).health()["shm"] is None
        with pytest.raises(flightq.ProtocolError, match="has shared memory disabled"):
            flightq.connect(srv.location, shm=True)


def test_connect_refuses_a_directory_the_server_does_not_see(server, tmp_path):
    with pytest.raises(flightq.ProtocolError, match=rf"does not see .* uses '{_DIR}'"):
        flightq.connect(server.location, shm=str(tmp_path))


def test_a_new_pool_removes_the_segments_of_dead_owners():
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(child.stdout)
    path = f"{SHM}/flightq-{dead}-deadbeef-1"
    with open(path, "wb") as f:
        f.write(b"x")
    shm.SegmentPool().close()
    assert not os.path.exists(path)


def test_a_gathered_stream_is_byte_for_byte_the_plain_one_also_for_row_slices():
    step = workloads.w2(groups=1)
    schema = flightq.SchemaRegistry.default().get(step.schema)
    plain = [
        s
        for b in encode_chunks(schema, step.columns, step.keys, step.tags, max_bytes=2**30)
        for s in split_batch(b, 20 * 2**20)
    ]
    sink = pa.BufferOutputStream()
    segments.write_stream(sink, plain[0].schema, plain)
    pool = shm.SegmentPool()
    try:
        with shm.gathering() as gather:
            cut = [
                s
                for b in encode_chunks(
                    schema, step.columns, step.keys, step.tags, max_bytes=2**30, sink=gather
                )
                for s in split_batch(b, 20 * 2**20)
            ]
            assert len(cut) > 1 and any(s.column(0).offset for s in cut)  # really sliced
            assert shm.gathered(gather)
            ref = pool.write(cut[0].schema, cut, "test", gather)
        with open(ref["path"], "rb") as f:
            f.seek(shm.HEADER)
            assert f.read(ref["nbytes"]) == sink.getvalue().to_pybytes()
    finally:
        pool.close()


def test_rows_outlive_the_producer_that_put_them_through_shm(server, client):
    # The producer exits, its pool unlinks its segment: the server serves its own copy.
    script = (
        "import sys, flightq\n"
        "from flightq import workloads\n"
        "step = workloads.w1(groups=1)\n"
        "with flightq.connect(sys.argv[1], [step.schema], shm=sys.argv[2]) as c:\n"
        "    c.create_partition('gone', step.schema, group_size=step.group_size)\n"
        "    c.put('gone', step.keys, step.columns, tags=step.tags)\n"
    )
    subprocess.run([sys.executable, "-c", script, server.location, _DIR], check=True, timeout=60)
    step = workloads.w1(groups=1)
    batch = client.get("gone", step.keys, as_="numpy")
    assert assert_rows_match(batch, step) > 0
    row = batch["pixel_values"][0][0]
    assert _mapped_files(row.__array_interface__["data"][0]) == _stores()
    assert server.shm_pool.paths() == []  # the answer needed no segment of its own


@pytest.mark.torch
def test_a_stopped_server_left_holding_rows_lets_go_of_them_and_their_segments() -> None:
    step = workloads.w2(groups=1)
    own = tempfile.mkdtemp(prefix="flightq-test-", dir=SHM)  # no other test's pool there
    with (
        flightq.Server(shm=own) as srv,
        flightq.connect(srv.location, [step.schema], timeout=TIMEOUT, shm=own) as c,
    ):
        c.create_partition("m", step.schema, group_size=step.group_size)
        assert c.put("m", step.keys, step.columns, tags=step.tags).route == "shm"
    try:
        # Stopped, it let go of its rows and the segments they lie in, whether or not its
        # object goes too: pyarrow before 26 keeps a stopped Flight server's object
        # referenced from C++ for as long as the process lives.
        assert srv.store.partitions() == [] and srv.store.held() == 0
        assert _mine(own) == []
        gone = weakref.ref(srv)
        del srv
        gc.collect()
        if _PYARROW_MAJOR >= 26:
            # Nothing the server handed to gRPC (its middleware) leads back to it.
            assert gone() is None
    finally:
        shutil.rmtree(own, ignore_errors=True)


def _big_rows(n: int) -> tuple[list[str], dict[str, list[np.ndarray]]]:
    keys = [f"b{i}" for i in range(n)]
    return keys, {"input_ids": [np.full(25_000, i, np.int64) for i in range(n)]}  # 200 KB


def test_a_put_through_shared_memory_is_one_record_batch_up_to_what_the_server_takes(
    monkeypatch,
):
    # A reader decodes a record batch at a fixed cost per column: a step put through
    # shared memory goes as one record batch up to what the server says it takes there,
    # even past its limit per put batch over the socket, which still holds for sockets.
    monkeypatch.setattr(shm, "PUT_BATCH_BYTES", 8 << 20)
    monkeypatch.setattr(shm, "BATCH_BYTES", 1 << 20)  # what a client cuts at unsaid
    keys, rows = _big_rows(15)  # 3 MB
    own = tempfile.mkdtemp(prefix="flightq-test-", dir=SHM)
    try:
        with (
            flightq.Server(shm=own, max_put_batch_bytes=1 << 20) as srv,
            flightq.connect(srv.location, timeout=TIMEOUT, shm=own, max_batch_bytes=1 << 20) as c,
            flightq.connect(srv.location, timeout=TIMEOUT, max_batch_bytes=4 << 20) as plain,
        ):
            assert c.health()["shm"]["batch_bytes"] == 8 << 20
            c.shm_min_bytes = 0
            c.create_partition("p", TEXT, tasks=["t"])
            assert c.put("p", keys, rows).route == "shm"
            got = c.get("p", keys, as_="numpy")
            assert got.received.record_batches == 1 and len(_pieces(srv, "p")) == 1
            assert [int(r[0]) for r in got["input_ids"]] == list(range(15))
            with pytest.raises(flightq.ProtocolError, match="limit of 1048576 bytes per batch"):
                plain.put("p", keys, rows, overwrite=True)
            c.drop("p")
    finally:
        shutil.rmtree(own, ignore_errors=True)


def test_a_server_that_does_not_say_what_it_takes_gets_puts_cut_as_before(monkeypatch):
    # A server older than the word (its health reply names no batch_bytes): puts
    # through shared memory are cut at shm.BATCH_BYTES, as before.
    from flightq import shm as shm_pkg

    said = shm_pkg.probe_reply

    def older(*a, **k):
        out = said(*a, **k)
        if out is not None:
            out.pop("batch_bytes", None)
        return out

    monkeypatch.setattr(shm_pkg, "probe_reply", older)
    monkeypatch.setattr(shm, "BATCH_BYTES", 1 << 20)
    keys, rows = _big_rows(15)
    own = tempfile.mkdtemp(prefix="flightq-test-", dir=SHM)
    try:
        with (
            flightq.Server(shm=own) as srv,
            flightq.connect(srv.location, timeout=TIMEOUT, shm=own, max_batch_bytes=1 << 20) as c,
        ):
            assert "batch_bytes" not in c.health()["shm"]
            c.shm_min_bytes = 0
            c.create_partition("p", TEXT, tasks=["t"])
            assert c.put("p", keys, rows).route == "shm"
            assert len(_pieces(srv, "p")) >= 3  # 3 MB cut at 1 MiB
            assert c.get("p", keys, as_="numpy").keys == keys
            c.drop("p")
    finally:
        shutil.rmtree(own, ignore_errors=True)


def test_a_plain_flight_put_through_shared_memory_is_held_to_the_servers_limit(monkeypatch):
    # A writer that ignores the health reply: a record batch in its segment larger than
    # the server takes through shared memory is refused, whole, naming the limit; one
    # within it is stored, even past the server's limit per put batch over the socket.
    keys, rows = _big_rows(15)  # 3 MB in one record batch
    schema = flightq.SchemaRegistry.default().get(TEXT)
    batch = flightq.encode(schema, rows, keys)
    own = tempfile.mkdtemp(prefix="flightq-test-", dir=SHM)
    pool = segments.SegmentPool(own)
    try:
        with (
            flightq.Server(shm=own, max_put_batch_bytes=1 << 20) as srv,
            flightq.connect(srv.location, timeout=TIMEOUT) as c,
        ):
            c.create_partition("p", TEXT, tasks=["t"])
            monkeypatch.setattr(shm, "PUT_BATCH_BYTES", 2 << 20)
            ref = pool.write(batch.schema, [batch], "test")
            with pytest.raises(
                fl.FlightServerError, match="exceeds the server's limit of 2097152 bytes"
            ):
                plain_shm_put(srv.location, ref, rows=15)
            assert c.stats()["partitions"]["p"]["rows"] == 0
            monkeypatch.setattr(shm, "PUT_BATCH_BYTES", 8 << 20)
            ref = pool.write(batch.schema, [batch], "test")
            plain_shm_put(srv.location, ref, rows=15)
            assert c.get("p", keys, as_="numpy").keys == keys
            c.drop("p")
    finally:
        pool.close()
        shutil.rmtree(own, ignore_errors=True)
