"""Record-batch packing: encode each reference workload, decode it back to tensors.

The decode benchmark rebuilds every field's per-row tensors (``batch[field]``), which is
what a trainer touches. Both check the rows bit for bit against the generated step.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from flightq_bench.payload import check_rows
from helpers_bench import make_step, record_throughput

import flightq
from flightq.workloads import to_torch

WORKLOADS = ["W1", "W1-bf16", "W2", "W3", "W4"]
_REGISTRY = flightq.SchemaRegistry.default()


def _encode(step: Any) -> pa.RecordBatch:
    t = to_torch(step)
    return flightq.encode(_REGISTRY.get(step.schema), t.columns, t.keys, t.tags)


def _decode_all(rb: pa.RecordBatch) -> tuple[flightq.Batch, dict[str, Any]]:
    batch = flightq.decode(rb)
    return batch, {f: batch[f] for f in batch.fields}


@pytest.mark.parametrize("name", WORKLOADS)
def test_encode(benchmark: Any, reduced: bool, name: str) -> None:
    step = make_step(name, reduced)
    rb = benchmark(_encode, step)
    batch, cols = _decode_all(rb)
    check_rows(step, batch.keys, cols, batch.tags, f"encode {name}")
    record_throughput(benchmark, step.nbytes())


@pytest.mark.parametrize("name", WORKLOADS)
def test_decode(benchmark: Any, reduced: bool, name: str) -> None:
    step = make_step(name, reduced)
    rb = _encode(step)
    batch, cols = benchmark(_decode_all, rb)
    check_rows(step, batch.keys, cols, batch.tags, f"decode {name}")
    record_throughput(benchmark, step.nbytes())
