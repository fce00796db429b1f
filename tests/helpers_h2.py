"""A bare HTTP/2 client for tests: opens gRPC calls by their headers alone.

pyarrow's Flight client always sends a call's first message (DoPut's schema, DoExchange's
descriptor) when it opens the call. A client written against HTTP/2 directly need not: it
can send a call's headers and then nothing, which leaves the server's Flight waiting for
that first message before any handler runs. This module is such a client, in a few dozen
lines of frames (RFC 9113) and literal header fields (RFC 7541, no Huffman, no table).
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = ["HeadersOnly"]

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _SETTINGS, _PING, _GOAWAY = 0x1, 0x4, 0x6, 0x7
_END_HEADERS, _ACK = 0x4, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: str, value: str) -> bytes:
    # "Literal header field without indexing, new name"; every string here is < 127 bytes.
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


class HeadersOnly:
    """One TCP connection to a gRPC server at ``host:port`` carrying calls that send their
    headers and never a message. A thread answers the server's SETTINGS and PINGs (so the
    connection stays healthy by HTTP/2's rules) and notes when the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._sock = socket.create_connection((host, port), timeout=30)
        self._sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0))
        self._next = 1
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def open(self, method: str) -> int:
        """Open a call of ``method`` (e.g. ``"DoPut"``) with its headers only; its stream id."""
        authority = (
            f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
        )
        block = b"".join(
            _literal(k, v)
            for k, v in (
                (":method", "POST"),
                (":scheme", "http"),
                (":path", f"/arrow.flight.protocol.FlightService/{method}"),
                (":authority", authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            )
        )
        with self._lock:
            stream, self._next = self._next, self._next + 2
            self._sock.sendall(_frame(_HEADERS, _END_HEADERS, stream, block))
        return stream

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    return
                buf += data
                while len(buf) >= 9:
                    n = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + n:
                        break
                    kind, flags, payload = buf[3], buf[4], buf[9 : 9 + n]
                    buf = buf[9 + n :]
                    with self._lock:
                        if kind == _SETTINGS and not flags & _ACK:
                            self._sock.sendall(_frame(_SETTINGS, _ACK, 0))
                        elif kind == _PING and not flags & _ACK:
                            self._sock.sendall(_frame(_PING, _ACK, 0, payload))
                    if kind == _GOAWAY:
                        return
        except OSError:
            return
        finally:
            self.closed.set()

    def close(self) -> None:
        """Close the connection (if the server has not)."""
        try:
            self._sock.close()
        finally:
            self._reader.join(timeout=5)

    def __enter__(self) -> HeadersOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
