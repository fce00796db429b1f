"""One tensor to (bytes, shape, dtype) and back, zero-copy where the memory allows.

This module knows numpy and (lazily) torch, never Arrow or sockets. Bytes are always
little-endian and C-contiguous. On the way in a tensor is normalised (moved to the CPU,
made contiguous and little-endian) unless the caller asks for zero-copy, in which case
anything that would need a copy is refused. On the way out a whole column's payload is
viewed once and rows are sliced from that view, so no tensor byte is copied.
"""

from __future__ import annotations

import itertools
import operator
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .dtypes import DTYPES, DType, from_numpy, from_torch
from .errors import DTypeError, EncodeError, ShapeError

__all__ = [
    "Encoded",
    "Bulk",
    "is_torch",
    "to_bytes",
    "bulk_to_bytes",
    "nbytes_for",
    "column_base",
    "row_view",
    "MAX_NBYTES",
    "memory_key",
    "MemoryIndex",
]

#: Largest payload one tensor may declare (int64 byte offsets).
MAX_NBYTES = 2**63 - 1


@dataclass(frozen=True)
class Encoded:
    """A tensor as flat bytes: ``data`` is a 1-D uint8 numpy array (a view when possible)."""

    data: np.ndarray
    shape: tuple[int, ...]
    dtype: str


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch."""
    mod = type(x).__module__
    return mod.startswith("torch") and "torch" in sys.modules and _torch_is_tensor(x)


def _torch_is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def memory_key(x: Any) -> tuple[Any, ...] | None:
    """Identity of a tensor's memory: while both tensors live, equal keys hold equal bytes.

    The address, shape, strides and dtype of a numpy array or a torch tensor (of any
    device: CUDA addresses are unique across devices). Empty tensors get no key: their
    addresses may coincide, and sharing them saves nothing. None for anything else.
    """
    if isinstance(x, np.ndarray) and x.size:
        return ("np", x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str)
    if is_torch(x) and x.numel():
        return ("torch", x.device, x.data_ptr(), x.shape, x.stride(), x.dtype)
    return None


_V = TypeVar("_V")


class MemoryIndex(Generic[_V]):
    """Values found by tensor memory: tensors that are the same memory find one value.

    Used within one call (an encode, a put's staging) to send, store and copy a tensor
    shared by several rows once. Every object asked about is held, with its
    :func:`memory_key`, until the index goes: a tensor built on access (a fresh view per
    read) could otherwise die during the call and leave its id, or its address, to another
    tensor, which would then be taken for it.
    """

    def __init__(self) -> None:
        self._objects: dict[int, tuple[Any, tuple[Any, ...] | None]] = {}
        self._values: dict[tuple[Any, ...], _V] = {}

    def key(self, x: Any) -> tuple[Any, ...] | None:
        """``memory_key(x)``, worked out once per object."""
        known = self._objects.get(id(x))
        if known is None:
            known = self._objects[id(x)] = (x, memory_key(x))
        return known[1]

    def get(self, x: Any) -> _V | None:
        """The value of ``x``'s memory; None when it has none yet, or ``x`` has no key."""
        k = self.key(x)
        return None if k is None else self._values.get(k)

    def put(self, x: Any, value: _V) -> None:
        """Give ``x``'s memory a value (nothing happens when ``x`` has no key)."""
        k = self.key(x)
        if k is not None:
            self._values[k] = value


def nbytes_for(shape: Sequence[int], itemsize: int, where: str = "") -> int:
    """Byte length of a tensor of ``shape``, checked for negative dims and int64 overflow.

    Raises
    ------
    ShapeError
        If a dim is negative or the byte length does not fit in int64.
    """
    n = itemsize
    for d in shape:
        d = int(d)
        if d < 0:
            raise ShapeError(
                f"{where}shape {tuple(shape)} has a negative dim", actual=[int(x) for x in shape]
            )
        n *= d
    if n > MAX_NBYTES:
        raise ShapeError(
            f"{where}shape {tuple(shape)} overflows: {n} bytes does not fit in int64",
            actual=[int(x) for x in shape],
        )
    return n


def to_bytes(x: Any, *, zero_copy: bool = False, where: str = "") -> Encoded:
    """Flatten one tensor (torch or numpy) to little-endian bytes.

    Parameters
    ----------
    x:
        A ``torch.Tensor`` (any device) or ``numpy.ndarray``.
    zero_copy:
        Refuse any tensor that would have to be copied (non-contiguous, big-endian, not on
        the CPU) instead of copying it.
    where:
        Prefix for error messages (field and row).

    Returns
    -------
    Encoded
        The bytes as a uint8 view, the exact shape and the dtype tag.

    Raises
    ------
    DTypeError
        If the dtype has no flightq tag.
    EncodeError
        If ``x`` is not a tensor, or zero-copy was asked and a copy is needed.
    """
    if isinstance(x, np.ndarray):
        return _numpy_to_bytes(x, zero_copy, where)
    if is_torch(x):
        return _torch_to_bytes(x, zero_copy, where)
    raise EncodeError(
        f"{where}expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}; "
        "wrap Python values with torch.tensor(...) or numpy.asarray(...)",
        actual=type(x).__name__,
    )


def _numpy_to_bytes(a: np.ndarray, zero_copy: bool, where: str) -> Encoded:
    tag = from_numpy(a.dtype)
    if _big_endian(a.dtype):
        if zero_copy:
            raise EncodeError(f"{where}big-endian array needs a byte swap; pass zero_copy=False")
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:
        if zero_copy:
            raise EncodeError(
                f"{where}non-contiguous array of shape {a.shape} needs a copy; "
                "call numpy.ascontiguousarray(...) or pass zero_copy=False"
            )
        a = np.ascontiguousarray(a)
    return Encoded(a.reshape(-1).view(np.uint8), tuple(int(d) for d in a.shape), tag)


def _big_endian(dt: np.dtype) -> bool:
    return dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big")


def _torch_to_bytes(t: Any, zero_copy: bool, where: str) -> Encoded:

    tag = from_torch(t.dtype)
    try:
        # Most tensors (CPU, contiguous, no grad, a numpy dtype) are their numpy view; a
        # third of the cost of the checks below. torch refuses the rest (TypeError,
        # RuntimeError): they take the checks.
        a = t.numpy()
    except (TypeError, RuntimeError):
        a = None
    if a is not None and a.size and a.flags.c_contiguous:
        return Encoded(a.reshape(-1).view(np.uint8), a.shape, tag)
    if t.numel() == 0:  # no bytes; its strides may be anything (0 from an empty numpy array)
        return Encoded(np.empty(0, dtype=np.uint8), tuple(int(d) for d in t.shape), tag)
    if t.device.type != "cpu":
        if zero_copy:
            raise EncodeError(f"{where}tensor on {t.device} needs a copy to the CPU")
        t = t.cpu()
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        if zero_copy:
            raise EncodeError(
                f"{where}non-contiguous tensor of shape {tuple(t.shape)} needs a copy; "
                "call .contiguous() or pass zero_copy=False"
            )
        t = t.contiguous()
    shape = tuple(int(d) for d in t.shape)
    return Encoded(_torch_bytes(t).numpy(), shape, tag)


def _torch_bytes(t: Any) -> Any:
    """A contiguous tensor's memory as a flat uint8 tensor (a view)."""
    import torch

    flat = t.reshape(-1)
    if len(flat) == 1 and flat.stride(0) != 1:
        # torch calls one element contiguous whatever its stride (a slice t[::2] of two
        # elements), but refuses to view its bytes through that stride.
        flat = flat.as_strided((1,), (1,))
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(frozen=True)
class Bulk:
    """Many tensors of one dtype, checked; :meth:`copy_into` lays their bytes back to back.

    The shapes are kept as Arrow keeps a shape column: ``ranks[i]`` dims of tensor ``i``,
    all tensors' dims end to end in ``dims``, so a column's checks and its shape column
    take a few array operations, not a loop over the rows.
    """

    tensors: list[Any]
    nbytes: np.ndarray
    ranks: np.ndarray
    dims: np.ndarray
    dtype: str
    #: No torch tensor is a negative (or conjugate) view: every one's memory is its value,
    #: ``nbytes`` from its data pointer (CPU, strided, contiguous: checked).
    plain: bool = True

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each tensor's shape (built on demand; the checks use ``ranks`` and ``dims``)."""
        ends = np.cumsum(self.ranks).tolist()
        dims = self.dims.tolist()
        return [tuple(dims[e - r : e]) for r, e in zip(self.ranks.tolist(), ends, strict=True)]

    def copy_into(self, out: np.ndarray) -> None:
        """Copy every tensor's bytes, in order, into ``out`` (uint8, ``nbytes.sum()`` long).

        A sink that knows Arrow copies torch tensors from :meth:`memory` instead (faster;
        :func:`flightq.sink.copy_bulk`).
        """
        if not len(out):
            return
        x = self.tensors[0]
        if isinstance(x, np.ndarray):
            np.concatenate(self.tensors, axis=None, out=out.view(x.dtype))
            return
        import torch

        dt = DTYPES[self.dtype]
        if dt.native_numpy and self.plain:
            # numpy's concatenate of many small tensors copies faster than torch.cat.
            views = list(map(_numpy_view, self.tensors))
            np.concatenate(views, axis=None, out=out.view(dt.storage))
            return
        flat = [t.reshape(-1) for t in self.tensors]
        with torch.no_grad():  # cat resolves conjugate and negative views as to_bytes does
            torch.cat(flat, out=torch.from_numpy(out).view(x.dtype))

    def memory(self) -> tuple[list[int], list[int]] | None:
        """Where each torch tensor's bytes are: its data pointer and byte length, read now
        (a copy made later reads them then); None for numpy arrays and for torch tensors
        that are negative views (their memory is not their value).

        Raises
        ------
        EncodeError
            If a tensor's size changed since it was checked (resized meanwhile).
        """
        ts = self.tensors
        if isinstance(ts[0], np.ndarray) or not self.plain:
            return None
        import torch

        sizes = list(map(_NBYTES, ts))
        checked = self.nbytes.tolist()
        if sizes != checked:
            i = next(i for i, (a, b) in enumerate(zip(sizes, checked, strict=True)) if a != b)
            raise EncodeError(
                f"tensor {i} of a column changed size during the put ({checked[i]} bytes, "
                f"then {sizes[i]}); leave tensors unchanged until put returns"
            )
        return list(map(torch.Tensor.data_ptr, ts)), sizes

    def byte_views(self) -> list[np.ndarray] | None:
        """Each tensor's bytes as a flat uint8 view of its memory (no copy), or None for
        torch tensors that are negative views (their memory is not their value)."""
        x = self.tensors[0]
        if isinstance(x, np.ndarray):
            return [t.reshape(-1).view(np.uint8) for t in self.tensors]
        if not self.plain:
            return None
        return [_torch_bytes(t.detach()).numpy() for t in self.tensors]


def bulk_to_bytes(xs: Sequence[Any]) -> Bulk | None:
    """Check many tensors for one flat little-endian copy, when none needs normalising.

    The common case of a column, in a few calls instead of :func:`to_bytes` per tensor:
    every ``x`` a ``numpy.ndarray`` (or every one a CPU ``torch.Tensor``), all of one
    dtype with a flightq tag, C-contiguous and little-endian. The bytes
    :meth:`Bulk.copy_into` writes equal those :func:`to_bytes` gives tensor by tensor.
    Each check is one pass of a C-level ``map`` over the tensors.

    Returns
    -------
    Bulk or None
        None when any tensor differs: the caller converts them one by one, which
        normalises or says why it cannot.
    """
    if not xs:
        return None
    if type(xs[0]) is np.ndarray:
        return _numpy_bulk(xs)
    if is_torch(xs[0]):
        return _torch_bulk(xs)
    return None


def _layout(xs: list[Any], itemsize: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per tensor its byte length and rank, and every tensor's dims end to end (int64)."""
    n = len(xs)
    shapes = list(map(_SHAPE, xs))
    ranks = np.fromiter(map(len, shapes), np.int64, n)
    dims = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, int(ranks.sum()))
    if len(dims) == n and (ranks == 1).all():  # 1-D rows (token fields): dims are lengths
        return dims * itemsize, ranks, dims
    return np.fromiter(map(_NBYTES, xs), np.int64, n), ranks, dims


def _numpy_bulk(xs: Sequence[Any]) -> Bulk | None:
    xs = list(xs)
    if set(map(type, xs)) != {np.ndarray}:
        return None
    dts = set(map(_DTYPE, xs))
    if len(dts) != 1:
        return None
    (dt,) = dts
    if _big_endian(dt) or not all(map(_C_CONTIGUOUS, xs)):
        return None
    try:
        tag = from_numpy(dt)
    except DTypeError:
        return None
    return Bulk(xs, *_layout(xs, dt.itemsize), tag)


def _torch_bulk(xs: Sequence[Any]) -> Bulk | None:
    import torch

    xs = list(xs)
    T = torch.Tensor
    if set(map(type, xs)) != {T}:
        return None
    dts = set(map(_DTYPE, xs))
    if len(dts) != 1:
        return None
    (dt,) = dts
    try:
        tag = from_torch(dt)
    except DTypeError:
        return None
    # One pass per property, each a C-level map: the memory of a CPU, strided, contiguous
    # tensor (nested ones aside) is its bytes, from its data pointer.
    if not all(map(_IS_CPU, xs)) or set(map(_LAYOUT, xs)) != {torch.strided}:
        return None
    if any(map(_IS_NESTED, xs)) or not all(map(T.is_contiguous, xs)):
        return None
    # flightq has no complex dtype, so no conjugate view: the negative bit is the one way
    # a tensor's memory differs from its value (``x.conj().imag``).
    plain = not any(map(T.is_neg, xs))
    n, itemsize = len(xs), xs[0].element_size()
    ranks = np.fromiter(map(T.dim, xs), np.int64, n)
    if (ranks == 1).all():  # 1-D rows (token fields): a length each, no torch.Size built
        dims = np.fromiter(map(T.numel, xs), np.int64, n)
        return Bulk(xs, dims * itemsize, ranks, dims, tag, plain)
    nbytes, ranks, dims = _layout(xs, itemsize)
    return Bulk(xs, nbytes, ranks, dims, tag, plain)


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NBYTES = operator.attrgetter("nbytes")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")
_IS_CPU = operator.attrgetter("is_cpu")
_LAYOUT = operator.attrgetter("layout")
_IS_NESTED = operator.attrgetter("is_nested")


def _numpy_view(t: Any) -> np.ndarray:
    """A checked CPU tensor's numpy view (detached: a tensor needing grad has one too)."""
    return t.detach().numpy()


#: Set once torch has given (and flightq silenced) its once-per-process warning about
#: tensors over read-only memory.
_TORCH_WARNED = False


def column_base(buf: Any, start: int, stop: int, dt: DType, as_: str) -> Any:
    """View ``buf[start:stop]`` as a flat array of ``dt`` elements, without copying.

    Never copies. Buffers received over gRPC are often not aligned to the element size;
    they are viewed in place all the same (numpy and torch CPU kernels accept unaligned
    data on x86-64 and arm64). Callers who want aligned, writable memory decode with
    ``copy=True``.

    Parameters
    ----------
    buf:
        Any object with the buffer protocol (a ``pyarrow.Buffer``, ``bytes``).
    as_:
        ``"numpy"`` or ``"torch"``.
    """
    nbytes = stop - start
    # Views are read-only even over a mutable buffer (a batch encoded in this process).
    if nbytes == 0:
        arr = np.empty(0, dtype=dt.storage)
    elif nbytes % dt.itemsize == 0:  # the elements at once: what the views below give
        arr = np.frombuffer(buf, dtype=_view_dtype(dt), count=nbytes // dt.itemsize, offset=start)
        arr.flags.writeable = False
    else:  # not whole elements: the view below refuses it, as it always did
        arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
        arr.flags.writeable = False
        arr = arr.view(dt.storage)
        if dt.native_numpy:
            arr = arr.view(dt.storage.newbyteorder("="))
    if as_ == "numpy":
        return arr
    import torch

    global _TORCH_WARNED
    if arr.flags.writeable or _TORCH_WARNED:  # writable: an empty column, no warning due
        t = torch.from_numpy(arr)
    else:
        # Received buffers are read-only; the tensors are documented as read-only views.
        # torch warns about that once per process: silence that one warning.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = torch.from_numpy(arr)
        _TORCH_WARNED = True
    if not dt.native_numpy:
        t = t.view(dt.torch())
    return t


#: Per dtype, the numpy dtype :func:`column_base` views elements as (native byte order
#: where numpy has the dtype; bfloat16 and float8 as their little-endian storage).
_VIEW_DTYPES: dict[str, np.dtype] = {}


def _view_dtype(dt: DType) -> np.dtype:
    got = _VIEW_DTYPES.get(dt.name)
    if got is None:
        got = _VIEW_DTYPES[dt.name] = (
            dt.storage.newbyteorder("=") if dt.native_numpy else dt.storage
        )
    return got


def row_view(base: Any, elem_offset: int, shape: tuple[int, ...], copy: bool) -> Any:
    """One row's tensor: a slice of a column base, reshaped (numpy or torch alike)."""
    n = 1
    for d in shape:
        n *= d
    v = base[elem_offset : elem_offset + n].reshape(shape)
    return v.copy() if copy and isinstance(v, np.ndarray) else (v.clone() if copy else v)
