"""Columns whose rows lie end to end in one tensor are put a column at a time.

A ``flightq.Packed`` (``(values, offsets)``, what ``column(name).packed()`` returns), a
jagged nested tensor, and a dense C-contiguous tensor whose first dim is the rows encode to
the very bytes the same rows give one tensor each; the socket put sends ``values`` from its
own memory. Anything unusual (another dtype, a broken declared shape, token lengths that
disagree, holes in a jagged tensor) falls back to the per-row path and its precise errors.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pyarrow as pa
import pytest
from helpers_wire import LIBS, as_lib, schema_of_fields

from flightq import Field, Packed, SchemaRegistry, decode, encode
from flightq.chunks import encode_chunks
from flightq.errors import DTypeError, ShapeError
from flightq.rows import PackedRows, columns_of

TEXT = SchemaRegistry.default().get("rollout_text@1")
LENS = [3, 0, 7, 5]
KEYS = ["a", "b", "c", "d"]
TAGS = [{"i": i} for i in range(len(KEYS))]


def _ipc(rb: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as w:
        w.write_batch(rb)
    return sink.getvalue().to_pybytes()


def _rows(lens: list[int], dt: type, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.random(n) * 100).astype(dt) for n in lens]


def _offsets(lens: list[int], start: int = 0) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64) + start


def _packed(rows: list[np.ndarray], lib: str, pad: int = 0) -> Packed:
    """``rows`` end to end after ``pad`` elements of padding (offsets not starting at 0)."""
    values = np.concatenate([np.full(pad, -1, dtype=rows[0].dtype), *rows])
    offs = _offsets([len(r) for r in rows], pad)
    if lib == "torch":
        import torch

        return Packed(torch.from_numpy(values), torch.from_numpy(offs.astype(np.int32)))
    return Packed(values, offs)


def _text(lib: str) -> dict[str, list]:
    return {
        "input_ids": [as_lib(r, lib) for r in _rows(LENS, np.int64, 0)],
        "generation_logprobs": [as_lib(r, lib) for r in _rows(LENS, np.float32, 1)],
        "input_lengths": as_lib(np.asarray(LENS, dtype=np.int32), lib),
    }


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("pad", [0, 4])
def test_a_packed_column_encodes_as_its_rows_do(lib: str, pad: int) -> None:
    rows = _text(lib)
    packed = {
        "input_ids": _packed(_rows(LENS, np.int64, 0), lib, pad),
        "generation_logprobs": _packed(_rows(LENS, np.float32, 1), lib, pad),
        "input_lengths": rows["input_lengths"],
    }
    cols = columns_of(packed, TEXT, KEYS)
    assert type(cols["input_ids"]) is PackedRows
    assert _ipc(encode(TEXT, packed, KEYS, TAGS)) == _ipc(encode(TEXT, rows, KEYS, TAGS))


def test_jagged_and_dense_columns_encode_as_their_rows_do(torch: ModuleType) -> None:
    rows = _text("torch")
    jagged = dict(rows)
    jagged["input_ids"] = torch.nested.nested_tensor(rows["input_ids"], layout=torch.jagged)
    assert type(columns_of(jagged, TEXT, KEYS)["input_ids"]) is PackedRows
    assert _ipc(encode(TEXT, jagged, KEYS, TAGS)) == _ipc(encode(TEXT, rows, KEYS, TAGS))
    dense = {"input_ids": torch.arange(24).reshape(4, 6), "token_mask": torch.ones(4, 6).long()}
    assert type(columns_of(dense, TEXT, KEYS)["input_ids"]) is PackedRows
    per_row = {k: list(v) for k, v in dense.items()}
    assert _ipc(encode(TEXT, dense, KEYS)) == _ipc(encode(TEXT, per_row, KEYS))


def test_dense_numpy_rows_and_fixed_tensor_shapes_encode_as_their_rows_do() -> None:
    s = schema_of_fields(
        Field("ids", "int64", "token", (None,)),
        Field("box", "float32", "tensor", (2, 3)),
    )
    box = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
    ids = np.arange(20, dtype=np.int64).reshape(4, 5)
    cols = {"ids": ids, "box": box}
    assert all(type(v) is PackedRows for v in columns_of(cols, s, KEYS).values())
    assert _ipc(encode(s, cols, KEYS)) == _ipc(
        encode(s, {"ids": list(ids), "box": list(box)}, KEYS)
    )
    got = decode(encode(s, cols, KEYS), as_="numpy")
    np.testing.assert_array_equal(got["box"][2], box[2])


@pytest.mark.parametrize("lib", LIBS)
def test_a_socket_put_sends_a_packed_column_from_its_own_memory(lib: str) -> None:
    """Deferred fills (the socket put) reference ``values``; encode's own copy does not."""
    p = _packed(_rows(LENS, np.int64), lib, pad=4)
    address = int(p.values.data_ptr()) if lib == "torch" else p.values.ctypes.data
    fills: list = []
    (sent,) = encode_chunks(TEXT, {"input_ids": p}, KEYS, max_bytes=2**20, fills=fills)
    assert sent.column("input_ids").buffers()[2].address == address + 4 * 8
    copied = encode(TEXT, {"input_ids": p}, KEYS)
    assert copied.column("input_ids").buffers()[2].address != address + 4 * 8
    assert _ipc(sent) == _ipc(copied)


