"""Tensor codec: one tensor to (bytes, shape, dtype) and back, on the workloads' shapes.

Each benchmark checks the bytes it timed against the source tensor, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers_bench import record_throughput

from flightq.dtypes import dtype
from flightq.tensor import column_base, row_view, to_bytes

# (id, shape, torch dtype): a W1 image, its bf16 variant, a W2 tile stack, a token row.
CASES = [
    ("w1-pixels-f32", (748, 1176), torch.float32),
    ("w1-pixels-bf16", (748, 1176), torch.bfloat16),
    ("w2-tiles-f32", (4, 3, 512, 512), torch.float32),
    ("tokens-i64", (2048,), torch.int64),
    ("empty-f32", (0, 3), torch.float32),
]
_REDUCED = {"w2-tiles-f32": (1, 3, 448, 448)}


def _tensor(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
    return torch.randint(0, 151_000, shape, generator=g, dtype=dt)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _shape(case: str, shape: tuple[int, ...], reduced: bool) -> tuple[int, ...]:
    return _REDUCED.get(case, shape) if reduced else shape


@pytest.mark.parametrize(("case", "shape", "dt"), CASES, ids=[c[0] for c in CASES])
def test_to_bytes(benchmark: Any, reduced: bool, case: str, shape: Any, dt: Any) -> None:
    t = _tensor(_shape(case, shape, reduced), dt)
    enc = benchmark(to_bytes, t, zero_copy=True)
    assert enc.shape == tuple(t.shape)
    assert enc.dtype == str(dt).removeprefix("torch.")
    assert enc.data.tobytes() == _raw(t)
    record_throughput(benchmark, t.nbytes)


@pytest.mark.parametrize(("case", "shape", "dt"), CASES, ids=[c[0] for c in CASES])
def test_view_back(benchmark: Any, reduced: bool, case: str, shape: Any, dt: Any) -> None:
    t = _tensor(_shape(case, shape, reduced), dt)
    raw = _raw(t)
    d = dtype(str(dt).removeprefix("torch."))
    buf = np.frombuffer(raw, dtype=np.uint8)

    def view() -> Any:
        return row_view(column_base(buf, 0, len(raw), d, "torch"), 0, tuple(t.shape), False)

    got = benchmark(view)
    assert got.dtype == dt and tuple(got.shape) == tuple(t.shape)
    assert _raw(got) == raw
    record_throughput(benchmark, t.nbytes)
