"""Write a run's results: ``bench.json``, ``bench.md`` (tables) and ``bench.png`` (chart).

The markdown and the chart carry the date, the machine (nproc, RAM, CPU model) and the
command that made them, so a copy in the README says where its numbers come from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .stats import fmt_spread
from .systems import BASELINE, COMPARED

__all__ = ["write", "markdown", "chart", "header"]


def header(doc: dict[str, Any]) -> str:
    """Date, machine and command, one line each."""
    m = doc["machine"]
    ram = m.get("ram_bytes", 0) / 2**30
    lines = [
        f"- date: {doc['date']}",
        f"- machine: {m.get('nproc')} CPUs, {ram:.1f} GiB RAM, {m.get('cpu_model')}, "
        f"Linux {m.get('kernel')}, Python {m.get('python')}",
        f"- command: `{doc['command']}`",
        f"- mode: {doc['mode']}; {doc['repetitions']} interleaved repetitions per system "
        f"(W4: {doc['pings']} pings in {doc['repetitions']} blocks); seed {doc['seed']}",
    ]
    if doc.get("size_notes"):
        sizes = "; ".join(f"{k}: {v}" for k, v in doc["size_notes"].items())
        lines.append(f"- reduced sizes (quick mode, same for every system): {sizes}")
    return "\n".join(lines)


def _rss(r: dict[str, Any]) -> str:
    rss, grow = r.get("peak_rss_mib") or {}, r.get("rss_growth_mib") or {}
    return " / ".join(
        "-" if rss.get(k) is None else f"{rss[k]:.0f} (+{grow.get(k) or 0:.0f})"
        for k in ("producer", "server", "consumer")
    )


def _cpu(cpu: dict[str, Any], per_op: bool) -> str:
    if "put" not in cpu:
        return "-"
    if per_op:
        return f"{cpu['put_ms_per_op']:.2f} / {cpu['get_ms_per_op']:.2f}"
    return f"{cpu['put']:.2f} / {cpu['get']:.2f}"


def _ratio(rat: dict[str, Any], key: str) -> str:
    return fmt_spread(rat.get(key, {}), 2, "x") if rat else "-"


def markdown(doc: dict[str, Any]) -> str:
    """The tables: per workload and system, then flightq against each peer."""
    out = ["# flightq bench", "", header(doc), ""]
    out += [
        "GB/s = 1e9 bytes of logical payload (`step.nbytes()`) per second: median "
        "[min-max] over repetitions. Ratios are taken per repetition (interleaved runs) "
        "and summarised the same way; above 1x means the row's system is faster. "
        "Step = put + get (for memcpy, raw TCP and pickle5: the one transfer). CPU: "
        "seconds of CPU (user + system, every thread) per GB of logical payload, of the "
        "writer and the server's processes during a put, of the reader and the server "
        "during a get (for a direct transfer: both ends, in both columns; W4: "
        "milliseconds per operation); on a machine of N cores a transfer costing C CPU "
        "seconds per GB cannot pass N / C GB/s. Peak RSS "
        "in MiB of producer / server / consumer during the operation, and in brackets its "
        "growth over the RSS just before the operation: one producer and one consumer "
        "process serve every system in turn, so the growth is the system's own footprint "
        "(Ray's object store pages stay mapped into both, raising later baselines); both "
        "keep freed memory (`flightq.keep_freed_memory()`, as a flightq client does), so "
        "memory one system freed can serve the next without growth. "
        "A server's figure sums its processes (Ray: raylet, GCS, reference actor; "
        "TransferQueue: controller and storage units).",
        "",
    ]
    skipped = {n: s for n, s in doc["systems"].items() if s.get("status") != "measured"}
    for w, wd in doc["workloads"].items():
        out += [f"## {w} ({wd['rows']} rows, {wd['nbytes'] / 1e6:.1f} MB; {wd['size']})", ""]
        lat = w == "W4"
        cols = ["system", "put GB/s", "get GB/s", "step ms"]
        cols += ["p50 / p99 ms"] if lat else []
        cols += [f"put vs {BASELINE}", f"get vs {BASELINE}"]
        cols += ["CPU ms put / get" if lat else "CPU s/GB put / get"]
        cols += ["peak RSS MiB p / s / c", "verified"]
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        vs = wd.get("ratios", {}).get("vs_" + BASELINE, {})
        for name, r in wd["results"].items():
            if r.get("status") != "measured":
                out.append(
                    f"| {name} | failed: {r.get('error', '?')[:120]} |" + " |" * (len(cols) - 2)
                )
                continue
            row = [
                name,
                fmt_spread(r["put_gbps"]),
                fmt_spread(r["get_gbps"]),
                fmt_spread(r["step_ms"], 3 if lat else 1),
            ]
            if lat:
                lm = r.get("latency_ms", {})
                row.append(f"{lm.get('p50', 0):.3f} / {lm.get('p99', 0):.3f}")
            rat = vs.get(name, {})
            row += [
                _ratio(rat, "put"),
                _ratio(rat, "get"),
                _cpu(r.get("cpu") or {}, lat),
                _rss(r),
                f"yes ({r['verified_cycles']})",
            ]
            out.append("| " + " | ".join(row) + " |")
        for name, s in skipped.items():
            out.append(f"| {name} | {s['status']} |" + " |" * (len(cols) - 2))
        out.append("")
    out += ["## flightq against each peer (ratio of flightq's speed to the peer's)", ""]
    out += ["| workload | flightq | peer | put | get | step |", "|---|---|---|---|---|---|"]
    for w, wd in doc["workloads"].items():
        for mine in COMPARED:
            for peer, rat in wd.get("ratios", {}).get(f"{mine}_vs", {}).items():
                row = [w, mine, peer, _ratio(rat, "put"), _ratio(rat, "get"), _ratio(rat, "step")]
                out.append("| " + " | ".join(row) + " |")
    dec_rows = [
        (w, name, r["decode"])
        for w, wd in doc["workloads"].items()
        for name, r in wd["results"].items()
        if r.get("decode")
    ]
    if dec_rows:
        out += [
            "",
            "## Decode: a flightq get's validating and rebuilding of every tensor",
            "",
            "Milliseconds per get (`Batch.received.decode_s`: wall time in the decoder, "
            "summed over the get's parallel streams, waits for the interpreter lock "
            "included, so over several streams it can pass the get's own time), as a "
            "share of the get, and the share left once the last record batch was in "
            "(record batches are decoded as they arrive, while gRPC receives the next; "
            "that tail also holds the end of the stream).",
            "",
            "| workload | system | record batches | decode ms | % of the get | "
            "% after the last batch |",
            "|---|---|---|---|---|---|",
        ]
        for w, name, d in dec_rows:
            row = [
                w,
                name,
                f"{d['record_batches']:g}",
                fmt_spread(d["decode_ms"]),
                fmt_spread(d["decode_pct"], 1),
                fmt_spread(d["tail_pct"], 1),
            ]
            out.append("| " + " | ".join(row) + " |")
    media_rows = [
        (w, name, r["media"])
        for w, wd in doc["workloads"].items()
        for name, r in wd["results"].items()
        if r.get("media")
    ]
    if media_rows:
        out += [
            "",
            "## Streamed puts (W5): bytes against the step's distinct bytes (each image once)",
            "",
            "Received by the server for the put (record batches' bytes), held by the "
            "partition after it (`stats` bytes), sent by the server for the claim; as "
            "multiples of the step's distinct payload bytes.",
            "",
            "| workload | system | distinct MB | put on the wire | held | claim on the wire |",
            "|---|---|---|---|---|---|",
        ]
        for w, name, m in media_rows:
            row = [
                w,
                name,
                f"{m['distinct_bytes'] / 1e6:.1f}",
                fmt_spread(m["put_wire_x"], 3, "x"),
                fmt_spread(m["held_x"], 3, "x"),
                fmt_spread(m["get_wire_x"], 3, "x"),
            ]
            out.append("| " + " | ".join(row) + " |")
    cuda_rows = [(w, wd) for w, wd in doc["workloads"].items() if wd.get("ratios", {}).get("cuda")]
    if cuda_rows:
        out += [
            "",
            "## CUDA tensors (--device cuda): flightq-cuda against flightq on the CPU, and "
            "against the pinned host-to-device copy",
            "",
            "| workload | put cuda/cpu | get cuda/cpu | get vs pinned H2D | pinned H2D GB/s |",
            "|---|---|---|---|---|",
        ]
        for w, wd in cuda_rows:
            c = wd["ratios"]["cuda"]
            h2d = wd["results"].get("h2d-pinned", {}).get("get_gbps", {})
            row = [
                w,
                _ratio(c.get("flightq", {}), "put"),
                _ratio(c.get("flightq", {}), "get"),
                _ratio(c.get("h2d-pinned", {}), "get"),
                fmt_spread(h2d),
            ]
            out.append("| " + " | ".join(row) + " |")
    out += ["", "## Systems", ""]
    for n, s in doc["systems"].items():
        extra = f" ({s['reason']})" if s.get("reason") else ""
        out.append(f"- **{n}** ({s['kind']}): {s['note']}. Status: {s['status']}{extra}.")
    return "\n".join(out) + "\n"


def chart(doc: dict[str, Any], path: Path) -> bool:
    """Bar chart of put and get GB/s per workload (log scale), W4 latency beside it.

    Returns False (and writes nothing) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    wls = [w for w in doc["workloads"] if w != "W4"]
    systems = [n for n, s in doc["systems"].items() if s.get("status") == "measured"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [3, 3, 1.4]})
    width = 0.8 / max(1, len(systems))
    for ax, key, title in ((axes[0], "put_gbps", "put"), (axes[1], "get_gbps", "get")):
        for i, name in enumerate(systems):
            vals, lo, hi = [], [], []
            for w in wls:
                s = doc["workloads"][w]["results"].get(name, {}).get(key) or {}
                med = s.get("median", 0.0)
                vals.append(med)
                lo.append(med - s.get("min", med))
                hi.append(s.get("max", med) - med)
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(wls))]
            ax.bar(xs, vals, width, yerr=[lo, hi], label=name, capsize=2)
        ax.set_xticks(range(len(wls)), wls)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s of logical payload (median, min-max)")
        ax.set_title(f"{title} throughput")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    w4 = doc["workloads"].get("W4", {}).get("results", {})
    names = [n for n in systems if "latency_ms" in w4.get(n, {})]
    p50 = [w4[n]["latency_ms"]["p50"] for n in names]
    p99 = [w4[n]["latency_ms"]["p99"] for n in names]
    axes[2].barh(names, p99, color="#cccccc", label="p99")
    axes[2].barh(names, p50, color="#4477aa", label="p50")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("ms (put + get round trip)")
    axes[2].set_title("W4 latency")
    axes[2].legend(fontsize=8)
    m = doc["machine"]
    fig.suptitle(
        f"flightq bench ({doc['mode']}) {doc['date']} | {m.get('nproc')} CPUs, "
        f"{m.get('ram_bytes', 0) / 2**30:.0f} GiB, {m.get('cpu_model')}\n{doc['command']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(doc: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md", "chart": out / "bench.png"}
    paths["json"].write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    paths["markdown"].write_text(markdown(doc))
    if not chart(doc, paths["chart"]):
        del paths["chart"]
    return paths
