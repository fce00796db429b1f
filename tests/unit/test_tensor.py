"""One tensor to (bytes, shape, dtype) and back: normalisation, zero-copy, refusals."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from helpers_wire import raw_bytes, tensor_span

from flightq import EncodeError, ShapeError
from flightq.dtypes import dtype
from flightq.tensor import MAX_NBYTES, column_base, is_torch, nbytes_for, row_view, to_bytes


def test_contiguous_numpy_array_is_flattened_without_a_copy() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    enc = to_bytes(a, zero_copy=True)
    assert (enc.shape, enc.dtype) == ((3, 4), "int32")
    assert enc.data.dtype == np.uint8 and enc.data.shape == (48,)
    assert tensor_span(enc.data) == tensor_span(a)


def test_contiguous_torch_tensor_is_flattened_without_a_copy(torch: ModuleType) -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    enc = to_bytes(t, zero_copy=True)
    assert (enc.shape, enc.dtype) == ((2, 3), "bfloat16")
    assert tensor_span(enc.data) == tensor_span(t)
    assert enc.data.tobytes() == raw_bytes(t)


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (5,), (5, 1), (2, 3, 4, 5)])
def test_shape_is_kept_exactly(shape: tuple[int, ...], torch: ModuleType) -> None:
    t = torch.zeros(shape, dtype=torch.float16)
    assert to_bytes(t).shape == shape
    assert to_bytes(t.numpy()).shape == shape
    assert len(to_bytes(t).data) == t.numel() * 2


ZERO_SIZE = {
    "stride 0": lambda torch: torch.from_numpy(np.frombuffer(b"", dtype=np.int16).copy()),
    "strides (0, 0)": lambda torch: torch.empty_strided((2, 0), (0, 0), dtype=torch.bfloat16),
    "transposed": lambda torch: torch.zeros(3, 0).T,
}


@pytest.mark.parametrize("case", ZERO_SIZE)
def test_zero_size_tensor_of_any_strides_encodes_to_no_bytes(case: str, torch: ModuleType) -> None:
    t = ZERO_SIZE[case](torch)
    enc = to_bytes(t, zero_copy=True)
    assert enc.shape == tuple(t.shape)
    assert len(enc.data) == 0 and enc.data.dtype == np.uint8


def test_big_endian_array_is_swapped_to_little_endian_keeping_its_values() -> None:
    a = np.array([1, 256, -2], dtype=">i4")
    enc = to_bytes(a)
    assert enc.dtype == "int32"
    assert enc.data.tobytes() == np.array([1, 256, -2], dtype="<i4").tobytes()


def test_big_endian_array_is_refused_when_zero_copy_is_asked() -> None:
    with pytest.raises(EncodeError, match=r"row 3: big-endian array needs a byte swap; pass "):
        to_bytes(np.zeros(3, dtype=">f8"), zero_copy=True, where="row 3: ")


def test_non_contiguous_tensor_is_copied_in_logical_order(torch: ModuleType) -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).T
    enc = to_bytes(t)
    assert enc.shape == (4, 3)
    assert enc.data.tobytes() == t.contiguous().numpy().tobytes()


def test_non_contiguous_tensor_is_refused_when_zero_copy_is_asked(torch: ModuleType) -> None:
    t = torch.zeros(3, 4).T
    with pytest.raises(
        EncodeError, match=r"non-contiguous tensor of shape \(4, 3\) needs a copy; call \.contig"
    ):
        to_bytes(t, zero_copy=True)


def test_non_contiguous_array_is_refused_when_zero_copy_is_asked() -> None:
    a = np.zeros((4, 6))[:, ::2]
    with pytest.raises(EncodeError, match=r"non-contiguous array of shape \(4, 3\) needs a copy"):
        to_bytes(a, zero_copy=True)


def test_tensor_that_requires_grad_is_detached_not_refused(torch: ModuleType) -> None:
    t = torch.ones(3, requires_grad=True)
    assert to_bytes(t, zero_copy=True).data.tobytes() == raw_bytes(t)


def test_negative_view_is_resolved_to_its_values(torch: ModuleType) -> None:
    t = torch._neg_view(torch.tensor([1.0, -2.0]))
    assert to_bytes(t).data.tobytes() == raw_bytes(torch.tensor([-1.0, 2.0]))


@pytest.mark.parametrize("value", [[1, 2], 3.0, b"abc", None])
def test_anything_but_a_tensor_is_refused_with_how_to_wrap_it(value: object) -> None:
    with pytest.raises(
        EncodeError, match=r"expected a torch\.Tensor or numpy\.ndarray, got \w+; wrap Python"
    ):
        to_bytes(value)


def test_is_torch_tells_tensors_from_arrays(torch: ModuleType) -> None:
    assert is_torch(torch.zeros(1))
    assert not is_torch(np.zeros(1))


@pytest.mark.parametrize(
    ("shape", "itemsize", "nbytes"),
    [
        ((), 4, 4),
        ((0,), 8, 0),
        ((0, 3), 2, 0),
        ((748, 1176), 4, 3_518_592),
        ((2**31, 2**31), 1, 2**62),
    ],
)
def test_nbytes_for_is_the_product_of_the_shape_and_the_itemsize(
    shape: tuple[int, ...], itemsize: int, nbytes: int
) -> None:
    assert nbytes_for(shape, itemsize) == nbytes


def test_nbytes_for_refuses_a_negative_dim() -> None:
    with pytest.raises(ShapeError, match=r"col x: shape \(3, -1\) has a negative dim"):
        nbytes_for((3, -1), 4, where="col x: ")


def test_nbytes_for_refuses_a_byte_length_beyond_int64() -> None:
    assert nbytes_for((MAX_NBYTES,), 1) == MAX_NBYTES
    with pytest.raises(ShapeError, match=r"shape \(4611686018427387904, 2\) overflows: "):
        nbytes_for((2**62, 2), 1)
    with pytest.raises(ShapeError, match=r"overflows: 9223372036854775808 bytes does not fit"):
        nbytes_for((2**61,), 4)


def test_column_base_views_the_buffer_in_place() -> None:
    buf = np.arange(8, dtype="<i4").tobytes()
    raw = memoryview(buf)
    base = column_base(raw, 8, 24, dtype("int32"), "numpy")
    assert base.tolist() == [2, 3, 4, 5]
    assert not base.flags.owndata


def test_column_base_views_a_misaligned_buffer_in_place() -> None:
    # gRPC hands received bodies over at any address; copying them would double the cost.
    storage = np.zeros(40, dtype=np.uint8)
    storage[1:33] = np.frombuffer(np.arange(4, dtype="<i8").tobytes(), dtype=np.uint8)
    base = column_base(storage, 1, 33, dtype("int64"), "numpy")
    assert base.tolist() == [0, 1, 2, 3]
    assert np.shares_memory(base, storage) and not base.flags.aligned
    aligned = row_view(base, 0, (4,), copy=True)
    assert aligned.flags.aligned and aligned.flags.writeable


def test_column_base_views_a_misaligned_buffer_in_place_as_torch(torch: ModuleType) -> None:
    storage = np.zeros(40, dtype=np.uint8)
    storage[1:33] = np.frombuffer(np.arange(4, dtype="<i8").tobytes(), dtype=np.uint8)
    t = column_base(storage, 1, 33, dtype("int64"), "torch")
    assert t.data_ptr() % 8 == 1 and t.sum().item() == 6 and (t * 2).tolist() == [0, 2, 4, 6]


def test_column_base_gives_torch_its_own_bfloat16_and_float8_dtypes(torch: ModuleType) -> None:
    want = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    base = column_base(raw_bytes(want), 0, 6, dtype("bfloat16"), "torch")
    assert base.dtype == torch.bfloat16 and torch.equal(base, want)
    fp8 = torch.tensor([0.5, -448.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    base = column_base(raw_bytes(fp8), 0, 2, dtype("float8_e4m3fn"), "torch")
    assert base.dtype == torch.float8_e4m3fn and raw_bytes(base) == raw_bytes(fp8)


def test_column_base_of_zero_bytes_is_an_empty_array_of_the_dtype(torch: ModuleType) -> None:
    base = column_base(b"", 0, 0, dtype("float64"), "torch")
    assert base.dtype == torch.float64 and base.shape == (0,)


def test_row_view_reshapes_a_slice_and_copies_only_when_asked(torch: ModuleType) -> None:
    base = torch.arange(10, dtype=torch.int16)
    view = row_view(base, 4, (2, 3), copy=False)
    assert view.tolist() == [[4, 5, 6], [7, 8, 9]]
    assert view.data_ptr() == base.data_ptr() + 4 * 2
    copied = row_view(base, 4, (2, 3), copy=True)
    assert torch.equal(copied, view) and copied.data_ptr() != view.data_ptr()
    arr = row_view(np.arange(10, dtype=np.int16), 0, (), copy=True)
    assert arr.shape == () and arr.flags.owndata
