"""What the tests' lying servers answer as flightq's server would: its health, one declared
partition ``"p"`` of ``rollout_text@1``, and rows of that schema (with a claim's grant)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

import flightq
from flightq.protocol import CLAIM_METADATA, PROTOCOL_VERSION

TEXT = flightq.SchemaRegistry.default().get("rollout_text@1")
HEALTH = {"ok": True, "protocol": PROTOCOL_VERSION, "partitions": 0, "shm": None}
DECLARED: dict[str, Any] = {
    "partition": "p",
    "schema": TEXT.canonical_json,
    "schema_ref": TEXT.ref,
    "fingerprint": TEXT.fingerprint,
    "tasks": ["train"],
    "group_size": None,
    "max_rows": None,
    "lease": 600.0,
    "max_failures": 3,
}


def rows(
    keys: list[str], claim: str | None = None, deliveries: list[int] | None = None
) -> pa.RecordBatch:
    """Rows of ``keys``; with ``claim``, under a claim's grant of ``deliveries`` (1 each)."""
    rb = flightq.encode(TEXT, {"input_ids": [np.arange(3) for _ in keys]}, keys)
    if claim is None:
        return rb
    grant = {"claim": claim, "lease": 30.0, "deliveries": deliveries or [1] * len(keys)}
    return rb.replace_schema_metadata({**rb.schema.metadata, CLAIM_METADATA: msgpack.packb(grant)})


@contextlib.contextmanager
def serving(*servers: fl.FlightServerBase) -> Iterator[None]:
    """``servers`` serving in threads of their own until the block ends."""
    for s in servers:
        threading.Thread(target=s.serve, daemon=True).start()
    try:
        yield
    finally:
        for s in servers:
            s.shutdown()
