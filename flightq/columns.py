"""The decoded columns of a :class:`flightq.batch.Batch`: per-row views of one field.

A token or tensor field's rows are views of one flat base over the received payloads; a
media field's segments are views of its dictionary's entries (a prompt group's rows
share their image); a scalar field is one 1-D tensor; an object field's rows are the
Python values its payloads decode to; a field over several record
batches of one answer is a :class:`ChunkedColumn`. Nothing is copied unless asked
(``copy=True``); compressed payloads are decoded into one new buffer per column.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from .codecs import RAW, decode_frames
from .errors import DecodeError, MissingFieldError, ShapeError
from .layout import KEY, SHAPE_SUFFIX, Packed, binary_offsets
from .schema import Field
from .tensor import column_base, nbytes_for, row_view

__all__ = [
    "Column",
    "TensorColumn",
    "MediaColumn",
    "ScalarColumn",
    "ObjectColumn",
    "ChunkedColumn",
    "Packed",
]

#: Rows up to which a column's shapes are read as Python values at once.
_FEW = 8


def _offsets_of(lengths: np.ndarray, as_: str, device: Any = None) -> Any:
    """Row offsets (N + 1, int32) from per-row lengths, as numpy or torch."""
    offs = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    return _as_offsets(offs, as_, device)


def _as_offsets(offs: np.ndarray, as_: str, device: Any = None) -> Any:
    """Row offsets (N + 1, int64, from 0) as int32, numpy or torch.

    Raises
    ------
    ShapeError
        If the last offset does not fit int32.
    """
    if offs[-1] > np.iinfo(np.int32).max:
        raise ShapeError(
            f"{int(offs[-1])} rows' elements overflow int32 offsets (cu_seqlens); "
            "pack fewer rows at a time",
            actual=int(offs[-1]),
        )
    out = offs.astype(np.int32)
    if as_ == "numpy":
        return out
    import torch

    t = torch.from_numpy(out)
    return t if device is None else t.to(device)


class Column:
    """Base of the decoded columns."""

    def __init__(self, f: Field, rb: pa.RecordBatch, as_: str, copy: bool) -> None:
        self.field = f
        self.as_ = as_
        self.copy = copy
        self.payload = rb.column(f.name)
        self._rb = rb
        #: Every row carries the field.
        self.complete = self.payload.null_count == 0
        #: Jagged offsets this column may share (:func:`_jagged`): its batch's list for a
        #: token field (set by the batch), else its own.
        self.ragged: list[Any] = []

    _valid: np.ndarray | None = None

    @property
    def valid(self) -> np.ndarray:
        """Per row, whether it carries the field (bool array)."""
        if self._valid is None:
            self._valid = (
                np.ones(len(self.payload), dtype=bool)
                if self.complete
                else self.payload.is_valid().to_numpy(zero_copy_only=False)
            )
        return self._valid

    def __len__(self) -> int:
        return len(self.payload)

    def _first_lacking(self) -> str | None:
        """The key of the first row that lacks the field."""
        i = int(np.argmin(self.valid)) if len(self) else 0
        return None if self.complete else str(self._rb.column(KEY)[i].as_py())

    def rows(self) -> Any:
        """The per-row structure of ``Batch.__getitem__``."""
        raise NotImplementedError

    def decoded(self) -> None:
        """Decode a codec's frames now where the column leaves them to a first access,
        each checked as exactly as validation checks it (a bad frame fails here). A token
        or tensor column decodes them as it is made."""

    _rows: Any = None

    def cached_rows(self) -> Any:
        """:meth:`rows`, built once (callers copy a list before handing it out)."""
        if self._rows is None:
            self._rows = self.rows()
        return self._rows

    def packed(self) -> Packed:
        """Every row end to end, and the rows' int32 offsets: token and tensor fields
        (:meth:`TensorColumn.packed`).

        Raises
        ------
        ShapeError
            Naming the field and its role, for a field of another role.
        """
        raise self._no_form("packed()", "token and tensor fields")

    def jagged(self) -> Any:
        """The rows as one jagged nested tensor: token and tensor fields
        (:meth:`TensorColumn.jagged`).

        Raises
        ------
        ShapeError
            Naming the field and its role, for a field of another role.
        """
        raise self._no_form("jagged()", "token and tensor fields")

    def cat(self) -> Packed:
        """Every row's media segments along dim 0, and row offsets: media fields
        (:meth:`MediaColumn.cat`).

        Raises
        ------
        ShapeError
            Naming the field and its role, for a field of another role.
        """
        raise self._no_form("cat()", "media fields")

    def _no_form(self, form: str, takes: str) -> ShapeError:
        f = self.field
        return ShapeError(
            f"field {f.name!r} is {'an' if f.role[0] in 'aeiou' else 'a'} {f.role} field: "
            f"{form} takes {takes}",
            field=f.name,
            expected=takes,
            actual=f.role,
        )


def _decoded_base(
    f: Field,
    payloads: pa.Array,
    shapes: list[tuple[int, ...] | None] | None,
    as_: str,
    key: Callable[[int], str] | None = None,
    offs: np.ndarray | None = None,
) -> tuple[Any, np.ndarray]:
    """One flat view over a binary array's payloads, and each payload's element offset
    and, last, the view's length (N + 1 offsets: payload ``i`` spans ``[at[i], at[i + 1])``).

    Raw payloads are viewed in place; compressed ones are decoded into one new buffer,
    each straight into its place and bounded by its shape (``None``: a payload no row
    uses, skipped). ``key(i)`` names payload ``i``'s row in an error; ``offs``, where
    known, are the payloads' byte offsets.
    """
    dt = f.dt
    if f.codec is RAW:
        bufs = payloads.buffers()
        offs = binary_offsets(payloads) if offs is None else offs
        data = bufs[2]
        if len(offs) <= _FEW + 1:  # a few rows: Python's arithmetic beats numpy's calls
            at = offs.tolist()
            lo, size = at[0], dt.itemsize
            base = column_base(data if data is not None else b"", lo, at[-1], dt, as_)
            return base, np.array([(o - lo) // size for o in at], dtype=np.int64)
        base = column_base(data if data is not None else b"", int(offs[0]), int(offs[-1]), dt, as_)
        return base, (offs - offs[0]) // dt.itemsize
    assert shapes is not None  # compressed payloads are sized by their shapes
    sizes = np.array(
        [0 if s is None else nbytes_for(s, dt.itemsize) for s in shapes], dtype=np.int64
    )
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    try:
        out = np.empty(int(starts[-1]), dtype=np.uint8)
    except MemoryError as e:
        raise DecodeError(
            f"column {f.name!r}: its shapes need {int(starts[-1])} decoded bytes, more than "
            "this process can allocate; ask for fewer rows at a time",
            field=f.name,
            expected=int(starts[-1]),
        ) from e
    data = payloads.buffers()[2]
    offs = binary_offsets(payloads).tolist()
    at = starts.tolist()
    mv = memoryview(data) if data is not None else memoryview(b"")
    dst = out.data
    used = [i for i, shape in enumerate(shapes) if shape is not None]
    failed = decode_frames(
        f.codec,
        [mv[offs[i] : offs[i + 1]] for i in used],
        [at[i + 1] - at[i] for i in used],
        [dst[at[i] : at[i + 1]] for i in used],
    )
    if failed is not None:  # the codec knows bytes, not columns or rows
        i, why = used[failed[0]], failed[1]
        k = key(i) if key is not None else None
        raise DecodeError(
            f"column {f.name!r}: {why}" + ("" if k is None else f" (row key {k!r})"),
            field=f.name,
            key=k,
            expected=why.expected,
            actual=why.actual,
        ) from why
    base = column_base(out, 0, len(out), dt, as_)
    return base, starts // dt.itemsize


class TensorColumn(Column):
    """A token or tensor field: one tensor per row.

    ``flat``: where validation found every row present and 1-D with a raw payload, the
    rows' dims and the payloads' byte offsets (:attr:`flightq.validation.Checked.flat`),
    taken as they are instead of read again.
    """

    def __init__(
        self,
        f: Field,
        rb: pa.RecordBatch,
        as_: str,
        copy: bool,
        flat: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        super().__init__(f, rb, as_, copy)
        self._shapes: list[tuple[int, ...] | None] | None = None
        #: The shape column's offsets (None: one dim per row, every row, from ``flat``).
        self._offs: np.ndarray | None = None
        if flat is not None and f.codec is RAW and self.complete:
            self._dims, payload_offsets = flat
            self._flat = True
            self._base, at = _decoded_base(f, self.payload, None, as_, offs=payload_offsets)
            #: Each row's element offset in the base; ``_at`` also ends with its length.
            self._elem, self._at = at[:-1], at
            return
        shapes = rb.column(f.name + SHAPE_SUFFIX)
        if len(shapes) <= _FEW:
            # A few rows: their shapes as Python values at once (a null row's is None,
            # as validation holds payload and shape to agree); numpy costs more here.
            listed = [None if s is None else tuple(s) for s in shapes.to_pylist()]
            ranks = [0 if s is None else len(s) for s in listed]
            offs = np.array([0, *itertools.accumulate(ranks)], dtype=np.int64)
            self._dims = np.array([d for s in listed if s for d in s], dtype=np.int64)
            self._shapes = listed
        else:
            offs = shapes.offsets.to_numpy()
            self._dims = shapes.values.to_numpy()[int(offs[0]) : int(offs[-1])]
        lo, hi = int(offs[0]), int(offs[-1])
        self._offs = offs
        #: Every row present with a 1-D shape (token fields: validation has seen rank >= 1
        #: in each row, so one dim per row means rank 1): its dim is its element count.
        self._flat = (
            self.complete
            and hi - lo == len(offs) - 1
            and (f.role == "token" or bool((offs[1:] - offs[:-1] == 1).all()))
        )
        present = None if f.codec is RAW else self.shapes
        self._base, at = _decoded_base(
            f, self.payload, present, as_, lambda i: str(rb.column(KEY)[i].as_py())
        )
        self._elem, self._at = at[:-1], at

    @property
    def shapes(self) -> list[tuple[int, ...] | None]:
        """Each row's shape (None where the row lacks the field)."""
        if self._shapes is not None:
            return self._shapes
        if self._offs is None:  # one dim per row, every row
            shapes: list[tuple[int, ...] | None] = [(d,) for d in self._dims.tolist()]
        else:
            offs, dims = (self._offs - self._offs[0]).tolist(), self._dims.tolist()
            shapes = [
                tuple(dims[offs[i] : offs[i + 1]]) if ok else None
                for i, ok in enumerate(self.valid.tolist())
            ]
        self._shapes = shapes
        return shapes

    def __getitem__(self, i: int) -> Any:
        shape = self.shapes[i]
        if shape is None:
            return None
        return row_view(self._base, int(self._elem[i]), shape, self.copy)

    def _check_packable(self) -> None:
        f = self.field
        if f.role != "token" and (f.shape is None or len(f.shape) < 1):
            raise ShapeError(
                f"column {f.name!r}: a {f.role} field of shape {f.shape} has no row dim to "
                "pack along; packing is for token fields (and tensors of rank >= 1)",
                field=f.name,
            )
        if not self.complete:
            raise MissingFieldError(
                f"column {f.name!r}: {int((~self.valid).sum())} rows lack the field, so it "
                "cannot be packed; select rows that have it (claim with wait_for)",
                field=f.name,
                key=self._first_lacking(),
            )
        if self._flat and len(self):
            return  # every row 1-D: no trailing dims to differ
        shapes: list[tuple[int, ...]] = self.shapes  # type: ignore[assignment]
        tails = {s[1:] for s in shapes}
        if len(tails) > 1:
            raise ShapeError(
                f"column {f.name!r}: rows of trailing shapes {sorted(tails)} cannot be packed "
                "along dim 0",
                field=f.name,
            )

    def lengths(self) -> np.ndarray:
        """Each row's length along dim 0 (int64)."""
        if self._flat and len(self):
            return self._dims.astype(np.int64)  # 1-D rows: a row's dim is its length
        shapes = self.shapes
        return np.array([0 if s is None else s[0] for s in shapes], dtype=np.int64)

    def packed(self) -> Packed:
        """Every row end to end, and the rows' int32 offsets: ``(flat, cu_seqlens)``.

        What flash-attention's varlen kernels take (``cu_seqlens_q``; ``.max_len`` is
        ``max_seqlen``). ``flat`` is a view of the received buffers (``copied`` False),
        except with ``copy=True`` or a compressed field (decoded once, then viewed).

        Raises
        ------
        MissingFieldError
            If some rows lack the field.
        ShapeError
            If the rows differ in their trailing dims, or the field has no row dim.
        """
        self._check_packable()
        copied = self.copy or self.field.codec is not RAW
        if self._flat and len(self):
            # Every row present and 1-D: the base holds them end to end, and its element
            # offsets are the rows' (validation held each payload to its shape's bytes).
            flat = self._base
            if self.copy:
                flat = flat.clone() if self.as_ == "torch" else flat.copy()
            device = getattr(flat, "device", None) if self.as_ == "torch" else None
            offsets = _as_offsets(self._at, self.as_, device)
            return Packed(flat, offsets, int(self._dims.max()), copied)
        lengths = self.lengths()
        shapes: list[tuple[int, ...]] = self.shapes  # type: ignore[assignment]
        tail = shapes[0][1:] if shapes else tuple(d or 0 for d in (self.field.shape or ())[1:])
        total = int(lengths.sum())
        flat = row_view(self._base, 0, (total, *tail), self.copy)
        device = getattr(flat, "device", None) if self.as_ == "torch" else None
        offsets = _offsets_of(lengths, self.as_, device)
        top = int(lengths.max()) if len(lengths) else 0
        return Packed(flat, offsets, top, copied)

    def jagged(self) -> Any:
        """The rows as one jagged nested tensor (``torch.nested``, ``layout=torch.jagged``)
        over the received buffers, no copy: its ``values()`` are :meth:`packed`'s ``flat``.

        Raises
        ------
        MissingFieldError, ShapeError
            As :meth:`packed`.
        """
        return _jagged(self.packed(), self.ragged)

    def rows(self) -> list[Any]:
        if self.copy or not self.complete or not len(self):
            return [self[i] for i in range(len(self))]
        # Every row present: cut the base in one call, then shape the views.
        if len(self) == 1:
            pieces = [self._base]
        elif self._flat and self.as_ == "torch":
            return list(self._base.split(self._dims.tolist()))
        elif self.as_ == "torch":
            counts = np.empty(len(self._elem), dtype=np.int64)
            np.subtract(self._elem[1:], self._elem[:-1], out=counts[:-1])
            counts[-1] = len(self._base) - self._elem[-1]
            pieces = list(self._base.split(counts.tolist()))
        else:  # slices in a loop: np.split's own per-piece work costs 4x more
            base, cut = self._base, [*self._elem.tolist(), len(self._base)]
            pieces = [base[cut[i] : cut[i + 1]] for i in range(len(cut) - 1)]
        if self._flat:
            return pieces
        shapes: list[tuple[int, ...]] = self.shapes  # type: ignore[assignment]
        return [
            v if len(shape) == 1 else v.reshape(shape)
            for v, shape in zip(pieces, shapes, strict=True)
        ]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a C-contiguous tensor of ``shape``."""
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


class MediaColumn(Column):
    """A media field: per row a list of zero or more segments, each with its own shape."""

    def __init__(self, f: Field, rb: pa.RecordBatch, as_: str, copy: bool) -> None:
        super().__init__(f, rb, as_, copy)
        outer = self.payload.offsets.to_numpy().astype(np.int64)
        self.row_segments = outer - outer[0]
        segs = self.payload.values.slice(int(outer[0]), int(outer[-1] - outer[0]))
        shapes = rb.column(f.name + SHAPE_SUFFIX)
        souter = shapes.offsets.to_numpy().astype(np.int64)
        seg_shapes = shapes.values.slice(int(souter[0]), int(souter[-1] - souter[0]))
        offs = seg_shapes.offsets.to_numpy().tolist()
        vals = seg_shapes.values.to_numpy().tolist()
        self.segment_shapes: list[tuple[int, ...]] = [
            tuple(vals[offs[j] : offs[j + 1]]) for j in range(len(seg_shapes))
        ]
        #: Per segment, its entry in the batch's dictionary of distinct payloads.
        self.entry = segs.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        entries = segs.dictionary
        entry_shapes: list[tuple[int, ...] | None] | None = None
        if f.codec is not RAW:  # compressed entries are sized by their segments' shapes
            entry_shapes = [None] * len(entries)
            for e, shape in zip(self.entry.tolist(), self.segment_shapes, strict=True):
                entry_shapes[e] = shape
        self._base, at = _decoded_base(f, entries, entry_shapes, as_, self._entry_key)
        self._elem = at[:-1]

    def _entry_key(self, e: int) -> str:
        """The key of the first row whose segments use entry ``e`` (for an error)."""
        j = int(np.argmax(self.entry == e))
        i = int(np.searchsorted(self.row_segments[1:], j, side="right"))
        return str(self._rb.column(KEY)[i].as_py())

    @property
    def counts(self) -> np.ndarray:
        """Segments per row (0 for a row with no media and for a row without the field)."""
        return np.diff(self.row_segments)

    def segment(self, j: int) -> Any:
        """Segment ``j`` of the whole column (rows in order); shared segments share memory."""
        return row_view(
            self._base, int(self._elem[self.entry[j]]), self.segment_shapes[j], self.copy
        )

    def __getitem__(self, i: int) -> list[Any] | None:
        if not self.complete and not self.valid[i]:
            return None
        return [self.segment(j) for j in range(self.row_segments[i], self.row_segments[i + 1])]

    def rows(self) -> list[list[Any] | None]:
        if self.copy:
            return [self[i] for i in range(len(self))]
        # One slice per distinct payload, then a view of it per segment: the rows of a
        # prompt group get their own views of the one image. (Not expand + unbind: torch
        # counts those as views of one multi-output op, which in-place ops under autograd
        # refuse, so a row's view would behave differently when its image is shared.)
        starts = self._elem.tolist()
        entry, shapes = self.entry.tolist(), self.segment_shapes
        if self.as_ == "numpy":
            pieces: dict[int, Any] = {}
            for e, shape in zip(entry, shapes, strict=True):
                if e not in pieces:
                    pieces[e] = self._base[starts[e] : starts[e] + math.prod(shape)]
            views = [pieces[e].reshape(s) for e, s in zip(entry, shapes, strict=True)]
        else:
            # One strided view of the flat base per segment, straight into its storage
            # (half the cost of a slice then a view; validation has bounded every
            # segment's extent inside its entry).
            base, at = self._base, self._base.storage_offset()
            strides: dict[tuple[int, ...], tuple[int, ...]] = {}
            views = []
            for e, s in zip(entry, shapes, strict=True):
                st = strides.get(s)
                if st is None:
                    st = strides[s] = _contiguous_strides(s)
                views.append(base.as_strided(s, st, at + starts[e]))
        bounds = self.row_segments.tolist()
        if self.complete:
            return [views[a:b] for a, b in itertools.pairwise(bounds)]
        return [
            views[bounds[i] : bounds[i + 1]] if ok else None
            for i, ok in enumerate(self.valid.tolist())
        ]

    def cat(self) -> Packed:
        """All segments concatenated along dim 0, and each row's range along that dim.

        Returns ``(values, row_offsets)`` (a :class:`Packed`): row ``i``'s segments are
        ``values[row_offsets[i]:row_offsets[i + 1]]``. A view of the received buffers when
        the segments lie end to end there, in row order (the field is raw and no segment
        is shared between rows); otherwise one copy, in which a segment shared by a prompt
        group's rows repeats once per row. ``.copied`` says which happened: a trainer that
        needs each image once iterates ``batch[name]`` (views, shared images shared)
        instead.

        Raises
        ------
        ShapeError
            If segments differ in their trailing dims (e.g. tiles of different sizes).
        """
        shapes = self.segment_shapes
        trail = {s[1:] for s in shapes}
        if len(trail) > 1 or any(len(s) == 0 for s in shapes):
            raise ShapeError(
                f"column {self.field.name!r}: segments of shapes {sorted(trail)} cannot be "
                "concatenated along dim 0; iterate the rows instead",
                field=self.field.name,
            )
        tail = next(iter(trail)) if trail else ()
        copied = False
        dim0 = np.array([s[0] for s in shapes], dtype=np.int64)
        seg_start = np.zeros(len(shapes) + 1, dtype=np.int64)
        np.cumsum(dim0, out=seg_start[1:])
        row_offsets = seg_start[self.row_segments]
        total = int(seg_start[-1])
        if not shapes:
            values = row_view(self._base, 0, (0, *tail), self.copy) if tail else self._base[:0]
        elif np.array_equal(self.entry, np.arange(self.entry[0], self.entry[0] + len(shapes))):
            values = row_view(self._base, int(self._elem[self.entry[0]]), (total, *tail), self.copy)
        else:
            copied = True
            parts = [self.segment(j) for j in range(len(shapes))]
            if self.as_ == "numpy":
                values = np.concatenate(parts)
            else:
                import torch

                values = torch.cat(parts)
        top = int(np.diff(row_offsets).max()) if len(row_offsets) > 1 else 0
        return Packed(values, row_offsets, top, copied or self.copy or self.field.codec is not RAW)


class ObjectColumn(Column):
    """An object field: one msgpack value per row (``None`` where a row lacks the field),
    decoded from the payloads on first access (:mod:`flightq.objects`); a codec's frames
    are decoded first, into one buffer for the column."""

    def _key(self, i: int) -> str:
        return str(self._rb.column(KEY)[i].as_py())

    _bytes: tuple[memoryview, list[int]] | None = None

    def _values(self) -> tuple[memoryview, list[int]]:
        """The rows' msgpack bytes end to end and their N + 1 offsets."""
        if self._bytes is None:
            f = self.field
            if f.codec is RAW:
                data = self.payload.buffers()[2]
                mv = memoryview(data if data is not None else b"")
                self._bytes = (mv, binary_offsets(self.payload).tolist())
            else:
                shapes = self._rb.column(f.name + SHAPE_SUFFIX).to_pylist()
                sized = [None if s is None else tuple(s) for s in shapes]
                base, at = _decoded_base(f, self.payload, sized, "numpy", self._key)
                self._bytes = (memoryview(base), at.tolist())
        return self._bytes

    def decoded(self) -> None:
        self._values()

    def _value(self, i: int) -> Any:
        """Row ``i``'s value (it has the field); the row's key is read for an error only."""
        from .objects import unpack_value

        mv, at = self._values()
        try:
            return unpack_value(mv[at[i] : at[i + 1]], self.field.name, None)
        except DecodeError:
            return unpack_value(mv[at[i] : at[i + 1]], self.field.name, self._key(i))

    def __getitem__(self, i: int) -> Any:
        if i < 0:
            i += len(self)
        return self._value(i) if self.valid[i] else None

    def rows(self) -> list[Any]:
        return [self._value(i) if ok else None for i, ok in enumerate(self.valid.tolist())]


