"""Codecs: frozen, described as plain dicts, recorded per field, checked on the way back."""

from __future__ import annotations

import json
from types import ModuleType

import numpy as np
import pyarrow as pa
import pytest
import zstandard
from helpers_wire import assert_same_rows, replace_column, schema_of_fields

import flightq
from flightq import DecodeError, Field, SchemaError, ShapeError
from flightq.codecs import RAW, Raw, Zstd, codec_from_dict
from flightq.layout import binary_offsets
from flightq.validation import validate


def _zstd_schema(level: int = 3) -> flightq.Schema:
    return schema_of_fields(
        Field("ids", "int64", "token", (None,), required=True, codec=Zstd(level)),
        Field("img", "bfloat16", "media", None, codec=Zstd(level)),
        Field("plain", "float32", "token", (None,)),
    )


@pytest.mark.parametrize(
    ("d", "codec"),
    [
        (None, RAW),
        ({"id": "raw"}, RAW),
        ({"id": "zstd"}, Zstd(3)),
        ({"id": "zstd", "level": 9}, Zstd(9)),
    ],
)
def test_codec_is_built_from_its_dict_form(d: dict | None, codec: flightq.codecs.Codec) -> None:
    assert codec_from_dict(d) == codec


@pytest.mark.parametrize("codec", [Raw(), Zstd(), Zstd(-7), Zstd(22)])
def test_codec_dict_form_round_trips(codec: flightq.codecs.Codec) -> None:
    d = codec.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert codec_from_dict(d) == codec


def test_codecs_are_frozen() -> None:
    with pytest.raises(AttributeError, match=r"cannot assign to field 'level'"):
        Zstd(3).level = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"id": "lz4"}, r"unknown codec \{'id': 'lz4'\}; expected \{'id': 'raw'\} or"),
        ({"id": "zstd", "window": 10}, r"unknown codec \{'id': 'zstd', 'window': 10\}"),
        ({"id": "raw", "level": 1}, r"unknown codec \{'id': 'raw', 'level': 1\}"),
        ({"level": 3}, r"codec must be a dict with an 'id', got \{'level': 3\}"),
        ("zstd", r"codec must be a dict with an 'id', got 'zstd'"),
        ({"id": "zstd", "level": 23}, r"zstd level must be an integer in \[-7, 22\], got 23"),
        ({"id": "zstd", "level": "3"}, r"zstd level must be an integer in \[-7, 22\], got '3'"),
    ],
)
def test_bad_codec_dicts_are_schema_errors(d: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        codec_from_dict(d)  # type: ignore[arg-type]


def test_zstd_frame_carries_its_decoded_size() -> None:
    data = np.arange(1000, dtype=np.int64).view(np.uint8)
    frame = Zstd(3).encode(data)
    assert len(frame) < data.nbytes
    assert Zstd().decoded_size(frame) == data.nbytes
    assert bytes(Zstd().decode(frame, data.nbytes)) == data.tobytes()


def test_zstd_refuses_a_frame_whose_size_is_not_the_shapes() -> None:
    frame = Zstd().encode(b"\x00" * 64)
    with pytest.raises(DecodeError, match=r"zstd frame declares 64 bytes, the shape needs 72"):
        Zstd().decode(frame, 72)


def test_zstd_refuses_a_corrupt_frame() -> None:
    frame = bytearray(Zstd().encode(np.arange(64, dtype=np.int64).tobytes()))
    frame[-6:] = b"\xff" * 6
    with pytest.raises(DecodeError, match=r"zstd payload is corrupt: "):
        Zstd().decode(bytes(frame), 512)


def test_zstd_frame_without_a_content_size_has_no_decoded_size() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"abc" * 10)
    assert Zstd().decoded_size(frame) is None
    assert Zstd().decoded_size(b"not zstd") is None


def test_a_scalar_field_takes_no_codec() -> None:
    with pytest.raises(SchemaError, match=r"field 'r': scalars are plain Arrow columns and take"):
        Field("r", "float32", "scalar", (), codec=Zstd())


