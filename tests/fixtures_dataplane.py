"""Fixtures, helpers and worker roles for the data-plane integration tests.

Every server is real: ``flightq.Server()`` on loopback port 0, used as a context manager.
Nothing mocks the transport. Test modules import the fixtures by name::

    from fixtures_dataplane import client_fixture, server_fixture  # noqa: F401

Run as a script, this module is one process of the W1 write-back pattern::

    python tests/fixtures_dataplane.py generator|logprob|trainer LOCATION PARTITION

Each role prints one JSON line describing what it did and exits 0, or raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flightq
from flightq import shm, workloads

__all__ = [
    "TEXT",
    "VLM",
    "TIMEOUT",
    "HERE",
    "server_fixture",
    "client_fixture",
    "text_keys",
    "text_columns",
    "raw",
    "assert_rows_match",
    "run_role",
    "cli_server",
    "python_env",
]

TEXT = "rollout_text@1"
VLM = "rollout_vlm@1"
#: Seconds any one call, claim or child process may take before the test fails.
TIMEOUT = 30.0
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: The W1 write-back partition: 2 groups of 16 (workloads.w1(groups=2)).
W1_GROUPS = 2
W1_TASKS = ("prev_lp", "train")


@pytest.fixture(name="server")
def server_fixture() -> Iterator[flightq.Server]:
    """A real flightq server on grpc://127.0.0.1:<free port>, serving in the background."""
    with flightq.Server() as srv:
        yield srv


@pytest.fixture(name="client")
def client_fixture(server: flightq.Server) -> Iterator[flightq.Client]:
    """A client connected to ``server``, schema-checked for rollout_text@1 and rollout_vlm@1."""
    with flightq.connect(server.location, [TEXT, VLM], timeout=TIMEOUT) as c:
        yield c


# --------------------------------------------------------------------------- data


def text_keys(groups: int, g: int, prefix: str = "p") -> list[str]:
    """Keys ``"{prefix}{group}_g{i}"``, group by group."""
    return [f"{prefix}{p}_g{i}" for p in range(groups) for i in range(g)]


