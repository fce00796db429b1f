"""Summaries of repeated measurements, and ratios taken pair by pair within a run.

Repetitions are interleaved (A B C, B C A, ...), so repetition ``r`` of two systems ran
close together in time; a ratio is computed per repetition and then summarised, which
cancels most of the machine's drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["summary", "percentiles", "paired_ratio", "fmt_spread", "median_seconds"]


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles, min, max and count (empty dict when there are no values)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {}
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {
        "median": float(med),
        "q1": float(q1),
        "q3": float(q3),
        "min": float(v.min()),
        "max": float(v.max()),
        "n": int(v.size),
    }


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 99)) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` of the values (empty when there are none)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {}
    return {f"p{p:g}": float(x) for p, x in zip(ps, np.percentile(v, list(ps)), strict=True)}


def paired_ratio(
    a: Sequence[float | None], b: Sequence[float | None], higher_is_better: bool = True
) -> dict[str, Any]:
    """Summary of ``a[r] / b[r]`` over repetitions where both are present.

    With ``higher_is_better=False`` (times) the ratio is ``b[r] / a[r]``, so above 1
    always means ``a`` did better.
    """
    out = []
    for x, y in zip(a, b, strict=False):
        if x is None or y is None or x <= 0 or y <= 0:
            continue
        out.append(x / y if higher_is_better else y / x)
    return summary(out)


def fmt_spread(s: dict[str, Any], digits: int = 2, unit: str = "") -> str:
    """``median [min-max]`` (or ``median`` for one value; ``-`` when empty)."""
    if not s:
        return "-"
    f = f"{{:.{digits}f}}"
    med = f.format(s["median"]) + unit
    if s.get("n", 1) < 2:
        return med
    return f"{med} [{f.format(s['min'])}-{f.format(s['max'])}]"


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls, after a few untimed ones."""
    for _ in range(max(3, reps // 10)):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)
