"""What a shared-memory answer copies of a slice of memory no segment holds
(``flightq.shm.table``): rows a put over the socket left in the server's heap."""

from __future__ import annotations

import pyarrow as pa

from flightq.shm import table


def _entries(n: int, size: int) -> pa.Array:
    return pa.array([bytes([i]) * size for i in range(n)], pa.large_binary())


def test_an_answer_copies_only_the_part_of_a_heap_buffer_its_slice_uses() -> None:
    entries = _entries(8, 64 << 10)  # 512 KiB in one data buffer of the heap
    d = table._Describer()
    desc = d.array(entries.slice(2, 2))
    assert d.extra_bytes < 2 * (64 << 10) + 4096  # two entries' bytes, not eight
    assert desc["n"] == 2 and desc["o"] == 0  # described as the compact copy
    # A slice that leaves less than SPARE_SLICE_BYTES of its buffer is copied as it is.
    small = _entries(64, 16 << 10)
    d = table._Describer()
    d.array(small.slice(0, 62))
    assert d.extra_bytes >= small.get_total_buffer_size()


def test_a_kept_description_copies_nothing_to_compact_a_slice() -> None:
    # What a kept description holds lives as long as the form: a compact copy would be
    # memory the budget does not count; it names the buffer the piece holds anyway.
    entries = _entries(8, 64 << 10)
    d = table._Describer(keep=True)
    d.array(entries.slice(2, 2))
    (data,) = [buf for _, buf in d.extra if buf.size >= 8 * (64 << 10)]
    assert data.address == entries.buffers()[2].address
