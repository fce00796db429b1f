"""Integration tests: real flightq servers on loopback port 0, real clients, real processes.

The fixtures every data-plane test shares: ``server`` (a :class:`flightq.Server` in this
process) and ``client`` (connected to it), ``pair`` (a client on the request stream and
one per call, of ``server``), ``shard_locations`` and ``sharded`` (shard servers and a
sharded client), ``shm_dir`` (a private directory under /dev/shm). A module may define
its own ``server``/``client`` to start them differently.
"""

from fixtures_dataplane import client_fixture, server_fixture, shm_dir_fixture
from fixtures_shard import shard_locations_fixture, sharded_fixture
from helpers_stream import pair_fixture

__all__ = [
    "client_fixture",
    "pair_fixture",
    "server_fixture",
    "shard_locations_fixture",
    "sharded_fixture",
    "shm_dir_fixture",
]