class ScalarColumn(Column):
    """A scalar field: one value per row, a plain Arrow column."""

    def tensor(self) -> Any:
        """The values as a 1-D tensor (or numpy array) of the field's dtype.

        Raises
        ------
        MissingFieldError
            If some rows lack the field.
        """
        if not self.complete:
            raise MissingFieldError(
                f"column {self.field.name!r}: {int((~self.valid).sum())} rows lack the field; "
                "use .rows() for a list with None entries",
                field=self.field.name,
                key=self._first_lacking(),
            )
        dt = self.field.dt
        arr = self.payload
        if dt.name == "bool":
            values = arr.to_numpy(zero_copy_only=False)
            base = values.copy() if self.copy else values
            if self.as_ == "numpy":
                return base
            import torch

            return torch.from_numpy(base)
        buf = arr.buffers()[1]
        start = arr.offset * dt.itemsize
        base = column_base(buf, start, start + len(arr) * dt.itemsize, dt, self.as_)
        return (
            base.copy()
            if self.copy and self.as_ == "numpy"
            else (base.clone() if self.copy else base)
        )

    def rows(self) -> Any:
        if self.complete:
            return self.tensor()
        dt = self.field.dt
        if not dt.native_numpy:
            raise MissingFieldError(
                f"column {self.field.name!r}: {dt.name} rows with gaps; select rows that have it",
                field=self.field.name,
                key=self._first_lacking(),
            )
        return self.payload.to_pylist()


