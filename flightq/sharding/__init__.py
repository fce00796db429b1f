"""One partition over several servers: routing (:mod:`.router`), calls to every shard at
once (:mod:`.fanout`) and the client over them (:mod:`.client`). See ``docs/sharding.md``."""

from .client import ShardedClient, connect_sharded
from .router import Router, group_key

__all__ = ["Router", "ShardedClient", "connect_sharded", "group_key"]
