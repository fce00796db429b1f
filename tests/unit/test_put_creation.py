"""What a put created, as the store reports it, and a clear that removes only those rows.

A put's answer says which rows it created: its creation numbers (group numbers), none
for a replay or a put that only added columns. A clear naming those numbers removes the
rows that put created and no other, whatever was put or cleared since: it is how a
sharded put undoes its part without touching an acknowledged put's rows. The store
alone, no network.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from flightq import SchemaRegistry, encode
from flightq.errors import NotFoundError
from flightq.server.partition import make_piece
from flightq.server.putplan import Stored
from flightq.server.store import Store
from flightq.validation import validate

TEXT = SchemaRegistry.default().get("rollout_text@1")


def _put(
    store: Store, keys: list[str], seed: int = 0, put_id: str | None = None, **fields: Any
) -> Stored:
    cols: dict[str, Any] = fields or {
        "input_ids": [np.arange(seed, seed + 4, dtype=np.int64) for _ in keys]
    }
    rb = encode(TEXT, cols, keys)
    return store.put("p", [make_piece(rb, validate(rb, TEXT))], False, put_id=put_id)


@pytest.mark.parametrize("group_size", [None, 2])
def test_a_put_reports_the_rows_it_created_and_a_replay_none(group_size: int | None) -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], group_size)
    a = _put(store, ["a_g0", "a_g1"], put_id="x")
    assert (a.rows, a.created, a.replay) == (2, 2, False)
    assert a.groups == ((0, 1) if group_size else (0, 2))
    b = _put(store, ["b_g0", "b_g1"])
    assert b.groups == ((1, 2) if group_size else (2, 4))  # never given out twice
    again = _put(store, ["a_g0", "a_g1"], seed=7, put_id="x")  # a retry by its put id
    assert (again.rows, again.created, again.groups, again.replay) == (2, 0, None, True)
    same = _put(store, ["b_g0", "b_g1"])  # a retry by content
    assert (same.created, same.groups, same.replay) == (0, None, True)
    lp = [np.zeros(4, dtype=np.float32)] * 2
    back = _put(store, ["a_g0", "a_g1"], prev_logprobs=lp)  # columns on existing rows
    assert (back.rows, back.created, back.groups, back.replay) == (2, 0, None, False)


def test_a_clear_naming_a_puts_creation_numbers_removes_only_the_rows_it_created() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    x = _put(store, ["a0", "a1"])
    _put(store, ["b0", "b1"])
    assert x.groups is not None
    # Keys of another put, and a key no longer held, are skipped, not refused.
    store.clear("p", ["b1"])
    assert store.clear("p", ["a0", "a1", "b0", "b1"], groups=list(x.groups)) == 2
    assert sorted(store.partition("p").rows) == ["b0"]
    # A row cleared and created again by another put is that put's: it stays.
    y = _put(store, ["a0"], seed=3)
    assert y.groups is not None and y.groups[0] >= x.groups[1]
    assert store.clear("p", ["a0"], groups=list(x.groups)) == 0
    # Without groups an unknown key still refuses the whole clear.
    with pytest.raises(NotFoundError):
        store.clear("p", ["a0", "nope"])
    assert sorted(store.partition("p").rows) == ["a0", "b0"]


def test_a_clear_of_a_puts_rows_forgets_its_put_id_so_a_retry_is_stored() -> None:
    store = Store()
    store.declare("p", TEXT, ["train"], None)
    x = _put(store, ["a0", "a1"], put_id="x")
    assert x.groups is not None
    assert store.clear("p", ["a0", "a1"], put_id="x", groups=list(x.groups)) == 2
    again = _put(store, ["a0", "a1"], put_id="x")
    assert (again.created, again.replay) == (2, False)
