"""Content digests of media payloads: the hash, a cheap hint, a per-tensor cache, and
what a put claims.

A media payload (one dictionary entry of a media column, as it is stored: the tensor's
raw bytes or its codec frame) has a **hint** (:func:`hint_of`: its size and a CRC of a
few fixed samples, microseconds to work out) and a **digest** (a hash of all its bytes).
A writer sends new payloads bare; the server files them under their hint, unhashed. Only
where a payload recurs (the writer sent one with that hint to the partition before) is
it hashed: the writer sends its digest and hint alone (a reference), and the server
hashes the payloads it holds under that hint to find the one that matches
(``docs/protocol.md``, "Media sent once").

The hash is BLAKE3 (:pypi:`blake3`, 32 bytes): collision resistant, so a writer cannot
craft a payload that another writer's digest would find. Where the package is missing,
BLAKE2b (32 bytes, :mod:`hashlib`) stands in; the digests name their hash, so writer
and server agree or the server says it does not know the writer's hash.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
import zlib
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

import msgpack
import pyarrow as pa

from .errors import ProtocolError
from .msgcheck import request_bytes
from .tensor import is_torch, memory_key

__all__ = [
    "HASH",
    "HASHES",
    "DIGEST_BYTES",
    "HINT_BYTES",
    "BATCH_KEY",
    "digest_of",
    "hint_of",
    "hashed_bytes",
    "empty_digest",
    "DigestCache",
    "pack_claims",
    "parse_claims",
    "Named",
    "MediaRefs",
    "split_claims",
    "KnownMedia",
]

#: Bytes of every digest.
DIGEST_BYTES = 32
#: Bytes of every hint: the payload's size (8), a CRC-32 of its samples (4).
HINT_BYTES = 12
#: The hint's samples: this many bytes at each of a few fixed places.
_SAMPLE = 4096
_SAMPLES = 5
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


_hashed = [0]
_hashed_lock = threading.Lock()


def hashed_bytes() -> int:
    """Payload bytes :func:`digest_of` has hashed in this process (for tests and
    benchmarks: what content addressing costs)."""
    return _hashed[0]


def _bytes_of(data: Any) -> memoryview:
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def digest_of(data: Any, hash: str = HASH) -> bytes:
    """The digest of a payload's bytes (any C-contiguous buffer) with ``hash``."""
    mv = _bytes_of(data)
    with _hashed_lock:
        _hashed[0] += mv.nbytes
    return HASHES[hash](mv)


def hint_of(data: Any) -> bytes:
    """A payload's hint: its size and a CRC-32 of ``_SAMPLES`` samples of ``_SAMPLE``
    bytes spread evenly over it (about 15 us for a 3.4 MiB image).

    Equal payloads have equal hints; unequal ones may too (a hint is no proof of
    anything, and anyone can craft a collision): it only says which payloads are worth
    hashing to find out whether they are equal.
    """
    mv = _bytes_of(data)
    n = mv.nbytes
    crc = 0
    if n <= _SAMPLE * _SAMPLES:
        crc = zlib.crc32(mv)
    else:
        for k in range(_SAMPLES):
            at = (n - _SAMPLE) * k // (_SAMPLES - 1)
            crc = zlib.crc32(mv[at : at + _SAMPLE], crc)
    return struct.pack("<QI", n, crc)


_EMPTY: dict[str, bytes] = {}


def empty_digest(hash: str) -> bytes:
    """The digest of no bytes (an empty payload is a payload, never a reference)."""
    d = _EMPTY.get(hash)
    if d is None:
        d = _EMPTY[hash] = digest_of(b"", hash)
    return d