@pytest.mark.parametrize("lib", LIBS)
def test_a_packed_put_cut_into_batches_matches_the_rows_cut(lib: str) -> None:
    lens = [40 + 7 * i for i in range(12)]
    keys = [f"k{i}" for i in range(12)]
    rows = _rows(lens, np.int64)
    per_row = encode_chunks(
        TEXT, {"input_ids": [as_lib(r, lib) for r in rows]}, keys, max_bytes=1500
    )
    packed = encode_chunks(TEXT, {"input_ids": _packed(rows, lib, pad=3)}, keys, max_bytes=1500)
    assert len(packed) == len(per_row) > 2
    assert [_ipc(b) for b in packed] == [_ipc(b) for b in per_row]


def test_packed_rows_read_as_a_sequence_of_their_rows() -> None:
    rows = _rows(LENS, np.int64)
    p = columns_of({"input_ids": _packed(rows, "numpy", pad=2)}, TEXT, KEYS)["input_ids"]
    assert len(p) == 4 and p.nbytes == sum(LENS) * 8
    assert p.row_nbytes().tolist() == [n * 8 for n in LENS]
    for got, want in zip(p, rows, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(p[-1], rows[-1])
    np.testing.assert_array_equal(p[2], rows[2])
    tail = p[1:3]
    assert type(tail) is PackedRows and len(tail) == 2
    np.testing.assert_array_equal(tail[1], rows[2])
    with pytest.raises(IndexError):
        p[4]


@pytest.mark.parametrize("lib", LIBS)
def test_a_packed_column_of_another_dtype_names_the_row(lib: str) -> None:
    p = _packed(_rows(LENS, np.int32), lib)
    with pytest.raises(DTypeError, match=r"expected dtype int64, got int32 \(row key 'a'\)"):
        encode(TEXT, {"input_ids": p}, KEYS)


@pytest.mark.parametrize("lib", LIBS)
def test_packed_token_lengths_that_disagree_name_the_row(lib: str) -> None:
    ids = _packed(_rows(LENS, np.int64), lib)
    lps = _packed(_rows([3, 0, 8, 5], np.float32), lib)
    with pytest.raises(ShapeError, match=r"sequence length 8 differs .*\(row key 'c'\)"):
        encode(TEXT, {"input_ids": ids, "generation_logprobs": lps}, KEYS)


def test_a_fixed_tensor_shape_the_packed_rows_break_names_the_row() -> None:
    s = schema_of_fields(Field("box", "float32", "tensor", (2, 3)))
    values = np.zeros((9, 3), dtype=np.float32)
    p = Packed(values, np.array([0, 2, 4, 7, 9]))
    with pytest.raises(ShapeError, match=r"\(row key 'c'\)"):
        encode(s, {"box": p}, KEYS)


@pytest.mark.parametrize(
    ("offsets", "what"),
    [
        (np.array([0, 3, 2, 7, 9]), "rise"),
        (np.array([0, 3, 5, 7, 99]), "rise"),
        (np.array([-1, 3, 5, 7, 9]), "rise"),
        (np.zeros((2, 5), dtype=np.int64), "N \\+ 1 integers"),
        (np.array([0.0, 3.0, 5.0, 7.0, 9.0]), "N \\+ 1 integers"),
    ],
)
def test_packed_offsets_that_do_not_fit_the_values_are_refused(
    offsets: np.ndarray, what: str
) -> None:
    p = Packed(np.arange(9, dtype=np.int64), offsets, max_len=0)
    with pytest.raises(ShapeError, match=f"column 'input_ids': a Packed column's .*{what}") as e:
        encode(TEXT, {"input_ids": p}, KEYS)
    assert e.value.field == "input_ids"


def test_packed_rows_of_another_count_than_the_keys_are_refused() -> None:
    p = _packed(_rows(LENS[:3], np.int64), "numpy")
    with pytest.raises(ShapeError, match=r"column 'input_ids': 3 rows for 4 keys"):
        encode(TEXT, {"input_ids": p}, KEYS)


def test_a_jagged_tensor_with_holes_is_put_row_by_row(torch: ModuleType) -> None:
    """``torch.nested.narrow`` gives a jagged tensor whose rows do not lie end to end:
    each row is read as it is."""
    base = torch.arange(40).reshape(4, 10)
    start, length = torch.tensor([1, 0, 2, 5]), torch.tensor([3, 1, 4, 2])
    holes = torch.nested.narrow(base, 1, start, length, layout=torch.jagged)
    assert type(columns_of({"input_ids": holes}, TEXT, KEYS)["input_ids"]) is list
    got = decode(encode(TEXT, {"input_ids": holes}, KEYS), as_="numpy")["input_ids"]
    want = [base[i, s : s + n].tolist() for i, (s, n) in enumerate(zip(start, length, strict=True))]
    assert [r.tolist() for r in got] == want


def test_a_non_contiguous_dense_column_is_put_row_by_row(torch: ModuleType) -> None:
    ids = torch.arange(24).reshape(6, 4).t()  # 4 rows of 6, not C-contiguous
    assert not isinstance(columns_of({"input_ids": ids}, TEXT, KEYS)["input_ids"], PackedRows)
    got = decode(encode(TEXT, {"input_ids": ids}, KEYS), as_="numpy")["input_ids"]
    assert [r.tolist() for r in got] == ids.tolist()


def test_bf16_packed_values_are_put_row_by_row(torch: ModuleType) -> None:
    s = schema_of_fields(Field("lp", "bfloat16", "token", (None,)))
    rows = [torch.randn(n).to(torch.bfloat16) for n in LENS]
    p = Packed(torch.cat(rows), torch.tensor(_offsets(LENS)))
    got = decode(encode(s, {"lp": p}, KEYS), as_="torch")["lp"]
    assert all(torch.equal(g, w) for g, w in zip(got, rows, strict=True))


def test_a_jagged_tensor_with_int32_offsets_encodes_as_its_rows_do(torch: ModuleType) -> None:
    """flash-attention's cu_seqlens are int32; a jagged tensor over them is put as is."""
    rows = [torch.from_numpy(r) for r in _rows(LENS, np.int64)]
    cu = torch.tensor(_offsets(LENS), dtype=torch.int32)
    jagged = torch.nested.nested_tensor_from_jagged(torch.cat(rows), cu)
    assert _ipc(encode(TEXT, {"input_ids": jagged}, KEYS)) == _ipc(
        encode(TEXT, {"input_ids": rows}, KEYS)
    )


@pytest.mark.parametrize(
    "offsets",
    [
        np.array([0, 3, -(2**63) + 2, -2, 9]),  # rises nowhere once differences wrap
        np.array([0, 3, 5, 7, 2**64 - 1], dtype=np.uint64),
        [0, 3, "x", 7, 9],
        None,
        np.array([True, False, True, True, True]),
    ],
    ids=["wrapping", "uint64-past-int64", "strings", "none", "bools"],
)
def test_offsets_no_check_can_be_fooled_by_are_refused(offsets: object) -> None:
    p = Packed(np.arange(9, dtype=np.int64), offsets)
    with pytest.raises(ShapeError, match="column 'input_ids': a Packed column's") as e:
        encode(TEXT, {"input_ids": p}, KEYS)
    assert e.value.field == "input_ids"


def test_packed_offsets_as_a_list_and_its_longest_row() -> None:
    values = np.arange(9, dtype=np.int64)
    p = Packed(values, [0, 3, 3, 7, 9])
    assert p.max_len == 4
    got = decode(encode(TEXT, {"input_ids": p}, KEYS), as_="numpy")["input_ids"]
    assert [r.tolist() for r in got] == [[0, 1, 2], [], [3, 4, 5, 6], [7, 8]]


def test_bf16_or_grad_offsets_are_refused_or_read(torch: ModuleType) -> None:
    values = torch.arange(9)
    with pytest.raises(ShapeError, match="offsets are N \\+ 1 integers"):
        encode(
            TEXT, {"input_ids": Packed(values, torch.tensor([0.0, 3, 5, 7, 9]).bfloat16())}, KEYS
        )
    p = Packed(values, torch.tensor([0, 3, 5, 7, 9]))
    assert encode(TEXT, {"input_ids": p}, KEYS).num_rows == 4


def test_a_packed_media_column_is_refused() -> None:
    vlm = SchemaRegistry.default().get("rollout_vlm@1")
    p = Packed(np.zeros((6, 1176), dtype=np.float32), np.array([0, 2, 2, 5, 6]))
    with pytest.raises(ShapeError, match="column 'pixel_values': a media column is one list"):
        encode(vlm, {"pixel_values": p}, KEYS)


def test_an_encoded_batch_keeps_its_scalars_when_the_caller_changes_them() -> None:
    for n in (3, 12):  # the few-rows path and the general one
        lengths = np.arange(n, dtype=np.int32)
        rb = encode(TEXT, {"input_lengths": lengths}, [f"k{i}" for i in range(n)])
        lengths[:] = 99
        assert rb.column("input_lengths").to_pylist() == list(range(n))


def test_packed_rows_on_the_cpu_leave_a_put_with_no_cuda_tensor(
    torch: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA process's put looks for CUDA tensors in every column: PackedRows are not
    walked row by row for it (their values are one tensor)."""
    from flightq.cuda.put import has_cuda

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as in a CUDA process

    cols = columns_of({"input_ids": _packed(_rows(LENS, np.int64), "torch")}, TEXT, KEYS)

    class NoRows(PackedRows):
        def __iter__(self):  # type: ignore[override]
            raise AssertionError("walked row by row")

    cols = {"input_ids": NoRows(cols["input_ids"].values, cols["input_ids"].offsets)}
    assert has_cuda(cols) is False
    cuda_packed = columns_of({"input_ids": Packed(_Cuda(), np.array([0, 3, 3, 7, 9]))}, TEXT, KEYS)
    # a CUDA tensor's rows stay packed: a put stages them to the host as one tensor
    # (flightq.cuda.put.stage; on a GPU: test_cuda.py::test_a_packed_or_jagged_cuda_column_...)
    col = cuda_packed["input_ids"]
    assert type(col) is PackedRows and col.offsets.tolist() == [0, 3, 3, 7, 9]
    assert list(col) == ["row of 3", "row of 0", "row of 4", "row of 2"]


class _Cuda:
    """Stands in for a CUDA tensor's device and shape (no GPU here): what ``columns_of``
    reads of a Packed column's values."""

    shape = (9,)

    class device:  # the attribute torch names so
        type = "cuda"

    def __getitem__(self, s: slice) -> _Cuda:
        return self

    def split(self, lengths: list[int]) -> list[str]:
        return [f"row of {n}" for n in lengths]
