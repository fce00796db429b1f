"""Content digests of media payloads: the hash, a per-tensor cache, and what a put claims.

A media payload (one dictionary entry of a media column, as it is stored: the tensor's
raw bytes or its codec frame) is named by a digest of those bytes. A writer sends a
digest beside each payload and, for media its partition already holds, the digest alone;
the server checks every payload against its digest and keeps one copy per partition
(``docs/protocol.md``, "Media sent once").

The hash is BLAKE3 (:pypi:`blake3`, 32 bytes): collision resistant, so a writer cannot
craft a payload that another writer's digest would find. Where the package is missing,
BLAKE2b (32 bytes, :mod:`hashlib`) stands in; the digests name their hash, so writer
and server agree or the server says it does not know the writer's hash.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

import msgpack
import pyarrow as pa

from .errors import ProtocolError
from .tensor import is_torch, memory_key

__all__ = [
    "HASH",
    "HASHES",
    "DIGEST_BYTES",
    "BATCH_KEY",
    "digest_of",
    "empty_digest",
    "DigestCache",
    "pack_claims",
    "parse_claims",
    "MediaRefs",
    "split_claims",
    "KnownMedia",
]

#: Bytes of every digest.
DIGEST_BYTES = 32
#: Payloads at least this large are hashed over several threads (BLAKE3 only; a W1 image
#: is 3.36 MiB).
_THREADED_BYTES = 2 << 20


def _blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def _hashes() -> dict[str, Callable[[memoryview], bytes]]:
    out: dict[str, Callable[[memoryview], bytes]] = {"blake2b": _blake2b}
    try:
        import blake3
    except ImportError:  # pragma: no cover - blake3 is a dependency; the fallback is tested
        return out

    def _blake3(data: memoryview) -> bytes:
        # blake3 lets go of the GIL; threads pay only on large payloads.
        big = data.nbytes >= _THREADED_BYTES
        h = blake3.blake3(data, max_threads=blake3.blake3.AUTO if big else 1)
        return h.digest()

    out["blake3"] = _blake3
    return out


#: The hashes this process computes, by wire name.
HASHES: dict[str, Callable[[memoryview], bytes]] = _hashes()
#: The hash a writer uses: BLAKE3 where installed.
HASH = "blake3" if "blake3" in HASHES else "blake2b"

#: Key of the digests an encoded batch carries in its (in-memory) schema metadata, on
#: their way to the put's stream, where they travel as the batch's app metadata.
BATCH_KEY = b"flightq.media"


def digest_of(data: Any, hash: str = HASH) -> bytes:
    """The digest of a payload's bytes (any C-contiguous buffer) with ``hash``."""
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return HASHES[hash](mv)


_EMPTY: dict[str, bytes] = {}


def empty_digest(hash: str) -> bytes:
    """The digest of no bytes (an empty payload is a payload, never a reference)."""
    d = _EMPTY.get(hash)
    if d is None:
        d = _EMPTY[hash] = digest_of(b"", hash)
    return d


class DigestCache:
    """Digests of tensors' payloads, worked out once per tensor object and kept while the
    object lives.

    A hit needs the same object (a weak reference to it), the same memory
    (:func:`flightq.tensor.memory_key`) and, for torch, the same ``_version`` (an in-place
    change bumps it). A writable numpy array has no version to check, so its digest is
    worked out on every put; a read-only one (``a.flags.writeable = False``) is cached.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple[int, str], tuple[Any, Any, Any, bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, x: Any, codec: str) -> bytes | None:
        """The cached digest of ``x``'s payload under ``codec``, or None."""
        hit = self._entries.get((id(x), codec))
        if hit is None:
            return None
        ref, mem, version, d = hit
        if ref() is not x or mem != memory_key(x) or version != _version(x):
            return None
        return d

    def put(self, x: Any, codec: str, digest: bytes) -> None:
        """Remember ``digest`` for ``x`` (nothing happens for a tensor that may change
        unseen: a writable numpy array)."""
        version = _version(x)
        if version is _UNVERSIONED:
            return
        key = (id(x), codec)
        entries = self._entries

        def gone(_: object) -> None:
            entries.pop(key, None)

        try:
            ref = weakref.ref(x, gone)
        except TypeError:
            return
        with self._lock:
            self._entries[key] = (ref, memory_key(x), version, digest)
            while len(self._entries) > self.max_entries:
                self._entries.pop(next(iter(self._entries)), None)


