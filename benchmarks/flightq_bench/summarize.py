"""Turn one workload's raw cycles into per-system figures and pair-by-pair ratios.

GB/s is 1e9 bytes of logical payload (``step.nbytes()``, each row's copy of a shared
image counted) per second. For W4 the per-repetition values that ratios pair up are the
medians of each block of pings; p50 and p99 are taken over all pings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .stats import fmt_spread, paired_ratio, percentiles, summary
from .systems import BASELINE, COMPARED, PEERS

__all__ = [
    "results",
    "ratios",
    "progress_line",
    "cpu_text",
    "cuda_line",
    "per_rep",
    "decode_text",
]

_MIB = 2**20


def per_rep(samples: list[dict[str, Any]], key: str) -> dict[int, float]:
    """Per repetition, the median of ``key`` over that repetition's cycles."""
    by: dict[int, list[float]] = {}
    for s in samples:
        by.setdefault(int(s["rep"]), []).append(float(s[key]))
    return {r: float(np.median(v)) for r, v in by.items()}


def _gbps(nbytes: int, seconds: dict[int, float]) -> dict[int, float]:
    return {r: nbytes / t / 1e9 for r, t in seconds.items() if t > 0}


def _peak_mib(samples: list[dict[str, Any]], role: str) -> float | None:
    vals = [s[f"peak_{role}"] for s in samples if s.get(f"peak_{role}")]
    return round(max(vals) / _MIB, 1) if vals else None


def _base_mib(samples: list[dict[str, Any]], role: str) -> float | None:
    vals = [s[f"rss0_{role}"] for s in samples if s.get(f"rss0_{role}")]
    return round(min(vals) / _MIB, 1) if vals else None


def _growth_mib(samples: list[dict[str, Any]], role: str) -> float | None:
    vals = [
        s[f"peak_{role}"] - s[f"rss0_{role}"]
        for s in samples
        if s.get(f"peak_{role}") and s.get(f"rss0_{role}")
    ]
    return round(max(vals) / _MIB, 1) if vals else None


def _cpu(samples: list[dict[str, Any]], nbytes: int) -> dict[str, float]:
    """CPU seconds per GB of logical payload, put and get: all cycles' CPU over all their
    bytes (a mean: the server's CPU clock ticks in 10 ms steps)."""
    out: dict[str, float] = {}
    for k in ("put", "get"):
        vals = [s[f"cpu_{k}"] for s in samples if f"cpu_{k}" in s]
        if vals and nbytes:
            out[k] = round(sum(vals) / (len(vals) * nbytes / 1e9), 3)
            out[f"{k}_ms_per_op"] = round(1e3 * sum(vals) / len(vals), 3)
    return out


