"""The media dictionary of a stored batch answered whole (``flightq.server.media``): a
view of the memory the put left where its copies allow one, a copy of their bytes only
otherwise; and no more unused bytes between them than the limit says."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from flightq.server import media
from flightq.server.media import SPARE_ENTRY_BYTES, Copy, Home


def _home(sizes: list[int]) -> Home:
    entries = pa.array([bytes([i % 251]) * n for i, n in enumerate(sizes)], pa.large_binary())
    return Home(entries, entries.get_total_buffer_size())


def _copies(home: Home, at: list[int]) -> list[Copy]:
    sizes = np.diff(np.frombuffer(home.entries.buffers()[1], dtype=np.int64))
    return [Copy(("f", b"", ()), home, i, int(sizes[i])) for i in at]


def _data_address(a: pa.Array) -> int:
    return a.buffers()[2].address


def _payloads(entries: pa.Array, at: np.ndarray | None, n: int) -> list[bytes]:
    where = range(n) if at is None else at.tolist()
    return [entries[int(i)].as_py() for i in where]


def test_consecutive_copies_are_a_slice_of_their_home() -> None:
    home = _home([8] * 10)
    copies = _copies(home, [3, 4, 5])
    entries, at, _ = media._dictionary_of(copies)
    assert at is None and len(entries) == 3
    assert _data_address(entries) == _data_address(home.entries)
    assert _payloads(entries, at, 3) == [home.entries[i].as_py() for i in (3, 4, 5)]


def test_scattered_small_copies_are_a_slice_with_their_places() -> None:
    # Equal size tensors share one copy: the distinct ones lie scattered in the put's
    # dictionary, with a few small unused entries between them.
    home = _home([8] * 100)
    want = [0, 7, 40, 99]
    copies = _copies(home, want)
    entries, at, _ = media._dictionary_of(copies)
    assert at is not None and at.dtype == np.int32
    assert _data_address(entries) == _data_address(home.entries)  # nothing copied
    assert _payloads(entries, at, 4) == [home.entries[i].as_py() for i in want]


def test_copies_with_more_unused_bytes_between_them_are_copied() -> None:
    home = _home([8, SPARE_ENTRY_BYTES + 1, 8])
    copies = _copies(home, [0, 2])
    entries, at, _ = media._dictionary_of(copies)
    assert at is None and len(entries) == 2
    assert _data_address(entries) != _data_address(home.entries)
    assert entries.to_pylist() == [home.entries[0].as_py(), home.entries[2].as_py()]


def test_copies_of_two_homes_are_copied() -> None:
    a, b = _home([8, 8]), _home([8, 8])
    copies = [*_copies(a, [1]), *_copies(b, [0])]
    entries, at, _ = media._dictionary_of(copies)
    assert at is None
    assert entries.to_pylist() == [a.entries[1].as_py(), b.entries[0].as_py()]


def test_spare_bytes_are_bounded_by_the_bytes_used_past_a_floor() -> None:
    # Over the socket the spare entries are sent: two 8-byte size tensors 5 000 entries
    # apart would send 40 kB for 16 B, so they are copied; with as many bytes used as
    # spare, a view.
    home = _home([8] * 5002)
    entries, at, _ = media._dictionary_of(_copies(home, [0, 5001]))
    assert at is None
    assert entries.to_pylist() == [home.entries[0].as_py(), home.entries[5001].as_py()]
    big = _home([8 << 10, 8 << 10, 8 << 10])
    entries, at, _ = media._dictionary_of(_copies(big, [0, 2]))
    assert at is not None and _data_address(entries) == _data_address(big.entries)


def _form(entries: pa.Array, rows: list[list[int] | None]) -> media.WholeAnswer:
    """A kept answer form of one media column ``f``: per row the dictionary entries of its
    segments (None: the row lacks the field)."""
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r or []))
    segs = pa.DictionaryArray.from_arrays(
        pa.array([e for r in rows for e in r or []], pa.int32()), entries
    )
    mask = pa.array([r is None for r in rows]) if None in rows else None
    col = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), segs, mask=mask)
    batch = pa.record_batch([col], names=["f"])
    return media.WholeAnswer(batch, ("f",), batch, frozenset(), 0, kept=True)


def test_rows_of_a_kept_form_carry_the_entries_they_use_as_a_view() -> None:
    entries = _home([8] * 6).entries
    whole = _form(entries, [[0], [1, 2], None, [3], [5]])
    rows, nbytes = media.rows_answer(whole, 1, 3)
    col = rows.batch.column(0)
    assert col.to_pylist() == [
        [entries[1].as_py(), entries[2].as_py()],
        None,
        [entries[3].as_py()],
    ]
    assert nbytes == 24 and len(col.values.dictionary) == 3
    assert _data_address(col.values.dictionary) == _data_address(entries)  # nothing copied
    assert rows.lo == 1 and rows.made == {0}  # the media column made afresh
    assert media.rows_answer(whole, 2, 1)[0].batch.column(0).to_pylist() == [None]


def test_rows_of_a_kept_form_whose_entries_lie_far_apart_are_cut_row_by_row() -> None:
    entries = _home([8, SPARE_ENTRY_BYTES + 1, 8]).entries
    whole = _form(entries, [[0], [2], [1]])
    assert media.rows_answer(whole, 0, 2) is None  # the large entry between would go too
    # As many segments as entries in their span, one of them unused all the same.
    assert media.rows_answer(_form(entries, [[0], [0], [2]]), 0, 3) is None
    rows, nbytes = media.rows_answer(whole, 1, 2)
    assert nbytes == SPARE_ENTRY_BYTES + 9
    assert rows.batch.column(0).to_pylist() == [[entries[2].as_py()], [entries[1].as_py()]]
