"""`flightq bench --shards` runs end to end: real shard processes, worker processes, output."""

from __future__ import annotations

import json
from pathlib import Path

from flightq_bench.cli import main


def test_bench_shards_measures_each_count_and_writes_its_table(tmp_path: Path) -> None:
    rc = main(
        ["--shards", "1,2", "--quick", "--reps", "1", "--workers", "1", "--out", str(tmp_path)]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "shards.json").read_text())
    assert [r["shards"] for r in doc["rows"]] == [1, 2]
    assert all(r["put_Bps"] > 0 and r["get_Bps"] > 0 for r in doc["rows"])
    assert doc["rows"][0]["put_x"] == 1.0
    assert "| 2 |" in (tmp_path / "shards.md").read_text()


def test_bench_shards_refuses_a_bad_count(tmp_path: Path) -> None:
    assert main(["--shards", "0", "--out", str(tmp_path)]) == 2
    assert main(["--shards", "two", "--out", str(tmp_path)]) == 2
