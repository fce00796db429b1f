"""A get's rows found to be one slice at once (``_one_run``): consecutive rows of one
stored batch as a put made them, within the answer's byte bound, which the pairwise walk
over the rows makes one run too; anything else is left to that walk."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from flightq.server.assemble import _continues, _one_run
from flightq.server.partition import Row


class _Piece:
    """Stands for a stored batch: rows compare their homes' pieces by identity."""


PIECES = [_Piece(), _Piece()]

homes = st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(0, 6)))


def _rows(spec: list[tuple[tuple[int, int] | None, int]]) -> list[Row]:
    return [
        Row(f"k{i}", 0, home=None if h is None else (PIECES[h[0]], h[1]), nbytes=n)  # type: ignore[arg-type]
        for i, (h, n) in enumerate(spec)
    ]


def _walk(rows: list[Row], max_bytes: int) -> bool:
    """Whether the pairwise walk makes the rows one run."""
    acc = rows[0].nbytes
    for prev, row in itertools.pairwise(rows):
        if acc + row.nbytes > max_bytes or not _continues(prev, row, ["input_ids"]):
            return False
        acc += row.nbytes
    return True


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(homes, st.integers(0, 50)), min_size=2, max_size=8),
    st.integers(0, 400),
    st.booleans(),
)
def test_one_run_is_what_the_walk_makes_one_run(spec, max_bytes, consecutive):
    if consecutive:  # most gets: the rows of one put, in order
        spec = [((0, 2 + i), n) for i, (_, n) in enumerate(spec)]
    rows = _rows(spec)
    fast, walked = _one_run(rows, max_bytes), _walk(rows, max_bytes)
    assert walked or not fast  # never one run where the walk cuts
    if consecutive:  # the rows of one put: found at once, or cut by bytes alone
        assert fast == walked == (sum(n for _, n in spec) <= max_bytes)


def test_a_key_asked_twice_a_gap_or_one_row_is_left_to_the_walk():
    assert not _one_run(_rows([((0, 3), 1)]), 10)
    assert not _one_run(_rows([((0, 3), 1), ((0, 3), 1)]), 10)
    # First and last look consecutive; the middle row is not.
    assert not _one_run(_rows([((0, 3), 1), ((0, 5), 1), ((0, 5), 1)]), 10)
    assert not _one_run(_rows([((0, 3), 1), (None, 1), ((0, 5), 1)]), 10)
    assert not _one_run(_rows([((0, 3), 1), ((1, 4), 1), ((0, 5), 1)]), 10)
    assert _one_run(_rows([((0, 3), 1), ((0, 4), 1), ((0, 5), 1)]), 10)
