"""flightq itself: ``Client.put`` of the step's rows, ``Client.get`` of them by key.

The producer passes the generator's per-row tensors as torch views (encoding is inside
the timed put); the consumer's timed get ends once every field's per-row tensors are built
(``batch[field]`` for each field, torch views). The server runs in its own process
(``python -m flightq.cli serve --host 127.0.0.1 --port 0``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from ..workloads import to_torch
from .endpoint import Consumer, Producer, now_ns, timed
from .payload import check_rows

__all__ = ["FlightqProducer", "FlightqConsumer", "server_argv"]


def server_argv() -> list[str]:
    """Command line of the flightq server process (loopback, free port)."""
    return [sys.executable, "-m", "flightq.cli", "serve", "--host", "127.0.0.1", "--port", "0"]


def _partition(info: dict[str, Any], workload: str) -> str:
    return f"bench-{info['run']}-{workload}"


class FlightqProducer(Producer):
    """One ``put`` of the whole step (all groups) per repetition."""

    def setup(self) -> dict[str, Any]:
        import flightq

        self.client = flightq.connect(self.info["location"], schemas=[self.step.schema])
        self.partition = _partition(self.info, self.step.name)
        self.client.create_partition(
            self.partition,
            schema=self.step.schema,
            tasks=["train"],
            group_size=self.step.group_size,
        )
        return {}

    def prepare(self) -> None:
        if getattr(self, "_torch", None) is None:
            # What a generator holds: torch tensors (bfloat16 pixels as torch.bfloat16).
            # Views over the generated arrays; nothing is copied.
            self._torch = to_torch(self.step)

    def put(self) -> dict[str, Any]:
        s = self._torch
        t0 = now_ns()
        self.client.put(self.partition, s.keys, s.columns, tags=s.tags)
        return timed(t0)

    def clear(self) -> None:
        self.client.clear(self.partition)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.drop(self.partition)
        self.client.close()


class FlightqConsumer(Consumer):
    """``get`` by key, then every field's per-row tensors."""

    def setup(self) -> dict[str, Any]:
        import flightq

        self.client = flightq.connect(self.info["location"], schemas=[self.ref.schema])
        self.partition = _partition(self.info, self.ref.name)
        self._got: Any = None
        return {}

    def get(self) -> dict[str, Any]:
        t0 = now_ns()
        batch = self.client.get(self.partition, self.ref.keys)
        cols = {f: batch[f] for f in batch.fields}
        self._got = (batch, cols)
        return timed(t0)

    def verify(self) -> None:
        batch, cols = self._got
        check_rows(self.ref, batch.keys, cols, batch.tags, "flightq")

    def release(self) -> None:
        self._got = None

    def close(self) -> None:
        self.client.close()