def text_columns(keys: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Small seeded rollout_text rows: input_ids, token_mask (ragged), two scalars."""
    rng = np.random.default_rng(seed)
    lens = [int(s) for s in rng.integers(3, 17, size=len(keys))]
    return {
        "input_ids": [rng.integers(0, 1000, size=s, dtype=np.int64) for s in lens],
        "token_mask": [(rng.random(s) > 0.5).astype(np.int64) for s in lens],
        "input_lengths": np.asarray(lens, dtype=np.int32),
        "total_reward": rng.random(len(keys), dtype=np.float32),
    }


def raw(x: Any) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor (torch or numpy) as (dtype name, shape, bytes), for bit-exact comparison."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.ascontiguousarray(x)
    return (a.dtype.name, tuple(a.shape), a.tobytes())


def assert_rows_match(
    batch: flightq.Batch, step: workloads.Step, extra: dict[str, list[Any]] | None = None
) -> int:
    """Every field of every row of ``batch`` equals the seeded ``step`` byte for byte.

    ``extra`` maps a field written later (e.g. ``prev_logprobs``) to its per-row values in
    step order. The batch must carry exactly the step's fields plus ``extra``'s. Returns the
    payload bytes compared.
    """
    extra = extra or {}
    index = {k: i for i, k in enumerate(step.keys)}
    want_fields = set(step.columns) | set(extra)
    assert set(batch.fields) == want_fields, (batch.fields, sorted(want_fields))
    compared = 0
    for name in batch.fields:
        source = extra[name] if name in extra else step.columns[name]
        got_rows = batch[name]
        role = batch.schema[name].role
        for j, key in enumerate(batch.keys):
            want = source[index[key]]
            got = got_rows[j]
            if want is None:  # the row lacks the field
                assert got is None, (name, key)
            elif role == "media":
                assert len(got) == len(want), (name, key)
                for gs, ws in zip(got, want, strict=True):
                    assert raw(gs) == raw(ws), (name, key)
                    compared += len(raw(ws)[2])
            elif role == "scalar":
                assert raw(got) == raw(np.asarray(want)), (name, key)
                compared += np.asarray(want).nbytes
            else:
                assert raw(got) == raw(want), (name, key)
                compared += len(raw(want)[2])
    for j, key in enumerate(batch.keys):
        assert batch.tags[j] == step.tags[index[key]], key
    return compared


# --------------------------------------------------------------------------- processes


def python_env() -> dict[str, str]:
    """The environment for child Python processes: flightq importable, quiet threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_role(role: str, location: str, partition: str) -> subprocess.Popen[str]:
    """Start one write-back role of this module in its own Python process."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), role, location, partition],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
    )


@contextlib.contextmanager
def cli_server(*extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``python -m flightq.cli serve --port 0`` in a child process; yields (location, proc).

    Waits for the ``{"listening": location}`` line on stdout; stops the server with SIGTERM.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "flightq.cli", "serve", "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=str(ROOT),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by pytest-timeout if the server hangs
        if not line:
            _, err = proc.communicate(timeout=TIMEOUT)
            raise AssertionError(f"flightq serve exited with {proc.returncode}: {err}")
        yield json.loads(line)["listening"], proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------- roles


def _generator(c: flightq.Client, partition: str) -> dict[str, Any]:
    """Put the W1 step one whole group at a time, as torch tensors."""
    step = workloads.to_torch(workloads.w1(groups=W1_GROUPS))
    rows = 0
    for g in range(W1_GROUPS):
        group = step.group(g)
        rows += c.put(partition, group.keys, group.columns, group.tags)
    return {"role": "generator", "rows": rows}


def _logprob(c: flightq.Client, partition: str) -> dict[str, Any]:
    """Claim groups for prev_lp with input_ids only; write prev_logprobs under the same keys."""
    ref = workloads.w1(groups=W1_GROUPS)
    lp = workloads.logprobs_for(ref)
    index = {k: i for i, k in enumerate(ref.keys)}
    keys: list[str] = []
    while len(keys) < ref.rows:
        b = c.claim(partition, "prev_lp", ref.group_size, ["input_ids"], timeout=TIMEOUT)
        assert b.fields == ["input_ids"], b.fields
        assert len({k.split("_")[0] for k in b.keys}) == 1, f"not one whole group: {b.keys}"
        for k, ids in zip(b.keys, b["input_ids"], strict=True):
            assert raw(ids) == raw(ref.columns["input_ids"][index[k]]), k
        c.put(partition, b.keys, {"prev_logprobs": [lp[index[k]] for k in b.keys]})
        keys += b.keys
    return {"role": "logprob", "keys": keys}


def _trainer(c: flightq.Client, partition: str) -> dict[str, Any]:
    """Claim groups once prev_logprobs is there, read every field, verify every byte, clear."""
    ref = workloads.w1(groups=W1_GROUPS)
    lp = workloads.logprobs_for(ref)
    keys: list[str] = []
    nbytes = 0
    while len(keys) < ref.rows:
        claimed = c.claim(partition, "train", ref.group_size, ["prev_logprobs"], timeout=TIMEOUT)
        assert claimed.fields == ["prev_logprobs"], claimed.fields
        full = c.get(partition, claimed.keys)
        assert full.keys == claimed.keys
        nbytes += assert_rows_match(full, ref, {"prev_logprobs": lp})
        assert c.clear(partition, claimed.keys) == len(claimed.keys)
        keys += claimed.keys
    return {"role": "trainer", "keys": keys, "bytes": nbytes}


_ROLES = {"generator": _generator, "logprob": _logprob, "trainer": _trainer}


def _main(argv: Sequence[str]) -> int:
    role, location, partition = argv
    with flightq.connect(location, [VLM], timeout=TIMEOUT) as c:
        print(json.dumps(_ROLES[role](c, partition)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))


@pytest.fixture(name="shm_dir")
def shm_dir_fixture() -> Iterator[str]:
    """A private directory under /dev/shm for segments, removed afterwards."""
    path = tempfile.mkdtemp(prefix="flightq-test-", dir=shm.DEFAULT_DIR)
    try:
        yield os.path.realpath(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
