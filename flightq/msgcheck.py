"""msgpack messages a client sent, measured before msgpack decodes them.

A control message (a ticket, an action body, a descriptor's command, a request-stream
frame's header, a put batch's media claims) is bytes on the wire that msgpack turns into
Python objects, which can take far more than the bytes: an empty map is one byte and a
64-byte dict, a two-character string three bytes and a 51-byte string (4 MB of empty maps
took a server 290 MiB to decode). :func:`decoded_bytes` walks a message's headers without
building anything and returns an upper bound of what its objects take
(``sys.getsizeof``, each container with its slots), refusing a message whose headers
claim more items than bytes follow (each takes one at least: a five-byte header may
claim 2**32). :func:`request_bytes` refuses a message whose size, or that bound, passes
the receiver's cap (the server's ``max_request_bytes``) before anything decodes it; a message
whose bound :func:`quick_bound` finds from a count of its bytes (a ticket of ASCII row
keys) is not walked.

The same costs size what a client sends: :func:`key_chunks` cuts a list of row keys into
lists whose messages cost at most :data:`SPLIT_BYTES`, within any server's cap.

Examples
--------
>>> decoded_bytes(b"\\x81\\xa1k\\x90", "clear")   # {"k": []}: a dict, "k", an empty list
290
>>> decoded_bytes(b"\\xdd\\xff\\xff\\xff\\xff", "clear")
Traceback (most recent call last):
...
flightq.errors.ProtocolError: clear: not a valid msgpack map (its headers claim 4294967295 \
more items at byte 5; 0 bytes follow)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .errors import ProtocolError, ResourceExhaustedError

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "MIN_MAX_REQUEST_BYTES",
    "SPLIT_BYTES",
    "decoded_bytes",
    "quick_bound",
    "narrow_bound",
    "MSGPACK_MAX_DEPTH",
    "has_wide_headers",
    "request_bytes",
    "key_bytes",
    "key_chunks",
]

#: A server's default cap on one control message: its bytes, and the Python objects they
#: decode to (``Server(max_request_bytes=...)``, ``flightq serve --max-request-bytes``).
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
#: The smallest cap a server takes. A flightq client's messages stay under it: key lists
#: are cut at :data:`SPLIT_BYTES`, a shared-memory put names at most 1.5 MiB of fills, a
#: request-stream frame carries at most ``stream_max_bytes`` (1 MiB) of action body.
MIN_MAX_REQUEST_BYTES = 2 * 2**20
#: What the keys one message of a flightq client names may cost the server to decode; a
#: longer list goes in several messages (:func:`key_chunks`).
SPLIT_BYTES = 2**20

# Upper bounds of sys.getsizeof for what msgpack builds, on 64-bit CPython (measured on
# 3.11; 3.12 strings are 8 bytes smaller): a list 56 bytes and 8 a slot; a dict 64 and at
# most 120 an entry (a dict of one takes 184); an ASCII string 49 and its length, any
# other at most 80 and 4 per UTF-8 byte (one 4-byte character makes each character take
# 4); bytes 33 and their length; an int 36 (those up to 127 are shared), a float 24; an
# ExtType or Timestamp 128 and its data. nil, true and false are shared: only their slot.
_LIST, _SLOT = 56, 8
_DICT, _ENTRY = 64, 120
_ASCII, _UNICODE = 49, 80
_BYTES = 33
_INT, _FLOAT = 36, 24
_EXT = 128

# The msgpack types from 0xc0 to 0xdf that are not strings or containers, by first byte:
# (bytes of the length field after it, 0 for none; bytes after that field, an ext's type
# byte included; the Python bytes, to which a length field adds its length). 0xc1 is
# never used.
_NONE = (0, 0, 0)
_OTHERS: dict[int, tuple[int, int, int]] = {
    0xC0: _NONE,
    0xC2: _NONE,
    0xC3: _NONE,
    0xC4: (1, 0, _BYTES),
    0xC5: (2, 0, _BYTES),
    0xC6: (4, 0, _BYTES),
    0xC7: (1, 1, _EXT),
    0xC8: (2, 1, _EXT),
    0xC9: (4, 1, _EXT),
    0xCA: (0, 4, _FLOAT),
    0xCB: (0, 8, _FLOAT),
    0xCC: (0, 1, _INT),
    0xCD: (0, 2, _INT),
    0xCE: (0, 4, _INT),
    0xCF: (0, 8, _INT),
    0xD0: (0, 1, _INT),
    0xD1: (0, 2, _INT),
    0xD2: (0, 4, _INT),
    0xD3: (0, 8, _INT),
    0xD4: (0, 2, _EXT + 1),
    0xD5: (0, 3, _EXT + 2),
    0xD6: (0, 5, _EXT + 4),
    0xD7: (0, 9, _EXT + 8),
    0xD8: (0, 17, _EXT + 16),
}
#: str8/16/32 and array16/32, map16/32: the bytes of their length field.
_STR_LEN = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_ARRAY_LEN = {0xDC: 2, 0xDD: 4}
_MAP_LEN = {0xDE: 2, 0xDF: 4}


def _invalid(what: str, why: str) -> ProtocolError:
    return ProtocolError(f"{what}: not a valid msgpack map ({why})")


def decoded_bytes(raw: bytes, what: str, stop: int | None = None) -> int:
    """An upper bound of the bytes the Python objects msgpack decodes ``raw`` to take,
    read from its headers alone; with ``stop``, returned as soon as it passes ``stop``.

    Parameters
    ----------
    raw:
        One msgpack object (a control message is a map).
    what:
        The message, for errors (``"clear"``, ``"ticket"``).
    stop:
        Stop walking once the bound passes it (the bound so far is returned).

    Raises
    ------
    ProtocolError
        Where a header claims more items or bytes than follow, or a byte is no msgpack
        type: refused before msgpack allocates what the header claims.
    """
    n = len(raw)
    limit = math.inf if stop is None else stop
    i = 0
    pending = 1  # objects still to read; each takes one byte at least
    total = 0
    while pending:
        if pending > n - i:
            raise _invalid(
                what, f"its headers claim {pending} more items at byte {i}; {n - i} bytes follow"
            )
        if total > limit:
            return total
        b = raw[i]
        pending -= 1
        if 0xA0 <= b < 0xC0:  # fixstr: row keys, names, the common case
            a = i + 1
            i = a + (b & 0x1F)
            total += _ASCII + i - a if raw[a:i].isascii() else _UNICODE + 4 * (i - a)
        elif b < 0x80:  # positive fixint: shared
            i += 1
        elif b < 0x90:  # fixmap
            k = b & 0x0F
            total += _DICT + _ENTRY * k
            pending += 2 * k
            i += 1
        elif b < 0xA0:  # fixarray
            k = b & 0x0F
            total += _LIST + _SLOT * k
            pending += k
            i += 1
        elif b >= 0xE0:  # negative fixint
            total += _INT
            i += 1
        elif b in _STR_LEN:
            a = i + 1 + _STR_LEN[b]
            i = a + int.from_bytes(raw[i + 1 : a], "big")
            total += _ASCII + i - a if raw[a:i].isascii() else _UNICODE + 4 * (i - a)
        elif b in _ARRAY_LEN:
            a = i + 1 + _ARRAY_LEN[b]
            k = int.from_bytes(raw[i + 1 : a], "big")
            total += _LIST + _SLOT * k
            pending += k
            i = a
        elif b in _MAP_LEN:
            a = i + 1 + _MAP_LEN[b]
            k = int.from_bytes(raw[i + 1 : a], "big")
            total += _DICT + _ENTRY * k
            pending += 2 * k
            i = a
        elif b in _OTHERS:
            field, rest, size = _OTHERS[b]
            a = i + 1 + field
            length = int.from_bytes(raw[i + 1 : a], "big") if field else 0
            i = a + rest + length
            total += size + length
        else:
            raise _invalid(what, f"byte {i} is 0x{b:02x}, no msgpack type")
        if i > n:
            raise _invalid(what, f"an object ends at byte {i}, past the {n} bytes that arrived")
    return total


#: Bytes that may be a container's header: fixmap and fixarray (0x80-0x9f, 15 items at
#: most), array16/32 and map16/32 (0xdc-0xdf, their length field after them).
_FIX_HEADERS = bytes(range(0x80, 0xA0))
_WIDE_HEADERS = b"\xdc\xdd\xde\xdf"
_WIDE_BYTES = tuple(bytes([b]) for b in _WIDE_HEADERS)
#: What a fixmap or fixarray header may make msgpack reserve: a dict of 15 entries.
_FIX_RESERVE = _DICT + _ENTRY * 15
#: :func:`decoded_bytes` of any message is at most this many times its length: each
#: object takes a byte at least and its parent's slot or half an entry (60), and none
#: takes more per byte than an empty map (one byte, a 64-byte dict).
_PER_BYTE = 124
#: The deepest nesting msgpack's unpacker opens (its stack; one level more is a
#: ``StackError``).
MSGPACK_MAX_DEPTH = 1024
#: Wide headers past which :func:`quick_bound` leaves a message to the walk.
_MAX_WIDE = 64


def quick_bound(raw: bytes, stop: int) -> int | None:
    """An upper bound of what decoding ``raw`` may take at its peak, found without walking
    it, where that bound is at most ``stop``; None where it is not (or the message has
    many wide headers), and :func:`decoded_bytes` must walk it.

    The objects of any message take at most :data:`_PER_BYTE` bytes per byte of it. What
    else msgpack may take is what it reserves at a container's header for the items it
    claims, before it finds them missing (up to 10 000 slots per header, at each nested
    level): every such header is one of the bytes that could be one, so the claims read
    at each of those bytes, summed, bound it. A message of row keys in ASCII has a
    handful of such bytes; one of hostile headers has many, or claims that pass ``stop``,
    and is walked (and refused) as before.

    Neither this bound nor the walk counts one thing: msgpack interns map keys, and a new
    key now and then grows the interpreter's table of interned strings (about 1 MB, once
    per tens of thousands of new keys, sized by the process, not by the message).
    """
    n = len(raw)
    bound = _PER_BYTE * n
    if bound > stop:
        return None
    bound += _FIX_RESERVE * (n - len(raw.translate(None, _FIX_HEADERS)))
    if bound > stop:
        return None
    if n - len(raw.translate(None, _WIDE_HEADERS)) > _MAX_WIDE:
        return None
    for b in _WIDE_HEADERS:
        i = raw.find(b)
        while i >= 0:
            width = 2 if b in (0xDC, 0xDE) else 4
            k = int.from_bytes(raw[i + 1 : i + 1 + width], "big")
            bound += _LIST + _SLOT * k if b < 0xDE else _DICT + _ENTRY * k
            if bound > stop:
                return None
            i = raw.find(b, i + 1)
    return bound


def has_wide_headers(data: bytes) -> bool:
    """Whether any byte of ``data`` could be an array16/32 or map16/32 header (one scan of
    many messages laid end to end: where it finds none, no message among them has one)."""
    return any(b in data for b in _WIDE_BYTES)  # memchr each: faster than one translate


def narrow_bound(n: int) -> int:
    """An upper bound of what decoding a message of ``n`` bytes with no wide header
    (:func:`has_wide_headers`) may take at its peak, found without reading the message.

    What its objects take is at most :data:`_PER_BYTE` a byte. What msgpack reserves for
    items a container claims and has not found yet is held only by the containers still
    open, one a nesting level, and msgpack opens at most :data:`MSGPACK_MAX_DEPTH` levels
    (deeper is a ``StackError``): with fix headers alone, each holds at most a 15-entry
    map's room (:data:`_FIX_RESERVE`; msgpack 1.2 presizes arrays only, 176 bytes a
    fixarray, so this holds for versions that presize maps too). As with
    :func:`quick_bound`, the interpreter's table of interned map keys is not counted: a
    new key now and then grows it, by an amount the process decides (about 1 MB where a
    few tens of thousands of strings are interned, more where more are)."""
    return _PER_BYTE * n + MSGPACK_MAX_DEPTH * _FIX_RESERVE


def _size(n: int) -> str:
    """``n`` bytes for a message: ``16 MiB``, ``70.2 MiB``, ``3.5 KiB``, ``12 bytes``."""
    if n >= 2**20:
        return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n / 2**20:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


def _too_large(what: str, past: str, size: int, limit: int) -> ResourceExhaustedError:
    return ResourceExhaustedError(
        f"{what}: a body of {_size(size)} {past} the server's cap of {_size(limit)} "
        "(max_request_bytes); name fewer keys per call, or start the server with a larger "
        "max_request_bytes",
        expected=limit,
        actual=size,
    )


def request_bytes(data: Any, what: str, limit: int) -> bytes:
    """The bytes of a control message a client sent (bytes or a buffer), once neither its
    size nor what it decodes to (:func:`decoded_bytes`) passes ``limit``; nothing of it is
    copied or decoded before its size is known to fit.

    Raises
    ------
    ResourceExhaustedError
        Past ``limit``, naming the message, its size, the cap and the fix.
    ProtocolError
        Where its headers claim more than follows, found by :func:`decoded_bytes` where it
        walks the message; where :func:`quick_bound` lets it through without the walk,
        msgpack refuses it at decode (a message of a few bytes, bounded whole), and the
        caller raises ProtocolError then.
    """
    size = memoryview(data).nbytes
    if size > limit:
        raise _too_large(what, "exceeds", size, limit)
    raw = data.to_pybytes() if hasattr(data, "to_pybytes") else bytes(data)
    if quick_bound(raw, limit) is None and decoded_bytes(raw, what, limit) > limit:
        raise _too_large(what, "would take more than", size, limit)
    return raw


def key_bytes(key: str) -> int:
    """What one row key in a list costs a receiver to decode: its slot and its string,
    as :func:`decoded_bytes` counts them."""
    if key.isascii():
        return _SLOT + _ASCII + len(key)
    return _SLOT + _UNICODE + 4 * len(key.encode("utf-8", "surrogatepass"))


def key_chunks(keys: Sequence[str], limit: int = SPLIT_BYTES) -> list[list[str]]:
    """``keys`` in order, cut into lists that each cost a receiver at most ``limit`` bytes
    to decode (:func:`key_bytes`; a key costing more goes alone); one list where they fit.

    Examples
    --------
    >>> [len(c) for c in key_chunks([f"k{i:07d}" for i in range(30_000)])]
    [16131, 13869]
    """
    keys = list(keys)
    # Cheap first: no key costs more than its 4 bytes per character could.
    if len(keys) * (_SLOT + _UNICODE) + 16 * sum(map(len, keys)) <= limit:
        return [keys]
    chunks: list[list[str]] = []
    start = used = 0
    for i, k in enumerate(keys):
        cost = key_bytes(k)
        if used + cost > limit and i > start:
            chunks.append(keys[start:i])
            start, used = i, 0
        used += cost
    chunks.append(keys[start:])
    return chunks
