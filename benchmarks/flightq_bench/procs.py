"""Processes of a benchmark run: memory readings, loopback checks, server subprocesses.

Everything here reads Linux's ``/proc``: peak RSS (``VmHWM``, reset between measurements
through ``clear_refs``), the listening sockets of a set of processes, the processes of a
session. A server subprocess starts in its own session so that everything it spawns
(Ray's raylet and workers included) can be found and ended by process id.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import platform
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LoopbackError",
    "Listener",
    "ServerProcess",
    "machine_info",
    "rss",
    "reset_peak",
    "cpu_seconds",
    "listeners",
    "check_loopback",
    "session_pids",
    "descendants",
    "end_processes",
]


class LoopbackError(RuntimeError):
    """A process of the benchmark listens on an address other than loopback."""


def _status(pid: int | str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                out[k] = v.strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def rss(pid: int | str = "self") -> tuple[int, int]:
    """Current and peak resident set size of a process, in bytes (0, 0 if it is gone)."""
    st = _status(pid)

    def kb(key: str) -> int:
        v = st.get(key, "0 kB").split()
        return int(v[0]) * 1024 if v else 0

    return kb("VmRSS"), kb("VmHWM")


def reset_peak(pid: int | str = "self") -> bool:
    """Reset a process's peak RSS to its current RSS (``clear_refs`` 5); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU time (user + system, every thread) a process has used so far, in seconds."""
    f = _stat_fields(str(pid))
    if not f:
        return 0.0
    return (int(f[11]) + int(f[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    return text[text.rfind(")") + 2 :].split()


def _all_pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def session_pids(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (zombies left out)."""
    out = []
    for p in _all_pids():
        f = _stat_fields(p)
        if f and f[0] != "Z" and int(f[3]) == sid:
            out.append(int(p))
    return out


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (not ``root`` itself)."""
    children: dict[int, list[int]] = {}
    for p in _all_pids():
        f = _stat_fields(p)
        if f and f[0] != "Z":
            children.setdefault(int(f[1]), []).append(int(p))
    out: list[int] = []
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    """A process's command line, space-joined ('' if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Listener:
    """One listening (TCP) or bound (UDP) socket of a process."""

    pid: int
    proto: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        """Whether the address is in 127.0.0.0/8 or ::1 (IPv4-mapped included)."""
        return _ip(self.address).is_loopback


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _parse_addr(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1])), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words)), int(port, 16)


def _socket_table(pid: int | str = "self") -> dict[int, tuple[str, str, int]]:
    """Inode to (proto, address, port) for listening TCP and bound UDP sockets of the
    network namespace that process ``pid`` is in."""
    table: dict[int, tuple[str, str, int]] = {}
    for proto, state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        try:
            with open(f"/proc/{pid}/net/{proto}") as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != state:
                continue
            addr, port = _parse_addr(parts[1])
            table[int(parts[9])] = (proto, addr, port)
    return table


def listeners(pids: Iterable[int]) -> list[Listener]:
    """Listening TCP and bound UDP sockets held by the given processes (each read in its
    own network namespace)."""
    tables: dict[str, dict[int, tuple[str, str, int]]] = {}
    out = []
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = _socket_table(pid)
        table = tables[netns]
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                hit = table.get(int(target[8:-1]))
                if hit:
                    out.append(Listener(pid, hit[0], hit[1], hit[2]))
    return out


def check_loopback(pids: Iterable[int], allowed: str | None = None) -> list[Listener]:
    """Return the processes' listeners; raise if any is bound beyond loopback (or beyond
    the network ``allowed``, e.g. a testbed's ``198.18.0.0/24``, besides loopback).

    Raises
    ------
    LoopbackError
        Naming each offending process, address and port.
    """
    found = listeners(sorted(set(pids)))
    net = ipaddress.ip_network(allowed) if allowed else None
    bad = [x for x in found if not x.loopback and not (net and _ip(x.address) in net)]
    if bad:
        lines = [f"pid {x.pid} ({cmdline(x.pid)[:60]}) {x.proto} {x.address}:{x.port}" for x in bad]
        raise LoopbackError(
            "refusing to measure: these benchmark processes listen beyond loopback: "
            + "; ".join(lines)
        )
    return found


def end_processes(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM each process, wait up to ``grace`` seconds, then SIGKILL the survivors."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    f = _stat_fields(str(pid))
    return f is not None and f[0] != "Z"


@dataclass
class ServerProcess:
    """A server subprocess in its own session; it prints one JSON line when ready.

    Use as a context manager: on exit (also on failure) the process gets SIGTERM and time
    to shut down, then every process left in its session is killed by id.
    """

    argv: list[str]
    name: str
    ready_timeout: float = 90.0
    env: dict[str, str] | None = None
    #: Its working directory (``python -m`` imports from there first); None: this one's.
    cwd: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if not os.environ.get("FLIGHTQ_BENCH_DEBUG") else None,
            start_new_session=True,
            env=env,
            cwd=self.cwd,
        )
        try:
            self.info = self._await_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _await_ready(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.ready_timeout
        buf = b""
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.2):
                if self.proc.poll() is not None:
                    break
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            for line in buf.splitlines():
                with contextlib.suppress(ValueError):
                    info = json.loads(line)
                    if isinstance(info, dict):
                        return info
        raise RuntimeError(
            f"{self.name} server did not report ready within {self.ready_timeout:.0f}s "
            f"(exit code {self.proc.poll()}); rerun with FLIGHTQ_BENCH_DEBUG=1 to see its stderr"
        )

    @property
    def pids(self) -> list[int]:
        """The server process and everything in its session."""
        if self.proc is None:
            return []
        return sorted({self.proc.pid, *session_pids(self.proc.pid)})

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        members = self.pids
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the bench's own servers also exit on stdin EOF
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)
        end_processes(sorted(set(members) | set(session_pids(self.proc.pid))), grace=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_info() -> dict[str, Any]:
    """nproc, RAM, CPU model, kernel and Python of this machine."""
    return {
        "nproc": os.cpu_count(),
        "ram_bytes": _mem_total(),
        "cpu_model": _cpu_model(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
    }


@contextlib.contextmanager
def env_set(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
