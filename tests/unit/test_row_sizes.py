"""What a client learns from its answers to size its next gets (`RowSizes`)."""

from __future__ import annotations

from flightq.client.reads import RowSizes


def test_parts_that_came_back_empty_teach_how_many_rows_the_server_keeps_together() -> None:
    sizes = RowSizes()
    assert sizes.together("p") == 1  # nothing known: any cut
    sizes.learn_parts("p", [0, 0, 0, 8])  # one prompt group over 4 streams
    assert sizes.together("p") == 8
    sizes.learn_parts("p", [0, 16, 0, 16])  # two groups of 16 over 4 streams
    assert sizes.together("p") == 16
    sizes.learn_parts("p", [16, 16, 16, 16])  # every part had rows: no fewer than 16 seen
    assert sizes.together("p") == 16
    sizes.learn_parts("p", [8, 8])  # a part of fewer rows than known: the server cut there
    assert sizes.together("p") == 8
    sizes.learn_parts("p", [0, 0])  # an answer of no rows teaches nothing
    assert sizes.together("p") == 8
    assert sizes.together("q") == 1  # per partition


def test_an_answers_bytes_count_each_buffer_once_whether_one_batch_or_slices() -> None:
    import numpy as np
    import pyarrow as pa

    import flightq
    from flightq.client.reads import distinct_nbytes

    s = flightq.SchemaRegistry.default().get("rollout_vlm@1")
    img = np.ones((64, 64), dtype=np.float32)  # one image shared by both rows: stored once
    cols = {
        "input_ids": [np.arange(5), np.arange(3)],
        "pixel_values": [[img], [img]],
        "image_grid_thw": [[np.array([[1, 2, 2]])], [np.array([[1, 2, 2]])]],
    }
    rb = flightq.encode(s, cols, keys=["a", "b"])
    whole = distinct_nbytes([rb])  # one batch: Arrow's own count, each buffer once
    assert whole == rb.get_total_buffer_size() > img.nbytes
    # Slices of one batch share its buffers (the image's dictionary above all): each
    # (address, size) once, not once per slice.
    walked = set()
    for col in rb.columns:
        bufs = col.buffers()
        if pa.types.is_large_list(col.type) and pa.types.is_dictionary(col.type.value_type):
            bufs += col.values.dictionary.buffers()
        walked.update((b.address, b.size) for b in bufs if b is not None)
    two = distinct_nbytes([rb.slice(0, 1), rb.slice(1, 1)])
    assert two == sum(size for _, size in walked) < whole + img.nbytes
    sizes = RowSizes()
    sizes.learn("p", 2, [rb])
    assert sizes.per_row("p") == whole / 2
