"""Puts straight into a :class:`flightq.server.store.Store`, for the unit tests of the
store's indexes and merges (no network): rows encoded and validated as the server does."""

from __future__ import annotations

from typing import Any

import numpy as np

from flightq import SchemaRegistry, encode
from flightq.server.partition import make_piece
from flightq.server.store import Store
from flightq.validation import validate

#: The text schema the store tests declare their partitions with.
TEXT = SchemaRegistry.default().get("rollout_text@1")


def store_put(store: Store, name: str, keys: list[str], *fields: str) -> None:
    """Rows ``keys`` with input_ids (new rows), or only ``fields`` written (again) back."""
    cols: dict[str, Any] = {f: [np.zeros(4, dtype=np.float32) for _ in keys] for f in fields}
    if not fields:
        cols = {"input_ids": [np.arange(4, dtype=np.int64) for _ in keys]}
    rb = encode(TEXT, cols, keys)
    tasks = len(store.partition(name).tasks)  # as the server makes a piece for a partition
    store.put(name, [make_piece(rb, validate(rb, TEXT), tasks=tasks)], overwrite=bool(fields))
