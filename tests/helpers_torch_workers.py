"""Functions a DataLoader's spawned workers run (importable by name in a new process)."""

from __future__ import annotations

import time

#: Seconds the second worker takes to start (a slow import, a device's first use).
SLOW_START_S = 2.0


def slow_second_worker(worker_id: int) -> None:
    """A ``worker_init_fn``: worker 1 starts :data:`SLOW_START_S` late."""
    if worker_id == 1:
        time.sleep(SLOW_START_S)
