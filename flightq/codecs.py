"""Payload codecs: raw and zstd, frozen, described as plain dicts.

A codec's identity is a stable string and its configuration a plain dict, stored in the
Arrow field metadata, so a receiver decodes with no out-of-band knowledge. Codecs apply
per tensor (per row, or per media segment). zstd frames carry their content size, so a
server checks a compressed payload's header against its shape before decompressing
it, then decompresses it once, bounded by that size, to check it decodes to exactly that.

zstd needs the ``zstandard`` package, an optional extra (``pip install 'flightq[zstd]'``)
imported on first use: schemas that declare zstd fields load without it, and the first
payload encoded or decoded with it says what to install.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import DecodeError, EncodeError, SchemaError

__all__ = ["Codec", "Raw", "Zstd", "codec_from_dict", "decode_frames", "encode_frames", "RAW"]

#: Frames that declare up to this many bytes are decoded in one call (an allocation of at
#: most this size); larger ones stream through a buffer of this size, so checking a frame
#: never holds more than this, whatever it declares.
_ONE_SHOT = 1 << 20


def _zstd(error: type[EncodeError] | type[DecodeError] = DecodeError) -> Any:
    """The ``zstandard`` module, imported on first use.

    Raises
    ------
    EncodeError, DecodeError
        (``error``) If it is not installed, naming the extra that brings it.
    """
    try:
        import zstandard
    except ImportError as e:
        raise error(
            "a zstd field needs the zstandard package: pip install 'flightq[zstd]' (or "
            "declare the field raw)",
            expected="zstandard",
        ) from e
    return zstandard


@dataclass(frozen=True)
class Codec:
    """Base of the codecs. ``id`` names the codec on the wire."""

    id: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """The codec as a plain dict (``{"id": ..., **config}``)."""
        raise NotImplementedError

    def encode(self, data: Any) -> Any:
        """Encode one payload (a buffer) to bytes."""
        raise NotImplementedError

    def decode(self, data: Any, nbytes: int, ctx: Any = None) -> Any:
        """Decode one payload, which must come back as exactly ``nbytes`` bytes (``ctx``:
        :meth:`context`'s, or None)."""
        raise NotImplementedError

    def decoded_size(self, data: Any) -> int | None:
        """The decoded byte length, read cheaply from the payload, or None if unknown."""
        raise NotImplementedError

    def context(self) -> Any:
        """State to reuse across the payloads of one batch (one thread), or None."""
        return None

    def check(self, data: Any, nbytes: int, ctx: Any = None) -> None:
        """Check that a payload decodes to exactly ``nbytes`` bytes, keeping none of them."""
        raise NotImplementedError

    def decode_into(self, data: Any, out: memoryview, ctx: Any = None) -> None:
        """Decode one payload into ``out``, which it must fill exactly."""
        raise NotImplementedError


@dataclass(frozen=True)
class Raw(Codec):
    """No transformation: the payload is the tensor's bytes."""

    id: ClassVar[str] = "raw"

    def to_dict(self) -> dict[str, Any]:
        return {"id": "raw"}

    def encode(self, data: Any) -> Any:
        return data

    def decode(self, data: Any, nbytes: int, ctx: Any = None) -> Any:
        return data

    def decoded_size(self, data: Any) -> int | None:
        return len(memoryview(data))

    def check(self, data: Any, nbytes: int, ctx: Any = None) -> None:
        got = len(memoryview(data))
        if got != nbytes:
            raise DecodeError(
                f"raw payload has {got} bytes, expected {nbytes}", expected=nbytes, actual=got
            )

    def decode_into(self, data: Any, out: memoryview, ctx: Any = None) -> None:
        self.check(data, len(out))
        out[:] = memoryview(data).cast("B")


#: Each thread's zstd compressors, one per level: made once (a compressor costs about as
#: much to make as a small payload to compress), never shared between threads (a
#: compressor is not thread-safe).
_COMPRESSORS = threading.local()


def _compressor(level: int) -> Any:
    made: dict[int, Any] | None = getattr(_COMPRESSORS, "by_level", None)
    if made is None:
        made = _COMPRESSORS.by_level = {}
    cctx = made.get(level)
    if cctx is None:
        cctx = made[level] = _zstd(EncodeError).ZstdCompressor(level=level, write_content_size=True)
    return cctx


@dataclass(frozen=True)
class Zstd(Codec):
    """zstd, one frame per payload, with the content size in the frame header."""

    id: ClassVar[str] = "zstd"
    level: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise SchemaError(f"zstd level must be an integer in [-7, 22], got {self.level!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": "zstd", "level": self.level}

    def encode(self, data: Any) -> Any:
        return _compressor(self.level).compress(data)

    def decode(self, data: Any, nbytes: int, ctx: Any = None) -> Any:
        """Decode one frame, which must declare and decode to exactly ``nbytes`` bytes.

        Raises
        ------
        DecodeError
            If the frame has no content size, declares another size, is corrupt, decodes
            to another size or is followed by other bytes; nothing beyond ``nbytes`` is
            ever allocated.
        """
        if 0 < nbytes <= _ONE_SHOT:
            return self._exact(data, nbytes, None, keep=True, dctx=ctx)
        out = bytearray(nbytes)
        self._exact(data, nbytes, memoryview(out), keep=False, dctx=ctx)
        return out

    def context(self) -> Any:
        """A decompression context, reused across one batch's frames (not thread-safe)."""
        return _zstd().ZstdDecompressor()

    def check(self, data: Any, nbytes: int, ctx: Any = None) -> None:
        """Check a frame as :meth:`decode` does, through a bounded buffer, keeping nothing."""
        self._exact(data, nbytes, None, keep=False, dctx=ctx)

    def decode_into(self, data: Any, out: memoryview, ctx: Any = None) -> None:
        """Decode a frame into ``out`` (no intermediate copy), checked as :meth:`decode`."""
        self._exact(data, len(out), out, keep=False, dctx=ctx)

    def _exact(
        self, data: Any, nbytes: int, out: memoryview | None, *, keep: bool, dctx: Any = None
    ) -> Any:
        """Check the header, then decode once, bounded by ``nbytes``: into ``out`` when
        given, returned when ``keep``, else through a scratch buffer that is discarded."""
        size = self.decoded_size(data)
        if size is None:
            raise DecodeError(
                f"zstd frame has no content size in its header, the shape needs {nbytes} "
                "bytes; compress with write_content_size=True",
                expected=nbytes,
            )
        if size != nbytes:
            raise DecodeError(
                f"zstd frame declares {size} bytes, the shape needs {nbytes}",
                expected=nbytes,
                actual=size,
            )
        zstandard = _zstd()
        dctx = dctx if dctx is not None else zstandard.ZstdDecompressor()
        raw = None
        try:
            if 0 < nbytes <= _ONE_SHOT:
                # The header's size, checked above, is what this allocates.
                raw = dctx.decompress(data, max_output_size=nbytes, allow_extra_data=False)
                got = len(raw)
                if out is not None and got == nbytes:
                    out[:] = raw
            else:  # also size 0, which the one-call path returns early without reading
                got = _stream(dctx, data, nbytes, out)
                used = _frame_bytes(data) if got == nbytes else None
                if used is not None and used != memoryview(data).nbytes:
                    raise DecodeError(
                        f"zstd payload holds {memoryview(data).nbytes - used} bytes after its "
                        "frame (another frame, a skippable one, or junk)",
                        expected=nbytes,
                    )
        except zstandard.ZstdError as e:
            raise DecodeError(
                f"zstd payload is corrupt: it does not decode to the {nbytes} bytes its "
                f"frame declares: {e}",
                expected=nbytes,
            ) from e
        if got != nbytes:
            more = "or more " if got > nbytes else ""
            raise DecodeError(
                f"zstd payload decoded to {got} bytes {more}but its frame declares {nbytes}",
                expected=nbytes,
                actual=got,
            )
        return raw if keep else None

    def decoded_size(self, data: Any) -> int | None:
        zstandard = _zstd()
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError:
            return None
        return None if size < 0 else size


RAW = Raw()


def _frame_bytes(data: Any) -> int:
    """The bytes of the one zstd frame that starts ``data`` (a frame a decode just read
    to its end, so its block headers are there): its header, each block's 3-byte header
    and content (one byte for an RLE block), and its checksum where the header says so.
    What a streamed decode reads, which stops at the frame's end and so does not see
    what follows it."""
    mv = memoryview(data).cast("B")
    at = _zstd().frame_header_size(bytes(mv[:18]))
    checksum = 4 if mv[4] & 0x04 else 0  # the frame header descriptor's checksum flag
    while at + 3 <= len(mv):
        head = mv[at] | mv[at + 1] << 8 | mv[at + 2] << 16
        kind, size = (head >> 1) & 3, head >> 3
        at += 3 + (1 if kind == 1 else size)
        if head & 1:  # the last block
            return at + checksum
    return len(mv) + 1  # cut short: not one frame (a decode would have failed first)


def _stream(dctx: Any, data: Any, nbytes: int, out: memoryview | None) -> int:
    """Decode ``data`` into ``out`` (or through a scratch buffer) and count the bytes,
    stopping once past ``nbytes``; returns the count (past ``nbytes`` if it decodes to
    more, or is followed by another frame)."""
    reader = dctx.stream_reader(data)
    got = 0
    if out is not None:
        while got < nbytes:
            k = reader.readinto(out[got:])
            if not k:
                return got
            got += k
    scratch = bytearray(min(nbytes, _ONE_SHOT) + 1 if out is None else 1)
    while got <= nbytes:
        k = reader.readinto(scratch)
        if not k:
            break
        got += k
    return got


#: Frames that come to this many bytes in all are decoded on several threads (a codec
#: lets go of the GIL while it decodes), each of at least this many bytes.
_THREADED_BYTES = 2 << 20
#: The most threads that decode frames beside their callers, in the whole process: a
#: server checking many puts at once starts no more than these.
_MAX_THREADS = 8
_SPARE = threading.BoundedSemaphore(_MAX_THREADS)


def decode_frames(
    codec: Codec,
    frames: Sequence[Any],
    sizes: Sequence[int],
    out: Sequence[memoryview] | None = None,
) -> tuple[int, DecodeError] | None:
    """Decode each of ``frames`` to exactly its ``sizes`` bytes, into ``out`` (one view a
    frame, of its size) or through a scratch buffer (None: each checked, nothing kept),
    as :meth:`Codec.decode_into` and :meth:`Codec.check` do. Frames of many bytes in all
    are split into runs of consecutive frames, decoded by the caller and by as many
    threads as the process's CPUs allow and :data:`_MAX_THREADS` has free. Returns None
    when every frame decodes, else the index of the first that does not and its error."""
    n = len(frames)
    runs, helpers = _runs(sizes)
    try:
        if len(runs) == 1:  # few bytes, one CPU, no helper free, or one frame of most
            return _decode_run(codec, frames, sizes, out, 0, n)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(runs) - 1, thread_name_prefix="flightq-decode") as pool:
            rest = [pool.submit(_decode_run, codec, frames, sizes, out, *r) for r in runs[1:]]
            failed = [_decode_run(codec, frames, sizes, out, *runs[0])]
            failed += [f.result() for f in rest]
    finally:
        _give_back(helpers)
    return next((f for f in failed if f is not None), None)


