"""A loopback TCP relay between a client and a server whose connections a test can cut,
as a dropped link does, while the server itself keeps running."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class Relay:
    """Listens on 127.0.0.1 (``listen_port``, 0: a free one) and relays every connection
    to ``port``; :meth:`cut` closes the connections relayed so far (new ones are relayed
    again). A relay closed and another opened on its port is a server gone and back."""

    def __init__(self, port: int, listen_port: int = 0) -> None:
        self.port = port
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        self._listener.settimeout(0.2)
        self.location = f"grpc://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut(self) -> int:
        """Close every connection relayed so far; returns how many sockets were closed."""
        with self._lock:
            socks, self._open = self._open, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(socks)

    def close(self) -> None:
        self._stop.set()
        self.cut()
        for t in list(self._threads):
            t.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                near, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.port))
            with self._lock:
                self._open += [near, far]
            for a, b in ((near, far), (far, near)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                self._threads.append(t)
                t.start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):  # one side gone: the relayed connection is over
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def relayed(location: str) -> Iterator[Relay]:
    """A :class:`Relay` to the server at ``location`` (grpc://127.0.0.1:PORT)."""
    relay = Relay(int(location.rsplit(":", 1)[1]))
    try:
        yield relay
    finally:
        relay.close()
