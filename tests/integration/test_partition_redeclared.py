"""A client's per-partition memory over a long run: partitions declared again under another
schema, and a partition per step, against a real server on loopback.

A client keeps each partition's schema (to encode puts), the media it sent there and the
size of its last answer. Another client may drop a partition and declare it again with
another schema: the first client's next put is described afresh and goes through. A run
that names a partition per step leaves each client remembering only the partitions it
used last (:data:`flightq.client.recent.RECENT_PARTITIONS`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, VLM, server_fixture, text_columns, text_keys

import flightq
from flightq.client import recent

__all__ = ["server_fixture"]

pytestmark = pytest.mark.timeout(120)

V1 = flightq.Schema("scored", 1, [flightq.Field("score", "float32", "scalar", ())])
V2 = flightq.Schema(
    "scored",
    2,
    [
        flightq.Field("score", "float32", "scalar", ()),
        flightq.Field("bonus", "float32", "scalar", (), required=False),
    ],
)


def _scores(n: int) -> dict[str, np.ndarray]:
    return {"score": np.arange(n, dtype=np.float32)}


def test_a_put_follows_a_partition_declared_again_with_other_fields(server) -> None:
    keys = text_keys(1, 4)
    with (
        flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT) as a,
        flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT) as b,
    ):
        a.create_partition("p", TEXT, tasks=["t"])
        a.put("p", keys, text_columns(keys))
        b.drop("p")
        b.create_partition("p", VLM, tasks=["t"])
        img = np.ones((4, 1176), dtype=np.float32)
        cols = {**text_columns(keys, seed=1), "pixel_values": [[img], [img], [], []]}
        # a still keeps rollout_text for "p", which declares no pixel_values: its encode
        # refuses the column, the schema is described afresh, and the put goes through.
        assert a.put("p", keys, cols) == 4
        got = a.get("p", keys, fields=["pixel_values"], as_="numpy")
        assert np.array_equal(got["pixel_values"][0][0], img) and got["pixel_values"][2] == []
        assert got.schema.ref == VLM


@contextlib.contextmanager
def _two_clients(server) -> Iterator[tuple[flightq.Client, flightq.Client]]:
    """Clients ``a`` and ``b`` (both schemas registered), ``a`` having put to "s" (V1)."""
    with (
        flightq.connect(server.location, timeout=TIMEOUT) as a,
        flightq.connect(server.location, timeout=TIMEOUT) as b,
    ):
        a.register_schema(V1)
        a.register_schema(V2)
        a.create_partition("s", V1, tasks=["t"])
        a.put("s", [f"k{i}" for i in range(3)], _scores(3))
        yield a, b


def test_a_put_follows_a_partition_declared_again_with_a_new_version(server) -> None:
    keys = [f"k{i}" for i in range(3)]
    with _two_clients(server) as (a, b):
        b.drop("s")
        b.create_partition("s", V2, tasks=["t"])
        # The columns encode under a's kept V1 too: the server refuses the batch's schema
        # (SchemaMismatchError), and the put goes again under V2.
        assert a.put("s", keys, _scores(3)) == 3
        assert a.get("s", keys, as_="numpy").schema.ref == "scored@2"


def test_a_put_refused_for_its_own_columns_is_refused_once(server, monkeypatch) -> None:
    keys = [f"k{i}" for i in range(3)]
    tries: list[str] = []
    put_as = flightq.Client._put_as

    def counted(self, partition, schema, *args, **kwargs):
        tries.append(schema.ref)
        return put_as(self, partition, schema, *args, **kwargs)

    monkeypatch.setattr(flightq.Client, "_put_as", counted)
    with flightq.connect(server.location, timeout=TIMEOUT) as a:
        a.register_schema(V1)
        a.create_partition("s", V1, tasks=["t"])
        before = a.stats()["counters"]["actions"]
        with pytest.raises(flightq.UndeclaredFieldError, match="'bonus'"):
            a.put("s", keys, {**_scores(3), "bonus": np.zeros(3, np.float32)})
        with pytest.raises(flightq.DTypeError, match="score"):
            a.put("s", keys, {"score": np.zeros(3, np.float64)})
        stats = a.stats()
        # One describe each (the schema kept is the server's), then the error: the put
        # is not made again under the same schema.
        assert tries == ["scored@1", "scored@1"]
        assert stats["counters"]["actions"] - before == 3
        assert stats["partitions"]["s"]["rows"] == 0 and stats["counters"]["puts"] == 0


def test_a_put_refused_for_its_columns_keeps_its_error_when_the_server_is_gone() -> None:
    keys = [f"k{i}" for i in range(3)]
    srv = flightq.Server().start()
    try:
        with flightq.connect(srv.location, timeout=2.0) as a:
            a.register_schema(V1)
            a.create_partition("s", V1, tasks=["t"])
            srv.stop()
            # The describe that would check the kept schema fails: the put's own error
            # stands, the failed describe its cause.
            with pytest.raises(flightq.UndeclaredFieldError, match="'bonus'") as got:
                a.put("s", keys, {**_scores(3), "bonus": np.zeros(3, np.float32)})
            assert isinstance(got.value.__cause__, flightq.FlightqError)
    finally:
        srv.stop()


def test_a_put_to_a_partition_dropped_under_it_names_the_partition(server) -> None:
    keys = [f"k{i}" for i in range(3)]
    with _two_clients(server) as (a, b):
        b.drop("s")
        with pytest.raises(flightq.NotFoundError, match="'s'"):
            a.put("s", keys, {**_scores(3), "bonus": np.zeros(3, np.float32)})


def test_a_partition_per_step_leaves_a_client_remembering_the_last_ones(
    server, monkeypatch
) -> None:
    monkeypatch.setattr(recent, "RECENT_PARTITIONS", 4)
    img = np.ones((4, 1176), dtype=np.float32)
    keys = text_keys(1, 2)
    with (
        flightq.connect(server.location, [VLM], timeout=TIMEOUT) as gen,
        flightq.connect(server.location, [VLM], timeout=TIMEOUT) as trainer,
    ):
        for step in range(10):
            name = f"step{step}"
            trainer.create_partition(name, VLM, tasks=["t"])
            gen.put(name, keys, {**text_columns(keys), "pixel_values": [[img], [img]]})
            assert len(trainer.get(name, keys, as_="numpy")) == 2
            if step > 1:  # the trainer drops what it has read (it keeps step0)
                trainer.drop(f"step{step - 1}")
        for c in (gen, trainer):
            assert len(c._schemas) <= 4 and len(c._media) <= 4
            assert len(c._reader.sizes._per_row) <= 4
        assert "step9" in gen._schemas and "step0" not in gen._schemas
        # A partition forgotten (step0, kept by the trainer) is described again on its
        # next put; its image goes whole again.
        again = {**text_columns(keys), "pixel_values": [[img], []]}
        assert gen.put("step0", keys, again, overwrite=True) == 2
        assert "step0" in gen._schemas
        assert trainer.get("step0", keys, as_="numpy")["pixel_values"][1] == []


def test_a_sharded_put_follows_a_partition_declared_again() -> None:
    from fixtures_shard import inproc_shards

    keys = [f"g{i}_0" for i in range(6)]  # routed over both shards
    with inproc_shards(2) as servers:
        locs = [s.location for s in servers]
        with (
            flightq.connect_sharded(locs, timeout=TIMEOUT) as a,
            flightq.connect_sharded(locs, timeout=TIMEOUT) as b,
        ):
            a.register_schema(V1)
            a.register_schema(V2)
            a.create_partition("s", V1, tasks=["t"])
            a.put("s", keys, _scores(6))
            b.drop("s")
            b.create_partition("s", V2, tasks=["t"])
            # Other fields: a's own encode refuses them under V1 before anything is
            # sent; described afresh, the put goes through under V2.
            cols = {**_scores(6), "bonus": np.ones(6, np.float32)}
            assert a.put("s", keys, cols) == 6
            b.drop("s")
            b.create_partition("s", V1, tasks=["t"])
            # Columns that encode under the V2 a keeps: every shard refuses the batch's
            # schema; a forgets the declaration, and its next put goes under V1.
            with pytest.raises(flightq.SchemaMismatchError):
                a.put("s", keys, _scores(6))
            assert a.put("s", keys, _scores(6)) == 6
            assert a.get("s", keys, as_="numpy").schema.ref == "scored@1"
