"""GetFlightInfo on any shard lists every shard's endpoint; pyarrow.flight alone reads them all."""

from __future__ import annotations

import msgpack
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, cli_server, text_columns, text_keys
from fixtures_shard import SHORT, inproc_shards

import flightq

pytestmark = pytest.mark.timeout(60)


def plain_read_all(location: str, name: str) -> tuple[fl.FlightInfo, pa.Table]:
    """Every endpoint of a partition, read with pyarrow.flight alone, one client each."""
    with fl.connect(location) as c:
        info = c.get_flight_info(fl.FlightDescriptor.for_path(name))
    tables = []
    for ep in info.endpoints:
        (loc,) = ep.locations
        with fl.connect(loc) as c:
            tables.append(c.do_get(ep.ticket).read_all())
    return info, pa.concat_tables(tables, promote_options="default")


def test_a_plain_flight_client_reads_the_whole_partition_from_any_shard() -> None:
    with inproc_shards(3) as servers:
        locations = [s.location for s in servers]
        keys = text_keys(10, 2)
        cols = text_columns(keys)
        with flightq.connect_sharded(locations, [TEXT], timeout=SHORT) as c:
            c.create_partition("rows", TEXT, group_size=2)
            c.put("rows", keys, cols)
            held = [c.stats()["shards"][loc]["rows"] for loc in locations]
        assert sum(1 for h in held if h) >= 2, held
        for s in servers:
            info, table = plain_read_all(s.location, "rows")
            assert [ep.locations[0].uri.decode() for ep in info.endpoints] == locations
            scans = [msgpack.unpackb(ep.ticket.ticket) for ep in info.endpoints]
            assert scans == [{"op": "scan", "partition": "rows"}] * 3
            assert info.total_records == -1  # the other shards' counts are not known here
            assert sorted(table.column("__key__").to_pylist()) == sorted(keys)
        with fl.connect(locations[0]) as plain:
            (listed,) = plain.list_flights()
            assert len(listed.endpoints) == 3


def test_flightq_serve_peers_lists_one_endpoint_per_peer() -> None:
    peers = ["grpc://127.0.0.1:1", "grpc://127.0.0.1:2"]
    with cli_server("--peers", ",".join(peers)) as (location, _):
        with flightq.connect(location, timeout=SHORT) as c:
            c.create_partition("rows", TEXT)
        with fl.connect(location) as plain:
            info = plain.get_flight_info(fl.FlightDescriptor.for_path("rows"))
        assert [ep.locations[0].uri.decode() for ep in info.endpoints] == peers


def test_a_server_without_peers_lists_itself_once() -> None:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=SHORT) as c:
        c.create_partition("rows", TEXT)
        c.put("rows", ["a"], text_columns(["a"]))
        with fl.connect(srv.location) as plain:
            info = plain.get_flight_info(fl.FlightDescriptor.for_path("rows"))
        (ep,) = info.endpoints
        assert ep.locations[0].uri.decode() == srv.location and info.total_records == 1
