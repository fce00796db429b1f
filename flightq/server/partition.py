"""What the server stores: validated pieces of puts, rows that point into them, partitions.

A row holds, per field, a reference to the received record batch (a :class:`Piece`) and the
row index that carries it: nothing is rebuilt or copied on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

from ..errors import EncodeError
from ..layout import MEDIA_TYPE, TAGS, binary_offsets, media_row_bytes
from ..schema import Schema
from ..validation import Checked

__all__ = ["Piece", "Row", "Partition", "make_piece"]


@dataclass
class Piece:
    """One validated record batch of a put, with what validation learned."""

    batch: pa.RecordBatch
    checked: Checked
    tags: list[dict[str, Any] | None]
    _valid: dict[str, list[bool] | None] = field(default_factory=dict, repr=False)
    _nbytes: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def valid(self, f: str) -> list[bool] | None:
        """Per row whether the batch carries field ``f``; None when every row does."""
        if f not in self._valid:
            col = self.batch.column(f)
            self._valid[f] = None if col.null_count == 0 else col.is_valid().to_pylist()
        return self._valid[f]

    def cell_nbytes(self, f: str, i: int) -> int:
        """Payload bytes of field ``f`` in row ``i``, counted as validation counts them: a
        media entry shared by several rows counts on the first row that uses it."""
        if f not in self._nbytes:
            col = self.batch.column(f)
            if col.type == pa.large_binary():
                sizes = np.diff(binary_offsets(col)).tolist()
            elif col.type == MEDIA_TYPE:
                sizes = media_row_bytes(col).tolist()
            else:
                sizes = [0] * len(col)
            self._nbytes[f] = sizes
        return self._nbytes[f][i]


@dataclass
class Row:
    """A stored row: per field, the piece and index holding it."""

    key: str
    group: int
    cells: dict[str, tuple[Piece, int]] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    seq_len: int = -1
    nbytes: int = 0


@dataclass
class Partition:
    """A declared partition and its rows (insertion-ordered)."""

    name: str
    schema: Schema
    tasks: tuple[str, ...]
    group_size: int | None
    rows: dict[str, Row] = field(default_factory=dict)
    delivered: dict[str, set[str]] = field(default_factory=dict)
    next_group: int = 0
    nbytes: int = 0
    #: Acknowledgements of recent puts by put id (oldest first), for idempotent retries.
    recent_puts: dict[str, int] = field(default_factory=dict)
    #: Most rows the partition holds at once; a put that would pass it waits for clears.
    max_rows: int | None = None

    def declaration(self) -> dict[str, Any]:
        """The declaration as sent by ``declare``."""
        return {
            "partition": self.name,
            "schema": self.schema.canonical_json,
            "schema_ref": self.schema.ref,
            "fingerprint": self.schema.fingerprint,
            "tasks": list(self.tasks),
            "group_size": self.group_size,
            "max_rows": self.max_rows,
        }


def _decode_tags(piece_batch: pa.RecordBatch, keys: list[str]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for k, b in zip(keys, piece_batch.column(TAGS).to_pylist(), strict=True):
        if b is None:
            out.append(None)
            continue
        try:
            t = msgpack.unpackb(b, raw=False)
        except Exception as e:  # hostile bytes raise assorted errors
            raise EncodeError(f"tags of row {k!r} are not valid msgpack: {e}") from e
        if not isinstance(t, dict):
            raise EncodeError(f"tags of row {k!r} must be a msgpack map, got {type(t).__name__}")
        out.append(t)
    return out


def make_piece(batch: pa.RecordBatch, checked: Checked) -> Piece:
    """Wrap a validated batch, parsing its tags (refusing invalid msgpack)."""
    return Piece(batch, checked, _decode_tags(batch, checked.keys))
