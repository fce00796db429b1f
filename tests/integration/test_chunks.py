"""Puts are cut into record batches of bounded size, never splitting shared media."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, overload

import numpy as np
import pytest
from helpers_wire import assert_same_rows, shipped

import flightq
from flightq import workloads
from flightq.batch import encode_chunks, row_nbytes, split_batch

if TYPE_CHECKING:
    import torch

VLM = "rollout_vlm@1"


@pytest.mark.torch
def test_chunks_keep_a_groups_shared_image_in_one_batch() -> None:
    step = workloads.w1(groups=3, g=4)
    batches = encode_chunks(shipped(VLM), step.columns, step.keys, step.tags, max_bytes=4 * 2**20)
    # each group is one image (3.4 MiB) plus text: one group per batch, one entry each
    assert [b.num_rows for b in batches] == [4, 4, 4]
    assert [len(b.column("pixel_values").values.dictionary) for b in batches] == [1, 1, 1]
    out = flightq.decode(batches)
    assert out.keys == step.keys
    assert_same_rows("media", out["pixel_values"], step.columns["pixel_values"])


def test_a_split_counts_a_shared_image_once_so_a_group_stays_in_one_batch() -> None:
    step = workloads.w1(groups=3, g=16)  # 16 views of a 3.4 MiB image per group
    (batch,) = encode_chunks(shipped(VLM), step.columns, step.keys, step.tags, max_bytes=2**30)
    # 54 MiB if every row counted the image, 3.4 MiB plus text per group counted once
    assert [b.num_rows for b in split_batch(batch, 8 * 2**20)] == [32, 16]
    sizes = row_nbytes(batch)
    image = step.columns["pixel_values"][0][0].nbytes
    assert sizes[0] > image and sizes[1:16].max() < image  # the group's first row pays


def test_chunks_of_distinct_rows_stay_under_the_limit(torch: ModuleType) -> None:
    step = workloads.w2(groups=1, g=8)
    limit = 16 * 2**20
    batches = encode_chunks(shipped(VLM), step.columns, step.keys, step.tags, max_bytes=limit)
    assert len(batches) > 1 and sum(b.num_rows for b in batches) == 8
    for b in batches:
        assert b.num_rows == 1 or b.nbytes <= limit + 2**20
    out = flightq.decode(batches)
    assert out.keys == step.keys
    assert_same_rows("media", out["pixel_values"], step.columns["pixel_values"])
    assert torch.equal(out["total_reward"], torch.from_numpy(step.columns["total_reward"]))


def test_a_chunked_put_lands_whole_and_reads_back_bit_exact() -> None:
    step = workloads.w2(groups=2, g=8)
    with flightq.Server() as srv, flightq.connect(srv.location, max_batch_bytes=8 * 2**20) as c:
        c.create_partition("p", VLM, tasks=["train"], group_size=8)
        assert c.put("p", step.keys, step.columns, step.tags) == 16
        b = c.claim("p", "train", 16, as_="numpy")
        assert b.keys == step.keys
        for name, want in step.columns.items():
            if isinstance(want, np.ndarray):
                assert np.array_equal(b[name], want)
            else:
                role = shipped(VLM)[name].role
                assert_same_rows(role, b[name], want)


class _FreshViews:
    """A media column whose rows are built on access: each row's image is a new view of
    its group's image, which dies once the caller lets it go."""

    def __init__(self, images: list[torch.Tensor], g: int, n: int) -> None:
        self.images, self.g, self.n = images, g, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[torch.Tensor]:
        if i >= self.n:
            raise IndexError(i)
        image = self.images[i // self.g]
        return [image.view(image.shape)]


def test_views_built_on_access_are_matched_by_memory(torch: ModuleType) -> None:
    # Shared images are found by memory (and remembered per object while the rows are
    # held): a group's fresh views are one entry, and no view is taken for another's.
    step = workloads.w1(groups=3, g=4)
    images = [torch.full((748, 1176), float(k)) for k in range(3)]
    cols = {**step.columns, "pixel_values": _FreshViews(images, 4, len(step.keys))}
    for limit in (2**30, 4 * 2**20):
        batches = encode_chunks(shipped(VLM), cols, step.keys, step.tags, max_bytes=limit)
        out = flightq.decode(batches)
        got = [float(r[0][0, 0]) for r in out["pixel_values"]]
        assert got == [float(i // 4) for i in range(len(step.keys))], limit
        assert sum(len(b.column("pixel_values").values.dictionary) for b in batches) == 3
        if limit < 2**30:  # one group per batch: each row's image counted where it is new
            assert [b.num_rows for b in batches] == [4, 4, 4]


class _LazyRow(Sequence[np.ndarray]):
    """A media row whose segments are built on access: a fresh view each time."""

    def __init__(self, images: list[np.ndarray]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    @overload
    def __getitem__(self, j: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, j: slice) -> list[np.ndarray]: ...
    def __getitem__(self, j: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(j, slice):
            return [x[:] for x in self.images[j]]
        return self.images[j][:]


@pytest.mark.torch
def test_segments_built_on_access_keep_their_own_images() -> None:
    # A segment seen earlier is remembered by object and held for the call: a later
    # segment's fresh view, at a recycled id, is never taken for it.
    step = workloads.w1(groups=1, g=4)
    for segs in (1, 3):
        pool = [np.full((2, 1176), float(k), np.float32) for k in range(4 * segs)]
        want = [[i * segs + j for j in range(segs)] for i in range(4)]
        want[3] = want[2]  # a row sharing the previous row's images
        cols = {k: v for k, v in step.columns.items() if k != "image_grid_thw"}
        cols["pixel_values"] = [_LazyRow([pool[t] for t in idx]) for idx in want]
        (b,) = encode_chunks(shipped(VLM), cols, step.keys, None, max_bytes=2**30)
        got = [[int(s[0, 0]) for s in r] for r in flightq.decode(b)["pixel_values"]]
        assert got == want, segs
        assert len(b.column("pixel_values").values.dictionary) == 3 * segs


def test_two_media_columns_built_on_access_are_each_counted_for_the_cut(torch: ModuleType) -> None:
    # Rows are sized before the put is cut: the second column's fresh views must not pass
    # for the first column's (already counted) images, or batches outgrow the limit.
    n = 8
    step = workloads.w1(groups=1, g=n)
    a = [torch.full((200, 1176), float(k)) for k in range(n)]  # 0.9 MiB each, unshared
    v = [torch.full((200, 1176), -float(k)) for k in range(n)]
    cols = {k: c for k, c in step.columns.items() if k not in ("pixel_values", "image_grid_thw")}
    cols["pixel_values"] = _FreshViews(a, 1, n)
    cols["pixel_values_videos"] = _FreshViews(v, 1, n)
    limit = 4 * 2**20
    batches = encode_chunks(shipped(VLM), cols, step.keys, None, max_bytes=limit)
    assert [b.num_rows for b in batches] == [2, 2, 2, 2]
    assert all(b.nbytes <= limit for b in batches)
    out = flightq.decode(batches)
    assert [float(r[0][0, 0]) for r in out["pixel_values_videos"]] == [-float(k) for k in range(n)]
