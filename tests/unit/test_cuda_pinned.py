"""The process-wide cap on pinned staging memory: its setting, and (on a GPU) its effect.

The setting (``FLIGHTQ_PINNED_LIMIT``, :func:`flightq.cuda.set_pinned_limit`) needs no
torch. That a pool past the cap hands out pageable memory, and that buffers given back
free their share, needs pinned memory: those tests are marked ``gpu``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flightq.cuda import pinned
from flightq.errors import DeviceError


@pytest.fixture
def limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(pinned.ENV, raising=False)
    yield
    pinned.set_pinned_limit(None)


def test_sizes_parse_in_powers_of_1024() -> None:
    assert pinned.parse_bytes("4G") == 4 * 2**30
    assert pinned.parse_bytes("512m") == 512 * 2**20
    assert pinned.parse_bytes(" 64KiB ") == 64 * 2**10
    assert pinned.parse_bytes("1073741824") == 2**30


@pytest.mark.parametrize("bad", ["", "-1", "4X", "1.5G", "G"])
def test_a_bad_size_names_the_variable(bad: str) -> None:
    with pytest.raises(DeviceError, match=pinned.ENV):
        pinned.parse_bytes(bad)


def test_the_cap_comes_from_the_call_then_the_environment_then_the_default(
    limit: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pinned.pinned_limit() == pinned.DEFAULT_PINNED_LIMIT == 4 * 2**30
    monkeypatch.setenv(pinned.ENV, "256M")
    assert pinned.pinned_limit() == 256 * 2**20
    pinned.set_pinned_limit("1G")
    assert pinned.pinned_limit() == 2**30
    pinned.set_pinned_limit(0)
    assert pinned.pinned_limit() == 0
    pinned.set_pinned_limit(None)
    assert pinned.pinned_limit() == 256 * 2**20
    monkeypatch.setenv(pinned.ENV, "lots")
    with pytest.raises(DeviceError, match="FLIGHTQ_PINNED_LIMIT='lots'"):
        pinned.pinned_limit()


@pytest.mark.parametrize("bad", [-1, True, "x"])
def test_set_pinned_limit_refuses_what_is_no_size(limit: None, bad: object) -> None:
    with pytest.raises(DeviceError):
        pinned.set_pinned_limit(bad)  # type: ignore[arg-type]
    assert pinned.pinned_limit() == pinned.DEFAULT_PINNED_LIMIT


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


_CAP_SCRIPT = """
import gc
from flightq.cuda import pinned
pinned.set_pinned_limit(3 * 2**20)
pool, other = pinned.PinnedPool(), pinned.PinnedPool()
a = pool.take(2 * 2**20)
assert a.is_pinned() and pinned.pinned_held() == 2 * 2**20
b = other.take(2 * 2**20)  # another pool of the process: the same cap
assert not b.is_pinned(), "past the cap: pageable"
assert other.pageable_bytes == 2 * 2**20 and other.allocated_bytes == 0
assert pinned.pinned_held() == 2 * 2**20
other.give(b)  # pageable buffers are not cached
del b
pool.give(a)  # cached, idle: still held
del a
assert pinned.pinned_held() == 2 * 2**20
c = pool.take(3 * 2**20)  # does not fit beside the cached one: that one is released
assert c.is_pinned() and pinned.pinned_held() == 3 * 2**20, pinned.pinned_held()
pool.give(c)
del c
pool.clear()
gc.collect()
assert pinned.pinned_held() == 0, pinned.pinned_held()
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs torch with a CUDA device (pinned memory)")
def test_past_the_cap_buffers_are_pageable_and_given_back_ones_free_room() -> None:
    # A process of its own: the cap and the bytes held are the whole process's.
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _CAP_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
