"""A process that ends with flightq still open exits with status 0, at once, losing
nothing a writer accepted.

A Writer left open lost the puts it had queued and not sent (its thread is a daemon).
Arrow's own exit hook shut a server left serving down with no deadline: a call that
does not end by itself (a consumer session, a client's request stream) held the process
forever; and a server left serving into the interpreter's finalization aborted the
process now and then ("terminate called without an active exception", status 134).

Each case runs in a Python process of its own, in a process group killed on timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from fixtures_dataplane import ROOT, TIMEOUT, python_env

import flightq
from flightq.exiting import EXIT_STOP_S

pytestmark = pytest.mark.timeout(240)

# Clients of the process's own server keep calling it from daemon threads, with claims
# (the request stream) and gets, when the main thread returns.
_BUSY = """
import threading, time
import numpy as np
import flightq

srv = flightq.Server().start()
c = flightq.connect(srv.location, timeout=5.0)
c.create_partition("r", "rollout_text@1", tasks=["train"])
c.put("r", ["a"], {"input_ids": [np.arange(4)]})
started = threading.Barrier(3)

def busy():
    started.wait()
    while True:
        try:
            c.get("r", ["a"], as_="numpy")
            c.claim("r", "train", 1, as_="numpy", timeout=0.05)
        except Exception:
            pass

for _ in range(2):
    threading.Thread(target=busy, daemon=True).start()
started.wait()
time.sleep(0.2)
print("returning", flush=True)
"""

# What a trainer that embeds a server leaves open: a session, a Writer, the compat.
_OPEN = """
import numpy as np
import flightq
from flightq.compat import transferqueue as tq

srv = flightq.Server().start()
c = flightq.connect(srv.location, timeout=5.0)
c.create_partition("r", "rollout_text@1", tasks=["train"])
c.put("r", ["a"], {"input_ids": [np.arange(4)]})
tq.init({"flightq": {"location": srv.location, "partitions": {"p": "rollout_text@1"}}})
w = flightq.Writer(c, "r")
w.put(["b"], {"input_ids": [np.arange(4)]})
assert c.claim("r", "train", 1, as_="numpy", timeout=5.0).keys
print("returning", flush=True)
"""


# A generator that queues puts to a server of another process and returns, never closing
# its writer; the server's location comes as argv[1].
_WRITER = """
import sys
import numpy as np
import flightq

c = flightq.connect(sys.argv[1], timeout=5.0)
w = flightq.Writer(c, "w", max_pending=64)
for k in range(40):
    w.put([f"k{k}"], {"input_ids": [np.arange(200_000)]})
print("returning", flush=True)
"""

# The same, its server gone: the exit waits no longer than EXIT_FLUSH_S and says so.
_WRITER_LOST = """
import sys
import numpy as np
import flightq, flightq.exiting

flightq.exiting.EXIT_FLUSH_S = 1.0
srv = flightq.Server().start()
c = flightq.connect(srv.location, timeout=5.0)
c.create_partition("w", "rollout_text@1", tasks=["train"])
srv.stop()
w = flightq.Writer(c, "w")
w.put(["k0"], {"input_ids": [np.arange(4)]})
print("returning", flush=True)
"""


def _exit(script: str, *args: str) -> tuple[int, float, str]:
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
        start_new_session=True,
    )
    returned = None
    try:
        assert p.stdout is not None
        line = p.stdout.readline()  # the main thread returns now
        returned = time.monotonic()
        assert line == "returning\n"
        p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pass  # held: reported below
    finally:
        rc = p.poll()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
    took = time.monotonic() - (returned or time.monotonic())
    return (-999 if rc is None else rc), took, err


def test_a_process_whose_own_clients_still_call_its_server_exits_at_once() -> None:
    rc, took, err = _exit(_BUSY)
    assert rc == 0, (rc, err[-2000:])  # held until killed before (-999)
    assert took < TIMEOUT / 2, took


def test_a_process_leaving_its_server_session_writer_and_compat_open_exits_cleanly() -> None:
    # Held by the open session every time before; without the claim, aborted about once
    # in 30 exits: a few exits here.
    for _ in range(4):
        rc, _took, err = _exit(_OPEN)
        assert rc == 0, (rc, err[-2000:])


def test_a_writer_left_open_sends_what_it_queued_before_its_process_exits(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("w", "rollout_text@1", tasks=["train"])
    rc, _took, err = _exit(_WRITER, server.location)
    assert rc == 0, (rc, err[-2000:])
    assert len(client.list_keys("w")) == 40  # 31 before: the queued puts were lost


def test_a_writer_left_open_whose_server_is_gone_ends_its_exit_within_the_bound() -> None:
    rc, took, err = _exit(_WRITER_LOST)
    assert rc == 0, (rc, err[-2000:])
    assert took < 1.0 + TIMEOUT / 4, took
    assert "a writer was not closed before exit: writer to 'w'" in err, err[-2000:]
    assert "k0" in err or "not stored" in err, err[-2000:]


# A server whose answer stream its client stalled, with idle_timeout off (never cut):
# Arrow's exit hook waited for it forever.
_STALLED = """
import threading, time
import numpy as np, pyarrow.flight as fl
import flightq
from flightq.protocol import GetTicket

