"""The client's side: the handshake, and a put whose batches travel in a segment."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ..errors import FlightqError, ProtocolError
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
    client: Any, cmd: dict[str, Any], batches: Sequence[pa.RecordBatch], timeout: float | None
) -> int:
    """One put whose batches travel in a segment; the DoPut carries only the command.

    Raises
    ------
    FlightqError
        As a streamed put (the server validates the same way); nothing is stored.
    """
    import pyarrow.flight as fl

    from ..encode import split_batch
    from ..protocol import from_flight_error, pack, unpack

    what = f"put to {cmd['partition']!r}"
    with client._lock:
        if client._shm_pool is None:
            client._shm_pool = SegmentPool(client.shm_dir)
        pool = client._shm_pool
    chunks = [c for b in batches for c in split_batch(b, client._put_batch_bytes())]
    ref = pool.write(chunks[0].schema, chunks, what)
    desc = fl.FlightDescriptor.for_command(pack({**cmd, "shm": ref}))
    ack = None
    try:
        writer, reader = client._flight.do_put(
            desc, chunks[0].schema, options=client._options(timeout)
        )
        with writer:
            writer.done_writing()
            ack = reader.read()
    except (pa.ArrowException, fl.FlightError) as e:
        raise from_flight_error(e, what) from e
    finally:
        if ack is None:
            pool.abandon(ref)
    if ack is None:
        raise FlightqError(f"{what}: the server sent no acknowledgement")
    return int(unpack(ack, "put acknowledgement")["rows"])
