"""A process forked after its parent used flightq: every call refuses at once, typed,
instead of hanging past its timeout (gRPC's state does not survive a fork); a fork made
before the first connection works.

Each case runs in a child Python process of its own (this test process has used gRPC),
which forks; the grandchild reports what each call did on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from fixtures_dataplane import ROOT, TIMEOUT, python_env

pytestmark = pytest.mark.timeout(120)

_AFTER = """
import json, os, sys, time
import numpy as np
import flightq
from flightq.compat import transferqueue as tq

srv = flightq.Server().start()
c = flightq.connect(srv.location, timeout=5.0)
c.create_partition("r", "rollout_text@1", tasks=["train"])
c.put("r", ["a"], {"input_ids": [np.arange(4)]})
tq.init({"flightq": {"location": srv.location, "partitions": {"p": "rollout_text@1"}}})
w = flightq.Writer(c, "r")
pid = os.fork()
if pid == 0:
    out = {}
    for name, call in {
        "inherited get": lambda: c.get("r", ["a"], as_="numpy"),
        "inherited claim": lambda: c.claim("r", "train", 1, as_="numpy", timeout=1.0),
        "connect": lambda: flightq.connect(srv.location, timeout=5.0),
        "server": lambda: flightq.Server(),
        "compat init": lambda: tq.init(),
        "writer put": lambda: w.put(["b"], {"input_ids": [np.arange(4)]}),
        "writer close": lambda: w.close(),
    }.items():
        started = time.monotonic()
        try:
            call()
            out[name] = ["ok", 0.0]
        except Exception as e:
            out[name] = [type(e).__name__, round(time.monotonic() - started, 3), str(e)]
    started = time.monotonic()
    c.close()  # hung in Arrow's close of the inherited connection before
    out["client close"] = ["ok", round(time.monotonic() - started, 3)]
    print(json.dumps(out), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert c.get("r", ["a"], as_="numpy").keys == ["a"]  # the parent serves on
w.close()
print(json.dumps({"child": status}), flush=True)
"""

_BEFORE = """
import json, os
import numpy as np
import flightq
pid = os.fork()  # before any connection: the child may use flightq
if pid == 0:
    with flightq.Server() as srv, flightq.connect(srv.location, timeout=5.0) as c:
        c.create_partition("r", "rollout_text@1", tasks=["train"])
        print(json.dumps({"put": int(c.put("r", ["a"], {"input_ids": [np.arange(4)]}))}))
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(json.dumps({"child": status}), flush=True)
"""


def _run(script: str) -> list[dict[str, object]]:
    # Its own process group: a forked grandchild that hangs goes with it on a timeout.
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=4 * TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_every_call_in_a_process_forked_after_flightq_was_used_refuses_at_once() -> None:
    child, parent = _run(_AFTER)
    assert parent == {"child": 0}
    kind, took = child.pop("client close")
    assert kind == "ok" and took < 1.0, (kind, took)
    assert set(child) == {
        "inherited get",
        "inherited claim",
        "connect",
        "server",
        "compat init",
        "writer put",
        "writer close",
    }
    for name, (kind, took, *message) in child.items():
        assert kind == "ProtocolError", (name, kind, message)
        assert took < 1.0, (name, took)  # hung until killed before
        assert "forked after its parent used flightq" in message[0]
        assert "'spawn'" in message[0]


def test_a_process_forked_before_the_first_connection_uses_flightq() -> None:
    assert _run(_BEFORE) == [{"put": 1}, {"child": 0}]
