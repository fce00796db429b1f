"""The server: the Flight edge (:mod:`.flight`), the action table (:mod:`.actions`), the
store and its partitions (:mod:`.store`, :mod:`.partition`), the answers it assembles
(:mod:`.assemble`), puts sent in parts (:mod:`.staging`) and snapshots (:mod:`.snapshot`).

The server checks record batches from Arrow offsets and shape columns; nothing here
rebuilds a tensor.
"""

from .flight import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_PUT_BATCH_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    Server,
    serve_forever,
)

__all__ = [
    "DEFAULT_MAX_BATCH_BYTES",
    "DEFAULT_MAX_PUT_BATCH_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
    "Server",
    "serve_forever",
]
