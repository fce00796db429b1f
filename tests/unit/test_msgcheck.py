"""What a msgpack message costs to decode, bounded from its headers before it is decoded
(flightq.msgcheck): the bound holds for any message, a header claiming more than follows
is refused, and a client's key lists are cut into messages within the bound."""

from __future__ import annotations

import contextlib
import sys
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flightq.errors import ProtocolError, ResourceExhaustedError
from flightq.msgcheck import (
    MIN_MAX_REQUEST_BYTES,
    SPLIT_BYTES,
    decoded_bytes,
    key_bytes,
    key_chunks,
    quick_bound,
    request_bytes,
)
from flightq.protocol import Clear, unpack


def _shared(x: Any) -> bool:
    """Objects CPython hands out without allocating: None, bools, small ints, the empty
    and one-character latin-1 strings, bytes of at most one byte."""
    if x is None or isinstance(x, bool):
        return True
    if type(x) is int:
        return -5 <= x <= 256
    if type(x) is str:
        return len(x) == 0 or (len(x) == 1 and ord(x) < 256)
    return type(x) is bytes and len(x) <= 1


def _held(obj: Any) -> int:
    """Bytes the decoded objects take (sys.getsizeof, walked)."""
    total, todo = 0, [obj]
    while todo:
        x = todo.pop()
        if _shared(x):
            continue
        total += sys.getsizeof(x)
        if isinstance(x, msgpack.ExtType):
            total += sys.getsizeof(x.data)
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return total


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary()
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary())
)
_MESSAGES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(), inner, max_size=20),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(_MESSAGES)
def test_the_bound_holds_for_any_message(obj: Any) -> None:
    raw = msgpack.packb(obj, use_bin_type=True)
    decoded = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    assert _held(decoded) <= decoded_bytes(raw, "t")
    quick = quick_bound(raw, 2**62)
    assert quick is None or quick >= decoded_bytes(raw, "t")


@pytest.mark.parametrize(
    ("obj", "held"),
    [
        ([{}] * 1000, 56 + 8 * 1000 + 64 * 1000),  # an empty map: 1 byte, a 64-byte dict
        (["ab"] * 1000, 56 + 8 * 1000 + 51 * 1000),  # 3 bytes, a 51-byte string
        ({"k": "é" * 10}, 64 + 120 + 50 + 80 + 4 * 20),  # non-ASCII: 4 bytes a UTF-8 byte
    ],
    ids=["empty maps", "short strings", "non-ascii"],
)
def test_small_bodies_are_counted_as_the_objects_they_become(obj: Any, held: int) -> None:
    assert decoded_bytes(msgpack.packb(obj, use_bin_type=True), "t") == held


#: {"keys": [[[...]]]}: 1000 nested arrays, each claiming 9 999 999 items.
_NESTED = b"\x81\xa4keys" + (b"\xdd" + (9_999_999).to_bytes(4, "big")) * 1000


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (b"\xdd\xff\xff\xff\xff", r"claim 4294967295 more items at byte 5; 0 bytes follow"),
        (b"\xdf\x00\x01\x00\x00" + b"\xc0" * 1000, r"claim 131072 more items"),
        (_NESTED, r"claim 9999999 more items at byte 11; 4995 bytes follow"),
        (b"\x81\xa2op\xdb\xff\xff\xff\xf0", r"ends at byte 4294967289, past the 9 bytes"),
        (b"\x91\xc6\x00\x10\x00\x00abc", r"ends at byte 1048582, past the 9 bytes"),
        (b"\x91\xc9\x00\x10\x00\x00\x01abc", r"ends at byte 1048583, past the 10 bytes"),
        (b"\x92\xcb\x00", r"ends at byte 10, past the 3 bytes"),
        (b"\x91\xc1", r"byte 1 is 0xc1, no msgpack type"),
    ],
    ids=["array32", "map32", "nested", "str32", "bin32", "ext32", "float64", "0xc1"],
)
def test_a_header_claiming_more_than_follows_is_refused_before_anything_is_built(
    raw: bytes, cause: str
) -> None:
    with pytest.raises(ProtocolError, match=rf"^clear: not a valid msgpack map \(.*{cause}"):
        decoded_bytes(raw, "clear")


