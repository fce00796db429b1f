"""The closed dtype vocabulary and its numpy, torch and Arrow tables.

A dtype on the wire is a short stable tag (``"float32"``, ``"bfloat16"``). Tensor payloads
travel as raw little-endian bytes, so what matters is the itemsize and how each side views
the bytes. numpy has no bfloat16 or float8: those travel (and, as numpy, come back) as their
bit patterns in ``uint16``/``uint8``; torch views them natively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import DTypeError, SchemaError

__all__ = ["DType", "DTYPES", "dtype", "from_numpy", "from_torch"]


@dataclass(frozen=True)
class DType:
    """One entry of the vocabulary.

    Attributes
    ----------
    name:
        The wire tag, also the torch attribute name (``torch.<name>``).
    itemsize:
        Bytes per element.
    storage:
        The numpy dtype that holds the bytes (little-endian); for bfloat16 and float8 the
        unsigned integer of the same width.
    native_numpy:
        Whether numpy has this dtype itself (False for bfloat16 and float8).
    arrow:
        The Arrow type of a scalar column of this dtype (bit patterns for the non-native ones).
    """

    name: str
    itemsize: int
    storage: np.dtype
    native_numpy: bool
    arrow: pa.DataType

    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)


def _d(name: str, storage: str, native: bool, arrow: pa.DataType) -> DType:
    st = np.dtype(storage).newbyteorder("<")
    return DType(name, st.itemsize, st, native, arrow)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _d("bool", "bool", True, pa.bool_()),
        _d("uint8", "u1", True, pa.uint8()),
        _d("int8", "i1", True, pa.int8()),
        _d("int16", "i2", True, pa.int16()),
        _d("int32", "i4", True, pa.int32()),
        _d("int64", "i8", True, pa.int64()),
        _d("float16", "f2", True, pa.float16()),
        _d("bfloat16", "u2", False, pa.uint16()),
        _d("float32", "f4", True, pa.float32()),
        _d("float64", "f8", True, pa.float64()),
        _d("float8_e4m3fn", "u1", False, pa.uint8()),
        _d("float8_e5m2", "u1", False, pa.uint8()),
    )
}

# numpy dtype (native byte order) to tag, for the dtypes numpy has.
_NUMPY_TO_TAG: dict[np.dtype, str] = {
    np.dtype(d.storage.str.replace("<", "=")): d.name for d in DTYPES.values() if d.native_numpy
}


def dtype(name: str) -> DType:
    """Look a tag up, with a readable error.

    Raises
    ------
    SchemaError
        If ``name`` is not in the vocabulary.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise SchemaError(
            f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}",
            actual=name if isinstance(name, str) else None,
        ) from None


def from_numpy(dt: np.dtype) -> str:
    """The tag of a numpy dtype, either byte order.

    ``ml_dtypes`` arrays (bfloat16, float8) are recognised by name.

    Raises
    ------
    DTypeError
        If numpy's dtype has no tag.
    """
    tag = _NUMPY_TO_TAG.get(dt)  # the common case, without numpy's slow dtype.name
    if tag is not None:
        return tag
    dt = np.dtype(dt)
    if dt.name in DTYPES and not DTYPES[dt.name].native_numpy:
        return dt.name  # ml_dtypes.bfloat16 and friends
    tag = _NUMPY_TO_TAG.get(dt.newbyteorder("="))
    if tag is None:
        raise DTypeError(
            f"numpy dtype {dt} has no flightq dtype; supported: {', '.join(DTYPES)}",
            actual=str(dt),
        )
    return tag


def from_torch(dt: Any) -> str:
    """The tag of a torch dtype (``torch.float32`` to ``"float32"``).

    Raises
    ------
    DTypeError
        If the torch dtype has no tag (complex, quantised, unsigned wider than 8 bits).
    """
    name = str(dt).removeprefix("torch.")
    if name not in DTYPES:
        raise DTypeError(
            f"torch dtype {dt} has no flightq dtype; supported: {', '.join(DTYPES)}",
            actual=name,
        )
    return name