class ChunkedColumn(Column):
    """A column over several record batches of one stream; rows in order.

    Row access stays zero-copy; :meth:`tensor` (scalars) and :meth:`cat` (media) copy
    once to join the chunks.
    """

    def __init__(self, parts: list[Column]) -> None:
        self.parts = parts
        self.field = parts[0].field
        self.as_ = parts[0].as_
        self.copy = parts[0].copy
        self.complete = all(p.complete for p in parts)
        self._starts = np.cumsum([0] + [len(p) for p in parts])
        self.ragged: list[Any] = []

    @property
    def valid(self) -> np.ndarray:
        if self._valid is None:
            self._valid = np.concatenate([p.valid for p in self.parts])
        return self._valid

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> Any:
        if i < 0:
            i += len(self)
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.parts[k][i - int(self._starts[k])]  # type: ignore[index]

    def _join(self, items: list[Any]) -> Any:
        if self.as_ == "numpy":
            return np.concatenate(items)
        import torch

        return torch.cat(items)

    def rows(self) -> Any:
        if self.field.role == "scalar" and self.complete:
            return self.tensor()
        out: list[Any] = []
        for p in self.parts:
            r = p.cached_rows()
            out.extend(r if isinstance(r, list) else list(r))
        return out

    def tensor(self) -> Any:
        """Scalars of every chunk as one 1-D tensor (see :meth:`ScalarColumn.tensor`)."""
        return self._join([p.tensor() for p in self.parts])  # type: ignore[attr-defined]

    @property
    def counts(self) -> np.ndarray:
        """Segments per row (media)."""
        return np.concatenate([p.counts for p in self.parts])  # type: ignore[attr-defined]

    def cat(self) -> Packed:
        """Media segments of every chunk along dim 0, and row offsets (one copy: the
        chunks lie in separate buffers; ``.copied`` is True)."""
        cats = [p.cat() for p in self.parts]
        # A part of no segments has no trailing dims to join on: left out.
        vals = [v for v, o in cats if int(o[-1])] or [cats[0].values]
        offs = [np.zeros(1, dtype=np.int64)]
        base = 0
        for _, o in cats:
            offs.append(o[1:] + base)
            base += int(o[-1])
        row_offsets = np.concatenate(offs)
        top = int(np.diff(row_offsets).max()) if len(row_offsets) > 1 else 0
        return Packed(self._join(vals), row_offsets, top, True)

    def packed(self) -> Packed:
        """Token rows of every chunk end to end, and int32 offsets (see
        :meth:`TensorColumn.packed`): one copy to join the chunks (``.copied`` True), a
        view when the answer came in one chunk."""
        parts = [p.packed() for p in self.parts]
        lengths = np.concatenate([np.diff(np.asarray(p.offsets, dtype=np.int64)) for p in parts])
        device = getattr(parts[0].values, "device", None) if self.as_ == "torch" else None
        offsets = _offsets_of(lengths, self.as_, device)
        top = max(p.max_len for p in parts)
        if len(parts) == 1:
            return Packed(parts[0].values, offsets, top, parts[0].copied)
        return Packed(self._join([p.values for p in parts]), offsets, top, True)

    def jagged(self) -> Any:
        """The rows as one jagged nested tensor (see :meth:`TensorColumn.jagged`)."""
        return _jagged(self.packed(), self.ragged)

    def lengths(self) -> np.ndarray:
        """Each row's length along dim 0 (int64)."""
        return np.concatenate([p.lengths() for p in self.parts])  # type: ignore[attr-defined]

    @property
    def shapes(self) -> list[tuple[int, ...] | None]:
        """Each row's shape, of every chunk (token and tensor fields; see
        :attr:`TensorColumn.shapes`)."""
        if self.field.role not in ("token", "tensor"):
            raise self._no_form("shapes", "token and tensor fields")
        return [s for p in self.parts for s in p.shapes]  # type: ignore[attr-defined]


