"""Decoding a zstd payload is bounded by the size its shape needs and typed, on the server
(:func:`flightq.validation.validate`) and on the consumer (:mod:`flightq.columns`)."""

from __future__ import annotations

import resource

import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import replace_column, schema_of_fields
from helpers_zstd import BLOCK, header, no_size_frame, relabel, rle_frame

import flightq
from flightq import DecodeError, Field
from flightq.codecs import Zstd
from flightq.columns import TensorColumn, _decoded_base
from flightq.validation import validate

GIB6 = 6 * 2**30
#: A frame past the size decoded in one call (streamed), and a skippable frame of 16 bytes.
_BIG = Zstd().encode(bytes(range(256)) * (2 * BLOCK * 8 // 256))
_SKIPPABLE = (0x184D2A50).to_bytes(4, "little") + (16).to_bytes(4, "little") + bytes(16)
IDS = Field("ids", "int64", "token", (None,), required=True, codec=Zstd())
SCHEMA = schema_of_fields(IDS)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@pytest.mark.parametrize(
    ("frame", "nbytes", "message"),
    [
        (relabel(b"\x01" * 8, 40), 40, r"does not decode to the 40 bytes .*corruption"),
        (relabel(bytes(range(256)) * 512, 40), 40, r"to the 40 bytes .*buffer is too small"),
        (header(40) + bytes(40), 40, r"does not decode to the 40 bytes its frame declares"),
        (Zstd().encode(bytes(40)) + b"x", 40, r"1 bytes of unused data, which is disallowed"),
        (Zstd().encode(b"") + b"x", 0, r"does not decode to the 0 bytes its frame declares"),
        (rle_frame(40, GIB6), 40, r"to the 40 bytes .*buffer is too small"),
        (rle_frame(2 * BLOCK * 8, 2 * BLOCK * 8 - 1), 2 * BLOCK * 8, r"to the 2097152 bytes"),
        (no_size_frame(bytes(40)), 40, r"no content size in its header, the shape needs 40"),
        (Zstd().encode(bytes(48)), 40, r"zstd frame declares 48 bytes, the shape needs 40"),
        (_BIG + _SKIPPABLE, 2 * BLOCK * 8, r"holds 24 bytes after its frame"),
        (_BIG + b"junk", 2 * BLOCK * 8, r"corrupt: it does not decode to the 2097152 bytes"),
        (
            _BIG + Zstd().encode(bytes(8)),
            2 * BLOCK * 8,
            r"bytes or more but its frame declares 2097152",
        ),
    ],
    ids=[
        "short",
        "long",
        "garbage",
        "trailing bytes",
        "trailing bytes after an empty frame",
        "6 GiB bomb",
        "streamed, short",
        "no content size",
        "another size declared",
        "streamed, a skippable frame after it",
        "streamed, junk after it",
        "streamed, a second frame after it",
    ],
)
def test_every_way_to_decode_a_bad_frame_is_a_typed_decode_error(
    frame: bytes, nbytes: int, message: str
) -> None:
    with pytest.raises(DecodeError, match=message) as e:
        Zstd().check(frame, nbytes)
    assert e.value.expected == nbytes
    with pytest.raises(DecodeError, match=message):
        Zstd().decode_into(frame, memoryview(bytearray(nbytes)))
    with pytest.raises(DecodeError, match=message):
        Zstd().decode(frame, nbytes)


def test_checking_a_6_gib_declaration_holds_a_bounded_buffer_not_the_payload() -> None:
    frame = rle_frame(GIB6, GIB6 + BLOCK)
    assert len(frame) < 200 * 1024
    peak = _peak_rss()
    with pytest.raises(DecodeError, match=r"does not decode to the 6442450944 bytes"):
        Zstd().check(frame, GIB6)
    Zstd().check(rle_frame(GIB6, GIB6), GIB6)  # a true 6 GiB frame passes, still bounded
    assert _peak_rss() - peak < 256 * 2**20


@pytest.mark.parametrize("n", [0, 1, 5, 200_000])  # one call, and streamed straight in
def test_a_good_frame_decodes_bit_exactly_into_its_place(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 9, n, dtype=np.int64).tobytes()
    out = bytearray(len(data) + 2)
    Zstd().decode_into(Zstd().encode(data), memoryview(out)[1 : 1 + len(data)])
    assert bytes(out) == b"\x00" + data + b"\x00"
    assert bytes(Zstd().decode(Zstd().encode(data), len(data))) == data


def _lying_batch() -> pa.RecordBatch:
    rb = flightq.encode(SCHEMA, {"ids": [np.arange(5), np.arange(5)]}, ["a", "b"])
    good = rb.column("ids").to_pylist()[0]
    return replace_column(rb, "ids", pa.array([good, rle_frame(40, GIB6)], pa.large_binary()))


def test_the_consumer_refuses_a_bomb_typed_naming_the_row() -> None:
    rb = _lying_batch()
    # As a consumer that trusts its server: the column decodes without validate.
    with pytest.raises(
        DecodeError,
        match=r"column 'ids': zstd payload is corrupt: it does not decode to the 40 bytes its "
        r"frame declares: .*Destination buffer is too small \(row key 'b'\)",
    ) as e:
        TensorColumn(IDS, rb, "numpy", False)
    assert e.value.attributes() == {"field": "ids", "key": "b", "expected": 40}
    with pytest.raises(DecodeError, match=r"\(row key 'b'\)") as e:
        validate(rb)
    assert e.value.attributes() == {"field": "ids", "key": "b", "expected": 40}
    with pytest.raises(DecodeError, match=r"column 'ids': zstd payload .*\(row key 'b'\)"):
        flightq.decode(rb, as_="numpy")


def test_a_column_too_large_to_allocate_is_a_decode_error_not_a_memory_error() -> None:
    payloads = pa.array([Zstd().encode(b"")], pa.large_binary())
    with pytest.raises(
        DecodeError,
        match=r"column 'ids': its shapes need 1125899906842624 decoded bytes, more than this "
        r"process can allocate",
    ):
        _decoded_base(IDS, payloads, [(2**47,)], "numpy")
