"""Shared fixtures of the benchmark suites (helpers: ``helpers_bench``).

Under ``make test`` pytest-benchmark is disabled (``--benchmark-disable``): each benchmark
then runs its function once as a plain test, on reduced workload sizes, and still checks
the result. ``pytest benchmarks --benchmark-enable`` times the full workloads.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def reduced(benchmark: Any) -> bool:
    """Whether to use the reduced workload sizes (timing disabled: a plain test run)."""
    return bool(getattr(benchmark, "disabled", True))
