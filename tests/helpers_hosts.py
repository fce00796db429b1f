"""A client process on a testbed host, driven step by step from a test.

The test process stays in the machine's own network namespace (gRPC threads it may have
started there could not follow it into another). :class:`Agent` spawns a process that
moves into a host's namespace first thing, then runs the operations of :data:`OPS` on its
one :class:`flightq.ShardedClient`, so one client lives through a whole fault: link down,
link up, a server restarted. An operation's error comes back as :class:`AgentError`
carrying the error's class names and message, and how long the call took.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Agent", "AgentError", "OPS"]


class AgentError(Exception):
    """An operation failed inside the agent: ``kinds`` are its error's class names (the
    class first, then its bases), ``seconds`` how long the call ran."""

    def __init__(self, kinds: list[str], message: str, seconds: float) -> None:
        super().__init__(f"{kinds[0]}: {message}")
        self.kinds = kinds
        self.message = message
        self.seconds = seconds


def _step(prefix: str, groups: int, seed: int) -> Any:
    from flightq import workloads

    step = workloads.w1(seed, groups=groups)
    step.keys = [f"{prefix}{k}" for k in step.keys]
    return step


def _crc(ids: Any, px: Any) -> int:
    return zlib.crc32(px.tobytes(), zlib.crc32(ids.tobytes()))


def _connect(st: dict[str, Any], locations: list[str], timeout: float, **kw: Any) -> None:
    """A sharded client with flightq's default keepalive (a quarter of ``timeout``);
    ``kw`` as :func:`flightq.connect` takes them (``session_timeout``)."""
    import flightq

    st["c"] = flightq.connect_sharded(
        locations, ["rollout_vlm@1"], timeout=timeout, poll=0.05, **kw
    )


def _create(st: dict[str, Any], partition: str, **kw: Any) -> None:
    st["c"].create_partition(partition, "rollout_vlm@1", tasks=["train"], group_size=16, **kw)


def _shards_of(st: dict[str, Any], prefix: str, groups: int, seed: int = 0) -> dict[str, int]:
    """Each W1 group's shard (by its first key)."""
    step = _step(prefix, groups, seed)
    return {k: st["c"].router.shard_of(k) for k in step.keys[::16]}


def _put(
    st: dict[str, Any],
    partition: str,
    prefix: str,
    groups: int,
    seed: int = 0,
    only: list[int] | None = None,
    put_id: str | None = None,
) -> dict[str, int]:
    """Put W1 groups (``only``: those groups); returns each row's checksum."""
    step = _step(prefix, groups, seed)
    rows = [i for i in range(len(step.keys)) if only is None or i // 16 in only]
    keys = [step.keys[i] for i in rows]
    cols = {
        name: [v[i] for i in rows] if isinstance(v, list) else v[rows]
        for name, v in step.columns.items()
    }
    st["c"].put(partition, keys, cols, [step.tags[i] for i in rows], put_id=put_id)
    return {k: _crc(cols["input_ids"][j], cols["pixel_values"][j][0]) for j, k in enumerate(keys)}


def _get(st: dict[str, Any], partition: str, keys: list[str]) -> dict[str, int]:
    b = st["c"].get(partition, keys, as_="numpy")
    ids, px = b["input_ids"], b["pixel_values"]
    return {k: _crc(ids[i], px[i][0]) for i, k in enumerate(b.keys)}


def _claim(st: dict[str, Any], partition: str, n: int, timeout: float, **kw: Any) -> list[str]:
    b = st["c"].claim(partition, "train", n, timeout=timeout, as_="numpy", **kw)
    st["last"] = b
    return list(b.keys)


def _deliveries(st: dict[str, Any]) -> dict[str, int]:
    """How many times each row of the last claim has been delivered (this time included)."""
    c = st["last"].claim
    return dict(zip(c.keys, c.deliveries, strict=True))


def _ack(st: dict[str, Any]) -> int:
    return int(st["c"].ack(st["last"]))


def _rows(st: dict[str, Any], partition: str) -> int:
    return int(st["c"].stats()["partitions"][partition]["rows"])


def _call(st: dict[str, Any], method: str, *args: Any, **kw: Any) -> Any:
    return getattr(st["c"], method)(*args, **kw)


#: What an agent can do, by name.
OPS: dict[str, Callable[..., Any]] = {
    "connect": _connect,
    "create": _create,
    "shards_of": _shards_of,
    "put": _put,
    "get": _get,
    "claim": _claim,
    "deliveries": _deliveries,
    "ack": _ack,
    "rows": _rows,
    "call": _call,
}


def _serve(conn: Connection, netns: str) -> None:
    from flightq_bench.hosts import enter

    enter(netns)
    import faulthandler

    faulthandler.enable()  # a hung agent killed with SIGABRT shows where it hung
    st: dict[str, Any] = {}
    while True:
        try:
            op, args, kw = conn.recv()
        except (EOFError, OSError):
            break
        if op == "exit":
            break
        t = time.monotonic()
        try:
            out: tuple[str, Any] = ("ok", OPS[op](st, *args, **kw))
        except Exception as e:
            kinds = [c.__name__ for c in type(e).__mro__]
            out = ("err", (kinds, str(e)))
        conn.send((*out, time.monotonic() - t))
    with contextlib.suppress(Exception):
        st["c"].close()


class Agent:
    """A client process inside network namespace ``netns``; use as a context manager."""

    def __init__(self, netns: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, netns), daemon=True)
        self.proc.start()
        child.close()

    def send(self, op: str, *args: Any, **kw: Any) -> None:
        """Start an operation; :meth:`result` waits for it."""
        self._conn.send((op, args, kw))

    def result(self, timeout: float = 60.0) -> Any:
        """The last operation's result, with ``self.seconds`` set to how long it ran.

        Raises
        ------
        AgentError
            If it failed.
        TimeoutError
            If no answer came within ``timeout`` seconds.
        """
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the agent did not answer within {timeout:.0f}s")
        status, value, self.seconds = self._conn.recv()
        if status == "err":
            raise AgentError(value[0], value[1], self.seconds)
        return value

    def __call__(self, op: str, *args: Any, **kw: Any) -> Any:
        self.send(op, *args, **kw)
        return self.result()

    def close(self) -> None:
        """Ask the process to exit; kill it after 10 s."""
        with contextlib.suppress(Exception):
            self._conn.send(("exit", (), {}))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
