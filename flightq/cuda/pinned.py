"""Pinned host memory: the reusable staging buffers and side streams that CUDA puts and
gets copy through, and the process-wide cap on how much of it flightq holds.

Pinned (page-locked) memory cannot be swapped or moved, and every client of a process
has its own :class:`PinnedPool`: without a cap, eight trainer ranks on one host, each
with a few clients, could each lock gigabytes. So the pinned bytes that all pools of one
process hold together, cached or in use, are capped (:func:`pinned_limit`, 4 GiB unless
``FLIGHTQ_PINNED_LIMIT`` or :func:`set_pinned_limit` says otherwise). A buffer that
would go past the cap is first made room for by releasing this pool's idle cached
buffers; if that is not enough it is ordinary pageable memory: the copy through it is
correct but synchronous and slower, and :attr:`PinnedPool.pageable_bytes` counts it.

torch is imported inside the functions that need it: a CPU-only process never loads it
through this module.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from ..errors import DeviceError
from .device import torch_module

__all__ = [
    "DEFAULT_PINNED_LIMIT",
    "PinnedPool",
    "parse_bytes",
    "pinned_held",
    "pinned_limit",
    "set_pinned_limit",
]

#: The cap on a process's pinned staging bytes when nothing else is set.
DEFAULT_PINNED_LIMIT = 4 * 2**30
#: The environment variable that sets the cap (bytes; ``K``, ``M``, ``G``, ``T``: KiB...).
ENV = "FLIGHTQ_PINNED_LIMIT"
#: Pinned buffers are allocated in multiples of this.
_GRAIN = 2**20

_lock = threading.Lock()
_held = 0  # pinned bytes allocated by every pool of this process and not yet freed
_limit: int | None = None  # set_pinned_limit's; None: the environment's or the default
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str, what: str = ENV) -> int:
    """``"512M"``, ``"4G"``, ``"1073741824"``: bytes (suffixes are powers of 1024).

    Raises
    ------
    DeviceError
        Naming ``what`` and the text, if it is not a non-negative size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise DeviceError(
            f"{what}={text!r} is not a size; give bytes, or a number with K, M, G or T "
            "(powers of 1024), e.g. 4G"
        )
    return int(m.group(1)) * _UNITS[m.group(2)]


def pinned_limit() -> int:
    """The cap on the pinned staging bytes that this process's pools hold together.

    :func:`set_pinned_limit`'s value, else ``$FLIGHTQ_PINNED_LIMIT``, else
    :data:`DEFAULT_PINNED_LIMIT`.
    """
    if _limit is not None:
        return _limit
    env = os.environ.get(ENV)
    return DEFAULT_PINNED_LIMIT if env is None or not env.strip() else parse_bytes(env)


def set_pinned_limit(nbytes: int | str | None) -> None:
    """Set the process's pinned staging cap (bytes or a size string; None: the
    environment's or the default again). Buffers already held stay; later ones obey it.

    Raises
    ------
    DeviceError
        If ``nbytes`` is negative or not a size.
    """
    global _limit
    if isinstance(nbytes, str):
        nbytes = parse_bytes(nbytes, "set_pinned_limit")
    if nbytes is not None and (isinstance(nbytes, bool) or nbytes < 0):
        raise DeviceError(f"set_pinned_limit({nbytes!r}): the cap must be a size >= 0 bytes")
    _limit = nbytes


def pinned_held() -> int:
    """Pinned bytes that flightq's pools of this process hold now, cached or in use."""
    return _held


def _freed(size: int) -> None:
    global _held
    with _lock:
        _held -= size