def _jagged(p: Packed, ragged: list[Any]) -> Any:
    """A jagged nested tensor over a packed column's values (no copy of the values).

    Its offsets are the very tensor of an earlier jagged column of the same batch whose
    rows have the same lengths (``ragged`` holds them: the batch's list for a token field,
    the column's own for any other): torch gives nested tensors one ragged dim per offsets
    object and refuses arithmetic between two of different ones, so a row's token fields
    (which share its sequence length) must share it for ``logprobs * mask`` to work. A
    write into one field's ``offsets()`` therefore shows in every token field of the read.
    """
    import torch

    if not isinstance(p.values, torch.Tensor):
        raise DecodeError("a jagged nested tensor needs torch tensors: decode with as_='torch'")
    offsets = p.offsets.to(torch.int64)  # torch's jagged layout takes int64 offsets
    for known in ragged:
        same_place = known.shape == offsets.shape and known.device == offsets.device
        if same_place and torch.equal(known, offsets):
            offsets = known
            break
    else:
        ragged.append(offsets)
    if len(offsets) < 2:
        return torch.nested.nested_tensor_from_jagged(p.values, offsets)
    # Its longest row told (known here, read from no device): torch otherwise takes the
    # values' whole length, and to_padded_tensor() pads every row to the batch's tokens.
    return torch.nested.nested_tensor_from_jagged(p.values, offsets, max_seqlen=p.max_len)
