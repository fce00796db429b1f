"""Payload codecs: raw and zstd, frozen, described as plain dicts.

A codec's identity is a stable string and its configuration a plain dict, stored in the
Arrow field metadata, so a receiver decodes with no out-of-band knowledge. Codecs apply
per tensor (per row, or per media segment). zstd frames carry their content size, so a
server can check a compressed payload against its shape without decompressing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import zstandard

from .errors import DecodeError, SchemaError

__all__ = ["Codec", "Raw", "Zstd", "codec_from_dict", "RAW"]


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

    def decode(self, data: Any, nbytes: int) -> Any:
        """Decode one payload, which must come back as exactly ``nbytes`` bytes."""
        raise NotImplementedError

    def decoded_size(self, data: Any) -> int | None:
        """The decoded byte length, read cheaply from the payload, or None if unknown."""
        raise NotImplementedError


@dataclass(frozen=True)
class Raw(Codec):
    """No transformation: the payload is the tensor's bytes."""

    id: ClassVar[str] = "raw"

    def to_dict(self) -> dict[str, Any]:
        return {"id": "raw"}

    def encode(self, data: Any) -> Any:
        return data

    def decode(self, data: Any, nbytes: int) -> Any:
        return data

    def decoded_size(self, data: Any) -> int | None:
        return len(memoryview(data))


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
        cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return cctx.compress(data)

    def decode(self, data: Any, nbytes: int) -> Any:
        size = self.decoded_size(data)
        if size != nbytes:
            raise DecodeError(
                f"zstd frame declares {size} bytes, the shape needs {nbytes}",
                expected=nbytes,
                actual=size,
            )
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise DecodeError(f"zstd payload is corrupt: {e}") from e
        if len(out) != nbytes:
            raise DecodeError(
                f"zstd payload decoded to {len(out)} bytes, expected {nbytes}",
                expected=nbytes,
                actual=len(out),
            )
        return out

    def decoded_size(self, data: Any) -> int | None:
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError:
            return None
        return None if size < 0 else size


RAW = Raw()


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
