"""The closed dtype vocabulary: its tables read the same in every direction."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pyarrow as pa
import pytest

from flightq import DTypeError, SchemaError
from flightq.dtypes import DTYPES, dtype, from_numpy, from_torch

# tag: (itemsize, numpy storage, torch dtype's name, Arrow scalar type, numpy has it natively)
TABLE = {
    "bool": (1, "bool", "bool", pa.bool_(), True),
    "uint8": (1, "uint8", "uint8", pa.uint8(), True),
    "int8": (1, "int8", "int8", pa.int8(), True),
    "int16": (2, "int16", "int16", pa.int16(), True),
    "int32": (4, "int32", "int32", pa.int32(), True),
    "int64": (8, "int64", "int64", pa.int64(), True),
    "float16": (2, "float16", "float16", pa.float16(), True),
    "bfloat16": (2, "uint16", "bfloat16", pa.uint16(), False),
    "float32": (4, "float32", "float32", pa.float32(), True),
    "float64": (8, "float64", "float64", pa.float64(), True),
    "float8_e4m3fn": (1, "uint8", "float8_e4m3fn", pa.uint8(), False),
    "float8_e5m2": (1, "uint8", "float8_e5m2", pa.uint8(), False),
}


def test_the_vocabulary_is_exactly_the_twelve_tags_of_the_issue() -> None:
    assert list(DTYPES) == list(TABLE)


@pytest.mark.parametrize("tag", TABLE)
def test_each_tag_maps_to_its_itemsize_storage_and_arrow_types(tag: str) -> None:
    itemsize, storage, _, arrow, native = TABLE[tag]
    d = dtype(tag)
    assert d.name == tag
    assert d.itemsize == itemsize
    assert d.storage == np.dtype(storage).newbyteorder("<")
    assert d.storage.byteorder in ("<", "|")  # little-endian, or byte-sized
    assert d.arrow == arrow
    assert d.native_numpy is native


@pytest.mark.parametrize("tag", TABLE)
def test_each_tag_maps_to_its_torch_dtype_of_the_same_itemsize(tag: str, torch: ModuleType) -> None:
    itemsize, _, torch_name, _, _ = TABLE[tag]
    torch_dt = getattr(torch, torch_name)
    assert dtype(tag).torch() is torch_dt
    assert torch.empty(0, dtype=torch_dt).element_size() == itemsize


@pytest.mark.parametrize("tag", TABLE)
def test_torch_dtype_maps_back_to_its_tag(tag: str, torch: ModuleType) -> None:
    assert from_torch(getattr(torch, TABLE[tag][2])) == tag


@pytest.mark.parametrize("tag", [t for t, row in TABLE.items() if row[4]])
@pytest.mark.parametrize("order", ["<", ">", "="])
def test_numpy_dtype_maps_back_to_its_tag_in_either_byte_order(tag: str, order: str) -> None:
    assert from_numpy(np.dtype(TABLE[tag][1]).newbyteorder(order)) == tag


def test_numpy_bit_pattern_storage_reads_as_the_unsigned_integer_not_the_float() -> None:
    # numpy has no bfloat16: a uint16 array is refused, never silently taken for bfloat16.
    with pytest.raises(DTypeError, match=r"numpy dtype uint16 has no flightq dtype"):
        from_numpy(np.dtype(np.uint16))


def test_unknown_tag_is_a_schema_error_listing_the_vocabulary() -> None:
    with pytest.raises(SchemaError, match=r"unknown dtype 'complex64'; expected one of bool, "):
        dtype("complex64")


@pytest.mark.parametrize("dt", [np.complex64, np.uint32, np.uint64, np.str_, np.object_])
def test_numpy_dtype_outside_the_vocabulary_is_refused(dt: type) -> None:
    with pytest.raises(DTypeError, match=rf"numpy dtype {np.dtype(dt)} has no flightq dtype"):
        from_numpy(np.dtype(dt))


@pytest.mark.parametrize("name", ["complex64", "uint16", "quint8"])
def test_torch_dtype_outside_the_vocabulary_is_refused(name: str, torch: ModuleType) -> None:
    dt = getattr(torch, name)
    with pytest.raises(DTypeError, match=rf"torch dtype {dt} has no flightq dtype; supported: "):
        from_torch(dt)
