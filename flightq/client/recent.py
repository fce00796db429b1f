"""What a client remembers per partition, kept for the partitions it used last.

A client remembers a partition's schema (to encode puts), the media it sent there (to send
them again as references) and the bytes per row of its last answer (to split large gets).
A training run that names a partition per step, and drops each once read, would have
its clients remember every step's partition for as long as they live; each table keeps
the :data:`RECENT_PARTITIONS` partitions used last instead. A partition forgotten costs
at most a round trip: its schema is described again, its media sent whole once, its
next get takes one stream.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar, overload

__all__ = ["RECENT_PARTITIONS", "Recent"]

#: Partitions each of a client's per-partition tables keeps.
RECENT_PARTITIONS = 1024

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")


class Recent(Generic[K, V]):
    """A mapping that keeps its ``limit`` entries used last (read or written); thread-safe.

    >>> r = Recent(limit=2)
    >>> r["a"], r["b"] = 1, 2
    >>> r.get("a")
    1
    >>> r["c"] = 3  # "b" was used least recently
    >>> sorted(r.keys())
    ['a', 'c']
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = RECENT_PARTITIONS if limit is None else limit
        if self.limit < 1:
            raise ValueError(f"limit must be at least 1, got {self.limit}")
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        """The value of ``key`` (now the entry used last), or ``default``."""
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Forget ``key``; its value, or ``default``."""
        with self._lock:
            return self._items.pop(key, default)

    def keys(self) -> list[K]:
        """The keys kept, used least recently first."""
        with self._lock:
            return list(self._items)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