class DigestCache:
    """Hints and digests of tensors' payloads, worked out once per tensor object (the
    digest only when needed) and kept while the object lives.

    A hit needs the same object (a weak reference to it), the same memory
    (:func:`flightq.tensor.memory_key`) and, for torch, the same ``_version`` (an in-place
    change bumps it). A writable numpy array has no version to check, so its digest is
    worked out on every put; a read-only one (``a.flags.writeable = False``) is cached.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple[int, str], tuple[Any, Any, Any, bytes, bytes | None]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, x: Any, codec: str) -> tuple[bytes, bytes | None] | None:
        """The cached hint and digest (None: not worked out yet) of ``x``'s payload
        under ``codec``, or None."""
        hit = self._entries.get((id(x), codec))
        if hit is None:
            return None
        ref, mem, version, h, d = hit
        if ref() is not x or mem != memory_key(x) or version != _version(x):
            return None
        return h, d

    def put(self, x: Any, codec: str, hint: bytes, digest: bytes | None) -> None:
        """Remember ``hint`` and ``digest`` for ``x`` (nothing happens for a tensor that
        may change unseen: a writable numpy array)."""
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
            self._entries[key] = (ref, memory_key(x), version, hint, digest)
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
    """A batch's media claims as they travel: one per dictionary entry of each media
    column (empty, a digest, or a digest and a hint: see :func:`parse_claims`)."""
    return msgpack.packb({"hash": hash, "fields": dict(fields)}, use_bin_type=True)


#: The lengths a claim may have: none, a digest, a digest and a hint.
_CLAIM_BYTES = (0, DIGEST_BYTES, DIGEST_BYTES + HINT_BYTES)


def parse_claims(
    raw: bytes | Any | None, what: str, limit: int | None = None
) -> tuple[str, dict[str, list[bytes]]] | None:
    """The claims a put's record batch makes about its media entries (its app metadata:
    bytes or a buffer), or None; ``limit``: the server's cap on a control message
    (:func:`flightq.msgcheck.request_bytes`).

    Per dictionary entry: empty (a payload, filed under its hint unhashed), a digest (a
    payload the server checks against it on receipt), or a digest followed by a hint
    (an empty entry: a reference to a payload the partition holds).

    Raises
    ------
    ProtocolError
        If the metadata is not such a map.
    ResourceExhaustedError
        If the metadata, or what it decodes to, passes ``limit``.
    """
    if raw is None or not len(raw):
        return None
    if limit is not None:
        raw = request_bytes(raw, f"{what}: media claims", limit)
    try:
        m = msgpack.unpackb(raw, raw=False)
        hash, fields = m["hash"], m["fields"]
        ok = isinstance(hash, str) and isinstance(fields, dict)
        ok = ok and all(
            isinstance(k, str)
            and isinstance(v, list)
            and all(isinstance(d, bytes) and len(d) in _CLAIM_BYTES for d in v)
            for k, v in fields.items()
        )
    except Exception as e:  # hostile bytes raise assorted errors
        raise ProtocolError(f"{what}: a record batch's media claims are malformed: {e}") from e
    if not ok:
        raise ProtocolError(
            f"{what}: a record batch's media claims are malformed: expected "
            '{"hash": str, "fields": {column: [b"" | 32-byte digest | digest + '
            f"{HINT_BYTES}-byte hint, ...]}}}}"
        )
    return hash, fields


#: A medium's name in a client's record of what a partition holds: column, hint, shape.
Named = tuple[str, bytes, tuple[int, ...]]


class MediaRefs:
    """What one put's encoding sends of its media: each new payload bare, and a reference
    (its digest and hint, no payload) for media whose hint the writer sent before.

    Parameters
    ----------
    cache:
        Hints and digests of tensors already seen (kept by the client across puts).
    known:
        ``(column, hint, shape)`` of media sent to the partition before: a payload with
        such a hint is hashed and goes as a reference. Empty: every payload is sent.
    claim:
        Send each payload with its digest (the server checks it on receipt): a put sent
        again after ``MediaUnknownError``.
    """

    def __init__(
        self,
        cache: DigestCache | None = None,
        known: Container[Named] = (),
        hash: str = HASH,
        claim: bool = False,
    ) -> None:
        self.cache = cache if cache is not None else DigestCache()
        self.known = known
        self.hash = hash
        self.claim = claim
        #: ``(column, hint, shape)`` of every entry encoded, sent or referenced.
        self.sent: set[Named] = set()
        #: Entries sent as references.
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
    """``(column, hint, shape)`` of media sent to one partition, the most recent
    ``max_entries`` of them: a client's record, per partition, of what a later put sends
    as a reference."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._names: dict[Named, None] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def update(self, names: Iterable[Named]) -> None:
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
