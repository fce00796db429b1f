"""Reference points without a server: memcpy, raw loopback TCP, pickle 5 over a socket.

- ``memcpy``: the consumer copies the step's payloads into a buffer it allocated and
  touched beforehand; one thread. The ceiling of any copy on this machine.
- ``raw-tcp``: the producer sends every payload's bytes (``sendall`` per tensor, no
  framing) and the consumer receives them into a preallocated, pre-touched buffer.
  Put, get and step time are the one transfer.
- ``pickle5``: ``pickle.dumps(protocol=5)`` with out-of-band buffers, sent over the same
  kind of socket; the receiver allocates a buffer per out-of-band payload and unpickles.
  pickle's memo sends an object referenced by several rows once (W1's shared images).
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
from typing import Any

import numpy as np

from .endpoint import Consumer, Producer, now_ns, timed
from .payload import as_payload, check_flat, check_rows, flat_buffers

__all__ = [
    "MemcpyConsumer",
    "TcpProducer",
    "TcpConsumer",
    "PickleProducer",
    "PickleConsumer",
]

_TIMEOUT = 120.0


def _prefaulted(n: int, scratch: dict[str, Any]) -> np.ndarray:
    """A touched buffer of ``n`` bytes, shared by the halves of one worker process."""
    buf = scratch.get("recv_buffer")
    if buf is None or len(buf) != n:
        scratch.pop("recv_buffer", None)
        buf = np.empty(n, dtype=np.uint8)
        buf.fill(0)  # touch every page now, so the timed region does not fault them in
        scratch["recv_buffer"] = buf
    return buf


def _recv_into(sock: socket.socket, mv: memoryview) -> None:
    off, n = 0, len(mv)
    while off < n:
        got = sock.recv_into(mv[off:], n - off)
        if got == 0:
            raise ConnectionError(f"peer closed after {off} of {n} bytes")
        off += got


class MemcpyConsumer(Consumer):
    """Copy the reference step's payloads into a preallocated buffer (one thread)."""

    def setup(self) -> dict[str, Any]:
        self._bufs = flat_buffers(self.ref)
        self._dst = _prefaulted(sum(len(b) for b in self._bufs), self.scratch)
        return {}

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        dst, off = self._dst, 0
        for b in self._bufs:
            n = len(b)
            dst[off : off + n] = b
            off += n
        return timed(t0)

    def verify(self) -> None:
        check_flat(self.ref, self._dst, "memcpy")

    def close(self) -> None:
        self._bufs = []


class _Listener(Consumer):
    """A consumer that listens on loopback and accepts the producer once."""

    def setup(self) -> dict[str, Any]:
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host = str(self.info.get("bind", "127.0.0.1"))  # a testbed host's address
        self._srv.bind((host, 0))
        self._srv.listen(1)
        self._srv.settimeout(_TIMEOUT)
        return {"port": self._srv.getsockname()[1], "host": host}

    def ready(self) -> None:
        self.sock, _ = self._srv.accept()
        self.sock.settimeout(_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._srv.close()

    def close(self) -> None:
        for s in ("sock", "_srv"):
            with contextlib.suppress(AttributeError, OSError):
                getattr(self, s).close()


class _Sender(Producer):
    def setup(self) -> dict[str, Any]:
        where = (str(self.info.get("host", "127.0.0.1")), int(self.info["port"]))
        self.sock = socket.create_connection(where, _TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return {}

    def close(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self.sock.close()


class TcpProducer(_Sender):
    """Send every payload's bytes, in canonical order, with no framing."""

    def setup(self) -> dict[str, Any]:
        self._bufs = flat_buffers(self.step)
        return super().setup()

    def put(self) -> dict[str, Any]:
        t0 = now_ns()
        for b in self._bufs:
            self.sock.sendall(memoryview(b))  # type: ignore[arg-type]
        return timed(t0)


class TcpConsumer(_Listener):
    """Receive the step's bytes into a preallocated, pre-touched buffer."""

    def setup(self) -> dict[str, Any]:
        self._dst = _prefaulted(self.ref.nbytes(), self.scratch)
        return super().setup()

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        _recv_into(self.sock, memoryview(self._dst))  # type: ignore[arg-type]
        return timed(t0)

    def verify(self) -> None:
        check_flat(self.ref, self._dst, "raw-tcp")


_HEAD = struct.Struct("<QQ")


class PickleProducer(_Sender):
    """pickle protocol 5, out-of-band buffers sent after the pickle stream."""

    def put(self) -> dict[str, Any]:
        t0 = now_ns()
        oob: list[pickle.PickleBuffer] = []
        data = pickle.dumps(as_payload(self.step), protocol=5, buffer_callback=oob.append)
        raws = [b.raw() for b in oob]
        lens = np.fromiter((r.nbytes for r in raws), dtype=np.uint64, count=len(raws))
        self.sock.sendall(_HEAD.pack(len(data), len(raws)) + lens.tobytes())
        self.sock.sendall(data)
        for r in raws:
            self.sock.sendall(r)
        return timed(t0, wire_bytes=len(data) + int(lens.sum()))


class PickleConsumer(_Listener):
    """Receive the pickle stream and one fresh buffer per out-of-band payload; unpickle."""

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        head = bytearray(_HEAD.size)
        _recv_into(self.sock, memoryview(head))
        n_data, n_bufs = _HEAD.unpack(head)
        lens_b = bytearray(8 * n_bufs)
        _recv_into(self.sock, memoryview(lens_b))
        data = bytearray(n_data)
        _recv_into(self.sock, memoryview(data))
        bufs = []
        for n in np.frombuffer(lens_b, dtype=np.uint64):
            b = bytearray(int(n))
            _recv_into(self.sock, memoryview(b))
            bufs.append(b)
        self._got = pickle.loads(data, buffers=bufs)
        return timed(t0)

    def verify(self) -> None:
        g = self._got
        check_rows(self.ref, g["keys"], g["columns"], g["tags"], "pickle5")

    def release(self) -> None:
        self._got = None
