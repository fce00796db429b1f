"""Same-host transfers through shared memory (``connect(..., shm=True)``).

Real servers on loopback, real files under /dev/shm; nothing is mocked. Each test checks
the bytes, the validation, and that no segment of this process outlives its owner.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, assert_rows_match, text_columns, text_keys
from helpers_wire import replace_column

import flightq
from flightq import shm, workloads
from flightq.batch import encode_chunks, split_batch

pytestmark = pytest.mark.timeout(120)

SHM = shm.DEFAULT_DIR


def _mine() -> list[str]:
    """Segment files this test process owns (its server and clients run in it)."""
    prefix = f"flightq-{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM) if n.startswith(prefix))


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


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    with flightq.Server() as srv:
        yield srv
    gc.collect()
    assert _mine() == []


@pytest.fixture(name="client")
def client_fixture(server: flightq.Server) -> Iterator[flightq.Client]:
    with flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT, shm=True) as c:
        yield c


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
    assert not row[0].flags.writeable  # the mapping is read-only


def test_w1_round_trips_bit_exact_through_torch(client):
    step = workloads.w1(groups=1)
    client.create_partition("w1", step.schema, group_size=step.group_size)
    client.put("w1", step.keys, workloads.to_torch(step).columns, tags=step.tags)
    assert assert_rows_match(client.get("w1", step.keys), step) > 0


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


def test_a_claim_whose_answer_cannot_be_written_gives_its_rows_back(server, client, tmp_path):
    keys = text_keys(1, 4)
    client.create_partition("c", TEXT, tasks=["train"], group_size=4)
    client.put("c", keys, text_columns(keys))
    server.shm_dir = str(tmp_path / "gone")  # the server can no longer create segments
    with pytest.raises(flightq.ResourceExhaustedError, match=r"no room for .* shared memory"):
        client.claim("c", "train", 4, timeout=TIMEOUT)
    server.shm_dir = SHM
    assert client.claim("c", "train", 4, timeout=TIMEOUT).keys == keys


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
    assert len(client._shm_pool.paths()) == 1
    assert len(server._shm_pool.paths()) == 1


def test_a_segment_goes_back_to_its_owner_only_when_the_last_view_dies(server, client):
    keys = text_keys(1, 4)
    client.create_partition("v", TEXT, group_size=4)
    client.put("v", keys, text_columns(keys))
    ids = client.get("v", keys, as_="numpy")["input_ids"][0]
    gc.collect()
    (seg,) = server._shm_pool._segs
    assert seg.state() == shm.TAKEN
    del ids
    gc.collect()
    assert seg.state() == shm.FREE


# --------------------------------------------------------------------------- validation


def _with_payload(rb: pa.RecordBatch, column: str, row: int, data: bytes) -> pa.RecordBatch:
    values = rb.column(column).to_pylist()
    values[row] = data
    return replace_column(rb, column, pa.array(values, type=rb.schema.field(column).type))


def test_a_crafted_int32_payload_is_refused_like_a_streamed_put_and_nothing_is_stored(client):
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
    assert len(_mine()) <= 2  # the client's segment (kept or replaced) and nothing more
    assert client.put_batch("g", good) == 8


def _raw_put(location: str, ref: dict[str, object]) -> None:
    cmd = {"op": "put", "partition": "p", "overwrite": False, "timeout": 1.0, "shm": ref}
    client = fl.connect(location)
    try:
        schema = pa.schema([("__key__", pa.utf8())])
        writer, reader = client.do_put(fl.FlightDescriptor.for_command(msgpack.packb(cmd)), schema)
        with writer:
            writer.done_writing()
            reader.read()
    finally:
        client.close()


def test_a_reference_outside_the_segment_directory_is_refused(server, client):
    client.create_partition("p", TEXT)
    with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* not a flightq segment"):
        _raw_put(server.location, {"path": "/etc/passwd", "gen": 1, "nbytes": 10})
    with pytest.raises(fl.FlightServerError, match=r"ProtocolError: .* is gone"):
        _raw_put(server.location, {"path": f"{SHM}/flightq-1-00000000-1", "gen": 1, "nbytes": 9})


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
    with pytest.raises(flightq.ProtocolError, match=r"does not see .* uses '/dev/shm'"):
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
    shm._write_stream(sink, plain[0].schema, plain)
    pool = shm.SegmentPool()
    try:
        with shm.gathering():
            cut = [
                s
                for b in encode_chunks(schema, step.columns, step.keys, step.tags, max_bytes=2**30)
                for s in split_batch(b, 20 * 2**20)
            ]
            assert len(cut) > 1 and any(s.column(0).offset for s in cut)  # really sliced
            ref = pool.write(cut[0].schema, cut, "test")
        with open(ref["path"], "rb") as f:
            f.seek(shm.HEADER)
            assert f.read(ref["nbytes"]) == sink.getvalue().to_pybytes()
    finally:
        pool.close()
