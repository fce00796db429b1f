"""Answers and snapshots under way: the memory of the rows they read stays counted.

A read's answer (a get, a claim, a scan) streams rows it found in a partition, and a
snapshot writes the rows it captured; both keep the stored record batches and media
buffers of those rows alive until they end, however slowly their reader reads, even where
the rows are cleared or replaced, or their partition dropped, meanwhile. Each registers a
:class:`Reading` with its partition (:attr:`Partition.readings`) while it is under way.
Where the partition lets go of a piece's memory (with its block's) or of a media buffer
that a reading under way holds, the bytes stay counted in the memory budget
(:attr:`Kept.bytes`, part of the store's ``held``) until the last reading holding them
ends; puts wait for that room as for any other.

What a reading holds is worked out only once something is let go while it is under way
(a clear during a slow read), not on every answer's way out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .partition import Row

__all__ = ["Kept", "Reading", "holder_of"]


def holder_of(piece: Any) -> Any:
    """What keeps a piece's memory alive: its block where it has one (the pieces read
    from one place share it), else the piece."""
    return piece if piece.block is None else piece.block


class Reading:
    """The rows an answer or a snapshot reads from one partition while it is under way."""

    __slots__ = ("_holds", "kept", "media", "partition", "rows")

    def __init__(self, partition: Any, rows: Collection[Row], media: tuple[str, ...]) -> None:
        #: The partition it is registered with (:attr:`Partition.readings`).
        self.partition = partition
        self.rows = rows
        #: The partition's media fields (their buffers are held too).
        self.media = media
        #: What :class:`Kept` keeps counted for this reading (holder ids).
        self.kept: set[int] = set()
        self._holds: set[int] | None = None

    def holds(self, holder: Any) -> bool:
        """Whether the rows keep ``holder`` (one of them, a piece, a block, a media home)
        alive."""
        if self._holds is None:
            from .media import row_copies
            from .partition import row_pieces

            held: set[int] = set(map(id, self.rows))
            for r in self.rows:
                held.update(id(holder_of(pc)) for pc in row_pieces(r))
                if self.media:
                    held.update(id(c.home) for c in row_copies(r, self.media))
            self._holds = held
        return id(holder) in self._holds


class Kept:
    """Bytes a partition let go of that readings under way still hold (one per store,
    with its lock): counted until the last of them ends."""

    __slots__ = ("_by_holder", "bytes")

    def __init__(self) -> None:
        self.bytes = 0
        #: Per holder id: its bytes, the readings holding it, and the holder itself (so
        #: that its id is not reused while it is counted).
        self._by_holder: dict[int, list[Any]] = {}

    def keep(self, readings: Iterable[Reading], holder: Any, nbytes: int) -> None:
        """``holder``'s ``nbytes``, let go of by its partition: counted while any of
        ``readings`` (its partition's, under way) holds it."""
        holding = [rd for rd in readings if rd.holds(holder)]
        if not holding or nbytes <= 0:
            return
        entry = self._by_holder.get(id(holder))
        if entry is None:
            entry = self._by_holder[id(holder)] = [0, 0, holder]
        entry[0] += nbytes
        self.bytes += nbytes
        for rd in holding:
            if id(holder) not in rd.kept:
                rd.kept.add(id(holder))
                entry[1] += 1

    def end(self, reading: Reading) -> int:
        """``reading`` is over: what it alone still held stops counting. Returns the
        bytes freed."""
        freed = 0
        for h in reading.kept:
            entry = self._by_holder[h]
            entry[1] -= 1
            if not entry[1]:
                del self._by_holder[h]
                freed += entry[0]
        reading.kept.clear()
        self.bytes -= freed
        return freed
