"""The server stores only zstd payloads it has verified: each frame's header declares the
byte length its shape needs and the frame decodes to exactly that, checked with bounded
memory. Frames are crafted by hand and sent with plain ``pyarrow.flight``; each is refused
typed, nothing is stored, and the server keeps serving."""

from __future__ import annotations

import re
import resource
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from fixtures_dataplane import TIMEOUT
from helpers_reliability import partition_state, plain_put, put_command
from helpers_wire import media_array, replace_column, schema_of_fields
from helpers_zstd import BLOCK, header, no_size_frame, relabel, rle_frame

import flightq
from flightq import Field
from flightq.codecs import Zstd

pytestmark = pytest.mark.timeout(120)

SCHEMA = schema_of_fields(
    Field("ids", "int64", "token", (None,), required=True, codec=Zstd()),
    Field("img", "uint8", "media", None, codec=Zstd()),
    name="zstd_checked",
)
SHAPES = pa.list_(pa.int64())
GIB6 = 6 * 2**30


def _batch(keys: list[str]) -> pa.RecordBatch:
    ids = [np.arange(5, dtype=np.int64) + i for i in range(len(keys))]
    img = [[np.full((2, 3), i, np.uint8)] for i in range(len(keys))]
    return flightq.encode(SCHEMA, {"ids": ids, "img": img}, keys)


def _ids(frame: bytes, shape: list[int] | None = None) -> pa.RecordBatch:
    """Two rows; row 'n1' carries ``frame`` as its ids (shape ``shape``, default (5,))."""
    rb = _batch(["n0", "n1"])
    good = rb.column("ids").to_pylist()[0]
    rb = replace_column(rb, "ids", pa.array([good, frame], type=pa.large_binary()))
    if shape is not None:
        rb = replace_column(rb, "ids__shape", pa.array([[5], shape], type=SHAPES))
    return rb


def _img(frame: bytes, shape: list[int]) -> pa.RecordBatch:
    """Two rows; row 'n1' has one image segment of ``shape`` carried by ``frame``."""
    rb = _batch(["n0", "n1"])
    good = Zstd().encode(np.zeros((2, 3), np.uint8).tobytes())
    rb = replace_column(rb, "img", media_array([[good], [frame]]))
    return replace_column(
        rb, "img__shape", pa.array([[[2, 3]], [shape]], type=pa.large_list(SHAPES))
    )


