"""flightq streaming (W5): two writer processes put one row per put, the trainer claims.

``flightq-stream`` is WORKLOADS.md's W5: the producer starts two writer processes (the
groups split between them, :attr:`flightq.workloads.Step.streams`), each with its own
client; a timed put is both writers putting their rows one row per put, in the step's
seeded order, until both are done. Each repetition the writers connect afresh and hold
fresh torch views of the step's arrays (untimed), so digests are computed and media sent
as a new step's would be. The consumer claims the whole step for ``train`` (one claim)
and builds every field's per-row tensors.

Beside the times, each cycle reports the bytes the server received for the put and sent
for the claim (its ``bytes_received`` / ``bytes_sent`` counters) and the bytes the
partition holds (``stats``), against the step's distinct bytes (each image once).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import warnings
from typing import IO, Any

import numpy as np

from flightq.workloads import Step, to_torch

from .endpoint import Consumer, Producer, now_ns, timed
from .payload import check_rows

__all__ = ["FlightqStreamProducer", "FlightqClaimConsumer"]

#: Writer processes of a streamed put.
WRITERS = 2
#: Seconds a writer may take to start or to put its rows.
_WRITER_TIMEOUT = 300.0


def _partition(info: dict[str, Any], workload: str) -> str:
    return f"bench-{info['run']}-{workload}-stream"


def _streams(step: Step) -> list[list[int]]:
    """Each writer's rows in put order: the step's own, or its groups split in row order."""
    if step.streams:
        return step.streams
    g = max(step.group_size, 1)
    return [[i for i in range(step.rows) if (i // g) % WRITERS == w] for w in range(WRITERS)]


def _send(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _recv(f: IO[bytes]) -> Any:
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("the other end went away")
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(f.read(n))


def writer_main() -> None:
    """A writer process (started by :class:`FlightqStreamProducer`; its stdin and stdout
    carry pickled frames): on ``prepare`` a fresh client and fresh tensor views, on
    ``go`` its rows one put each, answering the seconds it took."""
    import flightq

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    location, partition, step, rows = _recv(inp)
    for col in step.columns.values():  # read-only, as the workload makes them
        for row in col if isinstance(col, list) else ():
            for seg in row if isinstance(row, list) else ():
                seg.flags.writeable = False
    client = None
    puts: list[Any] = []
    _send(out, "ready")
    while True:
        msg = _recv(inp)
        if msg == "stop":
            break
        try:
            if msg == "prepare":
                if client is not None:
                    client.close()
                client = flightq.connect(location, schemas=[step.schema])
                views = to_torch(step)
                puts = [
                    (
                        [views.keys[i]],
                        {k: v[i : i + 1] for k, v in views.columns.items()},
                        [views.tags[i]],
                    )
                    for i in rows
                ]
                _send(out, "ok")
                continue
            assert client is not None
            t0 = time.perf_counter()
            for keys, cols, tags in puts:
                client.put(partition, keys, cols, tags)
            _send(out, time.perf_counter() - t0)
        except Exception as e:  # reported to the producer, which raises it
            _send(out, f"error: {type(e).__name__}: {e}")
    if client is not None:
        client.close()


class FlightqStreamProducer(Producer):
    """Two writer processes, one row per put (W5)."""

    def setup(self) -> dict[str, Any]:
        import flightq

        loc = self.info["location"]
        self.client = flightq.connect(loc, schemas=[self.step.schema])
        self.partition = _partition(self.info, self.step.name)
        self.client.create_partition(self.partition, schema=self.step.schema, tasks=["train"])
        # Subprocesses, not multiprocessing: the producer is a daemonic process.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "from flightq_bench.stream_system import writer_main; writer_main()"
        self._writers: list[subprocess.Popen[bytes]] = []
        for rows in _streams(self.step):
            p = subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
            self._writers.append(p)
            assert p.stdin is not None
            _send(p.stdin, (loc, self.partition, self.step, rows))
        for p in self._writers:
            self._answer(p)
        return {}

    def _tell(self, msg: str) -> None:
        for p in self._writers:
            assert p.stdin is not None
            _send(p.stdin, msg)

    def _answer(self, p: subprocess.Popen[bytes]) -> Any:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], _WRITER_TIMEOUT)
        if not ready:
            raise TimeoutError("a writer process did not answer in time")
        got = _recv(p.stdout)
        if isinstance(got, str) and got.startswith("error"):
            raise RuntimeError(f"writer process: {got}")
        return got

    def prepare(self) -> None:
        self._tell("prepare")
        for p in self._writers:
            self._answer(p)

    def put(self) -> dict[str, Any]:
        before = self.client.stats()["counters"]["bytes_received"]
        t0 = now_ns()
        self._tell("go")
        for p in self._writers:
            self._answer(p)
        out = timed(t0)
        st = self.client.stats()
        out["wire_bytes"] = st["counters"]["bytes_received"] - before
        out["held_bytes"] = st["partitions"][self.partition]["bytes"]
        out["distinct_bytes"] = self.step.nbytes(distinct_media=True)
        return out

    def clear(self) -> None:
        self.client.clear(self.partition)

    def close(self) -> None:
        for p in self._writers:
            with contextlib.suppress(Exception):
                assert p.stdin is not None
                _send(p.stdin, "stop")
                p.stdin.close()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(5)
            if p.stdout is not None:
                p.stdout.close()
        with contextlib.suppress(Exception):
            self.client.drop(self.partition)
        self.client.close()


class FlightqClaimConsumer(Consumer):
    """One claim of the whole step for ``train``, then every field's per-row tensors."""

    def setup(self) -> dict[str, Any]:
        import flightq

        self.client = flightq.connect(self.info["location"], schemas=[self.ref.schema])
        self.partition = _partition(self.info, self.ref.name)
        self._got: Any = None
        return {}

    def get(self) -> dict[str, Any]:
        before = self.client.stats()["counters"]["bytes_sent"]
        t0 = now_ns()
        batch = self.client.claim(self.partition, "train", self.ref.rows, timeout=60)
        cols = {f: batch[f] for f in batch.fields}
        out = timed(t0)
        self._got = (batch, cols)
        r = batch.received
        out["get_wire_bytes"] = self.client.stats()["counters"]["bytes_sent"] - before
        if r is not None:
            out["record_batches"] = r.record_batches
        return out

    def verify(self) -> None:
        batch, cols = self._got
        check_rows(_reordered(self.ref, batch.keys), batch.keys, cols, batch.tags, "flightq")

    def release(self) -> None:
        batch, _ = self._got
        self.client.ack(batch)
        self._got = None

    def close(self) -> None:
        self.client.close()


def _reordered(ref: Step, keys: list[str]) -> Step:
    """``ref`` with its rows in the order of ``keys`` (a claim's order)."""
    pos = {k: i for i, k in enumerate(ref.keys)}
    if sorted(keys) != sorted(ref.keys):
        raise AssertionError("flightq: the claim did not return every row of the step")
    order = [pos[k] for k in keys]
    cols: dict[str, Any] = {
        k: v[np.asarray(order)] if isinstance(v, np.ndarray) else [v[i] for i in order]
        for k, v in ref.columns.items()
    }
    return Step(ref.name, ref.schema, list(keys), cols, [ref.tags[i] for i in order], 1)
