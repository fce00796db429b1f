"""A put's plan (``plan_put``) of rows that are all new: the rows it builds and what it refuses.

A generator's put creates every row it carries; its plan builds them in bulk. Each row
must still be exactly what the definition says (its group, a cell per field it carries
pointing at its record batch and index, its tags, sequence length and byte counts), and
a refusal must name the first row that fails, as planning row by row does.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from flightq import SchemaRegistry, encode, layout
from flightq.errors import EncodeError, MissingFieldError
from flightq.server import partition
from flightq.server.partition import Partition, make_piece, put_keys
from flightq.server.putplan import plan_put
from flightq.validation import validate

TEXT = SchemaRegistry.default().get("rollout_text@1")


def _piece(keys: list[str], lens: list[int], tags: list | None = None, sparse: bool = False):
    cols: dict = {"input_ids": [np.arange(n, dtype=np.int64) for n in lens]}
    if sparse:  # an optional field some rows lack
        cols["generation_logprobs"] = [
            None if i % 2 else np.zeros(n, dtype=np.float32) for i, n in enumerate(lens)
        ]
    rb = encode(TEXT, cols, keys, tags)
    return make_piece(rb, validate(rb, TEXT), None)


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("sparse", [False, True])
def test_new_rows_are_planned_as_defined(group_size: int | None, sparse: bool) -> None:
    p = Partition("p", TEXT, ("train",), group_size)
    p.next_group = 3  # groups taken by earlier puts
    tags = [{"prompt_idx": i // 4} if i % 3 else None for i in range(12)]
    pieces = [  # rows built in bulk (past a few rows, every field present), and one by one
        _piece([f"a{i}" for i in range(12)], [i + 1 for i in range(12)], tags, sparse),
        _piece([f"b{i}" for i in range(4)], [5] * 4),
    ]
    plan = plan_put(p, pieces, False, None, p.writes)
    assert plan.new == [*(f"a{i}" for i in range(12)), *(f"b{i}" for i in range(4))]
    assert list(plan.ready) == plan.new and list(plan.rows) == plan.new
    n = 0
    for pc in pieces:
        ck = pc.checked
        for i, k in enumerate(ck.keys):
            row = plan.rows[k]
            assert row.key == k
            assert row.group == 3 + (n // group_size if group_size else n)
            carried = [f for f in ck.fields if pc.valid(f) is None or pc.valid(f)[i]]
            assert list(row.cells) == carried
            assert all(cell[0] is pc and cell[1] == i for cell in row.cells.values())
            # A home only where the row has every field of its piece (not one it lacks).
            assert row.home == ((pc, i) if carried == list(ck.fields) else None)
            assert row.tags == (pc.tags[i] or {})
            assert (row.seq_len, row.nbytes, row.held) == (
                int(ck.seq_lens[i]),
                int(ck.nbytes[i]),
                int(pc.own[i]),  # its key, tags map and objects; the piece counts the rest
            )
            n += 1
    assert plan.nbytes == int(sum(pc.checked.nbytes.sum() for pc in pieces))
    assert plan.need == int(sum(pc.held.sum() + pc.own.sum() for pc in pieces))
    assert plan.held == int(sum(pc.own.sum() for pc in pieces))
    # Each piece is counted whole once a stored row uses it, as many rows as use it.
    assert [(pc, n) for pc, n in plan.uses] == [(pc, len(pc.checked.keys)) for pc in pieces]
    assert [pc.cost for pc in pieces] == [int(pc.held.sum()) for pc in pieces]


def test_a_new_row_with_a_required_field_null_is_named() -> None:
    p = Partition("p", TEXT, ("train",), None)
    rb = encode(TEXT, {"input_ids": [np.arange(2)] * 4}, ["k0", "k1", "k2", "k3"])
    nulls = pa.array([b"\x00" * 16, None, None, b"\x00" * 16], type=pa.large_binary())
    shapes = pa.array([[2], None, None, [2]], type=pa.list_(pa.int64()))
    i = rb.schema.get_field_index("input_ids")
    rb = rb.set_column(i, rb.schema.field(i), nulls)
    rb = rb.set_column(i + 1, rb.schema.field(i + 1), shapes)
    piece = make_piece(rb, validate(rb, TEXT), None)
    null = r"row key 'k1': required field 'input_ids' is null"
    with pytest.raises(MissingFieldError, match=null):
        plan_put(p, [piece], False, None, p.writes)


def test_new_rows_lacking_a_required_field_name_the_first() -> None:
    p = Partition("p", TEXT, ("train",), None)
    rb = encode(TEXT, {"total_reward": np.ones(3, dtype=np.float32)}, ["x", "y", "z"])
    piece = make_piece(rb, validate(rb, TEXT), None)
    with pytest.raises(MissingFieldError, match=r"row key 'x' is new in partition 'p' and lacks"):
        plan_put(p, [piece], False, None, p.writes)


def test_a_put_into_an_empty_partition_gives_each_task_an_index_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def rows_of(p: Partition) -> list[tuple]:
        return [
            (r.key, r.group, list(r.cells), r.seq_len, r.nbytes, r.held) for r in p.rows.values()
        ]

    keys = [f"a{i}" for i in range(12)]
    whole = Partition("p", TEXT, ("train", "eval"), None)
    whole.commit(plan_put(whole, [_piece(keys, [3] * 12)], False, None, 0))
    monkeypatch.setattr(layout, "SLICE", 5)  # every bulk step of the plan in slices
    p = Partition("p", TEXT, ("train", "eval"), None)
    plan = plan_put(p, [_piece(keys, [3] * 12)], False, None, p.writes)
    assert len(plan.fresh) == 2 and plan.fresh[0] is not plan.fresh[1]
    p.commit(plan)
    assert p.rows is plan.rows and rows_of(p) == rows_of(whole)  # adopted, built alike
    train, other = p.progress.tasks["train"], p.progress.tasks["eval"]
    p.progress.take("train", ["a0", "a1"], 60.0, 0.0, None, [0, 1])
    assert list(train.ready) == keys[2:] and list(other.ready) == keys
    more = [f"b{i}" for i in range(9)]
    plan = plan_put(p, [_piece(more, [2] * 9)], False, None, p.writes)
    assert plan.fresh == ()  # the partition holds rows: merged into its dicts
    p.commit(plan)
    assert list(p.rows) == keys + more
    assert list(train.ready) == keys[2:] + more and list(other.ready) == keys + more


def test_mapped_is_map_over_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "SLICE", 3)
    a, b = list(range(10)), [str(i) for i in range(10)]
    assert layout.mapped(lambda x, y: (x, y), a, b) == list(zip(a, b, strict=True))
    assert layout.mapped(str, []) == []


@pytest.mark.parametrize("slice_", [4, 1 << 15])  # counted by Arrow, and in a set
def test_a_key_repeating_across_a_puts_batches_is_named(
    monkeypatch: pytest.MonkeyPatch, slice_: int
) -> None:
    monkeypatch.setattr(partition, "SLICE", slice_)
    a, b = [f"a{i}" for i in range(6)], [f"b{i}" for i in range(3)]
    keys = put_keys([_piece(a, [2] * 6), _piece(b, [2] * 3)])
    assert keys.set() == set(a + b)
    with pytest.raises(EncodeError, match=r"duplicate row key 'a4' within one put"):
        put_keys([_piece(a, [2] * 6), _piece(["b0", "a4", "b1"], [2] * 3)])
    assert put_keys([_piece(a, [2] * 6)]).set() == set(a)  # one batch: checked by validation


def test_compacting_a_piece_moves_its_rows_counts_them_and_tells_plans() -> None:
    p = Partition("p", TEXT, ("train",), None)
    keys = [f"k{i}" for i in range(8)]
    pc = _piece(keys, [40_000] * 8, tags=[{"i": i} for i in range(8)])  # 320 KB a row
    p.commit(plan_put(p, [pc], False, None, p.writes))
    whole = p.held
    assert (pc.users, whole) == (8, pc.cost + int(pc.own.sum()))
    left = p.cleared([p.rows.pop(k) for k in keys[:3]])
    gone = int(pc.own[:3].sum())  # what the cleared rows held of their own
    assert left == [pc] and pc.users == 5 and p.held == whole - gone  # the piece whole
    assert p.compact(left) == 0  # 5 of 8 rows: more than half, left as it is
    left = p.cleared([p.rows.pop(k) for k in keys[3:5]])
    seen = p.writes
    assert p.compact(left) == 3
    assert p.touched(seen, {"k6"}) and not p.touched(seen, {"k0"})  # plans of k5-k7 redo
    assert pc.users == 0
    new = p.rows["k5"].cells["input_ids"][0]
    assert new is not pc and new.users == 3
    assert p.held == new.cost + int(pc.own[5:].sum()) < whole / 2
    assert new.batch.num_rows == 3 and new.checked.keys == keys[5:]
    for j, k in enumerate(keys[5:]):
        r = p.rows[k]
        assert r.home == (new, j) and r.cells == {"input_ids": (new, j)}
        assert r.tags == {"i": 5 + j}
        ids = new.batch.column("input_ids")[j].as_py()
        assert np.frombuffer(ids, np.int64).tolist() == list(range(40_000))
    p.cleared([p.rows.pop(k) for k in keys[5:]])
    assert p.held == 0 and new.users == 0
