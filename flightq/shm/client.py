"""The client's side: the handshake, and a put whose batches travel in a segment."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ..errors import ProtocolError
from ..sink import Sink
from .gather import ShmGather
from .segments import SegmentPool

# --------------------------------------------------------------------------- client side


def handshake(client: Any) -> None:
    """Check that the server serves shared memory and sees the client's directory.

    The client writes a file of random bytes in its directory; the server's health reply
    must echo them.

    Raises
    ------
    ProtocolError
        If the server has shared memory disabled or sees other files (another host,
        container or directory).
    """
    token = secrets.token_bytes(32)
    name = f"flightq-{os.getpid()}-{secrets.token_hex(4)}-0"
    path = os.path.join(client.shm_dir, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token)
        os.close(fd)
        reply = client._action("health", {"shm_probe": path}).get("shm")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if not reply:
        raise ProtocolError(
            f"the server at {client.location} has shared memory disabled (Server(shm=False)); "
            "connect without shm"
        )
    if reply.get("probe") != token.hex():
        raise ProtocolError(
            f"the server at {client.location} does not see {client.shm_dir} (it uses "
            f"{reply.get('dir')!r}; another host or container?); connect without shm or "
            "pass shm=<a directory both share>"
        )


def put_via_shm(
    client: Any,
    cmd: dict[str, Any],
    batches: Sequence[pa.RecordBatch],
    timeout: float | None,
    sink: Sink | None = None,
) -> int:
    """One put whose batches travel in a segment; the DoPut carries only the command.

    Batches encoded into a :class:`~flightq.shm.gather.ShmGather` ``sink`` have their
    large payloads copied from the caller's tensors straight into the segment.

    Raises
    ------
    FlightqError
        As a streamed put (the server validates the same way); nothing is stored.
    """
    from ..chunks import split_batch

    what = f"put to {cmd['partition']!r}"
    with client._lock:
        if client._shm_pool is None:
            client._shm_pool = SegmentPool(client.shm_dir)
        pool = client._shm_pool
    chunks = [c for b in batches for c in split_batch(b, client._put_batch_bytes())]
    gather = sink if isinstance(sink, ShmGather) else None
    ref = pool.write(chunks[0].schema, chunks, what, gather)
    try:
        return int(client._do_put({**cmd, "shm": ref}, chunks[0].schema, (), timeout))
    except BaseException:
        pool.abandon(ref)
        raise
