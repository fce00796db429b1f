"""Start flightq shards as Ray actors, one per node, where RL frameworks already run.

NeMo RL and verl drive their generators and trainers from Ray; :func:`start_shards` puts
one flightq server actor on each of ``n`` nodes (a placement group with the ``SPREAD``
strategy), tells every server the full list of shards (its ``peers``, so GetFlightInfo
lists all endpoints) and returns the locations to hand to
:func:`flightq.connect_sharded`. Ray is imported only when a function here is called;
install it with ``pip install 'flightq[ray]'``.

Examples
--------
>>> import ray, flightq, flightq.ray                          # doctest: +SKIP
>>> ray.init()                                                # doctest: +SKIP
>>> shards = flightq.ray.start_shards(4, num_cpus=4)          # doctest: +SKIP
>>> c = flightq.connect_sharded(shards.locations, ["rollout_vlm@1"])  # doctest: +SKIP
>>> flightq.ray.stop_shards(shards)                           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Shards", "start_shards", "stop_shards"]


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError as e:
        raise ImportError(
            "flightq.ray needs Ray: pip install 'flightq[ray]' (or pip install 'ray>=2.9')"
        ) from e


class _ShardServer:
    """The body of one shard actor: a flightq server serving in a background thread."""

    def __init__(
        self,
        host: str | None,
        port: int,
        schemas: str | None,
        memory_budget: int | None,
        cap: int | None = None,
    ) -> None:
        from .memory import collect_rarely, keep_freed_memory
        from .registry import SchemaRegistry
        from .server.flight import Server, cap_own_memory

        # The actor's process is the server's own: tuned as flightq serve tunes itself.
        keep_freed_memory()
        collect_rarely()
        if host is None:
            host = _ray().util.get_node_ip_address()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        registry = SchemaRegistry.from_dir(schemas) if schemas else None
        self.server = Server(
            f"grpc://{host}:{port}", registry=registry, memory_budget=memory_budget
        ).start()
        #: The data-segment cap set on the actor's process (None: none).
        self.cap = cap_own_memory(self.server, cap)

    def memory_cap(self) -> int | None:
        return self.cap

    def location(self) -> str:
        return self.server.location

    def node_id(self) -> str:
        return str(_ray().get_runtime_context().get_node_id())

    def set_peers(self, peers: list[str]) -> None:
        self.server.peers = list(peers)

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Shards:
    """Running shard actors: their locations (for :func:`flightq.connect_sharded`)."""

    locations: list[str]
    actors: list[Any] = field(repr=False)
    placement_group: Any = field(repr=False)
    node_ids: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """Stop the servers and free the placement group (see :func:`stop_shards`)."""
        stop_shards(self)

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_shards(
    n: int,
    *,
    num_cpus: float = 1.0,
    host: str | None = None,
    port: int = 0,
    schemas: str | None = None,
    memory_budget: int | None = None,
    memory_cap: int | None = None,
    strategy: str = "SPREAD",
    timeout: float = 120.0,
) -> Shards:
    """Start ``n`` flightq servers as Ray actors, one per node where the cluster allows.

    Parameters
    ----------
    n:
        Number of shards.
    num_cpus:
        CPUs reserved for each shard (its placement-group bundle); more than 0.
    host:
        Address each server binds and is reached at; by default the IP of the node the
        actor runs on. ``"127.0.0.1"`` for a one-machine cluster.
    port:
        Port on each node; 0 lets each node's OS choose.
    schemas:
        A schema folder present on every node (default: the shipped schemas).
    memory_budget:
        Payload bytes each shard may hold (see :class:`flightq.Server`).
    memory_cap:
        Bytes each shard actor's process caps its data segment at (``RLIMIT_DATA``), as
        ``flightq serve --memory-cap`` does: a put whose compressed IPC body would
        inflate past it is refused with ResourceExhaustedError instead of filling the
        node. None: the default of :func:`flightq.memory.memory_cap` (from the budget and
        the call limits); 0: no cap.
    strategy:
        Placement-group strategy: ``"SPREAD"`` (one per node when there are enough nodes,
        else packed) or ``"STRICT_SPREAD"`` (one per node, or fail).
    timeout:
        Seconds to wait for the placement group and the servers.

    Returns
    -------
    Shards
        ``.locations`` in shard order; stop with :func:`stop_shards` or ``with``.

    Raises
    ------
    ImportError
        If Ray is not installed.
    ValueError
        If ``n < 1`` or ``num_cpus <= 0``.
    TimeoutError
        If the cluster cannot place the shards within ``timeout`` (e.g. STRICT_SPREAD on
        fewer nodes than ``n``); nothing is left running.
    """
    if n < 1 or not num_cpus > 0:
        raise ValueError(f"start_shards: need n >= 1 and num_cpus > 0, got {n}, {num_cpus}")
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": num_cpus}] * n, strategy=strategy)
    actors: list[Any] = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            raise TimeoutError(
                f"start_shards: the cluster could not place {n} shards of {num_cpus} CPUs "
                f"with {strategy} within {timeout:g}s (cluster: {ray.cluster_resources()})"
            )
        cls = ray.remote(_ShardServer)
        for i in range(n):
            placed = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            )
            actors.append(
                cls.options(
                    num_cpus=num_cpus,
                    scheduling_strategy=placed,
                    # As `flightq serve` runs (flightq.memory): one malloc arena.
                    runtime_env={"env_vars": {"MALLOC_ARENA_MAX": "1"}},
                ).remote(host, port, schemas, memory_budget, memory_cap)
            )
        locations = ray.get([a.location.remote() for a in actors], timeout=timeout)
        nodes = ray.get([a.node_id.remote() for a in actors], timeout=timeout)
        ray.get([a.set_peers.remote(locations) for a in actors], timeout=timeout)
    except BaseException:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        raise
    return Shards(locations, actors, pg, nodes)


def stop_shards(shards: Shards, timeout: float = 30.0) -> None:
    """Stop every shard's server, end its actor and free the placement group."""
    ray = _ray()
    from ray.util.placement_group import remove_placement_group

    try:
        with contextlib.suppress(Exception):  # an actor already gone needs no stopping
            ray.get([a.stop.remote() for a in shards.actors], timeout=timeout)
    finally:
        for a in shards.actors:
            ray.kill(a)
        remove_placement_group(shards.placement_group)
        shards.actors = []
