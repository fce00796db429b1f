"""Helpers for the reliability and security tests: plain Flight puts, partition state.

Nothing here is a fixture or holds state. The plain helpers use ``pyarrow.flight`` alone,
as a client in another language would, so they bypass every flightq client-side check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

import flightq

__all__ = [
    "put_command",
    "plain_put",
    "plain_error",
    "partition_state",
    "with_field_metadata",
    "with_schema_metadata",
    "add_column",
    "text_batch",
]


def put_command(partition: str, **extra: Any) -> fl.FlightDescriptor:
    """The DoPut command descriptor flightq's client sends."""
    return fl.FlightDescriptor.for_command(
        msgpack.packb({"op": "put", "partition": partition, **extra}, use_bin_type=True)
    )


def plain_put(
    location: str,
    descriptor: fl.FlightDescriptor,
    batches: Sequence[pa.RecordBatch],
    schema: pa.Schema | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """A DoPut with ``pyarrow.flight`` alone; returns the decoded acknowledgement."""
    schema = schema if schema is not None else batches[0].schema
    options = fl.FlightCallOptions(timeout=timeout)
    with fl.connect(location) as c:
        writer, reader = c.do_put(descriptor, schema, options=options)
        with writer:
            for b in batches:
                writer.write_batch(b)
            writer.done_writing()
            ack = reader.read()
    assert ack is not None, "no acknowledgement"
    return msgpack.unpackb(ack.to_pybytes())


def plain_error(exc: BaseException) -> tuple[str, str]:
    """``(type, message)`` of a flightq error carried in a Flight error's extra_info."""
    info = getattr(exc, "extra_info", None)
    assert info, f"no flightq extra_info on {type(exc).__name__}: {exc}"
    d = msgpack.unpackb(info)
    return d["type"], d["message"]


def partition_state(location: str, name: str) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Everything a partition holds, read with a plain client, plus ``inspect``."""
    with fl.connect(location) as c:
        info = c.get_flight_info(fl.FlightDescriptor.for_path(name))
        table = c.do_get(info.endpoints[0].ticket).read_all()
        body = msgpack.packb({"partition": name})
        (res,) = list(c.do_action(fl.Action("inspect", body)))
    return table.to_pydict(), msgpack.unpackb(res.body.to_pybytes())


def with_field_metadata(rb: pa.RecordBatch, name: str, **meta: bytes) -> pa.RecordBatch:
    """``rb`` with extra metadata entries on column ``name``."""
    i = rb.schema.get_field_index(name)
    f = rb.schema.field(i)
    fields = list(rb.schema)
    fields[i] = f.with_metadata({**(f.metadata or {}), **{k.encode(): v for k, v in meta.items()}})
    schema = pa.schema(fields, metadata=rb.schema.metadata)
    return pa.RecordBatch.from_arrays(list(rb.columns), schema=schema)


def with_schema_metadata(rb: pa.RecordBatch, **meta: bytes) -> pa.RecordBatch:
    """``rb`` with schema-level metadata entries replaced."""
    md = dict(rb.schema.metadata or {})
    md.update({k.encode(): v for k, v in meta.items()})
    return rb.replace_schema_metadata(md)


def add_column(rb: pa.RecordBatch, name: str, array: pa.Array) -> pa.RecordBatch:
    """``rb`` with one more column at the end, metadata kept."""
    schema = pa.schema([*rb.schema, pa.field(name, array.type)], metadata=rb.schema.metadata)
    return pa.RecordBatch.from_arrays([*rb.columns, array], schema=schema)


def text_batch(keys: Sequence[str], seed: int = 0, ref: str = "rollout_text@1") -> pa.RecordBatch:
    """A valid record batch of small seeded rows with input_ids and input_lengths."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 1000, size=4 + i % 3, dtype=np.int64) for i in range(len(keys))]
    schema = flightq.SchemaRegistry.default().get(ref)
    cols = {"input_ids": ids, "input_lengths": np.array([len(x) for x in ids], np.int32)}
    return flightq.encode(schema, cols, list(keys))


def plain_shm_put(
    location: str, ref: dict[str, object], rows: int | None = None, timeout: float = 1.0
) -> None:
    """A put to partition 'p' whose bytes a plain Flight client says lie in segment ``ref``
    (of ``rows`` rows, when given), waiting up to ``timeout`` seconds for room."""
    cmd: dict[str, object] = {"op": "put", "partition": "p", "overwrite": False, "timeout": timeout}
    if rows is not None:
        cmd["rows"] = rows
    cmd["shm"] = ref
    client = fl.connect(location)
    try:
        schema = pa.schema([("__key__", pa.utf8())])
        writer, reader = client.do_put(fl.FlightDescriptor.for_command(msgpack.packb(cmd)), schema)
        with writer:
            writer.done_writing()
            reader.read()
    finally:
        client.close()