def _link(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Across a testbed's link: the bytes each put and get put on the wire (headers
    included, per repetition's median) and the link's utilisation, those bytes per second
    as a fraction of its rate."""
    measured = [s for s in samples if "wire_put" in s]
    if not measured:
        return {}
    got = [
        {
            "rep": s["rep"],
            "put_bytes": s["wire_put"],
            "get_bytes": s["wire_get"],
            "put_util": s["wire_put"] / s["put_s"] / s["link_Bps"],
            "get_util": s["wire_get"] / s["get_s"] / s["link_Bps"],
        }
        for s in measured
    ]
    out = {k: summary(list(per_rep(got, k).values())) for k in got[0] if k != "rep"}
    out["rate_Bps"] = measured[0]["link_Bps"]
    return out


def _media(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed put's bytes (W5), per repetition's median, as multiples of the step's
    distinct bytes (each image once): received by the server for the put, held by the
    partition after it, sent by the server for the claim."""
    measured = [s for s in samples if "wire_bytes" in s]
    if not measured:
        return {}
    got = [
        {
            "rep": s["rep"],
            "put_wire_x": s["wire_bytes"] / s["distinct_bytes"],
            "held_x": s["held_bytes"] / s["distinct_bytes"],
            "get_wire_x": s.get("get_wire_bytes", 0) / s["distinct_bytes"],
        }
        for s in measured
    ]
    out: dict[str, Any] = {
        k: summary(list(per_rep(got, k).values())) for k in ("put_wire_x", "held_x", "get_wire_x")
    }
    out["distinct_bytes"] = measured[0]["distinct_bytes"]
    return out


def _decode(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A reader's decode time (flightq: ``Batch.received``), per repetition's median: in
    milliseconds, as a share of the get (%), and the share left once the last record
    batch was in (the tail that no receiving overlaps)."""
    measured = [s for s in samples if "decode_s" in s]
    if not measured:
        return {}
    got = [
        {
            "rep": s["rep"],
            "decode_ms": 1e3 * s["decode_s"],
            "decode_pct": 100 * s["decode_s"] / s["get_s"],
            "tail_pct": 100 * s["decode_tail_s"] / s["get_s"],
        }
        for s in measured
    ]
    out: dict[str, Any] = {
        k: summary(list(per_rep(got, k).values())) for k in ("decode_ms", "decode_pct", "tail_pct")
    }
    out["record_batches"] = float(
        np.median([s["record_batches"] for s in samples if "decode_s" in s])
    )
    return out


def decode_text(d: dict[str, Any]) -> str:
    """``decode 2.1 ms = 8.6% of the get (tail 4.0%)``, or empty without figures."""
    if not d:
        return ""
    return (
        f"decode {fmt_spread(d['decode_ms'])} ms = {fmt_spread(d['decode_pct'], 1)}% of the "
        f"get (after the last of {d['record_batches']:g} record batches: "
        f"{fmt_spread(d['tail_pct'], 1)}%)"
    )


def results(
    workload: str,
    nbytes: int,
    runnable: Sequence[Any],
    samples: dict[str, list[dict[str, Any]]],
    errors: dict[str, str],
) -> dict[str, Any]:
    """Per system: status, GB/s summaries, step time, latency (W4), peak RSS."""
    out: dict[str, Any] = {}
    for a in runnable:
        name = a.system.name
        got = samples.get(name, [])
        r: dict[str, Any] = {"status": "measured" if got and name not in errors else "failed"}
        if a.error or name in errors:
            r["error"] = a.error or errors[name]
        if not got or name in errors:
            out[name] = r
            continue
        r["put_gbps"] = summary(list(_gbps(nbytes, per_rep(got, "put_s")).values()))
        r["get_gbps"] = summary(list(_gbps(nbytes, per_rep(got, "get_s")).values()))
        r["step_ms"] = summary([v * 1e3 for v in per_rep(got, "step_s").values()])
        if workload == "W4":
            r["latency_ms"] = percentiles([s["step_s"] * 1e3 for s in got])
            r["put_ms"] = percentiles([s["put_s"] * 1e3 for s in got])
            r["get_ms"] = percentiles([s["get_s"] * 1e3 for s in got])
            r["pings"] = len(got)
        r["cpu"] = _cpu(got, nbytes)
        if link := _link(got):
            r["link"] = link
        if dec := _decode(got):
            r["decode"] = dec
        if media := _media(got):
            r["media"] = media
        r["peak_rss_mib"] = {k: _peak_mib(got, k) for k in ("producer", "server", "consumer")}
        r["baseline_rss_mib"] = {k: _base_mib(got, k) for k in ("producer", "server", "consumer")}
        r["rss_growth_mib"] = {k: _growth_mib(got, k) for k in ("producer", "server", "consumer")}
        r["verified_cycles"] = 1 + sum(1 for s in got if s.get("verified"))  # + the warm-up
        r["cycles"] = len(got)
        out[name] = r
    return out


def ratios(workload: str, samples: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    """Every system against raw TCP, and flightq against each peer, pair by pair.

    Each entry has ``put``, ``get`` and ``step`` summaries of the per-repetition ratios;
    above 1 means the first system was faster.
    """
    per = {
        name: {k: per_rep(got, f"{k}_s") for k in ("put", "get", "step")}
        for name, got in samples.items()
        if got
    }

    def pair(a: str, b: str) -> dict[str, Any]:
        reps = sorted(set(per[a]["put"]) & set(per[b]["put"]))
        return {
            k: paired_ratio(
                [per[a][k][r] for r in reps], [per[b][k][r] for r in reps], higher_is_better=False
            )
            for k in ("put", "get", "step")
        }

    out: dict[str, Any] = {"vs_" + BASELINE: {}, "flightq_vs": {}}
    if BASELINE in per:
        out["vs_" + BASELINE] = {n: pair(n, BASELINE) for n in per if n != BASELINE}
    for mine in COMPARED:
        if mine in per:
            out[f"{mine}_vs"] = {p: pair(mine, p) for p in (*PEERS, "memcpy") if p in per}
    if "flightq" in per:  # compressed against raw, over the same server and link
        out["vs_flightq"] = {n: pair(n, "flightq") for n in per if n.startswith("flightq-zstd")}
    if "flightq-cuda" in per:
        # GPU against CPU of the same run, and against the pinned host-to-device limit.
        out["cuda"] = {
            ref: pair("flightq-cuda", ref) for ref in ("flightq", "h2d-pinned") if ref in per
        }
    return out


def cuda_line(workload: str, cuda: dict[str, Any], res: dict[str, Any]) -> str:
    """The ``--device cuda`` figures of one workload: CUDA against CPU, and the H2D limit."""
    vs = cuda.get("flightq", {})
    line = (
        f"{workload:8} cuda/cpu       put {fmt_spread(vs.get('put', {}), 2, 'x')}  "
        f"get {fmt_spread(vs.get('get', {}), 2, 'x')}"
    )
    h2d = res.get("h2d-pinned", {}).get("get_gbps")
    if h2d:
        line += f"  pinned H2D {fmt_spread(h2d)} GB/s"
    return line


def cpu_text(workload: str, cpu: dict[str, float]) -> str:
    """CPU per put and get: seconds per GB, or (W4) milliseconds per operation."""
    if "put" not in cpu:
        return "CPU -"
    if workload == "W4":
        return f"CPU {cpu['put_ms_per_op']:.2f}/{cpu['get_ms_per_op']:.2f} ms"
    return f"CPU {cpu['put']:.2f}/{cpu['get']:.2f} s/GB"


def progress_line(workload: str, system: str, r: dict[str, Any]) -> str:
    """One line per system and workload, printed as the run goes."""
    head = f"{workload:8} {system:14}"
    if r.get("status") != "measured":
        return f"{head} FAILED: {str(r.get('error', '?')).splitlines()[0][:200]}"
    put, get = fmt_spread(r["put_gbps"]), fmt_spread(r["get_gbps"])
    line = f"{head} put {put} GB/s  get {get} GB/s  step {fmt_spread(r['step_ms'], 1)} ms"
    if "latency_ms" in r:
        lat = r["latency_ms"]
        line += f"  p50 {lat['p50']:.3f} ms  p99 {lat['p99']:.3f} ms"
    line += "  " + cpu_text(workload, r.get("cpu") or {})
    rss, grow = r["peak_rss_mib"], r["rss_growth_mib"]
    peaks = "/".join("-" if rss[k] is None else f"{rss[k]:.0f}(+{grow[k]:.0f})" for k in rss)
    line += f"  peak RSS p/s/c {peaks} MiB  verified x{r['verified_cycles']}"
    if r.get("decode"):
        line += "\n" + " " * 24 + decode_text(r["decode"])
    return line