srv = flightq.Server(idle_timeout=None, max_batch_bytes=1 << 20).start()
c = flightq.connect(srv.location, timeout=30.0)
c.create_partition("r", "rollout_text@1", tasks=["train"])
keys = [f"k{i}" for i in range(64)]
for k in keys:
    c.put("r", [k], {"input_ids": [np.arange(1 << 17)]})  # 1 MiB each
read = threading.Event()

def stall():
    r = fl.connect(srv.location).do_get(fl.Ticket(GetTicket(partition="r", keys=keys).to_wire()))
    r.read_chunk()
    read.set()
    time.sleep(3600)

threading.Thread(target=stall, daemon=True).start()
read.wait(30)
print("returning", flush=True)
"""

# `flightq serve` (its foreground loop, in this process) with a reader that stalls.
_SERVE_STALLED = """
import argparse, contextlib, os, signal, sys, threading, time
import numpy as np, pyarrow.flight as fl
import flightq
from flightq import exiting
from flightq.protocol import GetTicket
from flightq.server.flight import serve_forever

def stall():
    while not exiting._servers:
        time.sleep(0.05)
    (srv,) = exiting._servers
    while srv.port == 0:
        time.sleep(0.05)
    c = flightq.connect(srv.location, timeout=30.0)
    c.create_partition("r", "rollout_text@1", tasks=["train"])
    keys = [f"k{i}" for i in range(64)]
    for k in keys:
        c.put("r", [k], {"input_ids": [np.arange(1 << 17)]})  # 1 MiB each
    r = fl.connect(srv.location).do_get(fl.Ticket(GetTicket(partition="r", keys=keys).to_wire()))
    r.read_chunk()
    print("returning", file=sys.__stdout__, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3600)

threading.Thread(target=stall, daemon=True).start()
args = argparse.Namespace(
    host="127.0.0.1", port=0, schemas=None, memory_budget=None, idle_timeout=0,
    stop_timeout=1.0, max_batch_bytes=1 << 20,
)
with contextlib.redirect_stdout(sys.stderr):  # its startup line: stdout is the test's
    serve_forever(args)
"""

# Many servers, each with a consumer session open: they stop side by side (one after
# another, the last ones ran out of the bound now and then; a guard).
_MANY = """
import numpy as np
import flightq

servers = [flightq.Server().start() for _ in range(16)]
clients = [flightq.connect(s.location, timeout=5.0) for s in servers]
for c in clients:
    c.create_partition("r", "rollout_text@1", tasks=["train"])
    c.put("r", ["a"], {"input_ids": [np.arange(4)]})
    c.claim("r", "train", 1, as_="numpy", timeout=5.0)
print("returning", flush=True)
"""

# The application's own exit hook, registered after its writer, still puts through it,
# although a writer made later moved nothing.
_USER_HOOK = """
import atexit
import numpy as np
import flightq

srv = flightq.Server().start()
c = flightq.connect(srv.location, timeout=5.0)
c.create_partition("w", "rollout_text@1", tasks=["train"])
w = flightq.Writer(c, "w")

def last():
    w.put(["last"], {"input_ids": [np.arange(4)]})
    w.close(5)
    print("stored", len(c.list_keys("w")), flush=True)

