"""Puts are cut into record batches of bounded size, never splitting shared media."""

from __future__ import annotations

import numpy as np
import torch
from helpers_wire import assert_same_rows, shipped

import flightq
from flightq import workloads
from flightq.batch import encode_chunks, row_nbytes, split_batch

VLM = "rollout_vlm@1"


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


def test_chunks_of_distinct_rows_stay_under_the_limit() -> None:
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
