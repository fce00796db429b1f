"""Image-processor output split into per-row media segments.

Two layouts: Qwen2-VL-style patches with one grid per image (:func:`split_by_grid`), and
Omni-style tiles with a tile count per image (:func:`split_tiles`).

A Qwen2-VL-style image processor returns the patches of every image of a batch
concatenated, ``pixel_values`` of shape ``(sum(t * h * w), C)``, and one grid per image,
``image_grid_thw`` of shape ``(n_images, 3)``. flightq stores media per row, one segment
per image: :func:`split_by_grid` cuts the processor's output into those segments, as views
(no copy), and groups them by row.

Examples
--------
>>> import numpy as np
>>> from flightq.media import split_by_grid
>>> grid = np.array([[1, 2, 2], [1, 2, 3], [1, 1, 2]])  # 4 + 6 + 2 patches
>>> pixels = np.zeros((12, 1176), dtype=np.float32)
>>> rows = split_by_grid(pixels, grid, images_per_row=[2, 0, 1])
>>> [[p.shape for p in r] for r in rows["pixel_values"]]
[[(4, 1176), (6, 1176)], [], [(2, 1176)]]
>>> [[g.tolist() for g in r] for r in rows["image_grid_thw"]]
[[[[1, 2, 2]], [[1, 2, 3]]], [], [[[1, 1, 2]]]]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ShapeError

__all__ = ["split_by_grid", "split_tiles"]


def _ints(x: Any) -> np.ndarray:
    a = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    return a.astype(np.int64, copy=False)


def split_by_grid(
    pixel_values: Any,
    image_grid_thw: Any,
    images_per_row: Sequence[int] | None = None,
    *,
    pixel_field: str = "pixel_values",
    grid_field: str = "image_grid_thw",
) -> dict[str, list[list[Any]]]:
    """Per-row media segments from a processor's concatenated output.

    Parameters
    ----------
    pixel_values:
        ``(sum over images of t * h * w, C)``: every image's patches, image after image
        (torch or numpy).
    image_grid_thw:
        ``(n_images, 3)``: each image's ``(t, h, w)`` grid.
    images_per_row:
        How many images each row holds, in order (``0`` for a text row); ``None``: one
        image per row.
    pixel_field, grid_field:
        The names of the two fields in the result (``pixel_values_videos`` and
        ``video_grid_thw`` for videos).

    Returns
    -------
    dict
        ``{pixel_field: rows, grid_field: rows}``, each a list with one list per row of
        one segment per image: its patches ``(t * h * w, C)`` and its grid ``(1, 3)``,
        both views of the inputs. Pass it as the put's media columns.

    Raises
    ------
    ShapeError
        Naming ``image_grid_thw`` when the grids do not account for every patch, or
        ``images_per_row`` does not add up to the number of grids.
    """
    grid = _ints(image_grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ShapeError(
            f"{grid_field!r}: expected shape (n_images, 3), got {tuple(grid.shape)}",
            field=grid_field,
            expected=["n_images", 3],
            actual=list(grid.shape),
        )
    patches = grid.prod(axis=1)
    n_patches = int(pixel_values.shape[0]) if len(pixel_values.shape) else 0
    if int(patches.sum()) != n_patches:
        raise ShapeError(
            f"{pixel_field!r} has {n_patches} patches but {grid_field!r} accounts for "
            f"{int(patches.sum())} (the sum of t*h*w over its {len(grid)} images): pass the "
            "grids of exactly these images, in the same order",
            field=grid_field,
            expected=n_patches,
            actual=int(patches.sum()),
        )
    counts = [1] * len(grid) if images_per_row is None else [int(c) for c in images_per_row]
    if any(c < 0 for c in counts) or sum(counts) != len(grid):
        raise ShapeError(
            f"images_per_row adds up to {sum(counts)} images, {grid_field!r} has {len(grid)}",
            field=grid_field,
            expected=len(grid),
            actual=sum(counts),
        )
    starts = np.zeros(len(patches) + 1, dtype=np.int64)
    np.cumsum(patches, out=starts[1:])
    segs = [pixel_values[int(a) : int(b)] for a, b in itertools.pairwise(starts.tolist())]
    grids = [image_grid_thw[i : i + 1] for i in range(len(grid))]
    pix_rows: list[list[Any]] = []
    grid_rows: list[list[Any]] = []
    j = 0
    for c in counts:
        pix_rows.append(segs[j : j + c])
        grid_rows.append(grids[j : j + c])
        j += c
    return {pixel_field: pix_rows, grid_field: grid_rows}


def split_tiles(
    pixel_values: Any,
    tiles_per_image: Any,
    images_per_row: Sequence[int] | None = None,
    *,
    per_tile: dict[str, Any] | None = None,
    pixel_field: str = "pixel_values",
    count_field: str = "num_patches",
) -> dict[str, list[list[Any]]]:
    """Per-row tile stacks from an Omni-style (tiling) processor's output.

    Such a processor cuts each image into ``t`` tiles and returns the tiles of every
    image concatenated, ``pixel_values`` of shape ``(sum(t), 3, H, W)``, with one tile
    count per image (``num_patches``, ``num_tiles``). flightq stores one segment per
    image, its tile stack ``[t, 3, H, W]``; where tile sizes differ between images the
    processor gives one tensor per image, which is accepted too (then the counts are
    checked against them).

    Parameters
    ----------
    pixel_values:
        ``(sum over images of t, 3, H, W)`` (torch or numpy), or a list with one
        ``(t, 3, H, W)`` tensor per image.
    tiles_per_image:
        ``(n_images,)``: each image's tile count, in order.
    images_per_row:
        How many images each row holds (``0`` for a text row); ``None``: one per row.
    per_tile:
        Other per-tile arrays to split the same way, by field name, each with one entry
        (first dim) per tile: ``{"imgs_sizes": sizes, "num_frames": frames}``.
    pixel_field, count_field:
        The pixel field's name in the result, and the counts' name in error messages.

    Returns
    -------
    dict
        ``{pixel_field: rows, **{name: rows for name in per_tile}}``, each a list with
        one list per row of one segment per image, views of the inputs. Pass it as the
        put's media columns.

    Raises
    ------
    ShapeError
        Naming ``count_field`` when the counts do not account for every tile (of
        ``pixel_values`` or of a ``per_tile`` array), or ``images_per_row`` does not add
        up to the number of images.

    Examples
    --------
    >>> import numpy as np
    >>> tiles = np.zeros((7, 3, 4, 4), dtype=np.float32)  # 5 tiles, then 2
    >>> rows = split_tiles(tiles, [5, 2], [1, 0, 1], per_tile={"num_frames": np.ones(7)})
    >>> [[p.shape for p in r] for r in rows["pixel_values"]]
    [[(5, 3, 4, 4)], [], [(2, 3, 4, 4)]]
    >>> [[f.shape for f in r] for r in rows["num_frames"]]
    [[(5,)], [], [(2,)]]
    """
    counts = _ints(tiles_per_image).reshape(-1)
    if (counts < 0).any():
        raise ShapeError(
            f"{count_field!r}: tile counts must be >= 0, got {counts.tolist()}",
            field=count_field,
        )
    if isinstance(pixel_values, (list, tuple)):
        got = [int(x.shape[0]) for x in pixel_values]
        if got != counts.tolist():
            raise ShapeError(
                f"{pixel_field!r} holds {len(got)} images of {got} tiles but {count_field!r} "
                f"says {counts.tolist()}: pass the counts of exactly these images, in order",
                field=count_field,
                expected=got,
                actual=counts.tolist(),
            )
        segs = list(pixel_values)
    else:
        segs = _cut(pixel_values, counts, pixel_field, count_field)
    out = {pixel_field: segs}
    for name, values in (per_tile or {}).items():
        out[name] = _cut(values, counts, name, count_field)
    per_row = [1] * len(counts) if images_per_row is None else [int(c) for c in images_per_row]
    if any(c < 0 for c in per_row) or sum(per_row) != len(counts):
        raise ShapeError(
            f"images_per_row adds up to {sum(per_row)} images, {count_field!r} has {len(counts)}",
            field=count_field,
            expected=len(counts),
            actual=sum(per_row),
        )
    rows: dict[str, list[list[Any]]] = {name: [] for name in out}
    j = 0
    for c in per_row:
        for name, segments in out.items():
            rows[name].append(segments[j : j + c])
        j += c
    return rows


def _cut(values: Any, counts: np.ndarray, name: str, count_field: str) -> list[Any]:
    """``values`` cut along its first dim into consecutive pieces of ``counts``, as views."""
    n = int(values.shape[0]) if len(values.shape) else 0
    if int(counts.sum()) != n:
        raise ShapeError(
            f"{name!r} has {n} tiles but {count_field!r} accounts for {int(counts.sum())} "
            f"(the sum over its {len(counts)} images): pass the counts of exactly these "
            "images, in the same order",
            field=count_field,
            expected=n,
            actual=int(counts.sum()),
        )
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return [values[int(a) : int(b)] for a, b in itertools.pairwise(starts.tolist())]
