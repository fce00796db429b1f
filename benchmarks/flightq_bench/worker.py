"""The producer and consumer processes: a command loop over a pipe from the runner.

Each process generates its own copy of the workload from the seed (so no step crosses a
pipe), builds the systems' halves on request and runs their methods. Around every call it
resets its peak RSS and reports the peak reached during the call, and the CPU time the
call used (every thread of the process). It exits when the pipe closes, so a crashed
runner leaves no worker behind.

A worker keeps freed memory (:func:`flightq.keep_freed_memory`) from its start, whatever
systems it serves: a flightq client does so when it connects, and the process is shared,
so every system of a run is measured with the same allocator setting.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from flightq.memory import keep_freed_memory

from . import payload, procs

__all__ = ["Worker", "serve"]


def _load(path: str) -> Any:
    mod, _, cls = path.partition(":")
    return getattr(importlib.import_module(mod), cls)


def serve(conn: Connection, role: str, netns: str | None = None) -> None:
    """The worker's loop: ``(command, args)`` in, ``("ok", result)`` or ``("err", text)`` out.

    With ``netns`` the process first moves into that network namespace (a testbed host),
    before any thread of its own starts."""
    if netns:
        from .hosts import enter

        enter(netns)
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when to stop
    keep_freed_memory()
    step = None
    halves: dict[str, Any] = {}
    scratch: dict[str, Any] = {}
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if cmd == "exit":
                conn.send(("ok", None))
                break
            if cmd == "load":
                halves.clear()
                scratch.clear()
                step = None
                gc.collect()
                step = payload.generate(args["workload"], args["seed"], args["quick"])
                result: Any = {"rows": step.rows, "nbytes": step.nbytes()}
            elif cmd == "setup":
                cls = _load(args["path"])
                half = cls(step, args["info"])
                if hasattr(half, "scratch"):
                    half.scratch = scratch
                halves[args["system"]] = half
                result = half.setup()
            elif cmd == "call":
                half = halves[args["system"]]
                rss0, _ = procs.rss()
                procs.reset_peak()
                cpu0 = time.process_time()
                result = getattr(half, args["method"])() or {}
                result["rss0"], result["peak"] = rss0, procs.rss()[1]
                result["cpu_s"] = time.process_time() - cpu0
            elif cmd == "teardown":
                half = halves.pop(args["system"], None)
                if half is not None:
                    half.close()
                gc.collect()
                result = None
            elif cmd == "pid":
                result = os.getpid()
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))


class WorkerError(RuntimeError):
    """A command failed inside a worker process."""


class Worker:
    """A spawned producer or consumer process and its pipe. Use as a context manager."""

    def __init__(self, role: str, timeout: float = 300.0, netns: str | None = None) -> None:
        self.role = role
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve, args=(child, role, netns), name=f"bench-{role}", daemon=True
        )
        self.proc.start()
        child.close()
        self.pid = int(self.proc.pid or 0)

    def send(self, cmd: str, **args: Any) -> None:
        """Send a command without waiting (pair with :meth:`recv`)."""
        self._conn.send((cmd, args))

    def recv(self, timeout: float | None = None) -> Any:
        """The reply to the last command sent.

        Raises
        ------
        WorkerError
            If the command failed, the process died or no reply came within the timeout.
        """
        wait = self.timeout if timeout is None else timeout
        if not self._conn.poll(wait):
            raise WorkerError(f"{self.role}: no reply within {wait:.0f}s")
        try:
            status, result = self._conn.recv()
        except EOFError as e:
            raise WorkerError(f"{self.role} process died (exit code {self.proc.exitcode})") from e
        if status != "ok":
            raise WorkerError(f"{self.role}: {result}")
        return result

    def call(self, cmd: str, timeout: float | None = None, **args: Any) -> Any:
        """Send a command and wait for its reply."""
        self.send(cmd, **args)
        return self.recv(timeout)

    def close(self) -> None:
        """Ask the process to exit; kill it if it does not."""
        with contextlib.suppress(Exception):
            self.call("exit", timeout=10)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
