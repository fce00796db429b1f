"""Shards started as Ray actors on a local Ray cluster run the W1 write-back pattern."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow.flight as fl
import pytest

import flightq

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'flightq[ray]')")

from fixtures_dataplane import TEXT, text_columns  # noqa: E402
from fixtures_shard import run_w1_writeback  # noqa: E402
from helpers_budget import data_limit, hwm_mib, put_bomb  # noqa: E402
from helpers_reliability import plain_error  # noqa: E402

import flightq.ray as fray  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(name="local_ray", scope="module")
def local_ray_fixture() -> Iterator[None]:
    """A two-CPU Ray cluster on 127.0.0.1, shut down after the module."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def test_shards_started_as_actors_run_the_w1_writeback(local_ray: None) -> None:
    with fray.start_shards(2, num_cpus=0.5, host="127.0.0.1", timeout=60) as shards:
        assert len(shards.locations) == 2
        assert all(loc.startswith("grpc://127.0.0.1:") for loc in shards.locations)
        with (
            fl.connect(shards.locations[0]) as plain,
            flightq.connect_sharded(shards.locations, ["rollout_vlm@1"], timeout=30) as c,
        ):
            run_w1_writeback(c)
            # Each shard's process holds malloc to one arena, as `flightq serve` does.
            env = ray.get(shards.actors[0].__ray_call__.remote(lambda _: dict(os.environ)))
            assert env.get("MALLOC_ARENA_MAX") == "1"
            info = plain.get_flight_info(fl.FlightDescriptor.for_path("w1"))
            assert [ep.locations[0].uri.decode() for ep in info.endpoints] == shards.locations
    assert shards.actors == []


def test_start_shards_refuses_what_cannot_be_placed(local_ray: None) -> None:
    with pytest.raises(ValueError, match="num_cpus > 0"):
        fray.start_shards(1, num_cpus=0)
    with pytest.raises(TimeoutError, match="could not place 2 shards"):
        fray.start_shards(2, num_cpus=1, strategy="STRICT_SPREAD", timeout=2)


def test_a_shard_actor_caps_its_memory_and_refuses_a_put_that_inflates_past_it(
    local_ray: None,
) -> None:
    # As flightq serve: a per-call put whose compressed IPC body would inflate past the
    # cap is refused typed, nothing stored, and the actor serves on.
    budget = 64 * 2**20
    with fray.start_shards(1, num_cpus=0.5, host="127.0.0.1", memory_budget=budget) as shards:
        (actor,), (location,) = shards.actors, shards.locations
        pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
        cap = data_limit(pid)
        assert cap is not None and cap == ray.get(actor.memory_cap.remote())
        with flightq.connect(location, timeout=30) as c:
            c.create_partition("p", TEXT, tasks=["t"])
            before = hwm_mib(pid)
            kind, message = plain_error(put_bomb(location, "p", cap + 2**30))
            assert kind == "ResourceExhaustedError", message
            assert hwm_mib(pid) - before < 100  # the inflating allocation never took
            assert c.stats()["partitions"]["p"]["rows"] == 0  # nothing half-stored
            c.put("p", ["a"], text_columns(["a"]))  # the shard serves on
            assert c.get("p", ["a"], as_="numpy").keys == ["a"]


def test_a_shard_actor_with_memory_cap_0_sets_none(local_ray: None) -> None:
    with fray.start_shards(1, num_cpus=0.5, host="127.0.0.1", memory_cap=0) as shards:
        (actor,) = shards.actors
        pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
        assert data_limit(pid) is None and ray.get(actor.memory_cap.remote()) is None


def test_a_bare_transferqueue_init_in_a_ray_actor_without_a_location_is_refused(
    local_ray: None,
) -> None:
    # A Ray actor does not inherit the driver's environment: its bare init() started a
    # server of its own, and the rows it put were seen by no other process.
    pytest.importorskip("torch", reason="the compat layer reads TensorDicts (needs torch)")

    @ray.remote(num_cpus=0.1)
    class Worker:
        def init(self, location: str | None) -> str:
            os.environ.pop("FLIGHTQ_LOCATION", None)
            if location is not None:
                os.environ["FLIGHTQ_LOCATION"] = location
            import flightq.compat.transferqueue as tq

            try:
                return str(tq.init()["location"])
            except flightq.ProtocolError as e:
                return f"refused: {e}"
            finally:
                tq.close()

    with flightq.Server() as srv:
        w = Worker.remote()  # type: ignore[attr-defined]
        refused = ray.get(w.init.remote(None), timeout=60)
        assert refused.startswith("refused: init() in a Ray worker with no location"), refused
        assert ray.get(w.init.remote(srv.location), timeout=60) == srv.location
        ray.kill(w)
