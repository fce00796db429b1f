"""zstd frames crafted by hand: lying headers, missing sizes, bombs built in kilobytes.

A frame is magic, a frame header (descriptor byte, window byte, optional 8-byte content
size) and blocks, each a 3-byte header (last-block bit, type, size) and its content. An
RLE block repeats one byte up to 128 KiB from 4 bytes on the wire, so a 6 GiB expansion
takes 192 KiB to send and no memory to build. See RFC 8878, section 3.1.1.
"""

from __future__ import annotations

import struct

import zstandard

__all__ = ["BLOCK", "header", "rle_frame", "relabel", "no_size_frame"]

MAGIC = b"\x28\xb5\x2f\xfd"
#: Largest block's decoded size (and the window these frames declare).
BLOCK = 128 * 1024


def header(declared: int | None) -> bytes:
    """A frame header with a 128 KiB window and ``declared`` content size (None: absent)."""
    window = bytes([(17 - 10) << 3])
    if declared is None:
        return MAGIC + b"\x00" + window
    return MAGIC + b"\xc0" + window + struct.pack("<Q", declared)


def rle_frame(declared: int | None, total: int, byte: int = 0) -> bytes:
    """A frame of RLE blocks that decodes to ``total`` copies of ``byte``, whose header
    says ``declared``."""
    n, rest = divmod(total, BLOCK)
    sizes = [BLOCK] * n + ([rest] if rest or not n else [])
    out = bytearray(header(declared))
    for i, size in enumerate(sizes):
        bits = (size << 3) | (1 << 1) | int(i == len(sizes) - 1)
        out += struct.pack("<I", bits)[:3] + bytes([byte])
    return bytes(out)


def no_size_frame(data: bytes) -> bytes:
    """A well-formed frame of ``data`` without a content size in its header."""
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


def relabel(data: bytes, declared: int) -> bytes:
    """A frame of ``data`` (compressed for real) whose header says ``declared`` bytes."""
    frame = no_size_frame(data)
    assert frame[4] == 0, "expected a descriptor with no size, no checksum, no dictionary"
    return MAGIC + b"\xc0" + frame[5:6] + struct.pack("<Q", declared) + frame[6:]
