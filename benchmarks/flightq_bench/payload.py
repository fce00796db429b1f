"""The generated rows every system moves, and the bit-exact checks of what arrived.

A step is generated from its workload name and seed in each process that needs it (the
producer, and the consumer for its reference copy), so all systems move the same rows.
:func:`flat_buffers` lists the step's tensor payloads in one canonical order: their bytes
add up to ``step.nbytes()``, the logical payload that every GB/s figure divides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flightq import workloads

__all__ = [
    "VerifyError",
    "QUICK_SIZES",
    "generate",
    "describe_sizes",
    "flat_buffers",
    "as_payload",
    "to_numpy",
    "check_rows",
    "unpacked",
    "check_flat",
]

#: Reduced sizes used by ``--quick`` (every system gets the same reduced rows).
QUICK_SIZES: dict[str, dict[str, int]] = {
    "W1": {"groups": 2},
    "W1-bf16": {"groups": 2},
    "W2": {"groups": 3},
    "W3": {"groups": 8},
    "W4": {},
    "W5": {},
    "W5-copies": {},
}
_FULL_ROWS = {"W1": 128, "W1-bf16": 128, "W2": 96, "W3": 512, "W4": 1}
_GROUP_SIZE = {"W1": 16, "W1-bf16": 16, "W2": 8, "W3": 16, "W4": 1}


class VerifyError(AssertionError):
    """What a system delivered differs from what was put."""


def generate(name: str, seed: int = 0, quick: bool = False) -> workloads.Step:
    """Generate workload ``name`` (reduced row count when ``quick``; never other changes)."""
    if name not in workloads.WORKLOADS:
        raise ValueError(
            f"unknown workload {name!r}; expected one of {', '.join(workloads.WORKLOADS)}"
        )
    sizes = QUICK_SIZES.get(name, {}) if quick else {}
    if not sizes:
        return workloads.make(name, seed)
    if name == "W1-bf16":
        return workloads.w1(seed, bf16=True, **sizes)
    fn = workloads.WORKLOADS[name]
    return fn(seed, **sizes)


def describe_sizes(quick: bool) -> dict[str, str]:
    """Per workload, how its size differs from WORKLOADS.md (empty when not ``quick``)."""
    if not quick:
        return {}
    out = {}
    for name, sizes in QUICK_SIZES.items():
        if sizes:
            rows = sizes["groups"] * _GROUP_SIZE[name]
            out[name] = f"{rows} of {_FULL_ROWS[name]} rows ({sizes['groups']} groups)"
    return out


def flat_buffers(step: workloads.Step, distinct: bool = False) -> list[np.ndarray]:
    """Every tensor payload of the step as a flat uint8 view, in a canonical order.

    Shared media segments appear once per row that carries them, so the lengths add up to
    ``step.nbytes()``; with ``distinct``, once (``step.nbytes(distinct_media=True)``).
    """
    out: list[np.ndarray] = []
    seen: set[int] = set()
    for col in step.columns.values():
        if isinstance(col, np.ndarray):
            out.append(_u8(col))
            continue
        for row in col:
            if row is None:
                continue
            if isinstance(row, list):
                for seg in row:
                    if distinct and id(seg) in seen:
                        continue
                    seen.add(id(seg))
                    out.append(_u8(seg))
            else:
                out.append(_u8(row))
    return out


def _u8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def as_payload(step: workloads.Step) -> dict[str, Any]:
    """The step as one picklable object: keys, tags and the per-row columns."""
    return {"keys": step.keys, "tags": step.tags, "columns": step.columns}


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view of a tensor or array (bfloat16 as its uint16 bit patterns)."""
    if isinstance(x, np.ndarray):
        return x
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.uint16)
        return t.contiguous().numpy()
    return np.asarray(x)


def _same(ref: np.ndarray, got: Any, where: str) -> None:
    g = to_numpy(got)
    if g.dtype != ref.dtype:
        raise VerifyError(f"{where}: dtype {g.dtype}, expected {ref.dtype}")
    if g.shape != ref.shape:
        raise VerifyError(f"{where}: shape {g.shape}, expected {ref.shape}")
    if not np.array_equal(_u8(g), _u8(ref)):
        raise VerifyError(f"{where}: bytes differ")


def unpacked(columns: Mapping[str, Any]) -> dict[str, Any]:
    """``columns`` with each ``flightq.Packed`` one cut into its rows (views), for
    :func:`check_rows`; other columns as they are."""
    from flightq import Packed

    return {
        f: [
            v.values[a:b]
            for a, b in zip(v.offsets[:-1].tolist(), v.offsets[1:].tolist(), strict=True)
        ]
        if isinstance(v, Packed)
        else v
        for f, v in columns.items()
    }


def check_rows(
    ref: workloads.Step,
    keys: Sequence[str],
    columns: Mapping[str, Any],
    tags: Sequence[Mapping[str, Any]] | None = None,
    system: str = "",
) -> None:
    """Check received rows against the reference step, bit for bit.

    ``columns`` maps each field to its per-row structure: a list of tensors (token and
    tensor fields), a list of segment lists (media), or a 1-D tensor or sequence (scalars).

    Raises
    ------
    VerifyError
        Naming the system, field, row and what differs.
    """
    if list(keys) != list(ref.keys):
        raise VerifyError(f"{system}: keys differ (got {len(keys)}, expected {len(ref.keys)})")
    missing = set(ref.columns) - set(columns)
    if missing:
        raise VerifyError(f"{system}: fields missing: {sorted(missing)}")
    for name, want in ref.columns.items():
        got = columns[name]
        where = f"{system}: field {name!r}"
        if isinstance(want, np.ndarray):
            _same(want, got if not isinstance(got, list) else np.asarray(got), where)
            continue
        if len(got) != len(want):
            raise VerifyError(f"{where}: {len(got)} rows, expected {len(want)}")
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            at = f"{where} row {ref.keys[i]!r}"
            if isinstance(w, list):
                if g is None or len(g) != len(w):
                    raise VerifyError(
                        f"{at}: {0 if g is None else len(g)} segments, expected {len(w)}"
                    )
                for j, (ws, gs) in enumerate(zip(w, g, strict=True)):
                    _same(ws, gs, f"{at} segment {j}")
            elif w is None:
                if g is not None:
                    raise VerifyError(f"{at}: a value where none was put")
            else:
                _same(w, g, at)
    if tags is not None and [dict(t) for t in tags] != [dict(t) for t in ref.tags]:
        raise VerifyError(f"{system}: tags differ")


def check_flat(ref: workloads.Step, received: Any, system: str = "") -> None:
    """Check a flat receive buffer against the step's canonical byte sequence.

    Raises
    ------
    VerifyError
        With the offset of the first differing buffer.
    """
    buf = np.frombuffer(received, dtype=np.uint8)
    off = 0
    for i, b in enumerate(flat_buffers(ref)):
        n = len(b)
        if off + n > len(buf) or not np.array_equal(buf[off : off + n], b):
            raise VerifyError(f"{system}: bytes differ in buffer {i} at offset {off}")
        off += n
    if off != len(buf):
        raise VerifyError(f"{system}: received {len(buf)} bytes, expected {off}")