class PinnedPool:
    """Reusable pinned host buffers and one copy stream per device, owned by one client.

    A buffer handed back with :meth:`give` may still be the source or target of copies in
    flight: it carries their events and is only handed out again once they completed.
    Thread-safe. Nothing is allocated (and torch is not imported) before the first use.
    Every pool of the process counts against one cap (:func:`pinned_limit`); past it a
    buffer is pageable memory (see the module's notes).

    Parameters
    ----------
    max_cached_bytes:
        Free buffers kept beyond this are released to torch's host allocator.
    """

    def __init__(self, max_cached_bytes: int = 2**30) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[Any, list[Any]]] = []
        self._streams: dict[int, Any] = {}
        #: Pinned bytes allocated so far (new buffers only; reuse does not count).
        self.allocated_bytes = 0
        #: Bytes handed out as pageable memory because the process's pinned cap was reached.
        self.pageable_bytes = 0

    def take(self, nbytes: int) -> Any:
        """A 1-D uint8 CPU tensor of at least ``nbytes`` bytes, idle: pinned unless the
        process's cap is reached (then pageable, see :func:`pinned_limit`)."""
        torch = torch_module()
        with self._lock:
            fits = [(b, ev) for b, ev in self._free if b.numel() >= nbytes]
            # Prefer an idle buffer, then the smallest: large ones stay for large puts.
            fits.sort(key=lambda x: (not all(e.query() for e in x[1]), x[0].numel()))
            if fits:
                buf, events = fits[0]
                self._free = [x for x in self._free if x[0] is not buf]
            else:
                buf, events = None, []
        for e in events:
            e.synchronize()
        if buf is None:
            size = max(_GRAIN, (nbytes + _GRAIN - 1) // _GRAIN * _GRAIN)
            buf = self._allocate(torch, size)
        return buf

    def _allocate(self, torch: Any, size: int) -> Any:
        global _held
        limit = pinned_limit()
        if _held + size > limit:
            self._evict(lambda: _held + size <= limit)
        with _lock:
            ok = _held + size <= limit
            if ok:
                _held += size  # reserved before allocating: other threads see it at once
        if ok:
            try:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:
                _freed(size)  # the host refused to lock more memory: pageable below
            else:
                weakref.finalize(buf, _freed, size)
                with self._lock:
                    self.allocated_bytes += size
                return buf
        with self._lock:
            self.pageable_bytes += size
        return torch.empty(size, dtype=torch.uint8)

    def _evict(self, enough: Any) -> None:
        """Release idle cached buffers, smallest first, until ``enough()``."""
        while not enough():
            with self._lock:
                self._free.sort(key=lambda x: x[0].numel())
                k = next(
                    (i for i, (_, evs) in enumerate(self._free) if all(e.query() for e in evs)),
                    None,
                )
                if k is None:
                    return
                # Its last reference: the finalizer gives its bytes back to the cap.
                self._free.pop(k)

    def give(self, buf: Any, events: Iterable[Any] = ()) -> None:
        """Hand ``buf`` back; it is reused once every event in ``events`` has completed.

        A pageable buffer (taken past the cap) is dropped, not cached: a later take
        should get pinned memory once the cap has room again.
        """
        if not buf.is_pinned():
            for e in events:
                e.synchronize()
            return
        evicted = []
        with self._lock:
            self._free.append((buf, list(events)))
            while sum(b.numel() for b, _ in self._free) > self.max_cached_bytes:
                self._free.sort(key=lambda x: x[0].numel())
                evicted.append(self._free.pop(0))
        # Outside the lock: another thread's take or give never waits on these copies.
        while evicted:
            old, evs = evicted.pop()
            for e in evs:
                e.synchronize()
            del old  # its last reference: the finalizer gives its bytes back to the cap

    def stream(self, device: Any) -> Any:
        """The side stream this pool copies on for ``device`` (a ``torch.device``)."""
        torch = torch_module()
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = torch.cuda.Stream(device=device)
                self._streams[device.index] = s
        return s

    def clear(self) -> None:
        """Release every free buffer (those in use stay with their holders)."""
        with self._lock:
            free, self._free = self._free, []
        for _, evs in free:
            for e in evs:
                e.synchronize()
