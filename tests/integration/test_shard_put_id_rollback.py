"""A sharded put rolled back on one shard, then retried with the same ``put_id``."""

from __future__ import annotations

import pytest
from fixtures_dataplane import TEXT
from fixtures_shard import grouped_rows, inproc_shards

import flightq

pytestmark = pytest.mark.timeout(60)


def test_a_put_retried_by_its_put_id_after_a_rollback_stores_every_row() -> None:
    with inproc_shards(2) as servers:
        c = flightq.connect_sharded([s.location for s in servers], [TEXT], timeout=10)
        c.create_partition("rows", TEXT, group_size=2)
        put = grouped_rows(16, 2)
        keys, cols = put["keys"], put["columns"]
        by = {
            s: [i for i in range(0, len(keys), 2) if c.router.shard_of(keys[i]) == s]
            for s in (0, 1)
        }
        g0, g1 = by[0][0], by[1][0]
        rows = [g0, g0 + 1, g1, g1 + 1]
        part = {
            "keys": [keys[i] for i in rows],
            "columns": {n: [v[i] for i in rows] for n, v in cols.items()},
        }
        # Shard 0 already holds the first group: that part conflicts, shard 1's is rolled back.
        other = grouped_rows(16, 2, seed=1)["columns"]  # same keys, other content
        c.put("rows", part["keys"][:2], {n: [v[g0], v[g0 + 1]] for n, v in other.items()})
        with pytest.raises(flightq.ConflictError, match="rolled back 2 new rows"):
            c.put("rows", **part, put_id="p1")
        c.clear("rows", part["keys"][:2])
        c.put("rows", **part, put_id="p1")  # the retry
        assert len(c.get("rows", part["keys"], as_="numpy").keys) == 4
        c.close()
