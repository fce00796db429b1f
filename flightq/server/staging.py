"""One put over several parallel DoPut streams, stored all or nothing.

A large put may travel as ``parts`` streams at once (each on its own connection, so the
receiver's copies run on several cores). Every stream's DoPut command carries the same
``stage`` (a token the client draws for this one attempt) and its ``part`` index; the
server checks each stream's record batches as usual, then the stream's handler waits here
until every part has arrived. The handler of the last part stores all of them in one step
(in part order, so rows keep the client's order), and every part's handler answers with
the same result or raises the same error. If a part fails, or does not arrive within the
put's timeout (and :data:`GRACE_S`), every part fails and nothing is stored. The parts
that arrived wait no longer than the server's idle timeout once none is on its way (the
missing ones never started: a client that stalls its put), nor once one of them lost its
client. A decided put is remembered for a while (:data:`_KEEP_S`, the latest
:data:`MAX_DECIDED` of them), so a part that comes late fails at once instead of waiting,
and is never acknowledged with the put it missed (a stage used again stores nothing); a
retry draws a new ``stage``. What a decided put keeps is its result or its error's class
and message: never the error itself, whose traceback would keep the failed part's record
batches alive.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import FlightqError, ProtocolError, UnavailableError
from ..protocol import MAX_PUT_PARTS, PutCommand
from .budget import MAX_NAME_CHARS
from .putplan import Stored

__all__ = ["Staging", "MAX_PARTS"]

#: Most streams one put may use.
MAX_PARTS = MAX_PUT_PARTS
#: Seconds a decided put is remembered (for its late parts).
_KEEP_S = 300.0
#: Most decided puts remembered: past it the oldest decision goes first (a part that comes
#: later than thousands of other decisions then waits out its own timeout instead).
MAX_DECIDED = 4096
#: Most characters of a decided put's error message kept (a refusal may quote what a
#: client sent; 4 096 decisions of it stay within a few MiB).
MAX_KEPT_MESSAGE = 1024
#: Longest single wait (a condition wait refuses huge timeouts).
_WAIT_S = 3600.0
#: Seconds the parts that arrived wait beyond the put's timeout: a missing part that is
#: still on its way (waiting for room under the memory budget, from the same timeout)
#: fails the put with its own error first, so the writer is told why.
GRACE_S = 1.0
#: Longest wait between two looks at the parts' clients and at the idle clock.
_TICK_S = 1.0


@dataclass
class _Put:
    parts: int
    key: tuple[str, str]  # (partition, stage)
    pieces: dict[int, list[Any]] = field(default_factory=dict)
    #: Parts whose stream is being read now (they have not joined or failed yet).
    coming: set[int] = field(default_factory=set)
    #: When a part last started or ended its stream (the idle clock of the parts here).
    active: float = field(default_factory=time.monotonic)
    done: bool = False
    committing: bool = False  # every part is here; only the commit decides now
    decided_at: float = 0.0
    result: Stored | None = None
    #: The error's class and message (the error itself would keep its frames alive).
    error: tuple[type[BaseException], str] | None = None
    #: Its structured attributes of plain scalars (``retry`` among them: every part's
    #: caller learns whether the put may pass later).
    attrs: dict[str, Any] = field(default_factory=dict)


class Staging:
    """The parts of puts arriving on parallel streams, keyed by partition and put id."""

    def __init__(self, idle: float | None = None) -> None:
        #: Seconds the parts that arrived wait while no other part is on its way (None:
        #: until the put's timeout).
        self.idle = idle or None
        self._cond = threading.Condition()
        self._puts: dict[tuple[str, str], _Put] = {}  # (partition, stage)
        #: The decided ones among them, in the order they were decided.
        self._decided: OrderedDict[tuple[str, str], _Put] = OrderedDict()

    def check(self, cmd: PutCommand) -> tuple[str, int, int] | None:
        """``(stage, part, parts)`` of a put command, None for a put of one stream.

        The command's parser bounds ``part`` and ``parts``; a put in parts must also have
        its ``part`` among its ``parts`` and a ``stage``.

        Raises
        ------
        ProtocolError
            If ``part`` / ``parts`` disagree or come without a ``stage``.
        """
        parts, part, stage = cmd.parts, cmd.part, cmd.stage
        if parts is None:
            return None
        if part is None or not 1 <= parts <= MAX_PARTS or not 0 <= part < parts:
            raise ProtocolError(
                f"put descriptor: 'part' must be in [0, parts) and 'parts' in [1, {MAX_PARTS}]"
            )
        if stage is None or not 0 < len(stage) <= 64:
            raise ProtocolError("put descriptor: a put in parts needs a 'stage' (<= 64 chars)")
        return stage, part, parts

    def refuse(self, command: Any, error: BaseException) -> None:
        """A part whose command was refused (it did not parse): if the command still names
        a put in parts (``partition``, ``stage``, ``parts``), that put fails, so that its
        other parts stop waiting and it is never committed without this one."""
        if not isinstance(command, dict):
            return
        partition, stage, parts = (command.get(k) for k in ("partition", "stage", "parts"))
        if (
            isinstance(partition, str)
            and isinstance(stage, str)
            and 0 < len(stage) <= 64
            and isinstance(parts, int)
            and not isinstance(parts, bool)
            and 1 <= parts <= MAX_PARTS
        ):
            self.fail(partition, stage, parts, error)

    def arrive(self, partition: str, stage: str, part: int, parts: int) -> None:
        """A part's stream starts: while one is on its way, the parts that arrived wait
        for it (up to the put's timeout).

        Raises
        ------
        FlightqError
            At once, if the put was decided already: its error, or a ``ProtocolError``
            where it was stored without this part (its stage used again).
        """
        if len(partition) > MAX_NAME_CHARS:
            return  # names no put that could be stored: its command fails further on
        with self._cond:
            p = self._entry(partition, stage, parts)
            if p.done:
                _raise_decided(p, f"put to {partition!r} in {parts} parts", part)
            p.coming.add(part)
            p.active = time.monotonic()

    def left(self, partition: str, stage: str, part: int) -> None:
        """A part's stream ended (read whole or failed; idempotent)."""
        with self._cond:
            p = self._puts.get((partition, stage))
            if p is not None and part in p.coming:
                p.coming.discard(part)
                p.active = time.monotonic()
                self._cond.notify_all()

    def fail(self, partition: str, stage: str, parts: int, error: BaseException) -> None:
        """A part could not be read or checked: the whole put fails, nothing is stored.
        A partition name longer than any partition's (:data:`MAX_NAME_CHARS`) names no
        put that could be stored: nothing is remembered."""
        if len(partition) > MAX_NAME_CHARS:
            return
        with self._cond:
            p = self._entry(partition, stage, parts)
            self._decide(p, error=error)

    def join(
        self,
        partition: str,
        stage: str,
        part: int,
        parts: int,
        pieces: list[Any],
        commit: Callable[[list[Any]], Stored],
        timeout: float,
        cancelled: Callable[[], bool] | None = None,
    ) -> Stored:
        """Add one part's checked pieces; wait for the others; return what the put did
        (the same for every part).

        The last part to arrive runs ``commit`` on every part's pieces, in part order.
        ``cancelled`` says whether this part's client went away (it fails the put).

        Raises
        ------
        FlightqError
            The error ``commit`` raised, or that another part failed with (the same for
            every part); ``ProtocolError`` if parts disagree on their count, the others
            did not arrive within ``timeout``, none was on its way for :attr:`idle`
            seconds, or the put was stored without this part; ``UnavailableError`` if a
            part's client went away before the put was decided.
        """
        what = f"put to {partition!r} in {parts} parts"
        deadline = time.monotonic() + timeout + GRACE_S
        with self._cond:
            p = self._entry(partition, stage, parts)
            p.coming.discard(part)
            p.active = time.monotonic()
            if p.done:
                _raise_decided(p, what, part)
            if p.parts != parts or part in p.pieces:
                unfit = ProtocolError(
                    f"{what}: part {part} does not fit the parts already here "
                    f"({sorted(p.pieces)} of {p.parts}); nothing was stored"
                )
                if p.committing:
                    raise unfit  # the put goes on without this stray part
                self._decide(p, error=unfit)
            if not p.done:
                p.pieces[part] = pieces
            last = not p.done and len(p.pieces) == p.parts
            everything = [pc for i in range(p.parts) for pc in p.pieces[i]] if last else []
            p.committing = p.committing or last
        if last:
            try:
                result = commit(everything)
            except BaseException as e:
                with self._cond:
                    self._decide(p, error=e, final=True)
            else:
                with self._cond:
                    self._decide(p, result=result, final=True)
        with self._cond:
            try:
                while not p.done:
                    # Once every part is here, the commit's answer is the answer, however
                    # long the store takes (it waits for space within the put's timeout).
                    now = time.monotonic()
                    left = deadline - now
                    stop = None if p.committing else self._stop(p, what, part, cancelled, now)
                    if stop is None and left <= 0 and not p.committing:
                        stop = ProtocolError(
                            f"{what}: {len(p.pieces)} arrived within "
                            f"{timeout + GRACE_S:.3g} s; nothing was stored"
                        )
                    if stop is not None:
                        self._decide(p, error=stop)
                        break
                    wait = min(left, _WAIT_S) if left > 0 else 1.0
                    if cancelled is not None or self.idle is not None:
                        wait = min(wait, _TICK_S)
                    self._cond.wait(wait)
            except BaseException as e:
                # This part's handler is going away (interrupted, or a wait the platform
                # refused): its put must never be committed later without it.
                self._decide(p, error=ProtocolError(f"{what}: part {part} failed: {e!r}"))
                raise
        if p.error is not None:
            _raise_decided(p, what, part)
        assert p.result is not None, "a put decided without an error has its result"
        return p.result

    def _stop(
        self, p: _Put, what: str, part: int, cancelled: Callable[[], bool] | None, now: float
    ) -> FlightqError | None:
        # With the lock held: why the parts here stop waiting now, if they do.
        if cancelled is not None and cancelled():
            return UnavailableError(
                f"{what}: part {part}'s client went away before the put was stored; "
                "nothing was stored"
            )
        if self.idle is not None and not p.coming and now - p.active > self.idle:
            missing = sorted(set(range(p.parts)) - set(p.pieces))
            return ProtocolError(
                f"{what}: parts {missing} did not start within {self.idle:.3g} s of the "
                "last part's stream (the server's idle_timeout); nothing was stored"
            )
        return None

    def staged(self) -> dict[str, int]:
        """Parts that arrived and wait for their put's other parts right now, per partition.

        A put whose every part is here (committing) or that is decided counts no more.
        """
        out: dict[str, int] = {}
        with self._cond:
            for (partition, _), p in self._puts.items():
                if not p.done and not p.committing and p.pieces:
                    out[partition] = out.get(partition, 0) + len(p.pieces)
        return out

    def _entry(self, partition: str, stage: str, parts: int) -> _Put:
        # With the lock held: the put of this stage, new or remembered; old ones go (the
        # decided ones in the order they were decided, so this looks at few).
        now = time.monotonic()
        decided = self._decided
        while decided and (
            len(decided) > MAX_DECIDED or now - next(iter(decided.values())).decided_at > _KEEP_S
        ):
            k, _ = decided.popitem(last=False)
            del self._puts[k]
        p = self._puts.get((partition, stage))
        if p is None:
            p = self._puts[(partition, stage)] = _Put(parts, (partition, stage))
        return p

    def _decide(
        self,
        p: _Put,
        result: Stored | None = None,
        error: BaseException | None = None,
        final: bool = False,
    ) -> None:
        # With the lock held: the first decision stands, and once every part is here only
        # the commit's (``final``); the parts' pieces are let go.
        if p.committing and not final:
            return
        if not p.done:
            p.done, p.result = True, result
            p.error = None if error is None else (type(error), _kept(str(error)))
            p.attrs = _plain(error)
            p.decided_at = time.monotonic()
            p.pieces = {i: [] for i in p.pieces}
            self._decided[p.key] = p
            self._cond.notify_all()


def _raise_decided(p: _Put, what: str, part: int) -> None:
    """Raise what a decided put answers a part: its error, or where it was stored, a
    ``ProtocolError`` for a part that was not among those stored."""
    if p.error is None:
        raise ProtocolError(
            f"{what}: part {part} came after the put of its stage was stored without it "
            "(a stage is used once; a retry draws a new one); nothing of it was stored"
        )
    kind, message = p.error
    if issubclass(kind, FlightqError):
        raise kind(message, **p.attrs)
    raise ProtocolError(f"{what}: {message}")


def _plain(error: BaseException | None) -> dict[str, Any]:
    """``error``'s structured attributes that are plain scalars (strings cut as messages
    are), as a decided put keeps them."""
    if not isinstance(error, FlightqError):
        return {}
    return {
        a: _kept(v) if isinstance(v, str) else v
        for a, v in error.attributes().items()
        if isinstance(v, (str, int, float, bool))
    }


def _kept(message: str) -> str:
    """A decided put's error message as kept: at most :data:`MAX_KEPT_MESSAGE` characters."""
    if len(message) <= MAX_KEPT_MESSAGE:
        return message
    return f"{message[:MAX_KEPT_MESSAGE]}... ({len(message)} characters)"