def test_zstd_fields_round_trip_bit_exactly_and_name_their_codec_in_field_metadata(
    torch: ModuleType,
) -> None:
    schema = _zstd_schema(level=5)
    ids = [torch.arange(300, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None]
    img = [
        [torch.randn(4, 3, 8, 8).to(torch.bfloat16), torch.zeros(0, 2, dtype=torch.bfloat16)],
        [],
        [torch.full((2, 2), 1.5, dtype=torch.bfloat16)],
    ]
    plain = [torch.zeros(300), torch.zeros(0), torch.ones(7)]
    rb = flightq.encode(schema, {"ids": ids, "img": img, "plain": plain}, ["a", "b", "c"])

    zstd5 = json.dumps({"id": "zstd", "level": 5}, sort_keys=True).encode()
    assert rb.schema.field("ids").metadata[b"flightq.codec"] == zstd5
    assert rb.schema.field("img").metadata[b"flightq.codec"] == zstd5
    assert b"flightq.codec" not in rb.schema.field("plain").metadata
    # compressed on the wire: 300 int64s of a ramp take far fewer than 2400 bytes
    assert int(np.diff(binary_offsets(rb.column("ids")))[0]) < 2400

    out = flightq.decode(rb)
    assert_same_rows("token", out["ids"], ids)
    assert_same_rows("media", out["img"], img)
    assert_same_rows("token", out["plain"], plain)


def test_zstd_field_decodes_from_metadata_alone_through_ipc(torch: ModuleType) -> None:
    from helpers_wire import ipc_bytes, read_ipc

    schema = _zstd_schema()
    ids = [torch.arange(50, dtype=torch.int64) * 7]
    rb = read_ipc(ipc_bytes(flightq.encode(schema, {"ids": ids}, ["k"])))
    out = flightq.decode(rb, as_="numpy")
    assert out.schema["ids"].codec == Zstd(3)
    assert out["ids"][0].tolist() == (np.arange(50) * 7).tolist()


def test_zstd_payload_whose_frame_size_breaks_the_shape_is_refused_without_decompressing(
    torch: ModuleType,
) -> None:
    schema = _zstd_schema()
    rb = flightq.encode(schema, {"ids": [torch.arange(4, dtype=torch.int64)]}, ["k7"])
    frame = Zstd().encode(np.arange(3, dtype=np.int64).tobytes())
    bad = pa.array([frame], type=pa.large_binary())
    rb = replace_column(rb, "ids", bad)
    with pytest.raises(
        ShapeError, match=r"column 'ids': shape \(4,\) needs 32 bytes of int64, payload has 24 \("
    ):
        validate(rb)


def test_zstd_payload_without_a_readable_size_is_refused(torch: ModuleType) -> None:
    schema = _zstd_schema()
    rb = flightq.encode(schema, {"ids": [torch.arange(4, dtype=torch.int64)]}, ["k7"])
    rb = replace_column(rb, "ids", pa.array([b"garbage"], type=pa.large_binary()))
    with pytest.raises(
        ShapeError, match=r"column 'ids': zstd payload without a readable size \(row key 'k7'\)"
    ):
        flightq.decode(rb)


def test_codec_metadata_that_disagrees_with_the_carried_schema_is_refused(
    torch: ModuleType,
) -> None:
    schema = _zstd_schema()
    rb = flightq.encode(schema, {"ids": [torch.arange(4, dtype=torch.int64)]}, ["k"])
    i = rb.schema.get_field_index("ids")
    meta = dict(rb.schema.field("ids").metadata)
    meta[b"flightq.codec"] = b'{"id": "zstd", "level": 9}'
    arrow = rb.schema.set(i, rb.schema.field("ids").with_metadata(meta))
    rb = pa.RecordBatch.from_arrays(rb.columns, schema=arrow)
    with pytest.raises(
        DecodeError,
        match=r"column 'ids': codec \{'id': 'zstd', 'level': 9\} differs from the schema's "
        r"\{'id': 'zstd', 'level': 3\}",
    ):
        flightq.decode(rb)


def test_without_zstandard_a_zstd_field_names_the_extra() -> None:
    """zstandard is optional: schemas with zstd fields load, the first payload says what
    to install (run where the import fails: a child process that blocks it)."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["zstandard"] = None  # import zstandard fails from here on
import numpy as np
import flightq
s = flightq.Schema("z", 1, [flightq.Field("x", "uint8", "token", [None], codec=flightq.Zstd())])
try:
    flightq.encode(s, {"x": [np.zeros(8, dtype=np.uint8)]}, ["k"])
except flightq.EncodeError as e:
    assert "pip install 'flightq[zstd]'" in str(e), e
    print("refused")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr


def _coded_rows() -> tuple[flightq.Schema, pa.RecordBatch, list[np.ndarray], list[object]]:
    """Three rows of zstd token, object and media fields, the last row lacking all three;
    the two rows' images are one entry, and the second row has one more."""
    schema = schema_of_fields(
        Field("ids", "int64", "token", (None,), codec=Zstd()),
        Field("log", "uint8", "object", codec=Zstd()),
        Field("img", "float32", "media", None, codec=Zstd()),
    )
    ids = [np.arange(300, dtype=np.int64) * i for i in range(2)]
    logs: list[object] = [[{"role": "user", "content": "word " * 200}], {"n": 1}]
    shared = np.linspace(0, 1, 600, dtype=np.float32).reshape(20, 30)
    img = [[shared], [shared, np.ones((4, 5), np.float32)], None]
    rb = flightq.encode(
        schema, {"ids": [*ids, None], "log": [*logs, None], "img": img}, ["a", "b", "c"]
    )
    return schema, rb, ids, logs


def test_a_read_decodes_each_zstd_frame_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _, rb, ids, logs = _coded_rows()
    decoded: list[int] = []
    real = Zstd._exact

    def counted(self: Zstd, data: object, nbytes: int, *a: object, **kw: object) -> object:
        decoded.append(nbytes)
        return real(self, data, nbytes, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Zstd, "_exact", counted)
    out = flightq.decode(rb, as_="numpy")
    assert len(decoded) == 6  # two rows each of ids and log, two images: checked as decoded
    assert [r.tolist() for r in out["ids"][:2]] == [r.tolist() for r in ids]
    assert out["log"] == [*logs, None]
    assert [[a.shape for a in r] for r in out["img"][:2]] == [[(20, 30)], [(20, 30), (4, 5)]]
    assert out["img"][1][1].tolist() == np.ones((4, 5)).tolist()
    assert len(decoded) == 6  # and not again on access


@pytest.mark.parametrize("field", ["ids", "log", "img"])
def test_a_bad_zstd_frame_fails_the_read_not_a_later_access(field: str) -> None:
    from helpers_wire import media_array

    _, rb, _, _ = _coded_rows()
    if field == "img":  # the second row's own image: its second entry
        entries = rb.column("img").values.dictionary.to_pylist()
        cut = entries[1][: len(entries[1]) // 2]
        col = media_array([[entries[0]], [entries[0], cut], None])
        rb = replace_column(rb, "img", col)
    else:
        frames = rb.column(field).to_pylist()
        cut = frames[1][: len(frames[1]) // 2]
        rb = replace_column(rb, field, pa.array([frames[0], cut, None], type=pa.large_binary()))
    with pytest.raises(DecodeError, match=rf"column '{field}': zstd payload .*\(row key 'b'\)"):
        flightq.decode(rb, as_="numpy")


def test_zstd_encodes_from_several_threads_at_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    schema = _zstd_schema()
    rows = [np.arange(2000, dtype=np.int64) * i for i in range(8)]

    def round_trip(i: int) -> bool:
        ids = [np.roll(r, i) for r in rows]
        rb = flightq.encode(schema, {"ids": ids}, [f"k{j}" for j in range(len(ids))])
        got = flightq.decode(rb, as_="numpy")["ids"]
        return all(np.array_equal(a, b) for a, b in zip(got, ids, strict=True))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, range(64)))


def _frames(n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    raw = [
        np.arange(size // 8, dtype=np.int64).tobytes()[: size - 1] + bytes([i]) for i in range(n)
    ]
    return raw, [Zstd().encode(r) for r in raw]


@pytest.mark.parametrize("cpus", [1, 4])
def test_frames_decode_in_order_into_their_views_on_one_thread_or_several(
    monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    from flightq import codecs

    monkeypatch.setattr(codecs, "_cpus", lambda: cpus)
    raw, frames = _frames(12, 2 << 20)  # 24 MiB: four runs of three frames with 4 CPUs
    out = bytearray(sum(map(len, raw)))
    views = [memoryview(out)[i * len(raw[0]) : (i + 1) * len(raw[0])] for i in range(len(raw))]
    assert codecs.decode_frames(Zstd(), frames, [len(r) for r in raw], views) is None
    assert bytes(out) == b"".join(raw)
    assert codecs.decode_frames(Zstd(), frames, [len(r) for r in raw]) is None  # checked only


@pytest.mark.parametrize("cpus", [1, 4])
def test_the_first_frame_that_fails_is_named_on_one_thread_or_several(
    monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    from flightq import codecs

    monkeypatch.setattr(codecs, "_cpus", lambda: cpus)
    raw, frames = _frames(12, 2 << 20)
    frames[10] = frames[10][: len(frames[10]) // 2]  # in the last run
    frames[4] = frames[4] + b"junk"  # in the second
    sizes = [len(r) for r in raw]
    for out in (None, [memoryview(bytearray(s)) for s in sizes]):
        failed = codecs.decode_frames(Zstd(), frames, sizes, out)
        assert failed is not None and failed[0] == 4
        assert "zstd payload is corrupt" in str(failed[1])


def test_one_frame_of_nearly_all_the_bytes_decodes_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flightq import codecs

    monkeypatch.setattr(codecs, "_cpus", lambda: 4)
    raw = [b"a", b"b", np.arange(2 << 20, dtype=np.int64).tobytes()]  # 16 MiB last
    frames = [Zstd().encode(r) for r in raw]
    out = [memoryview(bytearray(len(r))) for r in raw]
    assert codecs.decode_frames(Zstd(), frames, [len(r) for r in raw], out) is None
    assert [bytes(o) for o in out] == raw
    assert codecs._SPARE._value == codecs._MAX_THREADS  # every helper's place given back


@pytest.mark.parametrize("cpus", [1, 4])
def test_payloads_encode_in_order_on_one_thread_or_several(
    monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    from flightq import codecs

    monkeypatch.setattr(codecs, "_cpus", lambda: cpus)
    raw, frames = _frames(12, 2 << 20)
    got = codecs.encode_frames(Zstd(), [np.frombuffer(r, np.uint8) for r in raw])
    assert [Zstd().decode(g, len(r)) for g, r in zip(got, raw, strict=True)] == raw
    assert got == frames
    assert codecs._SPARE._value == codecs._MAX_THREADS


def test_a_zstd_column_of_many_bytes_encodes_and_reads_back_on_several_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flightq import codecs

    monkeypatch.setattr(codecs, "_cpus", lambda: 4)
    schema = _zstd_schema()
    ids = [np.arange(i, i + 300_000, dtype=np.int64) for i in range(24)]  # 55 MiB
    rb = flightq.encode(schema, {"ids": [*ids, None]}, [f"k{i}" for i in range(25)])
    out = flightq.decode(rb, as_="numpy")["ids"]
    assert all(np.array_equal(a, b) for a, b in zip(out[:24], ids, strict=True))
    assert out[24] is None
