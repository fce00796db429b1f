"""A decoded :class:`~flightq.Batch` as a ``tensordict.TensorDict``, rows as its batch dim.

What each role becomes is decided by the schema, never by the values:

``token``
    a jagged nested tensor (``torch.nested``, ``layout=torch.jagged``) over the received
    buffers, no copy (rows of several record batches are joined once);
``tensor``
    a dense ``(N, *shape)`` tensor when the declared shape is fixed (a view), a jagged
    nested tensor when only its first dim varies, else a ``NonTensorStack`` of the rows;
``scalar``
    a 1-D tensor of N values (a view);
``media``
    a ``NonTensorStack`` of per-row segment lists (views: a prompt group's rows share
    their image, text rows hold ``[]``).

The row keys and tags ride along as the ``NonTensorStack`` entries ``__key__`` and
``__tags__`` (no field is named with ``__``), so a trainer can write columns back:
``client.put(p, td["__key__"], {...})``, or put the TensorDict itself (its ``__key__``
is checked against the keys). A field some rows lack is refused
(:class:`~flightq.MissingFieldError`): a TensorDict has no "absent" cell.

``tensordict`` is an optional extra: ``pip install 'flightq[tensordict]'``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import DecodeError, MissingFieldError
from .layout import KEY, TAGS

if TYPE_CHECKING:
    from .batch import Batch

__all__ = ["to_tensordict", "require_tensordict", "tensordict_reads", "AS_TENSORDICT"]

#: The ``as_`` of a get or claim that returns a TensorDict.
AS_TENSORDICT = "tensordict"

F = TypeVar("F", bound=Callable[..., Any])


def require_tensordict() -> Any:
    """The ``tensordict`` module.

    Raises
    ------
    DecodeError
        If it (or torch) is not installed, naming the extra that brings it.
    """
    try:
        import tensordict
    except ImportError as e:
        raise DecodeError(
            "as_='tensordict' needs the tensordict package (pip install "
            "'flightq[tensordict]'; it needs torch), or pass as_='torch'"
        ) from e
    return tensordict


def to_tensordict(batch: Batch, meta: bool = True) -> Any:
    """``batch`` as a TensorDict of batch size ``[len(batch)]`` (see the module docstring).

    ``meta=False`` leaves out the ``__key__`` and ``__tags__`` entries: tensordict holds
    an object per row for each (about 1.5 µs a row each where :func:`_stack` takes its
    direct builder, 4 µs a tags row elsewhere), which a reader that knows its keys need
    not pay.

    Raises
    ------
    DecodeError
        If tensordict is missing, or the batch was decoded as numpy.
    MissingFieldError
        If some rows lack a field the batch carries; ask for fields every row has.
    """
    td_mod = require_tensordict()
    if batch.as_ != "torch":
        raise DecodeError("a TensorDict holds torch tensors: decode with as_='torch'")
    n = len(batch)
    out: dict[str, Any] = {}
    for name in batch.fields:
        out[name] = _entry(batch, name, td_mod)
    if meta:
        out[KEY] = td_mod.NonTensorStack.from_list(list(batch.keys))  # str: its fast path
        out[TAGS] = _stack(td_mod, batch.tags)
    return td_mod.TensorDict(out, batch_size=[n])


def _entry(batch: Batch, name: str, td_mod: Any) -> Any:
    col = batch.column(name)
    f = col.field
    if not col.complete:
        i = next(i for i, ok in enumerate(col.valid.tolist()) if not ok)
        raise MissingFieldError(
            f"field {name!r} is missing in {int((~col.valid).sum())} of {len(col)} rows "
            f"(first: row key {batch.keys[i]!r}); a TensorDict has no absent cells: ask "
            "for fields every row has (fields=[...], or claim with wait_for=[...])",
            field=name,
            key=batch.keys[i],
        )
    if f.role == "scalar":
        return col.tensor()  # type: ignore[attr-defined]
    if f.role in ("media", "object"):
        return _stack(td_mod, batch[name])
    shape = f.shape or ()
    if f.role == "token" or (shape and shape[0] is None and None not in shape[1:]):
        return col.jagged()
    if shape and None not in shape:
        return col.packed().values.view(len(col), *shape)
    rows = batch[name]
    if not shape:
        import torch

        return torch.stack(rows) if rows else torch.empty(0, dtype=f.dt.torch())
    return _stack(td_mod, rows)


def _stack(td_mod: Any, values: Sequence[Any]) -> Any:
    """``NonTensorStack(*[NonTensorData(v) for v in values])``, one member per row.

    ``NonTensorData(v)`` runs tensorclass's general constructor (about 4 µs for a row's
    tags dict); tensordict builds the same member directly for values it stores as they
    are (``NonTensorStack.from_list`` of strings and numbers, about 1.5 µs), and flightq
    builds every member so where this tensordict has that builder and it passed
    :func:`_flat_member`'s check. Elsewhere the general constructor.
    """
    flat = _flat_member(td_mod)
    if flat is None:
        return td_mod.NonTensorStack(*[td_mod.NonTensorData(v) for v in values])
    return td_mod.NonTensorStack(*[flat(v, None) for v in values])


@functools.cache
def _flat_member(td_mod: Any) -> Callable[[Any, Any], Any] | None:
    """tensordict's direct builder of a stack member (``tensorclass._flat_ntd(value,
    device)``), where it gives what ``NonTensorData(value)`` gives for a row's tags, media
    segments, key and tensor: same type, same value, no batch size, and a stack of them
    that lists and indexes as the general one does. None where it is absent or differs
    (another tensordict version): :func:`_stack` then takes the general constructor."""
    import torch

    try:
        build = importlib.import_module(td_mod.__name__ + ".tensorclass")._flat_ntd
    except (ImportError, AttributeError):
        return None
    probes = [{"uid": "p0", "n": 1}, [torch.zeros(2)], "k0", torch.zeros(2, 3)]
    try:
        made = [build(v, None) for v in probes]
        general = [td_mod.NonTensorData(v) for v in probes]
        same = all(
            type(m) is type(g) and m.batch_size == g.batch_size and m.data is g.data
            for m, g in zip(made, general, strict=True)
        )
        stack = td_mod.NonTensorStack(*made)
        listed = stack.tolist()
        same = (
            same
            and len(listed) == len(probes)
            and all(a is b for a, b in zip(listed, probes, strict=True))
        )
        same = same and stack[1].data is probes[1] and stack.batch_size == (len(probes),)
    except Exception:
        return None
    return build if same else None


#: The attribute of a claim's TensorDict holding its :class:`flightq.Claim`.
CLAIM_ATTRIBUTE = "_flightq_claim"


def tensordict_reads(method: F) -> F:
    """A client's get or claim that also answers ``as_="tensordict"``.

    The read decodes as torch, then :func:`to_tensordict` turns the batch into a
    TensorDict. tensordict is checked for first: a claim without it takes no rows.
    """

    @functools.wraps(method)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("as_") != AS_TENSORDICT:
            return method(self, *args, **kwargs)
        require_tensordict()
        kwargs["as_"] = "torch"
        batch = method(self, *args, **kwargs)
        try:
            td = to_tensordict(batch)
        except BaseException:
            if batch.claim is not None:  # a claim's rows go back before the error
                with contextlib.suppress(Exception):
                    self.nack(batch)
            raise
        if batch.claim is not None:
            # A claim's TensorDict carries its lease: client.ack(td) / client.nack(td).
            object.__setattr__(td, CLAIM_ATTRIBUTE, batch.claim)
        return td

    return read  # type: ignore[return-value]