atexit.register(last)
flightq.Writer(c, "w").close()
w.put(["k0"], {"input_ids": [np.arange(4)]})
print("returning", flush=True)
"""

# Generators started by multiprocessing with forkserver (which flightq's docs advise)
# end with os._exit: no atexit hook runs there.
_MP_CHILD = """
import multiprocessing as mp
import numpy as np
import flightq

def generate(location):
    w = flightq.Writer(flightq.connect(location, timeout=10.0), "w", max_pending=64)
    for k in range(40):
        w.put([f"k{k}"], {"input_ids": [np.arange(200_000)]})

if __name__ == "__main__":
    with flightq.Server() as srv, flightq.connect(srv.location) as c:
        c.create_partition("w", "rollout_text@1", tasks=["train"])
        p = mp.get_context("forkserver").Process(target=generate, args=(srv.location,))
        p.start()
        p.join(60)
        print("stored", p.exitcode, len(c.list_keys("w")), flush=True)
    print("returning", flush=True)
"""


def test_a_server_whose_stream_never_ends_is_left_after_the_bound_and_named() -> None:
    rc, took, err = _exit(_STALLED)
    assert rc == 0, (rc, err[-2000:])  # held until killed before (-999)
    assert took < 5.0 + TIMEOUT / 4, took
    assert "did not stop within 5s at exit" in err, err[-2000:]


def test_flightq_serve_whose_stop_ran_out_exits_without_waiting_again() -> None:
    # `flightq serve` gave up on a call after --stop-timeout, and its exit hook then
    # waited its own 5 s more for the same call. The stalled reader is in the server's
    # process, where the idle watch cuts no connection (as where it cannot cut: not Linux).
    rc, took, err = _exit(_SERVE_STALLED)
    assert rc == 0, (rc, err[-2000:])
    assert "did not stop within 1s" in err and "exiting without waiting" in err, err[-2000:]
    assert "at exit" not in err, err[-2000:]  # the exit hook no longer waits for it
    assert took < 1 + EXIT_STOP_S - 1, took  # 6 s and more before


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_flightq_serve_refuses_a_stop_timeout_that_is_not_seconds(value: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "flightq.cli", "serve", "--port", "0", "--stop-timeout", value],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
        timeout=TIMEOUT,
    )
    assert p.returncode == 2 and "--stop-timeout must be seconds >= 0" in p.stderr, p.stderr
    assert "listening" not in p.stdout  # refused before it serves


def test_many_servers_with_open_sessions_stop_side_by_side_at_exit() -> None:
    for _ in range(2):
        rc, _took, err = _exit(_MANY)
        assert rc == 0, (rc, err[-2000:])  # one after another, the last ran out of time
        assert "did not stop" not in err, err[-2000:]


def test_the_applications_exit_hook_registered_after_its_writer_still_puts_through_it(
    tmp_path: Path,
) -> None:
    out = _output(_USER_HOOK, tmp_path)
    assert out.splitlines()[-1] == "stored 2", out  # the writer was closed before it


def test_a_forkserver_childs_open_writer_sends_what_it_queued(tmp_path: Path) -> None:
    out = _output(_MP_CHILD, tmp_path)
    assert "stored 0 40" in out, out  # 2 of 40 before: the child ends with os._exit


def _output(script: str, where: Path) -> str:
    # A file: a forkserver child imports its target from the main module's file.
    path = where / "main.py"
    path.write_text(textwrap.dedent(script))
    p = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
        timeout=4 * TIMEOUT,
        start_new_session=True,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_a_closed_client_refuses_calls_itself_typed(
    server: flightq.Server, client: flightq.Client
) -> None:
    client.create_partition("c", "rollout_text@1", tasks=["train"])
    c = flightq.connect(server.location)
    c.close()
    for call in (
        lambda: c.get("c", ["a"], as_="numpy"),
        lambda: c.claim("c", "train", 1, as_="numpy", timeout=1.0),
        lambda: c.put("c", ["a"], {"input_ids": [np.arange(4)]}),
        c.health,
    ):
        with pytest.raises(flightq.FlightqError, match="the client is closed"):
            call()  # Arrow's untyped "FlightClient is closed" before