#: (id, the put, error class, message, expected, actual)
CASES: list[tuple[str, Callable[[], pa.RecordBatch], str, str, int, int | None]] = [
    (
        "header says 40 bytes, frame decodes to 8",
        lambda: _ids(relabel(b"\x01" * 8, 40)),
        "DecodeError",
        r"column 'ids': zstd payload is corrupt: it does not decode to the 40 bytes its frame "
        r"declares: .*Data corruption detected \(row key 'n1'\)",
        40,
        None,
    ),
    (
        "header says 40 bytes, frame decodes to 128 KiB",
        lambda: _ids(relabel(bytes(range(256)) * 512, 40)),
        "DecodeError",
        r"column 'ids': zstd payload is corrupt: it does not decode to the 40 bytes its frame "
        r"declares: .*Destination buffer is too small \(row key 'n1'\)",
        40,
        None,
    ),
    (
        "garbage after a valid header",
        lambda: _ids(header(40) + bytes(range(7, 47))),
        "DecodeError",
        r"column 'ids': zstd payload is corrupt: it does not decode to the 40 bytes its frame "
        r"declares: .* \(row key 'n1'\)",
        40,
        None,
    ),
    (
        "bytes after a complete frame",
        lambda: _ids(Zstd().encode(np.arange(5, dtype=np.int64).tobytes()) + b"tail"),
        "DecodeError",
        r"column 'ids': zstd payload .* 4 bytes of unused data, which is disallowed "
        r"\(row key 'n1'\)",
        40,
        None,
    ),
    (
        "a skippable frame after a frame past 1 MiB (decoded as a stream)",
        lambda: _ids(
            Zstd().encode(np.arange(2 * BLOCK, dtype=np.int64).tobytes())
            + (0x184D2A50).to_bytes(4, "little")
            + (16).to_bytes(4, "little")
            + bytes(16),
            [2 * BLOCK],
        ),
        "DecodeError",
        r"column 'ids': zstd payload holds 24 bytes after its frame .*\(row key 'n1'\)",
        16 * BLOCK,
        None,
    ),
    (
        "a frame with no content size in its header",
        lambda: _ids(no_size_frame(np.arange(5, dtype=np.int64).tobytes())),
        "ShapeError",
        r"column 'ids': zstd payload without a readable size \(row key 'n1'\)",
        None,  # type: ignore[list-item]
        None,
    ),
    (
        "a 192 KiB frame that says 40 bytes and expands to 6 GiB",
        lambda: _ids(rle_frame(40, GIB6)),
        "DecodeError",
        r"column 'ids': zstd payload is corrupt: it does not decode to the 40 bytes its frame "
        r"declares: .*Destination buffer is too small \(row key 'n1'\)",
        40,
        None,
    ),
    (
        "a frame whose header and shape say 6 GiB and which expands to more",
        lambda: _ids(rle_frame(GIB6, GIB6 + BLOCK), [GIB6 // 8]),
        "DecodeError",
        r"column 'ids': zstd payload is corrupt: it does not decode to the 6442450944 bytes its "
        r"frame declares: .*Data corruption detected \(row key 'n1'\)",
        GIB6,
        None,
    ),
    (
        "an image segment whose frame decodes short",
        lambda: _img(relabel(b"\x07" * 5, 6), [2, 3]),
        "DecodeError",
        r"column 'img': zstd payload is corrupt: it does not decode to the 6 bytes its frame "
        r"declares: .* \(row key 'n1'\)",
        6,
        None,
    ),
    (
        "an image segment whose frame has no content size in its header",
        lambda: _img(no_size_frame(bytes(6)), [2, 3]),
        "ShapeError",
        r"column 'img': zstd payload without a readable size \(row key 'n1'\)",
        None,  # type: ignore[list-item]
        None,
    ),
    (
        "an image segment of 6 GiB declared that expands to more",
        lambda: _img(rle_frame(GIB6, GIB6 + 1), [GIB6 // 2**15, 2**15]),
        "DecodeError",
        r"column 'img': zstd payload is corrupt: it does not decode to the 6442450944 bytes "
        r"its frame declares: .* \(row key 'n1'\)",
        GIB6,
        None,
    ),
]


@pytest.fixture
def served() -> Iterator[tuple[flightq.Server, flightq.Client]]:
    """A server with partition 'z' of the zstd schema, holding rows k0 and k1."""
    with flightq.Server() as srv:
        with flightq.connect(srv.location, timeout=TIMEOUT) as c:
            c.register_schema(SCHEMA)
        with flightq.connect(srv.location, [SCHEMA], timeout=TIMEOUT) as c:
            c.create_partition("z", SCHEMA)
            c.put_batch("z", _batch(["k0", "k1"]))
            yield srv, c


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@pytest.mark.parametrize(
    ("put", "cls", "message", "expected", "actual"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_zstd_frame_that_breaks_its_shape_is_refused_typed_and_nothing_is_stored(
    served: tuple[flightq.Server, flightq.Client],
    put: Callable[[], pa.RecordBatch],
    cls: str,
    message: str,
    expected: int | None,
    actual: int | None,
) -> None:
    srv, c = served
    before = partition_state(srv.location, "z"), c.stats()["partitions"]["z"]
    rb = put()
    peak = _peak_rss()
    with pytest.raises(fl.FlightError) as e:
        plain_put(srv.location, put_command("z"), [rb])
    grown = _peak_rss() - peak
    info = msgpack.unpackb(e.value.extra_info)
    assert info["type"] == cls
    assert re.search(message, info["message"]), info["message"]
    assert info.get("field") == ("ids" if "'ids'" in message else "img")
    if cls == "DecodeError":
        assert (info.get("key"), info.get("expected"), info.get("actual")) == (
            "n1",
            expected,
            actual,
        )
    # Checking a 6 GiB declaration streams through a bounded buffer, in this process.
    assert grown < 256 * 2**20, f"peak RSS grew by {grown} bytes"
    after = partition_state(srv.location, "z"), c.stats()["partitions"]["z"]
    assert after == before
    # The same refusal through the flightq client, typed; then a good put is stored.
    with pytest.raises(getattr(flightq, cls)):
        c.put_batch("z", rb)
    assert c.put_batch("z", _batch(["g0"])) == 1
    assert c.get("z", ["g0"], as_="numpy")["ids"][0].tolist() == [0, 1, 2, 3, 4]


def test_a_verified_zstd_put_reads_back_bit_exactly(
    served: tuple[flightq.Server, flightq.Client],
) -> None:
    srv, c = served
    ack = plain_put(srv.location, put_command("z"), [_batch(["n0", "n1"])])
    assert ack
    got = c.get("z", ["n1"], as_="numpy")
    assert got["ids"][0].tolist() == [1, 2, 3, 4, 5]
    assert got["img"][0][0].tolist() == [[1, 1, 1], [1, 1, 1]]
