"""A testbed of "hosts" on one machine: network namespaces behind a rate-limited switch.

:class:`Testbed` creates ``N`` network namespaces (the hosts ``h0`` ... ``hN-1``) and one
more that holds a Linux bridge (the switch). Each host has one link to the switch: a veth
pair whose host end is ``eth0`` (address ``198.18.0.<i+1>/24``, from the benchmarking
range of RFC 2544) and whose switch end is ``h<i>``. A ``tbf`` qdisc on both ends limits
the link to the same rate in each direction, as a full-duplex NIC would. Every interface
and address lives inside a namespace the testbed created; the machine's own namespace
gets nothing but the names under ``/run/netns``.

What the kernel here cannot do, the testbed does not pretend: there is no ``netem``, so no
delay or loss is emulated. Round trips are those of veth (microseconds), whatever the rate.

Clean-up ends every process inside the namespaces (found with ``ip netns pids``, ended by
id), then deletes the namespaces, which takes their links with them. It is idempotent,
bounded in time (every command has a timeout) and runs on :meth:`Testbed.close`, at
interpreter exit (``atexit``) and on SIGTERM, SIGINT and SIGHUP. A run killed with
SIGKILL leaves namespaces whose names carry its process id; the next testbed removes
those of processes that no longer run (:func:`remove_stale`).

Run from the command line (as root)::

    python -m flightq_bench.hosts run --hosts 3 --link 10gbit --servers 2 -- python client.py
    python -m flightq_bench.hosts clean

``run`` starts ``flightq serve`` on the first ``--servers`` hosts and the command on each
of the others, with ``FLIGHTQ_LOCATIONS`` (comma-separated) in its environment.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .procs import end_processes

__all__ = [
    "PREFIX",
    "SUBNET",
    "Host",
    "Server",
    "Testbed",
    "TestbedError",
    "parse_rate",
    "problem",
    "enter",
    "remove_stale",
    "main",
]

#: Every namespace the testbed creates is named ``PREFIX-<creator pid>-<role>``.
PREFIX = "fqtb"
#: Host ``i`` has address ``SUBNET.<i+1>``.
SUBNET = "198.18.0"
_CMD_TIMEOUT = 10.0
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(sw|h\d+|probe)$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_CLONE_NEWNET = 0x40000000


class TestbedError(RuntimeError):
    """A command that builds, changes or removes the testbed failed."""

    __test__ = False  # not a pytest test class


def parse_rate(text: str) -> int:
    """``"10gbit"`` to bits per second (units: bit, kbit, mbit, gbit, tbit; decimal).

    Raises
    ------
    ValueError
        For anything else, naming the accepted forms.
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", text.strip().lower())
    if not m:
        raise ValueError(f"link rate {text!r}: expected a number and a unit, e.g. 10gbit, 500mbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _run(argv: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT) -> str:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise TestbedError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from e
    except FileNotFoundError as e:
        raise TestbedError(f"`{argv[0]}` is not installed") from e
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def _veth(a: str, ns_a: str, b: str, ns_b: str, mtu: int = 1500) -> list[str]:
    """``ip link add``: a veth pair with end ``a`` in ``ns_a`` and end ``b`` in ``ns_b``."""
    end_a = ["name", a, "netns", ns_a, "mtu", str(mtu)]
    end_b = ["name", b, "netns", ns_b, "mtu", str(mtu)]
    return ["ip", "link", "add", *end_a, "type", "veth", "peer", *end_b]


_PROBLEM: list[str] = []


def problem() -> str:
    """Why a testbed cannot be built here, or ``""`` (tried once per process, for real:
    a namespace, a veth pair into it and a ``tbf`` qdisc on it)."""
    if _PROBLEM:
        return _PROBLEM[0]
    why = ""
    if not sys.platform.startswith("linux"):
        why = "network namespaces need Linux"
    elif os.geteuid() != 0:
        why = "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN)"
    elif not (shutil.which("ip") and shutil.which("tc")):
        why = "`ip` and `tc` (iproute2) are not installed"
    else:
        ns = f"{PREFIX}-{os.getpid()}-probe"
        try:
            _run(["ip", "netns", "add", ns])
            _run(_veth("a", ns, "b", ns))
            _run(["tc", "-n", ns, "qdisc", "add", "dev", "a", "root", "tbf", "rate", "1gbit",
                  "burst", "1mb", "latency", "50ms"])  # fmt: skip
        except TestbedError as e:
            why = f"cannot build a testbed here: {e}"
        finally:
            _run(["ip", "netns", "del", ns], check=False)
    _PROBLEM.append(why)
    return why


def enter(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` (``setns``).

    Call it first thing in a fresh process: threads started afterwards (gRPC's included)
    inherit the namespace; threads started before keep theirs.
    """
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _remove(names: Sequence[str], grace: float = 3.0) -> None:
    pids = sorted({p for ns in names for p in _ns_pids(ns)} - {os.getpid()})
    end_processes(pids, grace)
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)


def _ours() -> list[str]:
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return []
    return sorted(n for n in names if _NAME.match(n))


def remove_stale(everything: bool = False) -> list[str]:
    """Remove testbed namespaces left by processes that no longer run (every testbed
    namespace with ``everything``), and the processes inside them. Returns their names."""
    stale = [
        n
        for n in _ours()
        if everything or not _alive(int(_NAME.match(n).group(1)))  # type: ignore[union-attr]
    ]
    _remove(stale)
    return stale


@dataclass(frozen=True)
class Host:
    """One host of a testbed: its namespace, address and switch port."""

    index: int
    ns: str
    address: str
    port: str

    def location(self, port: int) -> str:
        """``grpc://<address>:<port>``."""
        return f"grpc://{self.address}:{port}"


@dataclass
class Server:
    """A ``flightq serve`` process inside a host; :meth:`stop` or the testbed ends it."""

    host: Host
    location: str
    proc: subprocess.Popen[bytes]
    info: dict[str, Any] = field(default_factory=dict)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(timeout=_CMD_TIMEOUT)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()


class Testbed:
    """``hosts`` network namespaces on one switch, each link limited to ``link``.

    Use as a context manager (or call :meth:`close`); see the module's docstring.

    Parameters
    ----------
    hosts:
        How many hosts (1 to 200).
    link:
        The rate of every link, each direction, as ``tc`` writes it (``10gbit``).
    mtu:
        Of every link.

    Raises
    ------
    TestbedError
        If the testbed cannot be built (:func:`problem` says why before trying).
    """

    __test__ = False

    def __init__(self, hosts: int, link: str = "10gbit", mtu: int = 1500) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts: expected 1 to 200, got {hosts}")
        self.rate_bps = parse_rate(link)
        self.link = link
        self.mtu = mtu
        tag = f"{PREFIX}-{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.hosts = [Host(i, f"{tag}-h{i}", f"{SUBNET}.{i + 1}", f"h{i}") for i in range(hosts)]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self._old: dict[int, Any] = {}
        why = problem()
        if why:
            raise TestbedError(why)
        remove_stale()
        atexit.register(self.close)
        self._trap()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- building ------------------------------------------------------------------------

    def _build(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            _run(["ip", "netns", "add", h.ns])
            _run(_veth("eth0", h.ns, h.port, sw, self.mtu))
            _run(["ip", "-n", sw, "link", "set", h.port, "master", "br0", "up"])
            _run(["ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
            _run(["ip", "-n", h.ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])
        self.set_rate(self.link, add=True)

    def _tbf(self, rate_bps: int) -> list[str]:
        # The bucket holds 1 ms at the rate (at least 128 KiB: two GSO segments), and the
        # queue 50 ms: enough for TCP to fill the link, short enough to stay a link.
        burst = max(2**17, rate_bps // 8 // 1000)
        return ["tbf", "rate", str(rate_bps), "burst", str(burst), "latency", "50ms"]

    def set_rate(self, link: str, add: bool = False) -> None:
        """Limit every link (both directions) to ``link``, e.g. ``"1gbit"``."""
        rate = parse_rate(link)
        verb = "add" if add else "change"
        for h in self.hosts:
            for ns, dev in ((h.ns, "eth0"), (self.switch, h.port)):
                _run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", *self._tbf(rate)])
        self.link, self.rate_bps = link, rate

    # -- faults --------------------------------------------------------------------------

    def link_down(self, host: int) -> None:
        """Pull host ``host``'s cable at the switch: its port goes down, the host's
        ``eth0`` loses carrier, packets either way are dropped (no reset is sent)."""
        _run(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "down"])

    def link_up(self, host: int) -> None:
        """Plug the cable back in; connections that did not time out carry on."""
        _run(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up"])

    # -- processes -----------------------------------------------------------------------

    def popen(self, host: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``host`` (``ip netns exec``) in its own session; the
        testbed ends it on close."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *argv], **kw)
        self._procs.append(p)
        return p

    def serve(
        self, host: int, port: int = 8815, args: Sequence[str] = (), timeout: float = 60.0
    ) -> Server:
        """Start ``flightq serve`` on host ``host``, bound to its address; wait until it
        listens.

        Raises
        ------
        TestbedError
            If it does not print its ready line within ``timeout`` seconds.
        """
        h = self.hosts[host]
        argv = [sys.executable, "-m", "flightq.cli", "serve", "--host", h.address,
                "--port", str(port), *args]  # fmt: skip
        debug = bool(os.environ.get("FLIGHTQ_BENCH_DEBUG"))
        p = self.popen(
            host,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None if debug else subprocess.DEVNULL,
        )
        info = _ready_line(p, timeout)
        if info is None:
            p.kill()
            p.wait(timeout=_CMD_TIMEOUT)
            raise TestbedError(
                f"flightq serve on {h.ns} ({h.address}:{port}) did not start within "
                f"{timeout:.0f}s (exit code {p.poll()}); FLIGHTQ_BENCH_DEBUG=1 shows its stderr"
            )
        return Server(h, h.location(port), p, info)

    def counters(self, host: int) -> tuple[int, int]:
        """Bytes received and sent so far by host ``host``'s ``eth0`` (headers included)."""
        out = _run(["ip", "-n", self.hosts[host].ns, "-s", "-j", "link", "show", "eth0"])
        st = json.loads(out)[0]["stats64"]
        return int(st["rx"]["bytes"]), int(st["tx"]["bytes"])

    # -- clean-up ------------------------------------------------------------------------

    def _trap(self) -> None:
        if not _main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.close()
        old = self._old.get(signum)
        if callable(old):
            old(signum, frame)
        elif old == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        """End the processes inside the hosts and remove every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if _main_thread():
            for sig, old in self._old.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(sig, old)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        end_processes([p.pid for p in self._procs if p.poll() is None], grace=3.0)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1.0)
        _remove([*(h.ns for h in self.hosts), self.switch])

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _ready_line(p: subprocess.Popen[bytes], timeout: float) -> dict[str, Any] | None:
    assert p.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline, buf = time.monotonic() + timeout, b""
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.2):
            if p.poll() is not None:
                return None
            continue
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            return None
        buf += chunk
        for line in buf.splitlines():
            with contextlib.suppress(ValueError):
                info = json.loads(line)
                if isinstance(info, dict) and "listening" in info:
                    return info
    return None


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.command:
        print("flightq_bench.hosts run: give the client command after --", file=sys.stderr)
        return 2
    if not 1 <= args.servers < args.hosts:
        print("flightq_bench.hosts run: need 1 <= --servers < --hosts", file=sys.stderr)
        return 2
    with Testbed(args.hosts, args.link) as tb:
        servers = [tb.serve(i, args.port) for i in range(args.servers)]
        locations = ",".join(s.location for s in servers)
        print(json.dumps({"link": tb.link, "servers": locations.split(",")}), flush=True)
        env = dict(os.environ, FLIGHTQ_LOCATIONS=locations)
        clients = [tb.popen(i, args.command, env=env) for i in range(args.servers, args.hosts)]
        codes = [c.wait() for c in clients]
    return max(codes, default=0)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flightq_bench.hosts run|clean``."""
    p = argparse.ArgumentParser(prog="python -m flightq_bench.hosts", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="servers on the first hosts, the command on the others")
    r.add_argument("--hosts", type=int, default=2)
    r.add_argument("--servers", type=int, default=1)
    r.add_argument("--link", default="10gbit")
    r.add_argument("--port", type=int, default=8815)
    r.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("clean", help="remove testbed namespaces of runs that no longer run")
    c.add_argument("--all", action="store_true", help="also those of runs still running")
    args = p.parse_args(argv)
    if args.cmd == "clean":
        print("\n".join(remove_stale(everything=args.all)) or "nothing to remove")
        return 0
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return _cmd_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
