"""A put's columns as the per-row structures :func:`flightq.encode` takes.

A put accepts, besides plain per-row sequences, a ``tensordict.TensorDict`` whose batch
dimension is the rows, jagged nested tensors (``torch.nested``, either layout) as ragged
columns, and :class:`flightq.Packed` columns (``(values, offsets)``, what
``column(name).packed()`` returns). All are taken apart here, with no copy:

- a token or tensor column whose rows already lie end to end in one CPU tensor (a jagged
  nested tensor, a ``Packed``, a dense C-contiguous tensor whose first dim is the rows)
  becomes :class:`PackedRows`: the encoder checks and lays it out a column at a time and
  sends its memory as it is, never a tensor per row;
- any other nested tensor is unbound into its rows, a ``NonTensorStack`` into its Python
  values; any other dense tensor stays as it is (its first dim is the rows);
- an object field's values (a list, a ``NonTensorStack``, a 1-D numpy object array)
  become their msgpack bytes, a ``uint8`` array per row (:mod:`flightq.objects`).

Media take one segment per row from a tensor column (a row's patches, however many images
they hold); several segments per row travel as a list of lists (a ``NonTensorStack`` in a
TensorDict).

A TensorDict returned by a get or claim (``as_="tensordict"``) can be put back as it
is: its ``__key__`` entry is checked against the put's keys (rows out of order are
refused), its ``__tags__`` entry is not written (tags go through ``tags=``).

Nothing here imports torch or tensordict: both are recognised by their types' modules.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import EncodeError, ShapeError
from .layout import KEY, TAGS, Packed, int_offsets
from .schema import Schema

__all__ = ["columns_of", "is_tensordict", "is_nested", "PackedRows"]


def is_tensordict(x: Any) -> bool:
    """Whether ``x`` is a ``tensordict`` TensorDict (any of its classes)."""
    mod = type(x).__module__
    return mod.startswith("tensordict") and hasattr(x, "batch_size") and hasattr(x, "keys")


def is_nested(x: Any) -> bool:
    """Whether ``x`` is a torch nested tensor (jagged or strided layout)."""
    return bool(getattr(x, "is_nested", False)) and type(x).__module__.startswith("torch")


def _non_tensor(x: Any) -> bool:
    name = type(x).__name__
    return type(x).__module__.startswith("tensordict") and name in (
        "NonTensorStack",
        "NonTensorData",
    )


def columns_of(columns: Any, schema: Schema | None = None, keys: Any = None) -> Mapping[str, Any]:
    """``columns`` as a mapping of field name to per-row data.

    Plain mappings without nested tensors are returned unchanged; the rest is taken
    apart into per-row views (see the module docstring).

    Parameters
    ----------
    columns:
        A mapping of field name to column, or a TensorDict (batch dim = rows).
    schema:
        The put's schema: media fields given as one tensor take one segment per row.
    keys:
        The put's row keys, checked against a TensorDict's ``__key__`` entry.

    Raises
    ------
    EncodeError
        For a TensorDict without a batch dimension, a nested TensorDict entry, or a
        ``__key__`` entry that differs from ``keys``.
    """
    if type(columns) is _PerRow:
        return columns  # taken apart already (a put passes its columns on, layer by layer)
    if is_tensordict(columns):
        return _PerRow(_from_tensordict(columns, schema, keys))
    if not isinstance(columns, Mapping):
        raise EncodeError(
            f"columns are a mapping of field name to per-row data, or a TensorDict; got "
            f"{type(columns).__name__}",
            actual=type(columns).__name__,
        )
    if not any(_taken_apart(v, schema, name) for name, v in columns.items()):
        return _PerRow(columns)
    return _PerRow({name: _column(name, v, schema, keys) for name, v in columns.items()})


def _taken_apart(v: Any, schema: Schema | None, name: str) -> bool:
    """Whether :func:`_column` changes the column ``v``."""
    if is_nested(v) or _non_tensor(v) or type(v) is Packed or _object_field(schema, name):
        return True
    return _dense_rows(v) and _rows_field(schema, name)


def _object_field(schema: Schema | None, name: str) -> bool:
    """Whether ``name`` is an object field of ``schema`` (one msgpack value per row)."""
    return schema is not None and name in schema and schema[name].role == "object"


def _objects(name: str, v: Any, keys: Any) -> Sequence[Any]:
    """An object column's values as their msgpack bytes (:func:`flightq.objects.pack_values`:
    end to end in one ``uint8`` array where every row has one, else an array per row).

    Raises
    ------
    EncodeError, ShapeError
        For a column that is not one value per row, or a value an object field cannot
        hold (naming the row).
    """
    from .objects import pack_values

    if _non_tensor(v):
        v = _values(v)
    elif isinstance(v, np.ndarray) and v.dtype == object and v.ndim == 1:
        v = v.tolist()
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Sequence):
        raise EncodeError(
            f"column {name!r}: an object field takes one value per row (a list), got "
            f"{type(v).__name__}",
            field=name,
            actual=type(v).__name__,
        )
    names = [str(i) for i in range(len(v))] if keys is None else list(keys)
    if len(v) != len(names):
        raise ShapeError(
            f"column {name!r}: {len(v)} rows for {len(names)} keys",
            field=name,
            expected=len(names),
            actual=len(v),
        )
    return pack_values(name, v, names)  # as it is where an earlier layer of the put packed it


class _PerRow(dict[str, Any]):
    """Columns :func:`columns_of` has taken apart: given again, they pass as they are."""


def _from_tensordict(td: Any, schema: Schema | None, keys: Any) -> dict[str, Any]:
    if len(td.batch_size) < 1:
        raise EncodeError(
            "a TensorDict put needs a batch dimension (the rows): got batch_size [] ; "
            "build it with batch_size=[len(keys)] or td.unsqueeze(0) for one row",
            expected="batch_size [N]",
            actual="[]",
        )
    out: dict[str, Any] = {}
    for name in td.keys():  # noqa: SIM118 (iterating a TensorDict yields rows)
        if not isinstance(name, str):
            raise EncodeError(
                f"TensorDict entry {name!r}: field names are strings", actual=repr(name)
            )
        v = td.get(name)
        if name == KEY:
            got = list(_values(v))
            if keys is not None and got != list(keys):
                raise EncodeError(
                    f"TensorDict entry {KEY!r} holds other keys than the put's "
                    f"(first {got[:3]} against {list(keys)[:3]}): its rows would land "
                    "under the wrong keys; pass keys=td['__key__']",
                    field=KEY,
                )
            continue
        if name == TAGS:
            continue
        if is_tensordict(v) and not _non_tensor(v):
            raise EncodeError(
                f"TensorDict entry {name!r} is a nested TensorDict; flightq columns are "
                "flat: td.flatten_keys('_') names its entries 'outer_inner'",
                field=name,
            )
        out[name] = _column(name, v, schema, keys)
    return out


def _values(v: Any) -> list[Any]:
    """A NonTensorStack's (or NonTensorData's) per-row Python values."""
    got = v.tolist()
    return got if isinstance(got, list) else [got]


def _column(name: str, v: Any, schema: Schema | None, keys: Any = None) -> Any:
    if _object_field(schema, name):
        return _objects(name, v, keys)
    media = schema is not None and name in schema and schema[name].role == "media"
    if _non_tensor(v):
        return _values(v)
    if type(v) is Packed:
        if media:
            raise ShapeError(
                f"column {name!r}: a media column is one list of segments per row, not a "
                "Packed column (which would merge a row's images into one segment and give "
                "a row without media an empty one); put the rows' segment lists",
                field=name,
            )
        # On a GPU too: a put stages the values to the host in one copy (flightq.cuda.put).
        return _packed(name, v.values, v.offsets)
    if is_nested(v):
        if not media and _jagged_whole(v):
            offsets = v.offsets()
            offsets = offsets.cpu() if offsets.device.type != "cpu" else offsets
            return PackedRows(v.values(), offsets.numpy().astype(np.int64, copy=False))
        rows = list(v.unbind())
        return [[r] for r in rows] if media else rows
    if _dense_rows(v) and _rows_field(schema, name):
        n = v.shape[0]
        per_row = v.shape[1]
        values = v.reshape(n * per_row, *v.shape[2:])
        return PackedRows(values, np.arange(0, n * per_row + 1, max(per_row, 1), dtype=np.int64))
    if media and hasattr(v, "shape") and hasattr(v, "dim"):
        if v.dim() < 1:
            raise ShapeError(
                f"column {name!r}: a media column given as one tensor needs a row dim, got "
                f"shape {tuple(v.shape)}",
                field=name,
                actual=list(v.shape),
            )
        return [[r] for r in v.unbind(0)]
    return v


def _rows_field(schema: Schema | None, name: str) -> bool:
    """Whether ``name`` is a token or tensor field of ``schema`` (rows of dim >= 1)."""
    return schema is not None and name in schema and schema[name].role in ("token", "tensor")


def _dense_rows(v: Any) -> bool:
    """Whether ``v`` is a C-contiguous CPU tensor (numpy or torch) of rows of dim >= 1 whose
    rows lie end to end: a dense column :class:`PackedRows` can take as it is."""
    if type(v) is np.ndarray:
        return v.ndim >= 2 and v.shape[1] > 0 and v.flags.c_contiguous
    if type(v).__module__.startswith("torch") and hasattr(v, "is_contiguous") and not is_nested(v):
        return v.dim() >= 2 and v.shape[1] > 0 and v.device.type == "cpu" and v.is_contiguous()
    return False


def _jagged_whole(v: Any) -> bool:
    """Whether a nested tensor is a jagged one whose rows lie end to end in its
    ``values()`` (ragged along the rows' first dim, no holes), on any device."""
    return (
        str(v.layout) == "torch.jagged"
        and getattr(v, "_lengths", None) is None
        and getattr(v, "_ragged_idx", 1) == 1
    )


def _packed(name: str, values: Any, offsets: Any) -> PackedRows:
    """A ``Packed`` column as :class:`PackedRows`, its offsets checked.

    Raises
    ------
    ShapeError
        Naming the column, if the values are not a tensor of rows along dim 0 or the
        offsets are not N + 1 integers rising within them.
    """
    shape = getattr(values, "shape", None)
    if shape is None or len(shape) < 1:
        raise ShapeError(
            f"column {name!r}: a Packed column's values are a tensor of rows along dim 0, "
            f"got {type(values).__name__}",
            field=name,
        )
    o = int_offsets(offsets)
    if o is None or o.ndim != 1 or len(o) < 1:
        raise ShapeError(
            f"column {name!r}: a Packed column's offsets are N + 1 integers, got "
            f"{getattr(offsets, 'dtype', type(offsets).__name__)} of shape "
            f"{list(getattr(offsets, 'shape', ()))}",
            field=name,
        )
    if o[0] < 0 or o[-1] > shape[0] or (o[1:] < o[:-1]).any():
        raise ShapeError(
            f"column {name!r}: a Packed column's offsets rise from 0 or more to at most "
            f"the values' {shape[0]} rows along dim 0; got {o[:4].tolist()}...{o[-1]}",
            field=name,
            expected=int(shape[0]),
            actual=int(o[-1]),
        )
    return PackedRows(values, o)


class PackedRows(Sequence[Any]):
    """A column whose rows lie end to end in one tensor: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]`` along dim 0.

    A sequence of its rows (views) to whatever reads a column row by row; the encoder
    takes ``values`` and ``offsets`` as they are instead (:func:`flightq.encode.encode`).
    Slicing rows gives another ``PackedRows`` over the same ``values``.

    Attributes
    ----------
    values:
        A torch tensor or numpy array; a CUDA tensor's rows are staged to the host whole
        before a put encodes them (:func:`flightq.cuda.put.stage`).
    offsets:
        ``N + 1`` int64 offsets into ``values`` along dim 0, rising (numpy).
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: Any, offsets: np.ndarray) -> None:
        self.values = values
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(a, b, step)]
            return PackedRows(self.values, self.offsets[a : max(a, b) + 1])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __iter__(self) -> Iterator[Any]:
        o = self.offsets
        if len(o) < 2:
            return iter(())
        whole = self.values[int(o[0]) : int(o[-1])]
        if type(whole) is np.ndarray:  # slices: np.split's per-piece work costs 4x more
            cut = (o - o[0]).tolist()
            return iter([whole[cut[i] : cut[i + 1]] for i in range(len(cut) - 1)])
        return iter(whole.split(np.diff(o).tolist()))

    def _row_bytes(self) -> int:
        """The bytes of one element along dim 0 (a token, a row of a tensor's rows)."""
        v = self.values
        return math.prod(v.shape[1:]) * int(v.itemsize)

    @property
    def nbytes(self) -> int:
        """The bytes of every row."""
        return int(self.offsets[-1] - self.offsets[0]) * self._row_bytes()

    def row_nbytes(self) -> np.ndarray:
        """Each row's bytes (int64)."""
        return np.diff(self.offsets) * self._row_bytes()
