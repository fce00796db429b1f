"""Rows of many small puts are served in few record batches, against a real server.

A generator puts one prompt group at a time; a trainer reads many groups at once. Each
stored batch would otherwise be its own record batch in the answer, and each record batch
costs the server and the client a fixed amount of work: the server copies small slices
into one batch instead (up to ``flightq.server.assemble.COALESCED_BYTES``).
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures_dataplane import (  # noqa: F401
    assert_rows_match,
    client_fixture,
    raw,
    server_fixture,
)

import flightq
from flightq import workloads
from flightq.server.assemble import COALESCED_BYTES, SMALL_RUN_BYTES

pytestmark = [pytest.mark.timeout(60), pytest.mark.torch]


def _put_groups(client: flightq.Client, name: str, step: workloads.Step) -> None:
    client.create_partition(name, step.schema, tasks=["train"], group_size=step.group_size)
    for g in range(step.rows // step.group_size):
        part = step.group(g)
        client.put(name, part.keys, part.columns, part.tags)


def test_a_get_of_many_small_puts_arrives_in_few_record_batches(client):
    step = workloads.w3(0, groups=8, g=4)  # 8 puts of well under SMALL_RUN_BYTES each
    _put_groups(client, "text", step)
    batch = client.get("text", step.keys)
    assert step.nbytes() < COALESCED_BYTES
    assert len(batch.parts) == 1
    assert batch.keys == step.keys
    assert_rows_match(batch, step)


def test_a_claim_across_groups_is_coalesced_too(client):
    step = workloads.w3(0, groups=8, g=4)
    _put_groups(client, "text", step)
    batch = client.claim("text", "train", batch_size=16)
    assert len(batch.parts) == 1 and batch.keys == step.keys[:16]
    assert_rows_match(batch, step)


def test_coalesced_media_keeps_each_groups_image_shared_and_separate(client):
    step = workloads.w1(0, groups=4, g=3)
    images = [np.full((2, 3), g, dtype=np.float32) for g in range(4)]  # small images
    step.columns["pixel_values"] = [[images[i // 3]] for i in range(step.rows)]
    step.columns["image_grid_thw"] = [
        [np.array([[1, 2, 3]], dtype=np.int64)] for _ in range(step.rows)
    ]
    _put_groups(client, "vlm", step)
    batch = client.get("vlm", step.keys)
    assert len(batch.parts) == 1
    assert_rows_match(batch, step)
    px = batch["pixel_values"]
    assert px[0][0].data_ptr() == px[2][0].data_ptr() != px[3][0].data_ptr()
    assert len(batch.record_batch.column("pixel_values").values.dictionary) == 4


def test_rows_of_several_puts_with_large_media_come_in_a_batch_per_put_each_image_once(client):
    step = workloads.w1(0, groups=2, g=2)  # one 3.4 MiB image per group
    _put_groups(client, "big", step)
    image = step.columns["pixel_values"][0][0].nbytes
    assert image >= SMALL_RUN_BYTES
    batch = client.get("big", step.keys)
    # Each put's image lies in the dictionary it arrived with, and one dictionary cannot
    # be a view of two: joining the puts' rows would copy both images, so the answer is
    # cut between them (test_shm.py checks that nothing is copied), each image once.
    assert len(batch.parts) == 2
    for got in batch.parts:
        assert len(got.record_batch.column("pixel_values").values.dictionary) == 1
    assert_rows_match(batch, step)


def test_rows_of_several_puts_with_small_media_join_one_batch(client):
    # Copying small images costs less than a record batch more: one batch, as before.
    step = workloads.w1(0, groups=2, g=2)
    step.columns["pixel_values"] = [
        [np.full((64, 64), i // 2, np.float32)] for i in range(step.rows)
    ]
    _put_groups(client, "small", step)
    batch = client.get("small", step.keys)
    assert len(batch.parts) == 1
    assert len(batch.record_batch.column("pixel_values").values.dictionary) == 2
    assert_rows_match(batch, step)


def _short_text(step: workloads.Step, n: int = 8) -> workloads.Step:
    """The step with every per-token field cut to ``n`` tokens (rows of a few bytes)."""
    for name in ("input_ids", "generation_logprobs", "token_mask", "mm_token_type_ids"):
        if name in step.columns:
            step.columns[name] = [x[:n] for x in step.columns[name]]
    if "input_lengths" in step.columns:
        step.columns["input_lengths"] = np.full(step.rows, n, dtype=np.int32)
    return step


@pytest.mark.parametrize("skip_first", [False, True])
def test_coalesced_batches_stay_within_the_servers_batch_size(skip_first):
    limit = 128 * 1024
    step = _short_text(workloads.w1(0, groups=8, g=3), 200)  # ~5.6 KB of text per row
    images = [np.full((96, 80), g, dtype=np.float32) for g in range(8)]  # 30 KiB each
    step.columns["pixel_values"] = [[images[i // 3]] for i in range(step.rows)]
    # Without each group's first row, a slice carries an image its rows' sizes do not
    # count (a shared image counts on the group's first row).
    keys = [k for i, k in enumerate(step.keys) if not (skip_first and i % 3 == 0)]
    with (
        flightq.Server(max_batch_bytes=limit) as srv,
        flightq.connect(srv.location, [step.schema]) as c,
    ):
        _put_groups(c, "vlm", step)
        batch = c.get("vlm", keys)
        assert batch.keys == keys
        assert_rows_match(batch, step)
        parts = batch.parts
        assert 1 < len(parts) < 8  # coalesced, and cut
        for p in parts:
            groups = {k.split("_")[0] for k in p.keys}
            if len(groups) > 1:  # slices of several puts, copied together
                assert p.record_batch.nbytes <= limit, (p.keys, p.record_batch.nbytes)


def test_a_get_of_some_fields_coalesces_by_the_bytes_of_those_fields(client):
    step = workloads.w1(0, groups=4, g=4)  # 3.4 MiB images, small text rows
    _put_groups(client, "vlm", step)
    batch = client.get("vlm", step.keys, fields=["input_ids"])
    assert len(batch.parts) == 1  # the images are not asked for: the text slices merge
    assert [raw(x) for x in batch["input_ids"]] == [raw(x) for x in step.columns["input_ids"]]
