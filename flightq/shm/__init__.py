"""Same-host transfers through shared memory: Flight carries a ticket, the bytes are mapped.

When client and server share a host, a put or a read may move its record batches through a
file under ``/dev/shm`` instead of the socket (``flightq.connect(..., shm=True)``). A put's
writer serialises the batches as one Arrow IPC stream into a *segment* (a shared-memory
file it owns), copying each large tensor once, straight from the caller's memory, on
several threads; it sends a small reference ``{"path", "gen", "nbytes"}`` over Flight, and
the server copies the segment into one it owns and stores the batches as zero-copy views
of its copy, after the same checks as a streamed put. On Linux the writer's copy is left
out: the server reads the large tensors straight out of the writer's memory
(:mod:`~flightq.shm.direct`). A read is answered with the segments and offsets where
its bytes already lie (:mod:`flightq.shm.table`): the reader maps the producer's pages, and
nothing is copied on the way.

Why segments are reused. Allocating fresh tmpfs pages costs more than copying into them
(on the 2-core reference machine about 1.6 GB/s to allocate, 8 GB/s to copy), so each
writer keeps a :class:`SegmentPool` of warm segments. Who may touch a segment is settled
by two things:

- a state word in the header (its first page): ``WRITTEN`` once the owner filled it and
  sent the reference, ``TAKEN`` once a reader mapped it;
- ``flock`` on the file: every reader holds a shared lock while any view of its mapping
  lives (the lock goes with the process, should it die); the owner fills a segment again
  only under the exclusive lock, which it gets only when no reader holds one, and keeps
  while writing. Readers check the generation in the header under their lock, so a stale
  reference is refused, never read half-written.

The owner never fills a segment that is ``WRITTEN`` and not yet taken, unless its reader
has not come within the lease. Every file is mode 0600, named
``flightq-<owner pid>-<random>-<n>``; the pool unlinks its files when closed, at exit,
and a new pool removes those of owners that no longer run. A reader that mapped a file
keeps valid pages after it is unlinked.

The package: :mod:`~flightq.shm.segments` (the files, their owners and the checks of a
request), :mod:`~flightq.shm.mapping` (readers' mappings), :mod:`~flightq.shm.gather`
(a put's single copy into a segment), :mod:`~flightq.shm.direct` (the server reading a
put out of the writer's memory) and :mod:`~flightq.shm.owner` (whose memory: the process
holding the caller's connection), :mod:`~flightq.shm.client` (the client's side of
a put and of the handshake), :mod:`~flightq.shm.table` (reads answered with the segments
and offsets where the bytes lie).

Examples
--------
>>> import flightq
>>> with flightq.Server() as srv, flightq.connect(srv.location, shm=True) as c:
...     c.health()["shm"]["dir"]
'/dev/shm'
"""

from typing import Any

from .direct import filled_bytes
from .mapping import MAPPED, STORES, map_data, read, read_private, still_there, store_copy
from .segments import (
    BATCH_BYTES,
    DEFAULT_DIR,
    DEFAULT_KEEP_BYTES,
    FREE,
    HEADER,
    MARKER,
    PUT_BATCH_BYTES,
    TAKEN,
    WRITTEN,
    SegmentPool,
    check_peer,
    directory,
    is_local,
    open_regular,
    probe_reply,
)

#: The writer's side (the client's handshake and put, the encoder's gathering) loads on
#: first use: a server that imports this package never loads the encoder.
_WRITER = {
    "handshake": "client",
    "put_via_shm": "client",
    "gathered": "gather",
    "gathering": "gather",
}


def __getattr__(name: str) -> Any:
    if name in _WRITER:
        import importlib

        return getattr(importlib.import_module(f".{_WRITER[name]}", __name__), name)
    raise AttributeError(f"module 'flightq.shm' has no attribute {name!r}")


__all__ = [
    "BATCH_BYTES",
    "PUT_BATCH_BYTES",
    "DEFAULT_DIR",
    "DEFAULT_KEEP_BYTES",
    "FREE",
    "HEADER",
    "MAPPED",
    "MARKER",
    "STORES",
    "TAKEN",
    "WRITTEN",
    "SegmentPool",
    "check_peer",
    "directory",
    "filled_bytes",
    "gathered",
    "gathering",
    "handshake",
    "is_local",
    "map_data",
    "open_regular",
    "probe_reply",
    "put_via_shm",
    "read",
    "read_private",
    "still_there",
    "store_copy",
]
