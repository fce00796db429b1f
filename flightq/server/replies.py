"""Room for large action replies: what the server holds while it builds and sends them.

An action's reply is one Flight result, built whole in memory (the store's answer as
Python objects, then its msgpack bytes, then gRPC's copy) and held until it is sent. A
``stats`` of many partitions, a ``list_keys`` of a large partition or a long
``dead_letters`` can take tens of megabytes, and nothing else bounded how many were built
at once: 8 concurrent ``stats`` of 122 MiB each raised a 64 MiB-budget server's peak RSS
by 16.6 budgets.

Each such handler says, before it builds, about how many bytes its reply will hold
(:meth:`ReplyRoom.hold`, an upper bound from what the memory budget counts for what the
reply copies). A reply of at most :data:`SMALL_REPLY_BYTES` is built at once, whatever
else is in flight: a trainer's ordinary calls never wait here. A larger one is built
once it fits, with the large replies in flight, within the room (a quarter of the memory
budget; :data:`UNBUDGETED_ROOM_BYTES` without one), or once it is alone: a reply larger
than the room is never refused for its size, only built by itself. It keeps its bytes
until the reply is sent (or the call ends), and one that finds no room within
:data:`REPLY_WAIT_S` is refused with :class:`~flightq.errors.ResourceExhaustedError`.
See ``docs/reliability.md``.
"""

from __future__ import annotations

import threading
import time

from ..errors import RETRY_BUSY, ResourceExhaustedError

__all__ = ["SMALL_REPLY_BYTES", "UNBUDGETED_ROOM_BYTES", "REPLY_WAIT_S", "ReplyRoom", "Held"]

#: A reply of at most this many bytes (estimated) is built at once, never waiting.
SMALL_REPLY_BYTES = 1 << 20
#: The room for large replies of a server without a memory budget.
UNBUDGETED_ROOM_BYTES = 256 << 20
#: Seconds a large reply waits for room before it is refused.
REPLY_WAIT_S = 30.0


class ReplyRoom:
    """Bytes of large replies being built and sent, server-wide, within ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._changed = threading.Condition()
        #: Bytes held by large replies now, and how many they are.
        self.used = 0
        self.replies = 0
        #: Large replies waiting for room now.
        self.waiting = 0

    @classmethod
    def for_budget(cls, memory_budget: int | None) -> ReplyRoom:
        """The room of a server with ``memory_budget``: a quarter of it, or
        :data:`UNBUDGETED_ROOM_BYTES` without one."""
        return cls(UNBUDGETED_ROOM_BYTES if memory_budget is None else memory_budget // 4)

    def _take(self, n: int, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.replies and self.used + n > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhaustedError(
                        f"{what}: a reply of about {n} bytes found no room in {timeout:g} s: "
                        f"{self.replies} large replies ({self.used} bytes) are being built "
                        f"or sent, and the server holds at most {self.capacity} bytes of "
                        "them at once (a quarter of its memory budget, or one reply alone); "
                        "try again, or ask for less per call",
                        expected=self.capacity,
                        actual=self.used + n,
                        retry=RETRY_BUSY,
                    )
                self.waiting += 1
                try:
                    self._changed.wait(left)
                finally:
                    self.waiting -= 1
            self.used += n
            self.replies += 1

    def _give(self, n: int) -> None:
        with self._changed:
            self.used -= n
            self.replies -= 1
            self._changed.notify_all()


class Held:
    """One call's hold on a :class:`ReplyRoom`: at most one reply, given back once."""

    __slots__ = ("_n", "_room")

    def __init__(self, room: ReplyRoom | None) -> None:
        self._room = room
        self._n = 0

    def hold(self, n: int, what: str, timeout: float | None = None) -> None:
        """Count ``n`` bytes of the reply ``what`` is about to build, waiting for room
        where it is larger than :data:`SMALL_REPLY_BYTES` (see the module).

        Raises
        ------
        ResourceExhaustedError
            If no room is made within ``timeout`` seconds (None: :data:`REPLY_WAIT_S`).
        """
        if self._room is None or n <= SMALL_REPLY_BYTES or self._n:
            return
        self._room._take(n, what, REPLY_WAIT_S if timeout is None else timeout)
        self._n = n

    def release(self) -> None:
        """Give the bytes back (the reply was sent, or will not be)."""
        n, self._n = self._n, 0
        if n and self._room is not None:
            self._room._give(n)
