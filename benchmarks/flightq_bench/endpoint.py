"""The two halves of every system: what the producer process and the consumer process run.

A runner drives them through :mod:`flightq_bench.worker`. The timed methods return
monotonic timestamps in nanoseconds (``CLOCK_MONOTONIC`` is shared by every process of
the machine, so a send start in one process and a receive end in another can be
subtracted); everything else (preparing, verifying, clearing) is outside the timed region.
"""

from __future__ import annotations

import time
from typing import Any

from flightq.workloads import Step

__all__ = ["Producer", "Consumer", "now_ns", "timed"]


def now_ns() -> int:
    """Monotonic clock in nanoseconds, comparable across processes of this machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def timed(t0: int, **extra: Any) -> dict[str, Any]:
    """A result dict with start ``t0`` and the end time now."""
    return {"t0": t0, "t1": now_ns(), **extra}


class Producer:
    """Writes the step. Subclasses implement :meth:`put` (for direct transfers: the send).

    Parameters
    ----------
    step:
        The generated step to write.
    info:
        What the runner knows: the server's address, the consumer's port, the run id.
    """

    def __init__(self, step: Step, info: dict[str, Any]) -> None:
        self.step = step
        self.info = info

    def setup(self) -> dict[str, Any]:
        """Connect; returns anything the other side needs (untimed)."""
        return {}

    def ready(self) -> None:
        """Second setup phase, after both sides' :meth:`setup` (untimed)."""

    def prepare(self) -> None:
        """Work a system needs before each put that the benchmark does not time."""

    def put(self) -> dict[str, Any]:
        """Write the step; returns ``{"t0": ns, "t1": ns}``."""
        raise NotImplementedError

    def clear(self) -> None:
        """Remove what the last put stored (untimed)."""

    def close(self) -> None:
        """Disconnect."""


class Consumer:
    """Reads the step and checks it against its own reference copy.

    Parameters
    ----------
    ref:
        The same step, generated in this process from the same seed.
    info:
        As for :class:`Producer`.
    """

    def __init__(self, ref: Step, info: dict[str, Any]) -> None:
        self.ref = ref
        self.info = info
        #: Per-process scratch the worker shares between systems (e.g. receive buffers).
        self.scratch: dict[str, Any] = {}

    def setup(self) -> dict[str, Any]:
        """Connect or listen; returns anything the producer needs (untimed)."""
        return {}

    def ready(self) -> None:
        """Second setup phase, after both sides' :meth:`setup` (untimed)."""

    def get(self) -> dict[str, Any]:
        """Read the step (for direct transfers: receive it); ``{"t0": ns, "t1": ns}``."""
        raise NotImplementedError

    def verify(self) -> None:
        """Check the last received step bit for bit (untimed).

        Raises
        ------
        VerifyError
            If anything differs.
        """
        raise NotImplementedError

    def release(self) -> None:
        """Drop the last received step."""

    def close(self) -> None:
        """Disconnect."""
