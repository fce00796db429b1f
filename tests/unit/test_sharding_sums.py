"""A sharded client's stats: every count summed over the shards, waiting ones included."""

from __future__ import annotations

from flightq.sharding.router import sum_stats


def _shard(rows: int, waiting: int, waiting_puts: int, staged: int) -> dict:
    p = {
        "schema": "rollout_text@1",
        "fingerprint": "f",
        "tasks": ["train"],
        "group_size": None,
        "rows": rows,
        "bytes": 10 * rows,
        "delivered": {"train": 1},
        "waiting": {"train": waiting},
        "waiting_puts": waiting_puts,
        "staged_parts": staged,
    }
    return {"partitions": {"p": p}, "rows": rows, "bytes": 10 * rows, "waiting_claims": waiting}


def test_stats_of_shards_sum_rows_bytes_and_every_waiting_count():
    got = sum_stats([_shard(3, 1, 0, 2), _shard(4, 2, 1, 0)])
    p = got["partitions"]["p"]
    assert (got["rows"], got["bytes"], got["waiting_claims"]) == (7, 70, 3)
    assert p["rows"] == 7 and p["bytes"] == 70
    assert p["delivered"] == {"train": 2} and p["waiting"] == {"train": 3}
    assert (p["waiting_puts"], p["staged_parts"]) == (1, 2)
