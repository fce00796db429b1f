"""Hostile puts for the memory-budget tests, crafted for plain ``pyarrow.flight``.

Nothing here is a fixture or holds state: each helper builds what it returns. Each batch is
valid flightq apart from the one thing it overdoes.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
from fixtures_dataplane import TEXT, text_columns
from helpers_wire import replace_column

import flightq

__all__ = [
    "VLM",
    "action",
    "bomb_batch",
    "put_bomb",
    "data_limit",
    "hwm_mib",
    "empty_maps",
    "media_batch",
    "with_keys",
    "with_tags",
]

VLM = "rollout_vlm@1"


def action(location: str, kind: str, body: dict[str, Any], **options: Any) -> Any:
    """One DoAction with ``pyarrow.flight`` alone; returns the decoded result."""
    with fl.connect(location, **options) as c:
        (res,) = list(c.do_action(fl.Action(kind, msgpack.packb(body, use_bin_type=True))))
    return msgpack.unpackb(res.body.to_pybytes())


def media_batch(keys: list[str], unused: int = 0, seed: int = 0) -> pa.RecordBatch:
    """Rows of ``rollout_vlm@1``, one small image each; with ``unused`` > 0 the image
    dictionary carries one more entry of that many bytes that no row uses."""
    rng = np.random.default_rng(seed)
    schema = flightq.SchemaRegistry.default().get(VLM)
    ids = [rng.integers(0, 1000, size=4, dtype=np.int64) for _ in keys]
    imgs = [[rng.random((2, 8), dtype=np.float32)] for _ in keys]
    rb = flightq.encode(schema, {"input_ids": ids, "pixel_values": imgs}, keys)
    if not unused:
        return rb
    col = rb.column("pixel_values")
    entries = [*col.values.dictionary.to_pylist(), b"\0" * unused]
    values = pa.DictionaryArray.from_arrays(
        col.values.indices, pa.array(entries, pa.large_binary())
    )
    return replace_column(rb, "pixel_values", pa.LargeListArray.from_arrays(col.offsets, values))


def with_keys(rb: pa.RecordBatch, keys: list[str]) -> pa.RecordBatch:
    """``rb`` with other row keys."""
    return replace_column(rb, "__key__", pa.array(keys, pa.utf8()))


def with_tags(rb: pa.RecordBatch, tags: list[bytes | None]) -> pa.RecordBatch:
    """``rb`` with these msgpack tags per row."""
    return replace_column(rb, "__tags__", pa.array(tags, pa.binary()))


def empty_maps(nbytes: int) -> bytes:
    """Msgpack tags of about ``nbytes``: a map holding an array of empty maps, one byte
    each on the wire and a Python dict each once decoded (the costliest tags per byte)."""
    n = max(nbytes - 10, 0)
    return b"\x81\xa1t\xdd" + n.to_bytes(4, "big") + b"\x80" * n


def hwm_mib(pid: int) -> int:
    """The high-water mark of process ``pid``'s resident memory (MiB)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) // 1024


def data_limit(pid: int) -> int | None:
    """The soft ``RLIMIT_DATA`` of process ``pid`` (None: unlimited)."""
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max data size"))
    soft = line.split()[3]
    return None if soft == "unlimited" else int(soft)


def bomb_batch(nbytes: int) -> pa.RecordBatch:
    """A one-row text batch (key ``x``) whose ``input_ids`` payload is ``nbytes`` of
    zeros, mapped lazily (untouched pages cost this process nothing)."""
    batch = flightq.encode(flightq.SchemaRegistry.default().get(TEXT), text_columns(["x"]), ["x"])
    i = batch.schema.get_field_index("input_ids")
    offsets = pa.py_buffer(np.array([0, nbytes], np.int64))
    cell = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), 1, [None, offsets, pa.py_buffer(np.zeros(nbytes, np.uint8))]
    )
    return batch.set_column(i, batch.schema.field(i), cell.cast(batch.schema.field(i).type))


def put_bomb(location: str, partition: str, nbytes: int) -> fl.FlightError:
    """A per-call DoPut with plain ``pyarrow.flight`` of :func:`bomb_batch` (``nbytes``)
    in a zstd-compressed IPC body, a few hundred KiB on the wire; returns the error the
    server answered it with (the test fails if it answered none)."""
    from flightq.protocol import PutCommand

    bomb = bomb_batch(nbytes)
    put = PutCommand(partition=partition, rows=1, timeout=1.0).to_wire()
    options = fl.FlightCallOptions(write_options=pa.ipc.IpcWriteOptions(compression="zstd"))
    with fl.connect(location) as client:
        writer, _ = client.do_put(fl.FlightDescriptor.for_command(put), bomb.schema, options)
        try:
            writer.write_batch(bomb)
            writer.done_writing()
            writer.close()
        except fl.FlightError as e:
            return e
    raise AssertionError(f"a put of {nbytes} inflated bytes to {location} was not refused")
