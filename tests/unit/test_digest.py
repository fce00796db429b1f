"""Media digests: the hash, the hint, the per-tensor cache, what an encoded batch claims, W5."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest

import flightq
from flightq import workloads
from flightq.digest import (
    BATCH_KEY,
    HASHES,
    DigestCache,
    KnownMedia,
    MediaRefs,
    digest_of,
    hashed_bytes,
    hint_of,
    parse_claims,
    split_claims,
)
from flightq.errors import ProtocolError

VLM = flightq.SchemaRegistry.default().get("rollout_vlm@1")


def _row(image: np.ndarray) -> dict:
    return {
        "input_ids": [np.arange(4)],
        "generation_logprobs": [np.zeros(4, dtype=np.float32)],
        "token_mask": [np.ones(4, dtype=np.int64)],
        "input_lengths": np.array([4], dtype=np.int32),
        "pixel_values": [[image]],
    }


def test_blake3_is_the_hash_and_blake2b_stands_in_with_its_own_name():
    data = np.arange(1000, dtype=np.float32)
    import blake3

    assert digest_of(data) == blake3.blake3(data.tobytes()).digest()
    assert digest_of(data, "blake2b") == hashlib.blake2b(data.tobytes(), digest_size=32).digest()
    assert set(HASHES) == {"blake3", "blake2b"}


def test_a_cached_digest_needs_the_same_unchanged_object():
    cache = DigestCache()
    ro = np.arange(10, dtype=np.float32)
    ro.flags.writeable = False
    cache.put(ro, "raw", b"h" * 12, None)  # the hint first, the digest when needed
    assert cache.get(ro, "raw") == (b"h" * 12, None)
    cache.put(ro, "raw", b"h" * 12, b"d" * 32)
    assert cache.get(ro, "raw") == (b"h" * 12, b"d" * 32)
    assert cache.get(ro, "zstd") is None  # another codec, another payload
    assert cache.get(ro.copy(), "raw") is None
    rw = np.arange(10, dtype=np.float32)
    cache.put(rw, "raw", b"h" * 12, b"e" * 32)  # a writable array may change unseen: never cached
    assert cache.get(rw, "raw") is None


@pytest.mark.torch
def test_an_in_place_change_of_a_torch_tensor_misses_the_cache():
    import torch

    cache = DigestCache()
    t = torch.arange(10, dtype=torch.float32)
    cache.put(t, "raw", b"h" * 12, b"d" * 32)
    assert cache.get(t, "raw") == (b"h" * 12, b"d" * 32)
    t.add_(1)
    assert cache.get(t, "raw") is None


def test_an_entry_goes_with_its_tensor():
    cache = DigestCache()
    ro = np.arange(10, dtype=np.float32)
    ro.flags.writeable = False
    cache.put(ro, "raw", b"h" * 12, b"d" * 32)
    del ro
    assert len(cache) == 0  # the weak reference let it go


def test_a_hint_is_cheap_samples_and_equal_for_equal_bytes():
    rng = np.random.default_rng(0)
    img = rng.standard_normal((64, 1176), dtype=np.float32)
    before = hashed_bytes()
    h = hint_of(img)
    assert hashed_bytes() == before  # a hint hashes nothing
    assert len(h) == 12 and h == hint_of(img.copy()) and h != hint_of(img[:32])
    other = img.copy()
    other[0, 0] += 1  # inside the first sample
    assert hint_of(other) != h
    other = img.copy()
    other.view(np.uint8).reshape(-1)[10_000] ^= 1  # between samples: a look-alike
    assert hint_of(other) == h
    small = np.arange(10, dtype=np.uint8)
    assert hint_of(small) != hint_of(small[::-1].copy())  # small payloads: all bytes


def test_new_images_are_sent_bare_and_unhashed_equal_ones_of_a_put_once():
    img = np.random.default_rng(0).standard_normal((4, 6), dtype=np.float32)
    refs = MediaRefs()
    before = hashed_bytes()
    rb = flightq.encode(VLM, _row(img), ["a"], media=refs)
    assert hashed_bytes() == before
    assert BATCH_KEY not in (rb.schema.metadata or {})  # nothing to claim
    assert refs.sent == {("pixel_values", hint_of(img), (4, 6))}
    # Copies in one put: their hints agree, so they are hashed and go as one entry.
    copies = [img.copy() for _ in range(3)]
    cols = {k: v * 3 if isinstance(v, list) else np.repeat(v, 3) for k, v in _row(img).items()}
    cols["pixel_values"] = [[c] for c in copies]
    rb = flightq.encode(VLM, cols, ["a", "b", "c"], media=MediaRefs())
    assert len(rb.column("pixel_values").values.dictionary) == 1
    assert BATCH_KEY not in (rb.schema.metadata or {})


def test_media_sent_before_go_as_references_and_a_put_sent_again_claims_digests():
    img = np.random.default_rng(0).standard_normal((4, 6), dtype=np.float32)
    refs = MediaRefs()
    flightq.encode(VLM, _row(img), ["a"], media=refs)
    known = KnownMedia()
    known.update(refs.sent)
    again = MediaRefs(refs.cache, known)
    rb = flightq.encode(VLM, _row(img.copy()), ["d"], media=again)
    assert rb.column("pixel_values").values.dictionary[0].as_py() == b""
    assert again.references == 1
    schema, claims = split_claims(rb.schema)
    assert BATCH_KEY not in (schema.metadata or {})
    hash, fields = parse_claims(claims.to_pybytes(), "put")
    assert (hash, fields["pixel_values"]) == ("blake3", [digest_of(img) + hint_of(img)])
    # Sent again after MediaUnknownError: every payload, its digest beside it.
    rb = flightq.encode(VLM, _row(img.copy()), ["e"], media=MediaRefs(claim=True))
    assert len(rb.column("pixel_values").values.dictionary[0].as_py()) == img.nbytes
    _, claims = split_claims(rb.schema)
    assert parse_claims(claims.to_pybytes(), "put")[1]["pixel_values"] == [digest_of(img)]
    # Decoded without the server, an empty entry is no image: the server resolves it.
    assert flightq.encode(VLM, _row(img), ["e"]).schema.metadata.get(BATCH_KEY) is None


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb({"hash": "blake3", "fields": {"x": [b"short"]}}),
        msgpack.packb({"hash": "blake3", "fields": {"x": [b"d" * 40]}}),
        msgpack.packb({"hash": 3, "fields": {}}),
    ],
)
def test_malformed_claims_are_a_protocol_error(raw):
    with pytest.raises(ProtocolError, match="media claims are malformed"):
        parse_claims(raw, "put to 'p'")


def test_the_known_media_are_bounded():
    known = KnownMedia(max_entries=2)
    known.update([("f", bytes([i]) * 32, (1,)) for i in range(3)])
    assert len(known) == 2 and ("f", bytes([0]) * 32, (1,)) not in known


def test_w5_streams_every_row_once_from_two_writers_split_by_group():
    for copies in (False, True):
        step = workloads.make("W5-copies" if copies else "W5")
        assert step.rows == 128 and len(step.streams) == 2
        assert sorted(step.streams[0] + step.streams[1]) == list(range(128))
        for w, rows in enumerate(step.streams):
            assert {i // 16 % 2 for i in rows} == {w}
        assert step.streams[0] != sorted(step.streams[0])  # interleaved, seeded
        px = step.columns["pixel_values"]
        assert (px[0][0] is px[1][0]) is not copies
        assert np.array_equal(px[0][0], px[15][0]) and not px[0][0].flags.writeable
        assert step.nbytes(distinct_media=True) == workloads.w1(0).nbytes(distinct_media=True)
