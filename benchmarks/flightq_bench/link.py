"""``flightq bench --hosts 2 --link 10gbit``: the workloads across a rate-limited link.

A :class:`~flightq_bench.hosts.Testbed` of two hosts: the producer and consumer
processes (a generator and a trainer) run on ``h0``, the servers on ``h1``, and the
direct systems (raw TCP) send from ``h0`` to a receiver on ``h1``. So every put and every
get crosses the link once, each way limited to the rate by ``tbf``. The runner is the
loopback one (:mod:`flightq_bench.runner`: interleaved repetitions, every result checked
bit for bit, bounded in count and time); here it also reads the server host's interface
counters around each put and get, so the figures add the bytes on the wire (headers
included) and the link's utilisation: those bytes per second over the rate.

With ``--link 1gbit,10gbit`` the rates are measured one after the other on the same
testbed (``tc qdisc change``). There is no ``netem`` on the development machine: no
delay is emulated, and round trips stay those of veth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from . import hosts, runner
from .stats import fmt_spread

__all__ = ["DEFAULT_SYSTEMS", "run_link", "markdown"]

#: What a link run measures unless ``--systems`` says otherwise.
DEFAULT_SYSTEMS = (
    "raw-tcp",
    "bare-flight-records",
    "flightq",
    "flightq-zstd-tokens",
    "flightq-zstd",
)


def run_link(
    links: Sequence[str],
    base: runner.Options,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``base`` (workloads, systems, repetitions) once per link rate.

    Returns
    -------
    dict
        ``{"links": {rate: runner document}}``.

    Raises
    ------
    hosts.TestbedError
        If the testbed cannot be built here (the reason says what is missing).
    """
    out: dict[str, Any] = {"links": {}}
    with hosts.Testbed(2, links[0]) as tb:
        client, server = tb.hosts
        for link in links:
            tb.set_rate(link)
            progress(
                f"link {link}: {client.ns} ({client.address}) -> {server.ns} ({server.address})"
            )
            place = runner.Placement(
                client_ns=client.ns,
                server_ns=server.ns,
                server_address=server.address,
                network=f"{hosts.SUBNET}.0/24",
                rate_bps=tb.rate_bps,
                meter=lambda: tb.counters(server.index),
            )
            opts = runner.Options(**{**base.__dict__, "place": place})
            doc = runner.run(opts)
            doc["link"] = {"rate": link, "rate_bps": tb.rate_bps, "mtu": tb.mtu}
            out["links"][link] = doc
    return out


def _x(r: dict[str, Any], key: str) -> str:
    return fmt_spread(r.get(key, {}), 2, "x")


def _pct(s: dict[str, Any]) -> str:
    if not s:
        return "-"
    return f"{100 * s['median']:.0f}% [{100 * s['min']:.0f}-{100 * s['max']:.0f}]"


def _mb(s: dict[str, Any]) -> str:
    return f"{s['median'] / 1e6:.1f}" if s else "-"


def markdown(doc: dict[str, Any], command: str) -> str:
    """The tables of a link run: per rate, every system; then compression against raw."""
    docs = doc["links"]
    first = next(iter(docs.values()))
    m = first["machine"]
    lines = [
        "# flightq bench across a link",
        "",
        f"- command: `{command}`",
        f"- machine: {m['nproc']} cores ({m['cpu_model']}), kernel {m['kernel']}; the two "
        "hosts are network namespaces of this machine and share its cores",
        f"- sizes: {first['mode']}"
        + (
            f" ({'; '.join(f'{k}: {v}' for k, v in first['size_notes'].items())})"
            if first["size_notes"]
            else ""
        ),
        "- GB/s of logical payload, median [min-max] over repetitions; x: ratio to raw TCP "
        "in the same run, pair by pair; link: bytes on the wire (headers included) per "
        "second over the rate; wire MB: bytes that crossed the link per put / get",
        "",
    ]
    for link, d in docs.items():
        lines += [
            f"## {link}",
            "",
            "| workload | system | put GB/s | get GB/s | x raw TCP put | x raw TCP get "
            "| link put | link get | wire MB put / get |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for w, wd in d["workloads"].items():
            vs = wd["ratios"].get("vs_raw-tcp", {})
            for name, r in wd["results"].items():
                if r.get("status") != "measured":
                    lines.append(f"| {w} | {name} | failed: {str(r.get('error'))[:80]} |||||||")
                    continue
                lk = r.get("link", {})
                ratio = vs.get(name, {})
                px, gx = (_x(ratio, "put"), _x(ratio, "get")) if ratio else ("1x", "1x")
                lines.append(
                    f"| {w} | {name} | {fmt_spread(r['put_gbps'])} | {fmt_spread(r['get_gbps'])}"
                    f" | {px} | {gx}"
                    f" | {_pct(lk.get('put_util', {}))} | {_pct(lk.get('get_util', {}))}"
                    f" | {_mb(lk.get('put_bytes', {}))} / {_mb(lk.get('get_bytes', {}))} |"
                )
        lines.append("")
    lines += [
        "## Compression against raw fields",
        "",
        "flightq with zstd (level 3) against flightq with raw fields, same server, same "
        "link, pair by pair (above 1x: compression was faster).",
        "",
        "| workload | link | zstd tokens: put | get | zstd tokens and pixels: put | get "
        "| wire MB per get: raw / tokens / all |",
        "|---|---|---|---|---|---|---|",
    ]
    for link, d in docs.items():
        for w, wd in d["workloads"].items():
            vs = wd["ratios"].get("vs_flightq", {})
            res = wd["results"]
            wire = []
            for n in ("flightq", "flightq-zstd-tokens", "flightq-zstd"):
                with contextlib.suppress(KeyError, TypeError):
                    wire.append(_mb(res[n]["link"]["get_bytes"]))
                    continue
                wire.append("-")
            zt, za = vs.get("flightq-zstd-tokens", {}), vs.get("flightq-zstd", {})
            lines.append(
                f"| {w} | {link} | {_x(zt, 'put')} | {_x(zt, 'get')} | {_x(za, 'put')} "
                f"| {_x(za, 'get')} | {' / '.join(wire)} |"
            )
    return "\n".join(lines) + "\n"
