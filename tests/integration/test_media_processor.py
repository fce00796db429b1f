"""A Qwen2-VL image processor's output (every image of the batch concatenated, one
``image_grid_thw`` row per image) put through ``flightq.media.split_by_grid``, and the
error that names ``image_grid_thw`` when the output is passed whole; Omni-style tiles
(``(sum(t), 3, H, W)`` and a tile count per image) through ``split_tiles``.

Most processor-shaped arrays are built by hand: ``pixel_values`` of shape
``(sum(t*h*w), 1176)`` and ``image_grid_thw`` of shape ``(n_images, 3)``. One test runs a
real ``transformers.Qwen2VLImageProcessor()`` (defaults, offline; skipped where
transformers is not installed).
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures_dataplane import VLM, client_fixture, server_fixture

import flightq
from flightq.media import split_by_grid, split_tiles

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


def test_a_real_qwen2_vl_image_processors_output_round_trips_per_row(client) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    processor = transformers.Qwen2VLImageProcessor()  # defaults: nothing downloaded
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((320, 480), (96, 128))]
    out = processor(images=images, return_tensors="np")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    n = grid.prod(axis=1).tolist()
    assert grid[0].tolist() == [1, 22, 34] and pixels.shape == (sum(n), 1176)  # 748 + ...
    per_row, keys = [1, 0, 1], ["a_g0", "b_g0", "c_g0"]
    client.create_partition("r", VLM, tasks=["train"])
    ids = [np.arange(5, dtype=np.int64)] * len(keys)
    client.put("r", keys, {"input_ids": ids, **split_by_grid(pixels, grid, per_row)})
    b = client.get("r", keys, ["pixel_values", "image_grid_thw"], as_="numpy")
    assert [len(r) for r in b["pixel_values"]] == per_row  # the text row: no media
    values, offsets = b.column("pixel_values").cat()
    assert np.array_equal(values, pixels) and offsets.tolist() == [0, n[0], n[0], sum(n)]
    assert np.array_equal(np.concatenate([g for r in b["image_grid_thw"] for g in r]), grid)


TILES = [5, 1, 3]  # tiles per image
TILE_ROWS = [2, 0, 1]


def _tiles(rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = sum(TILES)
    return {
        "pixel_values": rng.random((n, 3, 8, 8), dtype=np.float32),
        "imgs_sizes": rng.integers(1, 448, (n, 2)).astype(np.int32),
        "num_frames": np.ones(n, dtype=np.int32),
    }


def test_omni_tiles_split_into_per_image_stacks_and_round_trip(client) -> None:
    t = _tiles(np.random.default_rng(6))
    extra = {"imgs_sizes": t["imgs_sizes"], "num_frames": t["num_frames"]}
    rows = split_tiles(t["pixel_values"], TILES, TILE_ROWS, per_tile=extra)
    assert [[p.shape for p in r] for r in rows["pixel_values"]] == [
        [(5, 3, 8, 8), (1, 3, 8, 8)],
        [],
        [(3, 3, 8, 8)],
    ]
    assert np.shares_memory(rows["pixel_values"][2][0], t["pixel_values"])
    assert [[s.shape for s in r] for r in rows["imgs_sizes"]] == [[(5, 2), (1, 2)], [], [(3, 2)]]
    keys = ["a_g0", "b_g0", "c_g0"]
    client.create_partition("r", VLM, tasks=["train"])
    client.put("r", keys, {"input_ids": [np.arange(4, dtype=np.int64)] * 3, **rows})
    b = client.get("r", keys, ["pixel_values", "imgs_sizes", "num_frames"], as_="numpy")
    for name in ("pixel_values", "imgs_sizes", "num_frames"):
        values, _ = b.column(name).cat()
        assert np.array_equal(values, t[name]), name


def test_tiles_per_image_tensors_of_different_sizes_are_taken_as_given() -> None:
    rng = np.random.default_rng(7)
    images = [
        rng.random((2, 3, 16, 8), dtype=np.float32),
        rng.random((4, 3, 8, 8), dtype=np.float32),
    ]
    rows = split_tiles(images, [2, 4], [1, 1])
    assert rows["pixel_values"][1][0] is images[1]
    with pytest.raises(flightq.ShapeError, match=r"'num_patches' says \[2, 3\]"):
        split_tiles(images, [2, 3])


def test_tile_counts_that_do_not_account_for_the_tiles_name_the_count_field() -> None:
    t = _tiles(np.random.default_rng(8))
    with pytest.raises(flightq.ShapeError, match="'num_tiles' accounts for 8") as e:
        split_tiles(t["pixel_values"], [5, 1, 2], count_field="num_tiles")
    assert e.value.field == "num_tiles"
    with pytest.raises(flightq.ShapeError, match="'imgs_sizes' has 8 tiles"):
        split_tiles(t["pixel_values"], TILES, per_tile={"imgs_sizes": t["imgs_sizes"][:8]})
    with pytest.raises(flightq.ShapeError, match="images_per_row adds up to 2 images"):
        split_tiles(t["pixel_values"], TILES, [1, 1])
