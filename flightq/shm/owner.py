"""Who asks: the process that holds a caller's connection, found through /proc.

A server reads a writer's memory (:mod:`flightq.shm.direct`) only for the process that
holds the client end of the caller's TCP connection. The whole connection must match:
this process's connected socket whose remote end is the peer gives the server's end, and
the pid's socket must run from the peer's address and port to that end
(``/proc/net/tcp`` and ``tcp6``, IPv4-mapped addresses included: gRPC's sockets are
dual-stack), its inode among the pid's descriptors (``/proc/<pid>/fd``). A socket that
only shares the peer's address and port (bound with ``SO_REUSEADDR``, connected to
another service) does not pass. A connection found held stays known for 30 s while the
descriptor still names the socket.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
import time

from ..errors import ProtocolError

__all__ = ["owner_check", "refused"]


def _peer_port(peer: str) -> tuple[int, bytes, int] | None:
    """A gRPC peer string's (family, packed address, port) if it is TCP loopback."""
    if peer.startswith("ipv4:"):
        host, _, port = peer[5:].rpartition(":")
    elif peer.startswith("ipv6:"):
        host, _, port = peer[5:].rpartition(":")
        host = host.strip("[]")
    else:
        return None
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
        n = int(port)
    except ValueError:
        return None
    if not ip.is_loopback and not (
        isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped and ip.ipv4_mapped.is_loopback
    ):
        return None
    return ip.version, ip.packed, n


def _proc_address(text: str) -> bytes:
    """An address of /proc/net/tcp{,6} as 16 bytes of IPv6 (IPv4 mapped): the file writes
    32-bit words in host order, as hex."""
    raw = bytes.fromhex(text)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return raw if len(raw) == 16 else _MAPPED + raw


_MAPPED = b"\0" * 10 + b"\xff\xff"
#: A socket's ends as (16-byte address, port) pairs.
_End = tuple[bytes, int]


def _connections() -> list[tuple[_End, _End, str]]:
    """Every connected TCP socket of this network namespace: (local, remote, inode)."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] != "01":  # connected sockets only: a listener is no connection
                        continue
                    lh, _, lp = cols[1].partition(":")
                    rh, _, rp = cols[2].partition(":")
                    out.append(
                        (
                            (_proc_address(lh), int(lp, 16)),
                            (_proc_address(rh), int(rp, 16)),
                            cols[9],
                        )
                    )
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return out


def _socket_links(pid: int | str) -> dict[str, str]:
    """``socket:[inode]`` links of a process's descriptors, by descriptor."""
    fd_dir = f"/proc/{pid}/fd"
    out = {}
    for name in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[name] = link
    return out


def _client_inodes(peer: _End) -> set[str]:
    """The inodes of the client end of this server's connections from ``peer``.

    The whole connection must match: this process's socket whose remote end is ``peer``
    gives the server's end, and the client's socket must run from ``peer`` to that end.
    A socket elsewhere that only shares the peer's address and port (bound with
    ``SO_REUSEADDR``, connected to another service) does not match.
    """
    conns = _connections()
    mine = {link[8:-1] for link in _socket_links("self").values()}
    ours = {local for local, remote, inode in conns if remote == peer and inode in mine}
    return {inode for local, remote, inode in conns if local == peer and remote in ours} - {"0"}


#: Connections found held by a pid: ``(peer, pid)`` to (descriptor, socket inode, when).
#: Reading /proc/net/tcp walks the kernel's whole table of connections (milliseconds);
#: a later put on the same connection checks that the descriptor still names the socket.
_owners: dict[tuple[str, int], tuple[str, str, float]] = {}
_owners_lock = threading.Lock()
#: Seconds a connection found held stays known without a new search.
_OWNER_TTL = 30.0
_MAX_OWNERS = 4096


def owner_check(peer: str, pid: int, what: str) -> None:
    """Check that process ``pid`` holds the client end of the connection ``peer``.

    Raises
    ------
    ProtocolError
        If the peer is not TCP loopback or the pid holds no such socket.
    """
    now = time.monotonic()
    with _owners_lock:
        known = _owners.get((peer, pid))
    if known is not None and now - known[2] < _OWNER_TTL:
        fd, link, _ = known
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                return
        except OSError:
            pass
    fd, link = _find_owner(peer, pid, what)
    with _owners_lock:
        if len(_owners) >= _MAX_OWNERS:
            _owners.clear()
        _owners[peer, pid] = (fd, link, now)


def _find_owner(peer: str, pid: int, what: str) -> tuple[str, str]:
    """The descriptor of ``pid`` that holds the client end of ``peer``, and its link."""
    where = _peer_port(peer)
    if where is None:
        raise refused(f"{what}: direct reads are for TCP loopback peers, not {peer!r}")
    version, packed, port = where
    end = (packed if version == 6 else _MAPPED + packed, port)
    wanted = {f"socket:[{i}]" for i in _client_inodes(end)}
    try:
        links = _socket_links(pid)
    except OSError as e:
        raise refused(f"{what}: cannot see process {pid}'s descriptors: {e}") from e
    for name, link in links.items():
        if link in wanted:
            return name, link
    raise refused(f"{what}: process {pid} does not hold the connection {peer!r}")


def refused(message: str) -> ProtocolError:
    """A refusal of a direct read: ``field`` "fills" tells the client to copy instead."""
    return ProtocolError(message, field="fills")
