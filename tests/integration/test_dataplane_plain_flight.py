"""A plain ``pyarrow.flight`` client reads a partition, with no flightq in the reading path.

Writers use flightq; the reader below uses only pyarrow and numpy, as a client in another
language would: ListFlights, GetFlightInfo on the partition's path, DoGet of the endpoint's
ticket, and the dtype named in each payload column's metadata.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import (  # noqa: F401
    TEXT,
    TIMEOUT,
    VLM,
    client_fixture,
    python_env,
    raw,
    server_fixture,
    text_columns,
)

from flightq import workloads

pytestmark = pytest.mark.timeout(60)


def plain_read(location: str, name: str) -> tuple[fl.FlightInfo, pa.Table]:
    """Read a whole partition with pyarrow.flight alone."""
    with fl.connect(location) as c:
        info = c.get_flight_info(fl.FlightDescriptor.for_path(name))
        (endpoint,) = info.endpoints
        return info, c.do_get(endpoint.ticket).read_all()


def plain_tensor(table: pa.Table, field: str, row: int) -> np.ndarray:
    """One token tensor from its payload, shape column and dtype metadata (no flightq)."""
    dtype = np.dtype(table.schema.field(field).metadata[b"flightq.dtype"].decode())
    payload = table.column(field)[row].as_py()
    shape = table.column(field + "__shape")[row].as_py()
    return np.frombuffer(payload, dtype=dtype).reshape(shape)


@pytest.fixture
def written(client):
    """Partition 'text': 5 rows, k1 and k3 with prev_logprobs, k2 cleared."""
    keys = [f"k{i}" for i in range(5)]
    cols = text_columns(keys)
    client.create_partition("text", TEXT, tasks=["train"])
    client.put("text", keys, cols, [{"prompt_idx": i} for i in range(5)])
    lp = {k: -np.arange(len(cols["input_ids"][i]), dtype=np.float32) for i, k in enumerate(keys)}
    client.put("text", ["k1", "k3"], {"prev_logprobs": [lp["k1"], lp["k3"]]})
    client.clear("text", ["k2"])
    return keys, cols, lp


def test_list_flights_describes_every_partition_by_path(client, written):
    client.create_partition("empty", TEXT)
    with fl.connect(client.location) as c:
        infos = {info.descriptor.path[0].decode(): info for info in c.list_flights()}
    assert set(infos) == {"text", "empty"}
    assert infos["text"].total_records == 4
    assert infos["text"].total_bytes > 0
    assert infos["empty"].total_records == 0
    assert infos["text"].descriptor.descriptor_type == fl.DescriptorType.PATH


def test_plain_client_reads_every_row_not_cleared_with_the_union_schema(client, written):
    keys, cols, lp = written
    info, table = plain_read(client.location, "text")
    assert info.total_records == 4
    assert info.schema.names == table.schema.names
    assert table.column("__key__").to_pylist() == ["k0", "k1", "k3", "k4"]
    # The union of what was written, in schema order, each payload with its shape column.
    assert table.schema.names == [
        "__key__",
        "__tags__",
        "input_ids",
        "input_ids__shape",
        "input_lengths",
        "prev_logprobs",
        "prev_logprobs__shape",
        "token_mask",
        "token_mask__shape",
        "total_reward",
    ]
    assert table.column("prev_logprobs").to_pylist()[0] is None  # k0 lacks it
    assert table.column("prev_logprobs__shape").null_count == 2
    for row, key in enumerate(["k0", "k1", "k3", "k4"]):
        i = keys.index(key)
        assert raw(plain_tensor(table, "input_ids", row)) == raw(cols["input_ids"][i])
        if key in ("k1", "k3"):
            assert raw(plain_tensor(table, "prev_logprobs", row)) == raw(lp[key])
    assert table.column("input_lengths").type == pa.int32()
    assert table.column("total_reward").to_pylist() == [
        float(cols["total_reward"][keys.index(k)]) for k in ("k0", "k1", "k3", "k4")
    ]
    meta = table.schema.metadata
    assert json.loads(meta[b"flightq.schema"])["name"] == "rollout_text"
    assert table.schema.field("input_ids").metadata[b"flightq.role"] == b"token"


def test_plain_client_reads_media_segments_with_their_shapes(client):
    step = workloads.w1(groups=1, g=2)
    client.create_partition("vlm", VLM, group_size=2)
    client.put("vlm", step.keys, step.columns, step.tags)
    _, table = plain_read(client.location, "vlm")
    media = pa.large_list(pa.dictionary(pa.int32(), pa.large_binary()))
    assert table.schema.field("pixel_values").type == media
    # The two rows share one image: one dictionary entry, indexed by both rows' segments.
    chunk = table.column("pixel_values").chunks[0]
    assert len(chunk.values.dictionary) == 1 and chunk.values.indices.to_pylist() == [0, 0]
    segments = table.column("pixel_values")[1].as_py()
    shapes = table.column("pixel_values__shape")[1].as_py()
    assert shapes == [[748, 1176]]
    got = np.frombuffer(segments[0], dtype=np.float32).reshape(shapes[0])
    assert raw(got) == raw(step.columns["pixel_values"][1][0])


def test_plain_client_endpoint_ticket_is_a_scan_of_the_partition(client, written):
    with fl.connect(client.location) as c:
        info = c.get_flight_info(fl.FlightDescriptor.for_path("text"))
    (endpoint,) = info.endpoints
    assert msgpack.unpackb(endpoint.ticket.ticket) == {"op": "scan", "partition": "text"}
    assert [loc.uri.decode() for loc in endpoint.locations] == [client.location]


def test_reading_a_partition_needs_no_flightq_import(client, written):
    code = textwrap.dedent(
        """
        import json, sys
        import pyarrow.flight as fl
        c = fl.connect(sys.argv[1])
        names = [i.descriptor.path[0].decode() for i in c.list_flights()]
        info = c.get_flight_info(fl.FlightDescriptor.for_path(names[0]))
        table = c.do_get(info.endpoints[0].ticket).read_all()
        print(json.dumps({
            "names": names,
            "keys": table.column("__key__").to_pylist(),
            "nulls": table.column("prev_logprobs").null_count,
            "flightq_imported": any(m.split(".")[0] == "flightq" for m in sys.modules),
        }))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, client.location],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=python_env(),
        check=True,
    )
    got = json.loads(out.stdout)
    assert got == {
        "names": ["text"],
        "keys": ["k0", "k1", "k3", "k4"],
        "nulls": 2,
        "flightq_imported": False,
    }


def test_get_flight_info_of_an_unknown_partition_names_it(server):
    with (
        fl.connect(server.location) as c,
        pytest.raises(fl.FlightServerError, match=r"NotFoundError: unknown partition 'nope'"),
    ):
        c.get_flight_info(fl.FlightDescriptor.for_path("nope"))