_UNVERSIONED = object()


def _version(x: Any) -> Any:
    if is_torch(x):
        return x._version
    if getattr(getattr(x, "flags", None), "writeable", True):
        return _UNVERSIONED
    return None


def pack_claims(hash: str, fields: Mapping[str, list[bytes]]) -> bytes:
    """A batch's digests as they travel: one per dictionary entry of each media column."""
    return msgpack.packb({"hash": hash, "fields": dict(fields)}, use_bin_type=True)


def parse_claims(raw: bytes | None, what: str) -> tuple[str, dict[str, list[bytes]]] | None:
    """The digests a put's record batch claims (its app metadata), or None.

    Raises
    ------
    ProtocolError
        If the metadata is not such a map.
    """
    if raw is None or not len(raw):
        return None
    try:
        m = msgpack.unpackb(raw, raw=False)
        hash, fields = m["hash"], m["fields"]
        ok = isinstance(hash, str) and isinstance(fields, dict)
        ok = ok and all(
            isinstance(k, str)
            and isinstance(v, list)
            and all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in v)
            for k, v in fields.items()
        )
    except Exception as e:  # hostile bytes raise assorted errors
        raise ProtocolError(f"{what}: a record batch's media digests are malformed: {e}") from e
    if not ok:
        raise ProtocolError(
            f"{what}: a record batch's media digests are malformed: expected "
            '{"hash": str, "fields": {column: [32-byte digest, ...]}}'
        )
    return hash, fields


class MediaRefs:
    """What one put's encoding sends of its media: a digest per dictionary entry, and the
    digest alone for media the server is known to hold.

    Parameters
    ----------
    cache:
        Digests of tensors already hashed (kept by the client across puts).
    known:
        ``(column, digest, shape)`` of media the partition is known to hold: those go as
        the digest alone (an empty payload). Empty: every payload is sent.
    """

    def __init__(
        self,
        cache: DigestCache | None = None,
        known: Container[tuple[str, bytes, tuple[int, ...]]] = (),
        hash: str = HASH,
    ) -> None:
        self.cache = cache if cache is not None else DigestCache()
        self.known = known
        self.hash = hash
        #: ``(column, digest, shape)`` of every entry encoded, sent or named.
        self.sent: set[tuple[str, bytes, tuple[int, ...]]] = set()
        #: Entries sent as the digest alone.
        self.references = 0


def split_claims(schema: pa.Schema) -> tuple[pa.Schema, pa.Buffer | None]:
    """An encoded batch's schema without its media digests, and the digests (as the
    batch's app metadata), or None where it carries none."""
    meta = schema.metadata
    if not meta or BATCH_KEY not in meta:
        return schema, None
    rest = {k: v for k, v in meta.items() if k != BATCH_KEY}
    return schema.with_metadata(rest), pa.py_buffer(meta[BATCH_KEY])


class KnownMedia:
    """``(column, digest, shape)`` of media one partition is known to hold, the most
    recent ``max_entries`` of them: a client's record, per partition, of what a later put
    may send as the digest alone."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._names: dict[tuple[str, bytes, tuple[int, ...]], None] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def update(self, names: Iterable[tuple[str, bytes, tuple[int, ...]]]) -> None:
        """Note media the server acknowledged holding."""
        with self._lock:
            for n in names:
                self._names.pop(n, None)
                self._names[n] = None
            while len(self._names) > self.max_entries:
                self._names.pop(next(iter(self._names)))

    def clear(self) -> None:
        """Forget everything (the server said it lost some)."""
        with self._lock:
            self._names.clear()
