"""A first draft of a schema from a sample batch, for a person to review and commit.

flightq never infers a schema at write time; :func:`draft_schema` (``flightq schema
draft``) only writes one down once, from a sample the user picks: a TensorDict whose
batch dim is the rows, or a dict of batched columns. Each entry's role comes from its
layout, which the review should confirm:

- a nested tensor (jagged or strided), or a dense tensor of rank >= 2: ``token``, first
  dim the sequence (``[null, ...]``). A row's token fields share its sequence length: a
  column with a length of its own (a response beside the prompt's ids) is a ``tensor``
  of shape ``[null]``, and a fixed-size one a ``tensor`` with its shape; edit the role;
- a 1-D tensor, or a list of Python numbers: ``scalar``;
- a list (or ``NonTensorStack``) of per-row lists of tensors: ``media``, dim 0 ``null``
  (patch and tile counts vary) and the other dims those all segments share (``null``
  where they differ);
- a list of per-row tensors: ``token`` (rows differ in dim 0) or ``tensor``;
- a list (or ``NonTensorStack``, or 1-D numpy object array) of strings, bytes, dicts or
  lists holding anything but tensors (a message log): ``object``, one msgpack value per
  row.

No field is marked required: mark those every new row must carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .dtypes import from_numpy, from_torch
from .errors import EncodeError, SchemaError
from .rows import columns_of, is_nested, is_tensordict
from .schema import Field, Schema
from .tensor import is_torch

__all__ = ["draft_schema"]


def draft_schema(sample: Any, name: str, version: int = 1, doc: str = "") -> Schema:
    """A schema that declares every entry of ``sample`` (see the module docstring).

    Parameters
    ----------
    sample:
        A TensorDict (batch dim = rows) or a mapping of field name to batched column.
    name, version, doc:
        The schema's name, version and description.

    Returns
    -------
    Schema
        Write it with ``schema.to_json()`` to ``schemas/<name>/v<version>.json``.

    Raises
    ------
    SchemaError
        If an entry's name is not a field name, or its values have no dtype flightq knows.
    """
    if is_tensordict(sample):
        names = [k for k in sample.keys() if not k.startswith("__")]  # noqa: SIM118
        entries = {k: sample.get(k) for k in names}
    elif isinstance(sample, Mapping):
        entries = dict(sample)
    else:
        raise SchemaError(
            f"draft from a TensorDict or a dict of batched columns, got {type(sample).__name__}"
        )
    fields = []
    for field_name, v in entries.items():
        try:
            fields.append(_field(field_name, v))
        except (EncodeError, TypeError) as e:
            raise SchemaError(f"field {field_name!r}: {e}", field=field_name) from e
    return Schema(
        name, version, fields, doc=doc or f"drafted from a sample of {len(fields)} fields"
    )


def _dtype(x: Any) -> str:
    if is_torch(x):
        return from_torch(x.dtype)
    if isinstance(x, np.ndarray):
        return from_numpy(x.dtype)
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int64"
    if isinstance(x, float):
        return "float32"
    raise TypeError(f"values of type {type(x).__name__} have no flightq dtype")


def _common(shapes: Sequence[tuple[int, ...]]) -> list[int | None] | None:
    """The dims every shape shares (``None`` where they differ); None if ranks differ."""
    if not shapes or len({len(s) for s in shapes}) != 1:
        return None
    return [d[0] if len(set(d)) == 1 else None for d in zip(*shapes, strict=True)]


def _tensor_like(x: Any) -> bool:
    return is_torch(x) or isinstance(x, np.ndarray)


def _field(name: str, v: Any) -> Field:
    if isinstance(v, np.ndarray) and v.dtype == object:
        v = v.tolist()  # Python objects, one per row
    rows = columns_of({name: v})[name]
    dense = (is_torch(v) or isinstance(v, np.ndarray)) and not is_nested(v)
    if dense and v.ndim == 1:
        return Field(name, _dtype(v), "scalar", ())
    if dense:
        return Field(name, _dtype(v), "token", (None, *v.shape[2:]))
    rows = [r for r in rows if r is not None]
    if not rows:
        raise TypeError("every row is None: nothing to draft from")
    first = rows[0]
    if isinstance(first, (str, bytes, Mapping)) or (
        isinstance(first, (list, tuple))
        and not all(_tensor_like(x) for r in rows if isinstance(r, (list, tuple)) for x in r)
    ):  # text, a dict, a message log: one msgpack value per row
        return Field(name, "uint8", "object")
    if isinstance(first, (list, tuple)):  # media: per row a list of segments
        segs = [x for r in rows for x in r]
        if not segs:
            raise TypeError("every media row is empty: nothing to draft from")
        shape = _common([tuple(x.shape) for x in segs])
        if shape:  # patches, tiles, frames: their count varies from image to image
            shape[0] = None
        return Field(name, _dtype(segs[0]), "media", None if shape is None else tuple(shape))
    if not hasattr(first, "shape"):
        return Field(name, _dtype(first), "scalar", ())
    shape = _common([tuple(x.shape) for x in rows])
    if shape is None or not shape:
        raise TypeError("rows differ in rank (or are 0-d tensors): declare this field by hand")
    if shape[0] is None or is_nested(v):
        return Field(name, _dtype(first), "token", (None, *shape[1:]))
    return Field(name, _dtype(first), "tensor", tuple(shape))
