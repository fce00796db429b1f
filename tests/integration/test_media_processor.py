"""A Qwen2-VL image processor's output (every image of the batch concatenated, one
``image_grid_thw`` row per image) put through ``flightq.media.split_by_grid``, and the
error that names ``image_grid_thw`` when the output is passed whole.

The processor-shaped arrays are built by hand: ``pixel_values`` of shape
``(sum(t*h*w), 1176)`` and ``image_grid_thw`` of shape ``(n_images, 3)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures_dataplane import VLM, client_fixture, server_fixture

import flightq
from flightq.media import split_by_grid

__all__ = ["client_fixture", "server_fixture"]

GRIDS = np.array([[1, 22, 34], [1, 4, 6], [1, 10, 12], [1, 2, 2]], dtype=np.int64)
PER_ROW = [1, 2, 0, 1]  # row 2 is a text row
KEYS = [f"p{i}_g0" for i in range(len(PER_ROW))]


def _processor_output(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = int(GRIDS.prod(axis=1).sum())
    return rng.random((n, 1176), dtype=np.float32), GRIDS.copy()


def test_split_by_grid_cuts_views_per_image_and_groups_them_by_row() -> None:
    pixels, grid = _processor_output(np.random.default_rng(0))
    rows = split_by_grid(pixels, grid, PER_ROW)
    shapes = [[p.shape for p in r] for r in rows["pixel_values"]]
    assert shapes == [[(748, 1176)], [(24, 1176), (120, 1176)], [], [(4, 1176)]]
    assert [len(r) for r in rows["image_grid_thw"]] == PER_ROW
    assert np.shares_memory(rows["pixel_values"][1][1], pixels)
    assert rows["image_grid_thw"][1][1].tolist() == [[1, 10, 12]]


def test_processor_output_round_trips_per_row(client: flightq.Client) -> None:
    client.create_partition("r", VLM, tasks=["train"])
    pixels, grid = _processor_output(np.random.default_rng(1))
    ids = [np.arange(5, dtype=np.int64)] * len(KEYS)
    client.put("r", KEYS, {"input_ids": ids, **split_by_grid(pixels, grid, PER_ROW)})
    b = client.get("r", KEYS, ["pixel_values", "image_grid_thw"], as_="numpy")
    assert [len(r) for r in b["pixel_values"]] == PER_ROW
    values, offsets = b.column("pixel_values").cat()
    assert np.array_equal(values, pixels) and offsets.tolist() == [0, 748, 892, 892, 896]
    grids = np.concatenate([g for r in b["image_grid_thw"] for g in r])
    assert np.array_equal(grids, GRIDS)


def test_the_whole_output_passed_as_a_column_names_image_grid_thw(client) -> None:
    client.create_partition("r", VLM, tasks=["train"])
    pixels, grid = _processor_output(np.random.default_rng(2))
    ids = [np.arange(5, dtype=np.int64)] * len(KEYS)
    with pytest.raises(flightq.ShapeError, match=r"896 rows for 4 keys.*image_grid_thw.*split_by"):
        client.put("r", KEYS, {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid})


def test_grids_that_do_not_account_for_the_patches_are_refused() -> None:
    pixels, grid = _processor_output(np.random.default_rng(3))
    with pytest.raises(flightq.ShapeError, match="'image_grid_thw' accounts for 892"):
        split_by_grid(pixels, grid[:-1], [1, 2, 0, 0])
    with pytest.raises(flightq.ShapeError, match="images_per_row adds up to 3 images"):
        split_by_grid(pixels, grid, [1, 1, 0, 1])


@pytest.mark.torch
def test_torch_processor_output_splits_into_views(torch) -> None:
    pixels, grid = _processor_output(np.random.default_rng(4))
    tp, tg = torch.from_numpy(pixels), torch.from_numpy(grid)
    rows = split_by_grid(tp, tg, PER_ROW)
    assert rows["pixel_values"][1][0].data_ptr() == tp[748:].data_ptr()
    assert rows["image_grid_thw"][3][0].shape == (1, 3)
