"""Helpers of the benchmark suites: the seeded steps they time and their throughput."""

from __future__ import annotations

from typing import Any

from flightq import workloads
from flightq.workloads import Step

#: Rows per workload in a plain test run: one group each (W4 is one row anyway).
_TEST_SIZES: dict[str, Any] = {
    "W1": lambda: workloads.w1(0, groups=1),
    "W1-bf16": lambda: workloads.w1(0, bf16=True, groups=1),
    "W2": lambda: workloads.w2(0, groups=1),
    "W3": lambda: workloads.w3(0, groups=2),
    "W4": lambda: workloads.w4(0),
}


def make_step(name: str, reduced: bool) -> Step:
    """The seeded workload (seed 0), with one group only when ``reduced``."""
    return _TEST_SIZES[name]() if reduced else workloads.make(name, 0)


def record_throughput(benchmark: Any, nbytes: int) -> None:
    """Attach the payload size, and GB/s of the median round when timing ran."""
    benchmark.extra_info["nbytes"] = nbytes
    stats = getattr(benchmark, "stats", None)
    if stats is not None and not getattr(benchmark, "disabled", True):
        median = stats.stats.median
        if median > 0:
            benchmark.extra_info["GB/s (median)"] = round(nbytes / median / 1e9, 3)
