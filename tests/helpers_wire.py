"""Shared helpers for the wire-format tests: schemas, bit-exact comparison, batch surgery.

Nothing here is a fixture or holds state: each helper builds what it returns.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from flightq import Field, Schema, SchemaRegistry
from flightq.dtypes import DTYPES

__all__ = [
    "HAS_TORCH",
    "LIBS",
    "OUTPUTS",
    "SHIPPED_REFS",
    "as_lib",
    "shipped",
    "schema_of_fields",
    "raw_bytes",
    "assert_same_tensor",
    "assert_same_rows",
    "assert_same_column",
    "replace_column",
    "drop_column",
    "ipc_bytes",
    "read_ipc",
    "buffer_span",
    "tensor_span",
]

SHIPPED_REFS = ("rollout_text@1", "rollout_vlm@1", "rollout_vlm_bf16@1")

HAS_TORCH = importlib.util.find_spec("torch") is not None

# The tensor libraries a test parametrizes over; the torch case skips where torch is absent.
LIBS = ("numpy", pytest.param("torch", marks=pytest.mark.torch))

# What decode can give here, for a refusal that must read the same whatever the output.
OUTPUTS = ("torch", "numpy") if HAS_TORCH else ("numpy",)


@functools.cache
def shipped(ref: str) -> Schema:
    """A shipped schema, read from a registry built for this call (schemas are frozen)."""
    return SchemaRegistry.default().get(ref)


def schema_of_fields(*fields: Field, name: str = "t", version: int = 1) -> Schema:
    """A throwaway schema over ``fields``."""
    return Schema(name, version, fields)


def as_lib(a: np.ndarray, lib: str) -> Any:
    """``a`` as library ``lib`` holds it: itself for numpy, a torch tensor sharing its memory."""
    if lib == "numpy":
        return a
    import torch

    return torch.from_numpy(a)


def _is_torch(x: Any) -> bool:
    # A torch tensor exists only once torch is loaded: a run without torch never imports it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def raw_bytes(x: Any) -> bytes:
    """A tensor's little-endian bytes, C order, whatever its dtype (bf16 and fp8 included)."""
    if _is_torch(x):
        import torch

        flat = x.detach().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    a = np.asarray(x, order="C")
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _dtype_tag(x: Any) -> str:
    if _is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def assert_same_tensor(got: Any, want: Any, *, bits_as: str | None = None) -> None:
    """``got`` equals ``want`` bit for bit: same library, dtype tag, shape and bytes.

    ``bits_as`` names the dtype ``want`` had when ``got`` is a numpy bit-pattern view of a
    dtype numpy lacks (bfloat16 as uint16, float8 as uint8).
    """
    if bits_as is None:
        assert type(got) is type(want) or (_is_torch(got) and _is_torch(want)), (
            f"got a {type(got).__name__}, want a {type(want).__name__}"
        )
        assert _dtype_tag(got) == _dtype_tag(want), (_dtype_tag(got), _dtype_tag(want))
    else:
        assert isinstance(got, np.ndarray), f"bit patterns come as numpy, got {type(got)}"
        assert _dtype_tag(want) == bits_as, (_dtype_tag(want), bits_as)
        assert _dtype_tag(got) == DTYPES[bits_as].storage.name, (_dtype_tag(got), bits_as)
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    assert raw_bytes(got) == raw_bytes(want)


def assert_same_rows(role: str, got: list[Any], want: Iterable[Any]) -> None:
    """Per-row structures of ``batch[name]`` equal the writer's, bit for bit.

    token/tensor rows are tensors or None; media rows are lists of tensors or None.
    """
    want = list(want)
    assert isinstance(got, list), f"ragged fields decode to a list, got {type(got).__name__}"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"row {i}: want None, got {g!r}"
        elif role == "media":
            assert isinstance(g, list), f"row {i}: a media row is a list, got {type(g)}"
            assert len(g) == len(w), f"row {i}: {len(g)} segments, want {len(w)}"
            for gs, ws in zip(g, w, strict=True):
                assert_same_tensor(gs, _like(ws, gs))
        else:
            assert_same_tensor(g, _like(w, g))


def assert_same_column(schema: Schema, name: str, got: Any, want: Any) -> None:
    """One decoded column equals the written one (scalars: as a 1-D tensor/array)."""
    f = schema[name]
    if f.role == "scalar":
        assert_same_tensor(got, _like(want, got))
    else:
        assert_same_rows(f.role, got, want)


def _like(want: Any, got: Any) -> Any:
    """``want`` as the library ``got`` came back in (numpy inputs decode to torch)."""
    if _is_torch(got) and isinstance(want, np.ndarray):
        import torch

        t = torch.from_numpy(np.asarray(want, order="C"))
        return (
            t.view(torch.bfloat16) if want.dtype == np.uint16 and got.dtype == torch.bfloat16 else t
        )
    return want


def replace_column(rb: pa.RecordBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    """``rb`` with column ``name`` swapped for ``array``, keeping every field's metadata."""
    i = rb.schema.get_field_index(name)
    arrays = list(rb.columns)
    arrays[i] = array
    fields = list(rb.schema)
    fields[i] = fields[i].with_type(array.type)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=rb.schema.metadata))


def media_array(rows: list[list[bytes] | None]) -> pa.Array:
    """A media payload column (``large_list<dictionary<int32, large_binary>>``) from bytes,
    one dictionary entry per segment."""
    flat = [seg for row in rows if row is not None for seg in row]
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + (len(row) if row is not None else 0))
    entries = pa.DictionaryArray.from_arrays(
        pa.array(range(len(flat)), type=pa.int32()), pa.array(flat, type=pa.large_binary())
    )
    mask = pa.array([row is None for row in rows]) if any(r is None for r in rows) else None
    return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), entries, mask=mask)


def drop_column(rb: pa.RecordBatch, name: str) -> pa.RecordBatch:
    """``rb`` without column ``name``, metadata kept."""
    i = rb.schema.get_field_index(name)
    keep = [j for j in range(rb.num_columns) if j != i]
    schema = pa.schema([rb.schema.field(j) for j in keep], metadata=rb.schema.metadata)
    return pa.RecordBatch.from_arrays([rb.column(j) for j in keep], schema=schema)


def ipc_bytes(rb: pa.RecordBatch) -> bytes:
    """One record batch as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as writer:
        writer.write_batch(rb)
    return sink.getvalue().to_pybytes()


def read_ipc(data: bytes | pa.Buffer) -> pa.RecordBatch:
    """The single record batch of an IPC stream, its buffers pointing into ``data``."""
    reader = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(data)))
    batches = list(reader)
    assert len(batches) == 1, f"expected one record batch, got {len(batches)}"
    return batches[0]


def buffer_span(buf: pa.Buffer) -> tuple[int, int]:
    """``[start, stop)`` addresses of an Arrow buffer."""
    return buf.address, buf.address + buf.size


def tensor_span(t: Any) -> tuple[int, int]:
    """``[start, stop)`` addresses of a torch tensor's or numpy array's bytes."""
    if _is_torch(t):
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    return t.ctypes.data, t.ctypes.data + t.nbytes