def test_a_small_message_of_nested_list_headers_is_refused_before_msgpack_reserves_them() -> None:
    # 10 KB: 1 023 nested arrays each claiming 10 000 items, far fewer bytes following.
    # msgpack reserves a list's slots at its header (up to 10 000 each, at every level):
    # handed this, it took 66 MiB before refusing it. The walk refuses it first, however
    # small the message, with nothing built.
    k = 10_000
    raw = (b"\xdd" + k.to_bytes(4, "big")) * 1023
    raw += b"\x00" * (k + 10 - len(raw))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=r"^clear: not a valid msgpack map \(its headers"):
            unpack(raw, "clear", MIN_MAX_REQUEST_BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


def _peak(raw: bytes) -> int:
    """Bytes msgpack held at its peak while decoding ``raw`` (or failing to)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(Exception):  # hostile bytes raise assorted errors
            msgpack.unpackb(raw, raw=False, strict_map_key=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


#: What an exception and its message take beside a failed decode.
_SLACK = 8 * 2**10


@pytest.mark.parametrize(
    ("header", "depth"),
    [(b"\xdc", 64), (b"\xdd", 64), (b"\xde", 64), (b"\xdf", 64), (b"\x9f", 1000), (b"\x8f", 1000)],
)
def test_the_quick_bound_covers_what_msgpack_reserves_for_headers_claiming_missing_items(
    header: bytes, depth: int
) -> None:
    # Nested headers each claiming 4 000 items (15 for fixarray, fixmap), the message
    # padded to twice as many bytes (msgpack takes claims up to its length, maps up to
    # half) but few items following: msgpack reserves each header's slots before it
    # finds them missing. Where the quick bound lets such a message through (its stop
    # at the bound), the bound covers that.
    width = {b"\xdc": 2, b"\xde": 2, b"\xdd": 4, b"\xdf": 4}.get(header)
    raw = (header + (4_000).to_bytes(width, "big") if width else header) * depth
    raw += b"\x00" * (8_010 - len(raw) if width else 100)
    bound = quick_bound(raw, 2**40)
    assert bound is not None
    assert quick_bound(raw, bound) == bound and quick_bound(raw, bound - 1) is None
    assert _peak(raw) <= bound + _SLACK


_TOKENS = st.sampled_from(
    [b"\xdc\x27\x10", b"\xdd\x00\x00\x27\x10", b"\xde\x13\x88", b"\xdf\x00\x00\x13\x88"]
    + [bytes([b]) for b in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xA3, 0xC0, 0x00, 0xE0)]
    + [b"\xd9\x05hello", b"\xc4\x02ab", b"\xcb" + bytes(8)]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_TOKENS, min_size=1, max_size=300), st.integers(0, 12_000))
def test_the_quick_bound_covers_the_peak_of_any_bytes_it_lets_through(
    tokens: list[bytes], pad: int
) -> None:
    raw = b"".join(tokens) + b"\x00" * pad  # padded: msgpack takes claims up to its length
    bound = quick_bound(raw, 2**40)
    if bound is not None:
        assert _peak(raw) <= bound + _SLACK


def test_a_tickets_row_keys_are_bounded_without_the_walk() -> None:
    # A get of 512 ASCII keys: a map header, an array16 header, 512 fixstr.
    raw = msgpack.packb({"op": "get", "partition": "p", "keys": [f"p{i}_g0" for i in range(512)]})
    bound = quick_bound(raw, MIN_MAX_REQUEST_BYTES)
    assert bound is not None and decoded_bytes(raw, "t") <= bound <= MIN_MAX_REQUEST_BYTES
    assert quick_bound(("€" * 2000).encode() + raw, MIN_MAX_REQUEST_BYTES) is None


def test_the_walk_stops_once_the_bound_passes_stop() -> None:
    n = 16 * 2**20
    raw = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n  # 1.2 GB of dicts once decoded
    got = decoded_bytes(raw, "t", stop=2**20)
    assert 2**20 < got < 2**20 + 64 + 8 * n  # the array header alone passed it


def test_request_bytes_refuses_past_the_cap_naming_the_call_size_cap_and_fix() -> None:
    big = msgpack.packb({"partition": "p", "keys": ["x" * 1000] * 3000})
    with pytest.raises(
        ResourceExhaustedError,
        match=r"^clear: a body of 2\.9 MiB exceeds the server's cap of 2 MiB "
        r"\(max_request_bytes\); name fewer keys per call, or start the server with a "
        r"larger max_request_bytes$",
    ) as e:
        request_bytes(big, "clear", 2 * 2**20)
    assert (e.value.expected, e.value.actual) == (2 * 2**20, len(big))
    bomb = msgpack.packb({"partition": "p", "keys": [{}] * 40_000})
    with pytest.raises(
        ResourceExhaustedError,
        match=r"^clear: a body of 39\.1 KiB would take more than the server's cap of 2 MiB",
    ):
        request_bytes(bomb, "clear", 2 * 2**20)
    assert request_bytes(memoryview(big), "clear", 4 * 2**20) == big


def test_key_chunks_keep_every_key_in_order_and_each_message_within_the_split() -> None:
    keys = [f"g{i:06d}_" + ("x" * (i % 900)) for i in range(6000)] + ["é" * 300] * 500
    parts = key_chunks(keys)
    assert len(parts) > 3
    assert [k for p in parts for k in p] == keys
    for p in parts:
        raw = Clear(partition="p" * 256, keys=p).to_wire()
        assert sum(map(key_bytes, p)) <= SPLIT_BYTES
        assert decoded_bytes(raw, "clear") <= SPLIT_BYTES + 2048 < MIN_MAX_REQUEST_BYTES
    few = [f"k{i}" for i in range(100)]
    assert key_chunks(few) == [few]


def test_the_narrow_bound_holds_msgpacks_deepest_nesting_and_its_densest_objects():
    from flightq.msgcheck import MSGPACK_MAX_DEPTH, has_wide_headers, narrow_bound

    deep = b"\x91" * MSGPACK_MAX_DEPTH + b"\xc0"  # as deep as msgpack opens
    assert msgpack.unpackb(deep) is not None
    with pytest.raises(msgpack.StackError):  # one more level: refused before it opens
        msgpack.unpackb(b"\x91" + deep)
    # Whole and cut short (every level's room reserved, nothing to fill it): the peak
    # stays within the bound, which the server takes without reading the bytes.
    for raw in (
        deep,
        b"\x9f" * MSGPACK_MAX_DEPTH,
        b"\x8f" * MSGPACK_MAX_DEPTH,
        b"\x9f\x80" * 500,
        msgpack.packb([{}] * 15),
        msgpack.packb({"k": "x" * 10_000, "l": [[{}] * 15] * 15}),
    ):
        assert not has_wide_headers(raw)
        assert _peak(raw) <= narrow_bound(len(raw)), raw[:8]
    assert has_wide_headers(msgpack.packb(list(range(16))))
