"""encode/decode: workload round trips, zero-copy views, the Batch surface, and refusals."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import (
    LIBS,
    OUTPUTS,
    as_lib,
    assert_same_column,
    assert_same_rows,
    assert_same_tensor,
    buffer_span,
    drop_column,
    ipc_bytes,
    media_array,
    read_ipc,
    replace_column,
    schema_of_fields,
    shipped,
    tensor_span,
)

import flightq
from flightq import (
    DecodeError,
    DTypeError,
    EncodeError,
    Field,
    MissingFieldError,
    SchemaMismatchError,
    ShapeError,
    UndeclaredFieldError,
    workloads,
)
from flightq.batch import PartDecoder, join, split_batch
from flightq.layout import binary_offsets
from flightq.validation import shape_products, validate

TEXT = "rollout_text@1"
VLM = "rollout_vlm@1"


def _round_trip(schema: flightq.Schema, columns: dict[str, Any], keys: list[str], **kw: Any):
    """Encode, send through an Arrow IPC stream, decode."""
    rb = flightq.encode(schema, columns, keys)
    return flightq.decode(read_ipc(ipc_bytes(rb)), **kw)


def _assert_step(step: workloads.Step, out: flightq.Batch) -> None:
    schema = shipped(step.schema)
    assert out.schema == schema
    assert out.keys == step.keys
    assert out.tags == step.tags
    assert out.fields == [f.name for f in schema if f.name in step.columns]
    for name, want in step.columns.items():
        assert_same_column(schema, name, out[name], want)


# --------------------------------------------------------------------------- workloads


@pytest.fixture(scope="module")
def w1(torch: ModuleType) -> tuple[workloads.Step, pa.RecordBatch]:
    """W1 as torch tensors, encoded (asking for ``torch`` marks the tests that use it)."""
    step = workloads.to_torch(workloads.make("W1"))
    return step, flightq.encode(shipped(step.schema), step.columns, step.keys, step.tags)


def test_w1_round_trips_bit_exactly(w1: tuple[workloads.Step, pa.RecordBatch]) -> None:
    step, rb = w1
    assert rb.num_rows == 128
    _assert_step(step, flightq.decode(rb))


def test_w1_bf16_round_trips_bit_exactly_with_bfloat16_pixels(torch: ModuleType) -> None:
    step = workloads.to_torch(workloads.make("W1-bf16"))
    rb = flightq.encode(shipped(step.schema), step.columns, step.keys, step.tags)
    out = flightq.decode(rb)
    assert out["pixel_values"][0][0].dtype == torch.bfloat16
    assert out["pixel_values"][0][0].shape == (748, 1176)
    _assert_step(step, out)


@pytest.mark.torch
def test_w2_tiles_round_trip_bit_exactly_through_ipc() -> None:
    step = workloads.to_torch(workloads.w2(groups=2))
    rb = flightq.encode(shipped(step.schema), step.columns, step.keys, step.tags)
    out = flightq.decode(read_ipc(ipc_bytes(rb)))
    assert {len(r) for r in out["pixel_values"]} >= {0, 1}
    assert any(seg.dim() == 4 for row in out["pixel_values"] for seg in row)
    _assert_step(step, out)


def test_w2_numpy_inputs_round_trip_to_numpy() -> None:
    step = workloads.w2(groups=1)
    out = _round_trip(shipped(step.schema), step.columns, step.keys, as_="numpy")
    for name, want in step.columns.items():
        assert_same_column(shipped(step.schema), name, out[name], want)


@pytest.mark.torch
def test_w3_round_trips_bit_exactly() -> None:
    step = workloads.to_torch(workloads.make("W3"))
    rb = flightq.encode(shipped(step.schema), step.columns, step.keys, step.tags)
    assert rb.num_rows == 512
    _assert_step(step, flightq.decode(rb))


@pytest.mark.torch
def test_w3_write_back_of_prev_logprobs_is_a_batch_of_that_field_alone() -> None:
    step = workloads.w3(groups=1)
    prev = workloads.logprobs_for(step)
    out = _round_trip(shipped(TEXT), {"prev_logprobs": prev}, step.keys)
    assert out.fields == ["prev_logprobs"]
    assert_same_rows("token", out["prev_logprobs"], prev)


# --------------------------------------------------------------------------- zero copy


def _assert_views_into(col: pa.Array, rows: list[Any], media: bool) -> int:
    """Every tensor lies at its payload's offset in the column's data buffer; returns count."""
    if media:
        # Segments index a dictionary of distinct payloads; a shared one is one entry.
        data = col.values.dictionary.buffers()[2]
        offsets = binary_offsets(col.values.dictionary)
        entry = col.values.indices.to_numpy()
        tensors = [seg for row in rows for seg in row]
    else:
        data = col.buffers()[2]
        offsets = binary_offsets(col)
        entry = np.arange(len(rows))
        tensors = rows
    lo, hi = buffer_span(data)
    for j, t in enumerate(tensors):
        e = int(entry[j])
        start, stop = tensor_span(t)
        assert lo <= start <= stop <= hi
        assert start == lo + int(offsets[e])
        assert stop - start == int(offsets[e + 1] - offsets[e])
    return len(tensors)


def test_decoding_w1_copies_no_tensor_bytes(w1: tuple[workloads.Step, pa.RecordBatch]) -> None:
    _, rb = w1
    out = flightq.decode(rb)
    seen = 0
    for name in out.fields:
        f = out.schema[name]
        if f.role == "scalar":
            continue
        seen += _assert_views_into(rb.column(name), out[name], media=f.role == "media")
    assert seen == 4 * 128 + 2 * 128  # four token fields, two media fields of one segment
    # The 16 rows of a group carry one image: one dictionary entry, 16 views of it.
    assert len(rb.column("pixel_values").values.dictionary) == 8
    px = out["pixel_values"]
    assert all(px[i][0].data_ptr() == px[16 * (i // 16)][0].data_ptr() for i in range(128))
    assert len({px[i][0].data_ptr() for i in range(128)}) == 8


@pytest.mark.torch
def test_decoding_a_received_stream_views_the_received_buffer() -> None:
    step = workloads.to_torch(workloads.w1(groups=1, g=2))
    wire = pa.py_buffer(ipc_bytes(flightq.encode(shipped(VLM), step.columns, step.keys)))
    rb = read_ipc(wire)
    out = flightq.decode(rb)
    lo, hi = buffer_span(wire)
    for name in ("input_ids", "generation_logprobs"):
        _assert_views_into(rb.column(name), out[name], media=False)
    _assert_views_into(rb.column("pixel_values"), out["pixel_values"], media=True)
    px = out["pixel_values"][1][0]
    assert lo <= tensor_span(px)[0] < tensor_span(px)[1] <= hi
    reward = out.column("total_reward").tensor()
    assert lo <= tensor_span(reward)[0] < tensor_span(reward)[1] <= hi


@pytest.mark.torch
def test_decode_copy_gives_writable_independent_tensors() -> None:
    step = workloads.to_torch(workloads.w1(groups=1, g=2))
    rb = read_ipc(ipc_bytes(flightq.encode(shipped(VLM), step.columns, step.keys)))
    data = rb.column("pixel_values").values.dictionary.buffers()[2]
    lo, hi = buffer_span(data)
    out = flightq.decode(rb, copy=True)
    px = out["pixel_values"][0][0]
    assert not lo <= px.data_ptr() < hi
    px.fill_(7.0)  # would fault on the read-only received buffer
    ids = out["input_ids"][0]
    ids[0] = -1
    again = flightq.decode(rb)
    assert_same_tensor(again["pixel_values"][0][0], step.columns["pixel_values"][0][0])
    assert again["input_ids"][0][0] == step.columns["input_ids"][0][0]


def test_numpy_views_are_read_only_and_copies_writable() -> None:
    schema = shipped(TEXT)
    cols = {"input_ids": [np.arange(5)], "total_reward": np.array([0.5], dtype=np.float32)}
    rb = flightq.encode(schema, cols, ["k"])
    view = flightq.decode(rb, as_="numpy")
    assert not view["input_ids"][0].flags.writeable
    assert not view["total_reward"].flags.writeable
    copied = flightq.decode(rb, as_="numpy", copy=True)
    assert copied["input_ids"][0].flags.writeable and copied["total_reward"].flags.writeable
    assert not np.shares_memory(copied["input_ids"][0], view["input_ids"][0])


# --------------------------------------------------------------------------- layout


BOUNDARY_SHAPES = {
    "scalar-like ()": (),
    "empty (0,)": (0,),
    "empty rows (0, 3)": (0, 3),
    "vector (N,)": (7,),
    "column (N, 1)": (7, 1),
    "rank-4 tiles": (4, 3, 16, 16),
    "large HxWxC": (1080, 1920, 3),
}


@pytest.mark.parametrize("shape", BOUNDARY_SHAPES.values(), ids=BOUNDARY_SHAPES.keys())
@pytest.mark.parametrize("lib", LIBS)
def test_boundary_shapes_round_trip_exactly_as_tensor_and_media(
    shape: tuple[int, ...], lib: str
) -> None:
    schema = schema_of_fields(
        Field("t", "uint8", "tensor", tuple(None for _ in shape)),
        Field("m", "uint8", "media", None),
    )
    rng = np.random.default_rng(len(shape))
    x = as_lib(rng.integers(0, 256, size=shape, dtype=np.uint8), lib)
    out = _round_trip(schema, {"t": [x, None], "m": [[x, x], []]}, ["a", "b"], as_=lib)
    assert_same_rows("tensor", out["t"], [x, None])
    assert_same_rows("media", out["m"], [[x, x], []])


@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (5, 1), (3, 4, 2)])
def test_token_shapes_round_trip_exactly(shape: tuple[int, ...], torch: ModuleType) -> None:
    schema = schema_of_fields(
        Field("tok", "float64", "token", (None, *([None] * (len(shape) - 1))))
    )
    x = torch.randn(shape, dtype=torch.float64)
    out = _round_trip(schema, {"tok": [x]}, ["a"])
    assert_same_rows("token", out["tok"], [x])


def test_ragged_stays_ragged_when_every_row_has_the_same_length(torch: ModuleType) -> None:
    ids = [torch.arange(5) + 10 * i for i in range(3)]
    rb = flightq.encode(shipped(TEXT), {"input_ids": ids}, ["a", "b", "c"])
    assert rb.column("input_ids__shape").to_pylist() == [[5], [5], [5]]
    out = flightq.decode(rb)["input_ids"]
    assert isinstance(out, list) and [tuple(t.shape) for t in out] == [(5,)] * 3
    assert_same_rows("token", out, ids)


@pytest.mark.torch
def test_text_rows_of_a_vlm_batch_have_no_media_which_is_not_a_missing_field() -> None:
    step = workloads.to_torch(workloads.w2(groups=1))
    px = list(step.columns["pixel_values"])
    px[3] = None  # this row does not carry the field at all
    rb = flightq.encode(
        shipped(VLM), {"input_ids": step.columns["input_ids"], "pixel_values": px}, step.keys
    )
    out = flightq.decode(rb)
    rows = out["pixel_values"]
    assert rows[7] == [] and rows[7] is not None  # W2: 1 row in 8 is text-only
    assert rows[3] is None
    assert rb.column("pixel_values").is_null().to_pylist()[3]
    assert not rb.column("pixel_values").is_null().to_pylist()[7]
    col = out.column("pixel_values")
    assert col.counts[7] == 0 and col.counts[3] == 0
    assert col.counts.tolist() == [0 if r is None else len(r) for r in px]


def test_media_cat_concatenates_segments_along_dim0_with_row_offsets(torch: ModuleType) -> None:
    grids = [
        [torch.tensor([[1, 22, 34]])],
        [],
        [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])],
        None,
    ]
    out = _round_trip(shipped(VLM), {"image_grid_thw": grids}, ["a", "b", "c", "d"])
    col = out.column("image_grid_thw")
    values, offsets = col.cat()
    assert values.tolist() == [[1, 22, 34], [1, 2, 3], [4, 5, 6]]
    assert offsets.tolist() == [0, 1, 1, 3, 3]
    assert col.counts.tolist() == [1, 0, 2, 0]
    assert col.segment_shapes == [(1, 3), (1, 3), (1, 3)]
    assert values.data_ptr() == col.segment(0).data_ptr()  # a view, not a copy


def test_media_cat_of_distinct_images_is_one_view_of_every_image(torch: ModuleType) -> None:
    step = workloads.to_torch(workloads.w1(groups=4, g=1))
    rb = flightq.encode(shipped(VLM), step.columns, step.keys)
    values, offsets = flightq.decode(rb).column("pixel_values").cat()
    assert values.shape == (4 * 748, 1176)
    assert offsets.tolist() == [0, 748, 1496, 2244, 2992]
    data = rb.column("pixel_values").values.dictionary.buffers()[2]
    assert buffer_span(data)[0] == values.data_ptr()
    assert torch.equal(values[748:1496], step.columns["pixel_values"][1][0])


def test_media_cat_of_shared_images_repeats_them_in_one_copy(torch: ModuleType) -> None:
    step = workloads.to_torch(workloads.w1(groups=2, g=2))
    rb = flightq.encode(shipped(VLM), step.columns, step.keys)
    values, offsets = flightq.decode(rb).column("pixel_values").cat()
    assert values.shape == (4 * 748, 1176)
    assert offsets.tolist() == [0, 748, 1496, 2244, 2992]
    data = rb.column("pixel_values").values.dictionary.buffers()[2]
    lo, hi = buffer_span(data)
    assert not lo <= values.data_ptr() < hi
    assert torch.equal(values[748:1496], step.columns["pixel_values"][1][0])
    assert torch.equal(values[1496:2244], step.columns["pixel_values"][2][0])


def test_media_cat_refuses_segments_of_different_trailing_dims(torch: ModuleType) -> None:
    px = [[torch.zeros(1, 3, 4, 4)], [torch.zeros(2, 3, 8, 4)]]
    out = _round_trip(shipped(VLM), {"pixel_values": px}, ["a", "b"])
    with pytest.raises(
        ShapeError,
        match=r"column 'pixel_values': segments of shapes \[\(3, 4, 4\), \(3, 8, 4\)\] cannot be "
        r"concatenated along dim 0; iterate the rows instead",
    ):
        out.column("pixel_values").cat()


@pytest.mark.torch
def test_media_cat_of_a_column_without_segments_is_empty() -> None:
    out = _round_trip(shipped(VLM), {"num_frames": [[], None]}, ["a", "b"])
    values, offsets = out.column("num_frames").cat()
    assert values.numel() == 0 and offsets.tolist() == [0, 0, 0]


def test_numpy_output_gives_bfloat16_as_its_bit_patterns(torch: ModuleType) -> None:
    px = torch.tensor([[1.0, -2.5, 3.0e38]], dtype=torch.bfloat16)
    out = _round_trip(shipped("rollout_vlm_bf16@1"), {"pixel_values": [[px]]}, ["a"], as_="numpy")
    got = out["pixel_values"][0][0]
    assert isinstance(got, np.ndarray) and got.dtype == np.uint16 and got.shape == (1, 3)
    assert got.tolist() == px.view(torch.uint16).tolist()
    assert_same_tensor(got, px, bits_as="bfloat16")


def test_scalars_decode_to_one_tensor_and_rows_lacking_them_to_none(torch: ModuleType) -> None:
    schema = shipped(TEXT)
    cols = {
        "input_lengths": torch.tensor([3, 5], dtype=torch.int32),
        "total_reward": [0.5, None],
        "truncated": np.array([True, False]),
        "mask_sample": [None, True],
    }
    out = _round_trip(schema, cols, ["a", "b"])
    assert_same_tensor(out["input_lengths"], cols["input_lengths"])
    assert_same_tensor(out["truncated"], torch.tensor([True, False]))
    assert out["total_reward"] == [0.5, None]
    assert out["mask_sample"] == [None, True]
    with pytest.raises(
        MissingFieldError, match=r"column 'total_reward': 1 rows lack the field; use \.rows\(\)"
    ):
        out.column("total_reward").tensor()


def test_scalars_accept_numpy_and_torch_zero_dim_values_per_row(torch: ModuleType) -> None:
    cols = {"input_lengths": [np.int32(4), torch.tensor(9, dtype=torch.int32)]}
    out = _round_trip(shipped(TEXT), cols, ["a", "b"])
    assert out["input_lengths"].tolist() == [4, 9]


def test_batch_exposes_keys_tags_schema_and_fields(torch: ModuleType) -> None:
    tags = [{"weight_version": 3, "prompt_idx": 0}, None]
    rb = flightq.encode(shipped(TEXT), {"input_ids": [torch.arange(2)] * 2}, ["a", "b"], tags)
    out = flightq.decode(rb)
    assert out.keys == ["a", "b"] and len(out) == 2
    assert out.tags == [{"weight_version": 3, "prompt_idx": 0}, {}]
    assert out.schema is not shipped(TEXT) and out.schema == shipped(TEXT)
    assert out.fields == ["input_ids"] and "input_ids" in out and "advantages" not in out
    assert list(out) == ["input_ids"]
    assert list(out.to_dict()) == ["input_ids"]
    assert repr(out) == "Batch(2 rows of rollout_text@1, fields=['input_ids'])"
    with pytest.raises(
        MissingFieldError, match=r"field 'advantages' is not in this batch of rollout_text@1; "
    ):
        out["advantages"]


def test_a_sliced_record_batch_decodes_its_own_rows() -> None:
    step = workloads.w2(groups=1)
    rb = flightq.encode(shipped(VLM), step.columns, step.keys, step.tags)
    part = flightq.decode(rb.slice(5, 3), as_="numpy")
    assert part.keys == step.keys[5:8] and part.tags == step.tags[5:8]
    for name, want in step.columns.items():
        assert_same_column(shipped(VLM), name, part[name], want[5:8])


def test_split_batch_cuts_zero_copy_slices_under_the_byte_limit() -> None:
    step = workloads.w3(groups=1)
    rb = flightq.encode(shipped(TEXT), step.columns, step.keys)
    parts = split_batch(rb, max_bytes=40_000)
    assert len(parts) > 1
    assert sum(p.num_rows for p in parts) == rb.num_rows
    assert [k for p in parts for k in flightq.decode(p, as_="numpy").keys] == step.keys
    assert split_batch(rb, max_bytes=10**9) == [rb]


def test_a_reader_builds_per_row_tensors_of_all_but_the_last_part_as_batches_arrive() -> None:
    # Each part's per-row tensors are built as the next record batch arrives (decoding
    # while gRPC receives); the last part's only when asked for, so a reader of whole
    # columns builds none it does not use. Tags are read at once: bad ones fail the read.
    step = workloads.w3(groups=2)
    rb = flightq.encode(shipped(TEXT), step.columns, step.keys, step.tags)
    parts = split_batch(rb, max_bytes=40_000)
    assert len(parts) >= 3
    d = PartDecoder("numpy")
    for p in parts:
        d.add(p)
    built = [p._columns.get("input_ids") for p in d.parts]
    assert all(c is not None and c._rows is not None for c in built[:-1])
    assert built[-1] is None and d.parts[-1]._tags is not None
    whole = join(d.parts)
    assert_same_column(shipped(TEXT), "input_ids", whole["input_ids"], step.columns["input_ids"])
    packed = PartDecoder("numpy")
    packed.add(rb)
    values, offsets = packed.parts[0].column("input_ids").packed()
    assert packed.parts[0].column("input_ids")._rows is None  # no per-row arrays built
    assert offsets[-1] == len(values) == sum(len(x) for x in step.columns["input_ids"])
    bad = replace_column(rb, "__tags__", pa.array([b"\xc1"] * rb.num_rows, pa.binary()))
    with pytest.raises(DecodeError):
        PartDecoder("numpy").add(bad)


def test_decode_refuses_an_unknown_output_library() -> None:
    rb = flightq.encode(shipped(TEXT), {"input_ids": [np.arange(2)]}, ["a"])
    with pytest.raises(ValueError, match=r"as_ must be 'torch' or 'numpy', got 'jax'"):
        flightq.decode(rb, as_="jax")


# --------------------------------------------------------------------------- encode refusals


def test_undeclared_field_is_refused_naming_it_and_the_declared_ones() -> None:
    with pytest.raises(
        UndeclaredFieldError,
        match=r"column 'rewards' is not declared by schema rollout_text@1; declared: input_ids, "
        r".*Declare it in a new schema version",
    ):
        flightq.encode(shipped(TEXT), {"input_ids": [np.arange(3)], "rewards": [1.0]}, ["a"])


@pytest.mark.parametrize(
    ("lib", "hint"),
    [
        pytest.param("torch", r"cast with \.to\(torch\.int32\)", marks=pytest.mark.torch),
        ("numpy", r"cast with \.astype\(numpy\.int32\)"),
    ],
)
def test_int64_into_an_int32_field_is_refused_with_the_cast_to_apply(lib: str, hint: str) -> None:
    ok = np.ones((1, 2), dtype=np.int32)
    x = as_lib(np.ones((1, 2), dtype=np.int64), lib)
    with pytest.raises(
        DTypeError,
        match=r"column 'imgs_sizes': expected dtype int32, got int64 \(row key 'g7_3'\); "
        + hint
        + r" or declare a new schema version",
    ):
        flightq.encode(shipped(VLM), {"imgs_sizes": [[ok], [ok, x]]}, ["g7_2", "g7_3"])


def test_int64_scalars_into_an_int32_scalar_field_are_refused(torch: ModuleType) -> None:
    with pytest.raises(
        DTypeError,
        match=r"column 'input_lengths': expected dtype int32, got int64; cast with \.to\(torch",
    ):
        flightq.encode(shipped(TEXT), {"input_lengths": torch.tensor([1, 2])}, ["a", "b"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.5], r"column 'input_lengths': expected a int32 value, got float 1\.5 \(row key 'a'\)"),
        ([True], r"column 'input_lengths': expected a int32 value, got bool True \(row key 'a'\)"),
        ([2**40], r"column 'input_lengths': values do not fit int32"),
        ([np.int64(3)], r"expected a int32 scalar, got int64 of shape \(\) \(row key 'a'\)"),
    ],
)
def test_python_scalars_of_the_wrong_type_are_refused(values: list, message: str) -> None:
    with pytest.raises(DTypeError, match=message):
        flightq.encode(shipped(TEXT), {"input_lengths": values}, ["a"])


def test_bool_scalar_field_refuses_ints() -> None:
    with pytest.raises(DTypeError, match=r"column 'truncated': expected a bool value, got int 1"):
        flightq.encode(shipped(TEXT), {"truncated": [1]}, ["a"])


def test_scalar_tensor_of_the_wrong_length_is_refused(torch: ModuleType) -> None:
    with pytest.raises(
        ShapeError,
        match=r"column 'total_reward': a scalar column is one value per row: expected shape "
        r"\(3,\), got \(2,\)",
    ):
        flightq.encode(shipped(TEXT), {"total_reward": torch.zeros(2)}, ["a", "b", "c"])


def test_bfloat16_scalars_must_be_given_as_tensors(torch: ModuleType) -> None:
    schema = schema_of_fields(Field("s", "bfloat16", "scalar"))
    with pytest.raises(DTypeError, match=r"column 's': bfloat16 scalars are given as tensors of"):
        flightq.encode(schema, {"s": [1.0]}, ["a"])
    out = flightq.decode(
        flightq.encode(schema, {"s": torch.tensor([1.5], dtype=torch.bfloat16)}, ["a"])
    )
    assert_same_tensor(out["s"], torch.tensor([1.5], dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("grid_shape", "message"),
    [
        ((1, 4), r"expected shape \[\?, 3\], got \(1, 4\)"),
        ((3,), r"expected rank 2 \[\?, 3\], got \(3,\)"),
    ],
)
def test_shape_breaking_the_declared_fixed_dims_is_refused(
    grid_shape: tuple[int, ...], message: str, torch: ModuleType
) -> None:
    grid = torch.zeros(grid_shape, dtype=torch.int64)
    with pytest.raises(
        ShapeError, match=r"column 'image_grid_thw' segment 0: " + message + r" \(row key 'b'\)"
    ):
        flightq.encode(shipped(VLM), {"image_grid_thw": [[], [grid]]}, ["a", "b"])


def test_token_fields_of_one_row_must_agree_on_the_sequence_length(torch: ModuleType) -> None:
    cols = {
        "input_ids": [torch.arange(5), torch.arange(4)],
        "token_mask": [torch.ones(5, dtype=torch.int64), torch.ones(3, dtype=torch.int64)],
    }
    with pytest.raises(
        ShapeError,
        match=r"column 'token_mask': sequence length 3 differs from the row's other token fields "
        r"\(4\) \(row key 'b'\)",
    ):
        flightq.encode(shipped(TEXT), cols, ["a", "b"])


def test_a_token_tensor_of_rank_zero_is_refused(torch: ModuleType) -> None:
    with pytest.raises(
        ShapeError, match=r"column 'input_ids': expected rank 1 \[\?\], got \(\) \(row key 'a'\)"
    ):
        flightq.encode(shipped(TEXT), {"input_ids": [torch.tensor(3)]}, ["a"])


def test_non_contiguous_tensor_is_refused_when_zero_copy_is_asked(torch: ModuleType) -> None:
    px = torch.zeros(8, 6).T
    with pytest.raises(
        EncodeError,
        match=r"column 'pixel_values' segment 0 \(row key 'r0'\): non-contiguous tensor of shape "
        r"\(6, 8\) needs a copy; call \.contiguous\(\) or pass zero_copy=False",
    ):
        flightq.encode(shipped(VLM), {"pixel_values": [[px]]}, ["r0"], zero_copy=True)
    out = flightq.decode(flightq.encode(shipped(VLM), {"pixel_values": [[px]]}, ["r0"]))
    assert_same_tensor(out["pixel_values"][0][0], px.contiguous())


def test_duplicate_row_keys_are_refused() -> None:
    with pytest.raises(EncodeError, match=r"duplicate row key 'b' within one put"):
        flightq.encode(shipped(TEXT), {"input_ids": [np.arange(1)] * 3}, ["a", "b", "b"])


def test_row_keys_are_strings() -> None:
    with pytest.raises(EncodeError, match=r"row keys are strings, got int 7"):
        flightq.encode(shipped(TEXT), {}, [7])  # type: ignore[list-item]


def test_a_column_of_the_wrong_row_count_is_refused() -> None:
    with pytest.raises(ShapeError, match=r"column 'input_ids': 2 rows for 3 keys"):
        flightq.encode(shipped(TEXT), {"input_ids": [np.arange(1)] * 2}, ["a", "b", "c"])


def test_a_column_that_is_not_a_sequence_of_rows_is_refused() -> None:
    with pytest.raises(
        EncodeError, match=r"column 'input_ids': expected a sequence of 1 rows, got str"
    ):
        flightq.encode(shipped(TEXT), {"input_ids": "abc"}, ["a"])


def test_a_media_row_is_a_list_of_segments_not_a_tensor(torch: ModuleType) -> None:
    with pytest.raises(
        EncodeError,
        match=r"column 'pixel_values': a media row is a list of tensors \(one per segment\), got "
        r"Tensor \(row key 'a'\); wrap one image as \[tensor\]",
    ):
        flightq.encode(shipped(VLM), {"pixel_values": [torch.zeros(2, 2)]}, ["a"])


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ([{}], r"tags: 1 entries for 2 keys"),
        ([{}, [1]], r"tags of row 'b' must be a dict, got list"),
        ([{}, {"t": object()}], r"tags of row 'b' are not msgpack-serialisable: "),
    ],
)
def test_bad_tags_are_refused_naming_the_row(tags: list, message: str) -> None:
    with pytest.raises(EncodeError, match=message):
        flightq.encode(shipped(TEXT), {}, ["a", "b"], tags)


# --------------------------------------------------------------------------- decode refusals


def _text_batch() -> pa.RecordBatch:
    cols = {
        "input_ids": [np.arange(4), np.arange(2)],
        "token_mask": [np.ones(4, dtype=np.int64), np.ones(2, dtype=np.int64)],
    }
    return flightq.encode(shipped(TEXT), cols, ["r0", "r1"])


def _with_metadata(rb: pa.RecordBatch, **changes: bytes) -> pa.RecordBatch:
    meta = dict(rb.schema.metadata) | {k.replace("_", ".").encode(): v for k, v in changes.items()}
    return pa.RecordBatch.from_arrays(rb.columns, schema=rb.schema.with_metadata(meta))


def _refused_by_validate_and_decode(rb: pa.RecordBatch, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        validate(rb)
    for as_ in OUTPUTS:
        with pytest.raises(error, match=message):
            flightq.decode(rb, as_=as_)


def test_payload_shorter_than_its_shape_is_refused() -> None:
    rb = _text_batch()
    payload = pa.array([np.arange(4).tobytes()[:31], np.arange(2).tobytes()], pa.large_binary())
    _refused_by_validate_and_decode(
        replace_column(rb, "input_ids", payload),
        ShapeError,
        r"column 'input_ids': shape \(4,\) needs 32 bytes of int64, payload has 31 "
        r"\(row key 'r0'\)",
    )


def test_media_segment_longer_than_its_shape_is_refused() -> None:
    rb = flightq.encode(shipped(VLM), {"num_frames": [[], [np.ones(3, np.int32)]]}, ["a", "b"])
    payload = media_array([[], [b"\x01" * 16]])
    _refused_by_validate_and_decode(
        replace_column(rb, "num_frames", payload),
        ShapeError,
        r"column 'num_frames': segment of shape \(3,\) needs 12 bytes of int32, payload has 16 "
        r"\(row key 'b'\)",
    )


def _shape_column(rb: pa.RecordBatch, name: str, shapes: list) -> pa.RecordBatch:
    return replace_column(rb, name + "__shape", pa.array(shapes, pa.list_(pa.int64())))


def test_shape_whose_byte_length_overflows_int64_is_refused() -> None:
    _refused_by_validate_and_decode(
        _shape_column(_text_batch(), "input_ids", [[4], [2**61]]),
        ShapeError,
        r"column 'input_ids': shape \(2305843009213693952,\) needs 18446744073709551616 bytes, "
        r"more than a payload may hold \(2\*\*62\) \(row key 'r1'\)",
    )


def test_media_shape_whose_product_overflows_int64_is_refused() -> None:
    rb = flightq.encode(shipped(VLM), {"pixel_values": [[np.zeros((1, 2), np.float32)]]}, ["a"])
    shapes = pa.array([[[2**32, 2**32]]], pa.large_list(pa.list_(pa.int64())))
    _refused_by_validate_and_decode(
        replace_column(rb, "pixel_values__shape", shapes),
        ShapeError,
        r"column 'pixel_values': shape \(4294967296, 4294967296\) needs 73786976294838206464 "
        r"bytes, .* \(row key 'a'\)",
    )


def test_negative_dim_is_refused() -> None:
    _refused_by_validate_and_decode(
        _shape_column(_text_batch(), "token_mask", [[4], [-2]]),
        ShapeError,
        r"column 'token_mask': expected dims >= 0, got shape \(-2,\) \(row key 'r1'\)",
    )


def test_shape_column_breaking_the_declared_rank_is_refused() -> None:
    _refused_by_validate_and_decode(
        _shape_column(_text_batch(), "input_ids", [[4], [1, 2]]),
        ShapeError,
        r"column 'input_ids': expected rank 1 \[\?\], got shape \(1, 2\) \(row key 'r1'\)",
    )


def test_shapes_of_other_ranks_are_refused_even_when_their_dims_match_the_byte_lengths() -> None:
    # One dim per row on average, and the dims equal the rows' element counts (4, 2):
    # only the ranks (0 and 2) are wrong.
    _refused_by_validate_and_decode(
        _shape_column(_text_batch(), "input_ids", [[], [4, 2]]),
        ShapeError,
        r"column 'input_ids': expected rank 1 \[\?\], got shape \(\) \(row key 'r0'\)",
    )


def test_token_fields_disagreeing_on_the_sequence_length_are_refused_on_decode() -> None:
    rb = _text_batch()
    mask = pa.array(
        [np.ones(4, np.int64).tobytes(), np.ones(3, np.int64).tobytes()], pa.large_binary()
    )
    rb = replace_column(_shape_column(rb, "token_mask", [[4], [3]]), "token_mask", mask)
    _refused_by_validate_and_decode(
        rb,
        ShapeError,
        r"column 'token_mask': sequence length 3 differs from the row's other token fields "
        r"\(2\) \(row key 'r1'\)",
    )


def test_missing_shape_column_is_refused() -> None:
    _refused_by_validate_and_decode(
        drop_column(_text_batch(), "token_mask__shape"),
        ShapeError,
        r"column 'token_mask': has no shape column 'token_mask__shape'; tensors travel with their",
    )


def test_shape_column_without_its_payload_is_refused() -> None:
    _refused_by_validate_and_decode(
        drop_column(_text_batch(), "token_mask"),
        DecodeError,
        r"shape column 'token_mask__shape' has no payload column 'token_mask'",
    )


def test_shape_column_lacking_a_row_the_payload_has_is_refused() -> None:
    _refused_by_validate_and_decode(
        _shape_column(_text_batch(), "input_ids", [[4], None]),
        ShapeError,
        r"column 'input_ids': payload and shape disagree on whether the row has the field "
        r"\(row key 'r1'\)",
    )


def test_media_shape_column_with_the_wrong_segment_count_is_refused() -> None:
    seg = np.zeros((1, 3), np.int64)
    rb = flightq.encode(shipped(VLM), {"image_grid_thw": [[seg], [seg, seg]]}, ["a", "b"])
    shapes = pa.array([[[1, 3]], [[1, 3]]], pa.large_list(pa.list_(pa.int64())))
    _refused_by_validate_and_decode(
        replace_column(rb, "image_grid_thw__shape", shapes),
        ShapeError,
        r"column 'image_grid_thw': 2 segments but 1 shapes \(row key 'b'\)",
    )


def test_shape_column_of_the_wrong_arrow_type_is_refused() -> None:
    rb = _text_batch()
    shapes = pa.array([[4], [2]], pa.list_(pa.int32()))
    _refused_by_validate_and_decode(
        replace_column(rb, "input_ids__shape", shapes),
        DecodeError,
        r"column 'input_ids__shape': expected Arrow type list<item: int64>, got list<item: int32>",
    )


def test_payload_column_of_the_wrong_arrow_type_is_refused() -> None:
    rb = _text_batch()
    payload = pa.array([np.arange(4).tobytes(), np.arange(2).tobytes()], pa.binary())
    _refused_by_validate_and_decode(
        replace_column(rb, "input_ids", payload),
        DecodeError,
        r"column 'input_ids': expected Arrow type large_binary for role token, got binary",
    )


def test_field_metadata_naming_another_dtype_is_refused() -> None:
    rb = _text_batch()
    # Layouts are checked once per Arrow schema; a batch that differs only in one field's
    # metadata is another layout and checked afresh.
    assert validate(rb).fields == ["input_ids", "token_mask"]
    i = rb.schema.get_field_index("input_ids")
    f = rb.schema.field(i)
    arrow = rb.schema.set(i, f.with_metadata(f.metadata | {b"flightq.dtype": b"float64"}))
    _refused_by_validate_and_decode(
        pa.RecordBatch.from_arrays(rb.columns, schema=arrow),
        DecodeError,
        r"column 'input_ids': field metadata says dtype 'float64', schema rollout_text@1 "
        r"declares 'int64'",
    )


def test_undeclared_column_in_a_received_batch_is_refused() -> None:
    rb = _text_batch()
    extra = pa.array([b"", b""], pa.large_binary())
    rb = pa.RecordBatch.from_arrays(
        [*rb.columns, extra],
        schema=rb.schema.append(pa.field("secret", pa.large_binary())),
    )
    _refused_by_validate_and_decode(
        rb,
        UndeclaredFieldError,
        r"column 'secret' is not declared by schema rollout_text@1; declared: input_ids, ",
    )


def test_a_column_name_appearing_twice_is_refused() -> None:
    rb = _text_batch()
    i = rb.schema.get_field_index("token_mask")
    rb = pa.RecordBatch.from_arrays(
        [*rb.columns, rb.column(i)], schema=rb.schema.append(rb.schema.field(i))
    )
    _refused_by_validate_and_decode(rb, DecodeError, r"column 'token_mask' appears more than once")


def test_shape_byte_lengths_match_the_product_of_dims_for_any_mix_of_ranks() -> None:
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 6))
        uniform = trial % 2 == 0
        rank = int(rng.integers(0, 4))
        ranks = [rank if uniform else int(rng.integers(0, 4)) for _ in range(n)]
        big = trial % 5 == 0  # dims near the overflow guard take the exact path
        shapes = [[int(d) for d in rng.integers(0, 2**20 if big else 9, size=r)] for r in ranks]
        offsets = np.concatenate([[0], np.cumsum(ranks)]).astype(np.int64)
        values = np.array([d for s in shapes for d in s], dtype=np.int64)
        got = shape_products(offsets, values, 4, "")
        assert got.tolist() == [4 * math.prod(s) for s in shapes], shapes


def test_duplicate_keys_in_a_received_batch_are_refused() -> None:
    rb = replace_column(_text_batch(), "__key__", pa.array(["r0", "r0"]))
    message = r"duplicate row key 'r0' within one batch"
    with pytest.raises(EncodeError, match=message):
        validate(rb)  # a put being checked: the writer's fault, as its encode would say
    for as_ in OUTPUTS:
        with pytest.raises(DecodeError, match=message):
            flightq.decode(rb, as_=as_)  # a received batch


def test_batch_without_flightq_metadata_is_refused() -> None:
    plain = pa.record_batch({"__key__": ["a"], "__tags__": pa.array([None], pa.binary())})
    _refused_by_validate_and_decode(
        plain, DecodeError, r"not a flightq record batch: no 'flightq\.schema' in the Arrow"
    )


def test_batch_of_another_wire_version_is_refused() -> None:
    _refused_by_validate_and_decode(
        _with_metadata(_text_batch(), flightq_wire=b"2"),
        DecodeError,
        r"wire version '2' is not supported \(this flightq reads '1'\)",
    )


def test_batch_whose_fingerprint_does_not_match_its_declarations_is_refused() -> None:
    _refused_by_validate_and_decode(
        _with_metadata(_text_batch(), flightq_fingerprint=b"0123456789abcdef"),
        DecodeError,
        r"schema rollout_text@1: metadata fingerprint '0123456789abcdef' does not match its "
        r"declarations \(8fc8fc254357e2fa\)",
    )


def test_validate_against_another_schema_reports_the_differences() -> None:
    rb = flightq.encode(shipped(VLM), {"input_ids": [np.arange(2)]}, ["a"])
    with pytest.raises(
        SchemaMismatchError,
        match=r"batch carries schema rollout_vlm@1 \(d7a5042c77355bdd\), expected "
        r"rollout_vlm_bf16@1 \(67f08417fecfdc87\): schema: expected rollout_vlm_bf16@1, actual "
        r"rollout_vlm@1; field 'pixel_values': dtype expected 'bfloat16', actual 'float32'",
    ):
        validate(rb, shipped("rollout_vlm_bf16@1"))
    assert validate(rb, shipped(VLM)).keys == ["a"]


def test_validate_reports_rows_sequence_lengths_and_payload_bytes() -> None:
    checked = validate(_text_batch())
    assert checked.keys == ["r0", "r1"]
    assert checked.fields == ["input_ids", "token_mask"]
    assert checked.seq_lens.tolist() == [4, 2]
    assert checked.nbytes.tolist() == [64, 32]


def test_tags_that_are_not_msgpack_maps_are_refused_naming_the_row() -> None:
    rb = replace_column(
        _text_batch(), "__tags__", pa.array([None, b"\x93\x01\x02\x03"], pa.binary())
    )
    bad_msgpack = replace_column(rb, "__tags__", pa.array([b"\xc1", None], pa.binary()))
    for as_ in OUTPUTS:
        with pytest.raises(DecodeError, match=r"tags of row 'r1' are not a map"):
            _ = flightq.decode(rb, as_=as_).tags
        with pytest.raises(DecodeError, match=r"tags of row 'r0' are not valid msgpack: "):
            _ = flightq.decode(bad_msgpack, as_=as_).tags


def test_many_rows_tags_decode_per_row_and_a_bad_value_names_its_first_row() -> None:
    # Past a few rows each distinct tag value is decoded once: rows without tags get {},
    # rows sharing bytes get maps of their own, a bad value names the first row using it.
    n = 20
    keys = [f"r{i}" for i in range(n)]
    ids = [np.arange(3) for _ in range(n)]
    tags = [None if i % 5 == 0 else {"g": i // 4} for i in range(n)]
    rb = flightq.encode(shipped(TEXT), {"input_ids": ids}, keys)
    col = pa.array([None if t is None else msgpack.packb(t) for t in tags], pa.binary())
    rb = replace_column(rb, "__tags__", col)
    for as_ in OUTPUTS:
        got = flightq.decode(rb, as_=as_).tags
        assert got == [{} if t is None else t for t in tags]
        got[1]["g"] = -1  # one row's map is its own
        assert got[2] == {"g": 0}
    bad = col.to_pylist()
    bad[13] = bad[17] = b"\xc1"
    rb_bad = replace_column(rb, "__tags__", pa.array(bad, pa.binary()))
    with pytest.raises(DecodeError, match=r"tags of row 'r13' are not valid msgpack"):
        _ = flightq.decode(rb_bad, as_="numpy").tags


def test_a_media_row_with_more_shapes_than_segments_is_named_before_a_null_row() -> None:
    # Row 0 has one segment and two shapes, row 1 is null but keeps a segment: the first
    # fault in row order is the one named.
    step = workloads.w1(0, groups=1, g=2)
    rb = flightq.encode(shipped(step.schema), step.columns, step.keys, step.tags)
    mask = pa.array([False, True])
    seg = rb.column("image_grid_thw").values
    pay = pa.LargeListArray.from_arrays(pa.array([0, 1, 2], pa.int64()), seg, mask=mask)
    shapes = pa.array([[1, 22, 34]] * 3, pa.list_(pa.int64()))
    shp = pa.LargeListArray.from_arrays(pa.array([0, 2, 3], pa.int64()), shapes, mask=mask)
    rb = replace_column(replace_column(rb, "image_grid_thw", pay), "image_grid_thw__shape", shp)
    _refused_by_validate_and_decode(
        rb,
        ShapeError,
        r"column 'image_grid_thw': 1 segments but 2 shapes \(row key 'p0_g0'\)",
    )


def test_views_of_a_shared_image_behave_as_views_of_one_that_is_not_shared(
    torch: ModuleType,
) -> None:
    # Every row gets its own plain view: an in-place op under autograd works on a row whose
    # image its group shares as on any other view.
    step = workloads.w1(0, groups=1, g=2)
    rb = flightq.encode(shipped(step.schema), step.columns, step.keys, step.tags)
    rows = flightq.decode(rb)["pixel_values"]
    first, second = rows[0][0], rows[1][0]
    assert first.data_ptr() == second.data_ptr() and first is not second
    # Refused ("output of a function that returns multiple views") for views made together
    # by one multi-output op such as unbind.
    first.mul_(torch.ones((), requires_grad=True))


def _many_rows(tags: list) -> pa.RecordBatch:
    keys = [f"r{i}" for i in range(len(tags))]
    return flightq.encode(shipped(TEXT), {"input_ids": [np.arange(2)] * len(keys)}, keys, tags)


def test_tags_shared_by_many_rows_read_as_each_rows_own_map() -> None:
    # Past a few rows each distinct value is decoded once; every row still gets a map of
    # its own, so changing one row's tags (or a list inside them) changes no other row's.
    tags = [{"prompt_idx": i // 4, "ids": [i // 4]} if i % 3 else {"w": i // 4} for i in range(16)]
    tags[5] = None
    out = flightq.decode(_many_rows(tags), as_="numpy").tags
    assert out == [t or {} for t in tags]
    assert len({id(t) for t in out}) == len(out)
    out[1]["prompt_idx"] = 99
    out[1]["ids"].append(7)
    assert out[2] == {"prompt_idx": 0, "ids": [0]} and out[3] == {"w": 0}


@pytest.mark.parametrize(
    ("bad", "message"),
    [(b"\xc1", "are not valid msgpack: "), (b"\x93\x01\x02\x03", "are not a map")],
)
def test_many_rows_tags_are_refused_at_the_first_bad_row(bad: bytes, message: str) -> None:
    good = msgpack.packb({"prompt_idx": 1})
    values = [good] * 5 + [None, bad, good, bad] + [good] * 3
    rb = replace_column(_many_rows([None] * 12), "__tags__", pa.array(values, pa.binary()))
    for as_ in OUTPUTS:
        with pytest.raises(DecodeError, match=f"tags of row 'r6' {message}") as e:
            _ = flightq.decode(rb, as_=as_).tags
        assert e.value.key == "r6"


@pytest.mark.parametrize(
    ("bad", "message"),
    [(b"\xc1", "are not valid msgpack: "), (b"\x93\x01\x02\x03", "are not a map")],
)
def test_a_reads_malformed_tags_fail_the_read_though_no_row_asks_for_its_map(
    bad: bytes, message: str
) -> None:
    # A read decodes each distinct value at once and makes the rows' own maps only when
    # asked for: the fault is still the read's, naming the first row that carries it.
    good = msgpack.packb({"prompt_idx": 1})
    values = [good] * 9 + [bad, None, bad]
    rb = replace_column(_many_rows([None] * 12), "__tags__", pa.array(values, pa.binary()))
    with pytest.raises(DecodeError, match=f"tags of row 'r9' {message}") as e:
        PartDecoder("numpy").add(rb)
    assert e.value.key == "r9"


def test_a_read_makes_its_rows_tag_maps_only_when_they_are_asked_for() -> None:
    tags = [{"prompt_idx": i // 4, "weight_version": 3} for i in range(16)]
    d = PartDecoder("numpy")
    d.add(_many_rows(tags))
    batch = join(d.parts)
    assert batch._tags is None  # checked, not yet a map per row
    _flat, offsets = batch.column("input_ids").packed()  # a reader of whole columns
    assert batch._tags is None and len(offsets) == 17
    assert batch.tags == tags
    assert len({id(t) for t in batch.tags}) == 16


def test_a_column_asked_for_a_form_its_role_has_not_names_the_field_and_role() -> None:
    step = workloads.w1(groups=1, g=2)
    b = flightq.decode(
        flightq.encode(shipped(VLM), step.columns, step.keys, step.tags), as_="numpy"
    )
    for name, form, takes in [
        ("total_reward", "packed", "token and tensor fields"),
        ("pixel_values", "packed", "token and tensor fields"),
        ("pixel_values", "jagged", "token and tensor fields"),
        ("input_ids", "cat", "media fields"),
    ]:
        with pytest.raises(
            ShapeError, match=rf"field '{name}' is a \w+ field: {form}\(\) takes {takes}"
        ) as e:
            getattr(b.column(name), form)()
        assert e.value.field == name
    flat, offsets = b.column("input_ids").packed()  # the forms their roles have still work
    assert offsets[-1] == len(flat)
    assert len(b.column("pixel_values").cat().offsets) == 3
