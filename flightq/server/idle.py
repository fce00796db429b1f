"""Streams that make no progress are cut: a stalled client gives its thread back.

A DoPut whose client sends its schema and then nothing, or a DoGet whose client stops
reading, holds a server thread and one of the ``max_calls`` slots
(:mod:`flightq.server.limits`) for as long as the client keeps its connection. pyarrow's
Flight server can neither cancel a call nor bound a handler's blocking read, and a handler
that returns while its read still blocks leaves a dangling reader behind (the process dies
with "pure virtual method called").

So the server ends the call's *transport* instead. :class:`IdleWatch` is server middleware
that follows every open DoPut, DoGet and DoExchange; the handler marks where it waits on the
client (:meth:`IdleWatch.reads` around a put's record batches, :meth:`IdleWatch.sends`
around the generator that feeds an answer: a client that stops reading blocks Flight's
writer, which then stops pulling from the generator). A watchdog thread finds each call
that has waited on its client for ``timeout`` seconds, looks up the TCP connection the call
came on (the peer ``context.peer()`` names, in ``/proc/self/net/tcp`` and ``tcp6``, then the
process's socket of that inode) and shuts it down. gRPC sees the connection gone and cancels
every call on it: the blocked read returns, the handler ends as it would for a client that
went away (nothing of a cut put is stored), and the slot frees.

A DoPut or DoExchange whose client sends its HTTP/2 headers and never its first message
waits inside Flight, before any handler runs, so its peer is never known. The watch sees
it start (the middleware is called first) and, once it has waited ``timeout`` seconds,
cuts by elimination: every connection on the server's port (``/proc/self/net/tcp{,6}``)
that carries no call whose handler runs and carried none for ``timeout`` seconds. A
stalled call on a connection that also carries a live one is not cut (it stays counted
against ``max_calls``).

A cut ends the whole connection, and gRPC carries all of one client's calls over one
connection: a legitimate client's other calls on it fail with ``UnavailableError`` and its
consumer session ends (its claims' rows go back to ready); its next call reconnects.

A consumer session waits on its client by design: it is watched only when its client
beats (:meth:`IdleWatch.heartbeats`), against the silence the client asked for instead of
``timeout``. A session silent that long has lost its client (its host died, its link was
cut: the server sees no end of a half-open connection): the watch ends the session first
(its claims' rows go back to ready), then cuts its connection. Linux only: elsewhere the
watch logs once that idle timeouts are unavailable and cuts nothing.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import pyarrow.flight as fl

from ..errors import ProtocolError

__all__ = ["IdleWatch", "DEFAULT_IDLE_TIMEOUT", "MIDDLEWARE_KEY", "cut_connection"]

log = logging.getLogger("flightq.server")

#: Seconds a stream may wait on its client before its connection is cut. Generous: a
#: legitimate client that is merely slow (a trainer busy between two reads of a large
#: answer, a generator computing its next batch) loses its connection when it passes it.
DEFAULT_IDLE_TIMEOUT = 60.0
#: The key the watch is installed under in the server's middleware.
MIDDLEWARE_KEY = "flightq.idle"

_WATCHED = (fl.FlightMethod.DO_PUT, fl.FlightMethod.DO_GET, fl.FlightMethod.DO_EXCHANGE)
#: Connections remembered as ones a handler ran a call of (the most recent ones).
_SEEN_KEPT = 16384
#: The state column of an established connection in /proc/net/tcp.
_ESTABLISHED = "01"
T = TypeVar("T")


class _Call(fl.ServerMiddleware):
    """One watched call: its peer, and since when it waits on its client (None: it does
    not, or nobody said so yet)."""

    def __init__(self, watch: IdleWatch) -> None:
        self._watch = watch
        self.peer: str | None = None
        self.waiting_since: float | None = None
        self.cut = False
        #: When Flight took the call, and whether a handler runs it yet (a DoPut or
        #: DoExchange reaches its handler once its first message arrived).
        self.started = time.monotonic()
        self.entered = False
        #: Whether its wait is one by design (a request stream's wait for the next
        #: request): cut only while the server stops.
        self.patient = False
        self.noted = False  # logged as not cuttable
        #: A beating consumer session's silence (its own limit), and what ends the
        #: session when it passes.
        self.limit: float | None = None
        self.on_silent: Callable[[], Any] | None = None

    def call_completed(self, exception: Any) -> None:
        self._watch._forget(self)


class IdleWatch(fl.ServerMiddlewareFactory):
    """Server middleware and a watchdog thread that cut the connection of a stream which
    has waited on its client for ``timeout`` seconds (see the module docstring).

    Parameters
    ----------
    timeout:
        Seconds; None or 0 disables the watch.
    on_cut:
        Called with the peer after each cut (the server counts and logs it).

    Raises
    ------
    ProtocolError
        If ``timeout`` is negative or not a number.
    """

    def __init__(
        self,
        timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        on_cut: Callable[[str], None] | None = None,
    ) -> None:
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not timeout >= 0
            or timeout == float("inf")
        ):
            raise ProtocolError(
                f"idle_timeout must be seconds >= 0 (0 or None: off), got {timeout!r}",
                actual=timeout,
            )
        self.timeout = float(timeout) if timeout else None
        self._limit = self.timeout  # lowered while the server stops (hurry)
        self._hurried = False
        self.port = 0  # the server's port, set once it listens
        self._on_cut = on_cut
        self._lock = threading.Lock()
        self._calls: set[_Call] = set()
        #: Connections (host, port) a handler ran a call of, most recent last: never cut
        #: for another's call that never started (a client between two calls).
        self._seen: dict[tuple[str, int], None] = {}
        self._pruned = 0.0  # time.monotonic() of the last pruning of gone connections
        #: Connections seen by the watchdog carrying no handled call, since when.
        self._unknown: dict[tuple[str, int], float] = {}
        #: Once the server stops: the connections on its port then, the only ones it may
        #: still cut by elimination.
        self._owned: set[tuple[str, int]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = sys.platform.startswith("linux")

    def __repr__(self) -> str:
        return f"IdleWatch(timeout={self.timeout})"

    # -------------------------------------------------------------- middleware

    def start_call(self, info: fl.CallInfo, headers: dict[str, Any]) -> _Call | None:
        if self.timeout is None or info.method not in _WATCHED:
            return None
        call = _Call(self)
        with self._lock:
            self._calls.add(call)
        return call

    def _forget(self, call: _Call) -> None:
        with self._lock:
            self._calls.discard(call)

    def _call(self, context: fl.ServerCallContext | None) -> _Call | None:
        if context is None or self.timeout is None:
            return None
        call = context.get_middleware(MIDDLEWARE_KEY)
        if isinstance(call, _Call) and call.peer is None:
            call.peer = context.peer()
            call.entered = True
            self._saw(call.peer)
        return call if isinstance(call, _Call) else None

    def _saw(self, peer: str) -> None:
        where = _where(peer)
        if where is not None:
            with self._lock:
                self._seen.pop(where, None)
                self._seen[where] = None
                if len(self._seen) > _SEEN_KEPT:
                    self._forget_some()

    def _forget_some(self) -> None:
        """Bring the table of connections seen back to :data:`_SEEN_KEPT`: first by the
        connections that are gone (at most once a second: it reads the TCP table), then
        the oldest. Under ``self._lock``."""
        now = time.monotonic()
        if self.port and now - self._pruned >= 1.0:
            self._pruned = now
            live: set[tuple[str, int]] = set()
            with contextlib.suppress(OSError):
                live = {(_norm(h), p) for h, p in _connections(self.port)}
            if live:  # (no table to read: only the oldest go)
                for w in [w for w in self._seen if w not in live]:
                    del self._seen[w]
        while len(self._seen) > _SEEN_KEPT:
            del self._seen[next(iter(self._seen))]

    def entered(self, context: fl.ServerCallContext | None) -> None:
        """A handler runs the call of ``context``: its first message came, and its
        connection is one a handler ran a call of (every handler calls this first)."""
        if self._call(context) is None and context is not None and self.timeout is not None:
            self._saw(context.peer())  # a call the watch does not follow (DoAction, ...)

    # -------------------------------------------------------------- handler hooks

    def reads(self, context: fl.ServerCallContext | None, source: Iterable[T]) -> Iterator[T]:
        """``source`` (a put's record batches from its stream), the call marked as
        waiting on its client while each next one is read (a batch trickling in slowly
        counts as one wait)."""
        call = self._call(context)  # now, in the handler, while its context is current
        return iter(source) if call is None else _reads(call, iter(source))

    def sends(self, context: fl.ServerCallContext | None, batches: Iterable[T]) -> Iterator[T]:
        """``batches`` (an answer's generator), the call marked as waiting on its client
        from each batch handed to Flight's writer until the writer asks for the next: the
        writer blocks while the client does not read."""
        call = self._call(context)
        return iter(batches) if call is None else _sends(call, iter(batches))

    @contextlib.contextmanager
    def patient(self, context: fl.ServerCallContext | None) -> Iterator[None]:
        """Around a wait on the client that is by design (a request stream waiting for
        its next request): never cut, except once the server stops (:meth:`hurry`), when
        it would hold the shutdown for as long as the client keeps its stream open."""
        call = self._call(context)
        if call is None:
            yield
            return
        call.patient, call.waiting_since = True, time.monotonic()
        try:
            yield
        finally:
            call.patient, call.waiting_since = False, None

    @property
    def watching(self) -> bool:
        """Whether the watchdog runs (it is on, on Linux, and started): only then can a
        silent consumer session be ended."""
        return self._thread is not None and self._thread.is_alive()

    def heartbeats(
        self, context: fl.ServerCallContext | None, silence: float, on_silent: Callable[[], Any]
    ) -> _Beats:
        """Watch the consumer session of ``context`` for beats: once none was heard for
        ``silence`` seconds (or, while the server stops, for its hurried limit), call
        ``on_silent`` (which ends the session) and cut the connection. Call
        :meth:`_Beats.heard` on each beat."""
        call = self._call(context)
        beats = _Beats(call)
        if call is not None:
            call.limit, call.on_silent = silence, on_silent
            call.waiting_since = time.monotonic()
        return beats

    # -------------------------------------------------------------- the watchdog

    def start(self) -> None:
        """Start the watchdog thread (once; nothing when the watch is off)."""
        if self.timeout is None or self._thread is not None:
            return
        if not self.available:
            log.warning(
                "idle stream timeouts are unavailable on %s (they need Linux's /proc): "
                "a stalled stream holds its slot until its client goes away",
                sys.platform,
            )
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flightq-idle", daemon=True)
        self._thread.start()

    def hurry(self, seconds: float) -> None:
        """From now on cut after ``seconds`` if that is sooner: a stopping server waits
        for the calls in flight, and a stream stalled by its client would never end."""
        if self.timeout is not None:
            self._limit = min(self.timeout, max(seconds, 0.05))
            # A stopping server takes no new connection: one on its port from now on is
            # another server's (a new one may listen there once this one's listener closed),
            # and is never cut by elimination here.
            if self.available and self.port and self._owned is None:
                self._owned = {(_norm(h), p) for h, p in _connections(self.port)}
            self._hurried = True

    def stop(self) -> None:
        """Stop the watchdog thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _every(self) -> float:
        """Seconds between two looks: a quarter of the shortest limit, 0.05 to 1."""
        with self._lock:
            limits = [c.limit for c in self._calls if c.limit is not None]
        shortest = min([self._limit or 1.0, *limits])
        return min(max(shortest / 4, 0.05), 1.0)

    def _limit_of(self, call: _Call, limit: float) -> float | None:
        """How long ``call`` may wait on its client now (None: for ever)."""
        if call.limit is not None:  # a beating session: its own silence
            return min(call.limit, limit) if self._hurried else call.limit
        return limit if self._hurried or not call.patient else None

    def _run(self) -> None:
        while not self._stop.wait(self._every()):
            limit, now = self._limit, time.monotonic()
            assert limit is not None
            with self._lock:
                due = []
                for c in self._calls:
                    if c.cut or c.peer is None or c.waiting_since is None:
                        continue
                    mine = self._limit_of(c, limit)
                    if mine is not None and now - c.waiting_since >= mine:
                        due.append((c, mine))
            self._cut_unstarted(now, limit)
            for call, mine in due:
                peer, since = call.peer, call.waiting_since
                if peer is None or since is None or now - since < mine:
                    continue  # it made progress meanwhile
                call.cut = True
                if call.on_silent is not None:
                    # A silent session: its rows go back now, whether or not the cut
                    # finds its connection.
                    try:
                        call.on_silent()
                    except Exception:  # the watch goes on
                        log.exception("ending a silent consumer session from %s", peer)
                    log.warning(
                        "ended the consumer session of %s: no beat for %.1f s (its silence)",
                        peer,
                        now - since,
                    )
                try:
                    found = cut_connection(self.port, peer)
                except OSError as e:
                    log.warning("idle stream from %s: could not cut its connection: %s", peer, e)
                    continue
                if found:
                    log.warning(
                        "cut the connection of %s: a stream waited %.1f s on it (idle_timeout)",
                        peer,
                        now - (since if since is not None else now),
                    )
                    if self._on_cut is not None:
                        self._on_cut(peer)

    def _cut_unstarted(self, now: float, limit: float) -> None:
        """Cut the connections a call that never sent its first message may be on: those
        no handler ever ran a call of, seen so for ``limit`` (see the module docstring)."""
        with self._lock:
            stalled = [c for c in self._calls if not c.entered and now - c.started >= limit]
            if not stalled:
                self._unknown.clear()
                return
            # A connection a live call was handled on is never one to cut, however long
            # ago it entered: the table of those seen is bounded, and others' calls may
            # have pushed it out.
            seen = set(self._seen)
            seen.update(w for c in self._calls if c.entered and (w := _where(c.peer or "")))
        conns = {(_norm(h), p) for h, p in _connections(self.port)}
        if self._owned is not None:
            conns &= self._owned
        unknown = {w: self._unknown.get(w, now) for w in conns - seen}
        self._unknown = unknown
        cut = 0
        for (host, port), since in unknown.items():
            if now - since < limit:
                continue  # new: its first call may be on its way to a handler
            peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
            try:
                found = cut_connection(self.port, peer)
            except OSError as e:
                log.warning("stalled call from %s: could not cut its connection: %s", peer, e)
                continue
            if found:
                cut += 1
                log.warning(
                    "cut the connection of %s: no call on it reached a handler, and a call "
                    "has waited %.1f s for its first message (idle_timeout)",
                    peer,
                    now - since + limit,
                )
                if self._on_cut is not None:
                    self._on_cut(peer)
        for c in stalled:
            if cut or c.noted or now - c.started < 3 * limit:
                continue
            c.noted = True
            log.warning(
                "a call has waited %.1f s for its first message on a connection that also "
                "carried handled calls: not cut (it holds one of max_calls)",
                now - c.started,
            )


class _Beats:
    """A beating consumer session's watch (:meth:`IdleWatch.heartbeats`)."""

    def __init__(self, call: _Call | None) -> None:
        self._call = call

    def heard(self) -> None:
        """A beat came: the session's silence starts again."""
        if self._call is not None:
            self._call.waiting_since = time.monotonic()


def _norm(host: str) -> str:
    """``host`` as one spelling (an IPv4-mapped IPv6 address as IPv4)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    return str(getattr(ip, "ipv4_mapped", None) or ip)


@functools.lru_cache(maxsize=1024)
def _where(peer: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC peer, the host as :func:`_norm` spells it (remembered for
    the last 1024 peers: every call's handler asks it, and parsing costs 30 us)."""
    parsed = _parse_peer(peer)
    return None if parsed is None else (_norm(parsed[0]), parsed[1])


def _connections(local_port: int) -> list[tuple[str, int]]:
    """(remote host, remote port) of every established TCP connection in this network
    namespace whose local port is ``local_port`` (the server's side of them)."""
    out = []
    for family, cols in _tcp_table():
        if len(cols) < 4 or cols[3] != _ESTABLISHED:
            continue
        local, remote = cols[1].rsplit(":", 1), cols[2].rsplit(":", 1)
        if int(local[1], 16) != local_port:
            continue
        raw = bytes.fromhex(remote[0])
        # /proc prints each 32-bit word of the address in host (little-endian) order.
        addr = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        try:
            host = socket.inet_ntop(family, addr)
        except (OSError, ValueError):
            continue
        out.append((host, int(remote[1], 16)))
    return out


def _tcp_table() -> Iterator[tuple[int, list[str]]]:
    """(address family, columns) of each line of this network namespace's TCP tables."""
    for path, family in (
        ("/proc/self/net/tcp", socket.AF_INET),
        ("/proc/self/net/tcp6", socket.AF_INET6),
    ):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield family, line.split()


def _reads(call: _Call, it: Iterator[T]) -> Iterator[T]:
    try:
        while True:
            call.waiting_since = time.monotonic()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                call.waiting_since = None
            yield item
    finally:
        call.waiting_since = None


def _sends(call: _Call, it: Iterator[T]) -> Iterator[T]:
    try:
        for b in it:
            call.waiting_since = time.monotonic()
            yield b
            call.waiting_since = None
    finally:
        call.waiting_since = None
        close = getattr(it, "close", None)
        if close is not None:  # now, not when collected: a claim's rows go back first
            close()


def _parse_peer(peer: str) -> tuple[str, int] | None:
    """``("127.0.0.1", 57618)`` from gRPC's ``"ipv4:127.0.0.1:57618"`` (or
    ``"ipv6:[::1]:57618"``, its brackets maybe percent-encoded); None for other transports."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _inodes(local_port: int, remote_port: int) -> list[int]:
    """Socket inodes of TCP connections in this network namespace from ``local_port``
    to ``remote_port`` (both sides of a loopback connection may be listed; the caller
    checks which one it holds)."""
    out = []
    for _, cols in _tcp_table():
        if len(cols) < 10:
            continue
        local, remote = cols[1].rsplit(":", 1)[1], cols[2].rsplit(":", 1)[1]
        if int(local, 16) == local_port and int(remote, 16) == remote_port:
            out.append(int(cols[9]))
    return out


def _same_host(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return a == b
    mapped = [getattr(v, "ipv4_mapped", None) or v for v in (x, y)]
    return mapped[0] == mapped[1]


def cut_connection(port: int, peer: str) -> bool:
    """Shut down (both ways) this process's TCP connection on local ``port`` from
    ``peer`` (gRPC's form, ``"ipv4:127.0.0.1:57618"``); returns whether one was found.

    The socket is found by inode (``/proc/self/fd/*`` -> ``socket:[inode]``), duplicated,
    checked by its addresses on the duplicate (the descriptor may have been closed and
    reused meanwhile) and shut down through it: shutdown acts on the socket every
    descriptor shares, so gRPC's own reads and writes on it fail. Only the duplicate is
    closed.
    """
    where = _parse_peer(peer)
    if where is None or not port:
        return False
    host, remote_port = where
    inodes = set(_inodes(port, remote_port))
    if not inodes:
        return False
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
        if not target.startswith("socket:[") or int(target[8:-1]) not in inodes:
            continue
        try:
            dup = os.dup(int(name))
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino not in inodes:
                continue
            with socket.socket(fileno=dup) as s:
                dup = -1  # the socket object owns it now
                mine, theirs = s.getsockname(), s.getpeername()
                if mine[1] != port or theirs[1] != remote_port or not _same_host(theirs[0], host):
                    continue
                s.shutdown(socket.SHUT_RDWR)
                return True
        except OSError:
            continue
        finally:
            if dup >= 0:
                os.close(dup)
    return False
