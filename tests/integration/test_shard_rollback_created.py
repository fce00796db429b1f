"""A sharded put that fails on one shard clears, on the others, only the rows it created.

Each shard's acknowledgement says which rows the put created there. A shard that answered
a retry as a replay created none: the rows of the put it acknowledged before stay. So do
rows that existed before the put (a write-back's, an overwrite's), and every row of a
shard whose server does not say (one older than that record). Real servers on loopback;
a shard is stopped to make a put fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TEXT, raw
from fixtures_shard import SHORT, grouped_rows, inproc_shards

import flightq

pytestmark = pytest.mark.timeout(120)


def _connect(servers: Sequence[flightq.Server]) -> flightq.ShardedClient:
    c = flightq.connect_sharded([s.location for s in servers], [TEXT], timeout=SHORT)
    c.create_partition("rows", TEXT, tasks=["train"], group_size=2)
    return c


def _on(c: flightq.ShardedClient, keys: list[str], shard: int) -> list[str]:
    mine = [k for k in keys if c.router.shard_of(k) == shard]
    assert mine and len(mine) < len(keys), "every group landed on one shard"
    return mine


def _part(put: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """The rows ``keys`` of a put (a dict of ``keys`` and ``columns``)."""
    at = {k: i for i, k in enumerate(put["keys"])}
    cols = {n: [v[at[k]] for k in keys] for n, v in put["columns"].items()}
    return {"keys": keys, "columns": cols}


def _held(location: str, keys: list[str], fields: Sequence[str] = ("input_ids",)) -> Any:
    """The rows the shard at ``location`` holds, and of ``keys`` their ``fields``."""
    with flightq.connect(location, timeout=SHORT) as one:
        total = one.stats()["partitions"]["rows"]["rows"]
        if not keys:
            return total, {}
        b = one.get("rows", keys, list(fields), as_="numpy")
        return total, {k: [raw(b[f][i]) for f in fields] for i, k in enumerate(b.keys)}


@pytest.mark.parametrize("put_id", ["p1", None], ids=["put_id", "same_content"])
def test_a_retry_while_a_shard_is_down_keeps_the_rows_the_first_attempt_stored(
    put_id: str | None,
) -> None:
    with inproc_shards(2) as servers, _connect(servers) as c:
        up, down = servers[0].location, servers[1].location
        put = grouped_rows(16, 2)
        c.put("rows", **put, put_id=put_id)  # acknowledged by both shards
        mine = _on(c, put["keys"], 0)
        before = _held(up, mine)
        servers[1].stop(1.0)
        with pytest.raises(
            flightq.UnavailableError,
            match=f"shard {down}: .*shard {up} had stored this part before",
        ):
            c.put("rows", **put, put_id=put_id)  # the documented idempotent retry
        assert _held(up, mine) == before == (len(mine), before[1])
        if put_id is not None:  # the shard did not forget the put id: acknowledged again
            with flightq.connect(up, timeout=SHORT) as one:
                again = one.put("rows", **_part(put, mine), put_id=put_id)
            assert again.creation is not None and again.creation.replay
            assert _held(up, mine) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_new_put_that_fails_on_one_shard_clears_the_rows_it_created_on_the_others(
    overwrite: bool,
) -> None:
    with inproc_shards(2) as servers, _connect(servers) as c:
        up, down = servers[0].location, servers[1].location
        earlier = grouped_rows(16, 2, prefix="q")
        c.put("rows", **earlier)
        kept = _on(c, earlier["keys"], 0)
        put = grouped_rows(16, 2, prefix="p", seed=1)
        mine = _on(c, put["keys"], 0)
        servers[1].stop(1.0)
        with pytest.raises(
            flightq.UnavailableError,
            match=f"shard {down}: .*rolled back {len(mine)} new rows on shard {up}",
        ):
            c.put("rows", **put, overwrite=overwrite, put_id="n1")
        total, _ = _held(up, [])
        assert total == len(kept)  # the earlier put's rows, no row of this one
        with flightq.connect(up, timeout=SHORT) as one, pytest.raises(flightq.NotFoundError):
            one.get("rows", mine[:1])


def test_a_write_back_that_fails_on_one_shard_keeps_the_rows_and_the_columns_it_added() -> None:
    with inproc_shards(2) as servers, _connect(servers) as c:
        up = servers[0].location
        put = grouped_rows(16, 2)
        c.put("rows", **put)
        mine = _on(c, put["keys"], 0)
        lp = [np.full(len(x), 0.5, dtype=np.float32) for x in put["columns"]["input_ids"]]
        servers[1].stop(1.0)
        with pytest.raises(
            flightq.UnavailableError,
            match=f"{len(mine)} existing rows on shard {up} keep what this put wrote.*"
            "overwrite=True",
        ):
            c.put("rows", put["keys"], {"prev_logprobs": lp}, put_id="w1")
        total, held = _held(up, mine, ("input_ids", "prev_logprobs"))
        assert total == len(mine)
        written = _part({"keys": put["keys"], "columns": {"lp": lp, **put["columns"]}}, mine)
        assert held == {
            k: [raw(a), raw(b)]
            for k, a, b in zip(
                mine, written["columns"]["input_ids"], written["columns"]["lp"], strict=True
            )
        }


def test_an_overwrite_that_also_creates_rows_clears_only_those_when_a_shard_fails() -> None:
    with inproc_shards(2) as servers, _connect(servers) as c:
        up = servers[0].location
        first = grouped_rows(16, 2, prefix="p")
        c.put("rows", **first)
        fresh = grouped_rows(16, 2, prefix="n", seed=2)
        ids = [x + 1 for x in first["columns"]["input_ids"]]  # the same rows, other tokens
        again = {"keys": first["keys"], "columns": {**first["columns"], "input_ids": ids}}
        put = {
            "keys": again["keys"] + fresh["keys"],
            "columns": {n: [*again["columns"][n], *fresh["columns"][n]] for n in again["columns"]},
        }
        rewritten, created = _on(c, first["keys"], 0), _on(c, fresh["keys"], 0)
        servers[1].stop(1.0)
        with pytest.raises(
            flightq.UnavailableError,
            match=f"rolled back {len(created)} new rows on shard {up}; "
            f"{len(rewritten)} existing rows on shard {up} keep what this put wrote",
        ):
            c.put("rows", **put, overwrite=True)
        total, held = _held(up, rewritten)
        assert total == len(rewritten)  # the rows it created are gone, the others stay
        assert held == {k: [raw(x)] for k, x in zip(rewritten, _ids(again, rewritten), strict=True)}


def _ids(put: dict[str, Any], keys: list[str]) -> list[Any]:
    return _part(put, keys)["columns"]["input_ids"]


class _FirstMessageOnly:
    """A DoPut's metadata writer that sends the first message (the acknowledgement) alone."""

    def __init__(self, writer: fl.FlightMetadataWriter) -> None:
        self._writer, self._sent = writer, False

    def write(self, buf: pa.Buffer) -> None:
        if not self._sent:
            self._writer.write(buf)
            self._sent = True


class _OlderServer(flightq.Server):
    """A server as flightq's were before put creation records: a DoPut answers with the
    acknowledgement alone."""

    def _do_put(self, descriptor: Any, reader: Any, writer: Any, context: Any = None) -> None:
        super()._do_put(descriptor, reader, _FirstMessageOnly(writer), context)


def test_a_shard_that_does_not_say_what_a_put_created_is_left_as_it_is() -> None:
    with _OlderServer() as older, flightq.Server() as other, _connect([older, other]) as c:
        keys = grouped_rows(8, 2)["keys"]
        mine = _on(c, keys, 0)
        # Rows of 1.6 MB: each shard's part is a DoPut of its own, not a request stream's.
        ids = [np.full(200_000, i, dtype=np.int64) for i in range(len(keys))]
        other.stop(1.0)
        with pytest.raises(
            flightq.UnavailableError,
            match=f"shard {older.location} did not say which of its {len(mine)} rows this put "
            "created .*nothing rolled back there",
        ):
            c.put("rows", keys, {"input_ids": ids}, put_id="o1")
        total, _ = _held(older.location, [])
        assert total == len(mine)