def encode_frames(codec: Codec, payloads: Sequence[Any]) -> list[Any]:
    """Each of ``payloads`` (buffers) encoded, in order; payloads of many bytes in all are
    split into runs encoded by the caller and by free helper threads, as
    :func:`decode_frames` does."""
    n = len(payloads)
    sizes = [memoryview(b).nbytes for b in payloads]
    runs, helpers = _runs(sizes)
    try:
        if len(runs) == 1:
            return [codec.encode(b) for b in payloads]
        from concurrent.futures import ThreadPoolExecutor

        def run(a: int, b: int) -> list[Any]:
            return [codec.encode(x) for x in payloads[a:b]]

        with ThreadPoolExecutor(len(runs) - 1, thread_name_prefix="flightq-encode") as pool:
            rest = [pool.submit(run, *r) for r in runs[1:]]
            out = run(*runs[0])
            for f in rest:
                out += f.result()
        assert len(out) == n
        return out
    finally:
        _give_back(helpers)


def _runs(sizes: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """Runs of consecutive items of about equal bytes, one for the caller and one for each
    helper thread it got (:data:`_SPARE`, given back with :func:`_give_back`); one run
    where the items are few bytes, the process has one CPU or no helper is free."""
    n = len(sizes)
    total = sum(sizes)
    want = min(_MAX_THREADS + 1, _cpus(), n, total // _THREADED_BYTES) - 1
    helpers = 0
    while helpers < want and _SPARE.acquire(blocking=False):
        helpers += 1
    if not helpers:
        return [(0, n)], 0
    bounds, acc, share = [0], 0, total / (helpers + 1)
    for i, size in enumerate(sizes):
        acc += size
        if acc >= share * len(bounds) and len(bounds) <= helpers:
            bounds.append(i + 1)
    bounds.append(n)
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a], helpers


def _give_back(helpers: int) -> None:
    for _ in range(helpers):
        _SPARE.release()


def _decode_run(
    codec: Codec,
    frames: Sequence[Any],
    sizes: Sequence[int],
    out: Sequence[memoryview] | None,
    start: int,
    stop: int,
) -> tuple[int, DecodeError] | None:
    ctx = codec.context()
    for i in range(start, stop):
        try:
            if out is None:
                codec.check(frames[i], sizes[i], ctx)
            else:
                codec.decode_into(frames[i], out[i], ctx)
        except DecodeError as e:
            return i, e
    return None


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def codec_from_dict(d: dict[str, Any] | None) -> Codec:
    """Build a codec from its dict form; ``None`` means raw.

    Raises
    ------
    SchemaError
        If the id is unknown or the configuration is invalid.
    """
    if d is None:
        return RAW
    if not isinstance(d, dict) or "id" not in d:
        raise SchemaError(f"codec must be a dict with an 'id', got {d!r}")
    cid = d["id"]
    config = {k: v for k, v in d.items() if k != "id"}
    if cid == "raw" and not config:
        return RAW
    if cid == "zstd" and set(config) <= {"level"}:
        return Zstd(**config)
    raise SchemaError(
        f"unknown codec {d!r}; expected {{'id': 'raw'}} or {{'id': 'zstd', 'level': N}}"
    )
