"""A put's columns as the per-row structures :func:`flightq.encode` takes.

A put accepts, besides plain per-row sequences, a ``tensordict.TensorDict`` whose batch
dimension is the rows, and jagged nested tensors (``torch.nested``, either layout) as
ragged columns. Both are taken apart here into per-row views, with no copy: a nested
tensor is unbound into its rows, a ``NonTensorStack`` into its Python values, a dense
tensor stays as it is (its first dim is the rows). Media take one segment per row from a
tensor column (a row's patches, however many images they hold); several segments per row
travel as a list of lists (a ``NonTensorStack`` in a TensorDict).

A TensorDict returned by a get or claim (``as_="tensordict"``) can be put back as it
is: its ``__key__`` entry is checked against the put's keys (rows out of order are
refused), its ``__tags__`` entry is not written (tags go through ``tags=``).

Nothing here imports torch or tensordict: both are recognised by their types' modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import EncodeError, ShapeError
from .layout import KEY, TAGS
from .schema import Schema

__all__ = ["columns_of", "is_tensordict", "is_nested"]


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
    if not any(is_nested(v) or _non_tensor(v) for v in columns.values()):
        return _PerRow(columns)
    return _PerRow({name: _column(name, v, schema) for name, v in columns.items()})


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
        out[name] = _column(name, v, schema)
    return out


def _values(v: Any) -> list[Any]:
    """A NonTensorStack's (or NonTensorData's) per-row Python values."""
    got = v.tolist()
    return got if isinstance(got, list) else [got]


def _column(name: str, v: Any, schema: Schema | None) -> Any:
    media = schema is not None and name in schema and schema[name].role == "media"
    if _non_tensor(v):
        return _values(v)
    if is_nested(v):
        rows = list(v.unbind())
        return [[r] for r in rows] if media else rows
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
