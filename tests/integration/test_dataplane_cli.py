"""``flightq serve``, ``flightq stats`` and ``flightq inspect``, each in its own process."""

from __future__ import annotations

import json
import platform
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from fixtures_dataplane import TEXT, TIMEOUT, cli_server, python_env, text_columns, text_keys

import flightq
from flightq import workloads
from flightq.cli import main

pytestmark = pytest.mark.timeout(90)


def flightq_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m flightq.cli ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "flightq.cli", *args],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def served():
    """A ``flightq serve --port 0`` process holding partition 'rollouts' (2 groups of 2)."""
    with cli_server() as (location, proc):
        keys = text_keys(2, 2)
        with flightq.connect(location, [TEXT], timeout=TIMEOUT) as c:
            c.create_partition("rollouts", TEXT, tasks=["prev_lp", "train"], group_size=2)
            c.put("rollouts", keys, text_columns(keys))
            c.ack(c.claim("rollouts", "train", 2, timeout=TIMEOUT))
            nbytes = c.stats()["bytes"]
        yield location, proc, nbytes


@pytest.mark.torch
def test_serve_on_port_0_announces_the_bound_location(served):
    location, proc, _ = served
    assert location.startswith("grpc://127.0.0.1:")
    assert not location.endswith(":0")
    assert proc.poll() is None


@pytest.mark.torch
def test_stats_prints_every_partition(served):
    location, _, _ = served
    out = flightq_cli("stats", location)
    assert out.returncode == 0, out.stderr
    assert f"{location}: 1 partitions, 4 rows" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("rollouts"))
    assert line.split()[:4] == ["rollouts", TEXT, "2", "4"]
    assert "prev_lp=0, train=2" in line


@pytest.mark.torch
def test_stats_json_is_the_servers_stats(served):
    location, _, nbytes = served
    out = flightq_cli("stats", location, "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rows"] == 4
    assert got["bytes"] == nbytes
    assert got["partitions"]["rollouts"]["delivered"] == {"prev_lp": 0, "train": 2}


@pytest.mark.torch
def test_inspect_prints_schema_fields_and_per_task_progress(served):
    location, _, _ = served
    out = flightq_cli("inspect", location, "rollouts")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"partition 'rollouts' on {location}" in text
    assert f"schema      {TEXT}" in text
    assert "group size 2" in text
    for field in ("input_ids", "token_mask", "input_lengths", "total_reward"):
        assert any(ln.split() == [field, "4"] for ln in text.splitlines()), field
    assert any(ln.split() == ["train", "2", "/", "2"] for ln in text.splitlines())
    assert any(ln.split() == ["prev_lp", "0", "/", "4"] for ln in text.splitlines())


@pytest.mark.torch
def test_inspect_json_carries_the_declaration(served):
    location, _, _ = served
    out = flightq_cli("inspect", location, "rollouts", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["fields"]["input_ids"] == 4
    assert got["ready"] == {"prev_lp": 4, "train": 2}
    assert got["declaration"]["schema_ref"] == TEXT
    assert json.loads(got["declaration"]["schema"])["name"] == "rollout_text"


@pytest.mark.torch
def test_inspect_of_an_unknown_partition_fails_with_the_servers_message(served):
    location, _, _ = served
    out = flightq_cli("inspect", location, "nope")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "flightq: NotFoundError: unknown partition 'nope'\n" in out.stderr
    assert "rollouts" not in out.stderr  # other partitions are never listed


def test_stats_of_an_unreachable_server_fails_typed():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = flightq_cli("stats", f"grpc://127.0.0.1:{port}")
    assert out.returncode == 2
    assert "flightq: UnavailableError:" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_cleanly_on_a_signal(sig):
    with cli_server() as (location, proc):
        with flightq.connect(location, timeout=TIMEOUT) as c:
            assert c.health()["ok"] is True
        proc.send_signal(sig)
        proc.wait(timeout=TIMEOUT)
        assert proc.returncode == 0


_KEPT = """
import sys
import numpy as np
import flightq
from flightq import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
elif sys.argv[1] == "connect":  # a client leaves the process's malloc alone by default
    flightq.connect(sys.argv[2]).close()
elif sys.argv[1] == "connect-tuned":  # unless asked
    flightq.connect(sys.argv[2], keep_freed_memory=True).close()
elif sys.argv[1] == "connect-shm":  # its payloads are mapped: malloc is left alone
    flightq.connect(sys.argv[2], shm=True, keep_freed_memory=True).close()
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) * 1024
np.empty(16 * 2**20, np.uint8)  # one block freed: glibc's own threshold rises to it
blocks = [np.ones(16 * 2**20, np.uint8) for _ in range(16)]  # what a put leaves
held = rss()
del blocks  # the rows are cleared
print(held - rss())
"""


@pytest.mark.torch
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")
def test_serve_cuts_answers_at_max_batch_bytes_keeping_groups_whole():
    step = workloads.w1(0, groups=4, g=4)
    limit = max(step.group(g).nbytes(distinct_media=True) for g in range(4)) * 5 // 4
    with cli_server("--max-batch-bytes", str(limit)) as (location, _):
        c = flightq.connect(location, [step.schema], timeout=TIMEOUT)
        c.create_partition("v", step.schema, tasks=["t"], group_size=step.group_size)
        c.put("v", step.keys, step.columns, step.tags)
        got = c.get("v", step.keys)
        c.close()
    assert got.received is not None and got.received.record_batches == 4  # a group each
    assert [len(p) for p in got.parts] == [4, 4, 4, 4]


def test_serve_keeps_freed_blocks_so_the_next_put_reuses_warm_pages():
    def returned(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _KEPT, mode], check=True, capture_output=True, text=True
        )
        return int(out.stdout)

    assert returned("plain") > 128 * 2**20  # given back to the kernel: the next put faults
    assert returned("tuned") < 32 * 2**20  # kept for the next put


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")
def test_a_client_keeps_freed_memory_only_when_asked():
    def returned(*args: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _KEPT, *args], check=True, capture_output=True, text=True
        )
        return int(out.stdout)

    with cli_server() as (location, _):
        assert returned("connect", location) > 128 * 2**20
        assert returned("connect-tuned", location) < 32 * 2**20
        assert returned("connect-shm", location) > 128 * 2**20


_FROM_MALLOC = """
import numpy as np
import pyarrow as pa
import flightq
from flightq.chunks import encode_chunks
schema = flightq.SchemaRegistry.default().get("rollout_vlm@1")
imgs = [np.full((748, 1176), i, np.float32) for i in range(8)]
cols = {"input_ids": [np.arange(8)] * 8, "pixel_values": [[im] for im in imgs]}
keys = [f"r{i}" for i in range(8)]
malloc = pa.system_memory_pool()
def from_malloc():
    before = malloc.bytes_allocated()
    batches = encode_chunks(schema, cols, keys, max_bytes=16 * 2**20)
    return malloc.bytes_allocated() - before
untuned = from_malloc()
assert flightq.keep_freed_memory()
print(untuned, from_malloc(), sum(im.nbytes for im in imgs))
"""


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)
def test_once_a_process_keeps_freed_memory_its_puts_take_payload_buffers_from_malloc():
    # Arrow's default pool (mimalloc) hands a large put's pages back to the kernel whatever
    # the process asks: each later put faults them in again (a full W2 put at 0.4x of the
    # speed from kept malloc, flightq bench). Small puts of an untuned process keep it.
    out = subprocess.run(
        [sys.executable, "-c", _FROM_MALLOC], check=True, capture_output=True, text=True
    )
    untuned, tuned, payload = map(int, out.stdout.split())
    assert untuned < payload // 8, (untuned, payload)
    assert tuned >= payload, (tuned, payload)


@pytest.mark.parametrize(
    "where", [("darwin", ("", "")), ("linux", ("musl", "1.2")), ("win32", ("", ""))]
)
def test_keep_freed_memory_changes_nothing_without_glibc(monkeypatch, where):
    platform_name, libc = where
    monkeypatch.setattr(sys, "platform", platform_name)
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: libc)
    assert flightq.keep_freed_memory() is False


def _serve_environ(env: dict[str, str]) -> tuple[dict[str, str], dict[str, object]]:
    """The environment a ``flightq serve`` process runs with once it listens, and the
    ``malloc`` entry of its startup line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flightq.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
        assert line["listening"].startswith("grpc://127.0.0.1:")
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
        return {k.decode(): v.decode() for k, v in pairs}, line["malloc"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas"
)
def test_serve_runs_with_one_malloc_arena_unless_the_environment_says_otherwise():
    env = {k: v for k, v in python_env().items() if k != "MALLOC_ARENA_MAX"}
    environ, malloc = _serve_environ(env)
    assert environ["MALLOC_ARENA_MAX"] == "1"
    # It says so on its startup line.
    assert malloc == {"arena_max": "1", "keep_freed_memory": True}
    environ, malloc = _serve_environ({**env, "MALLOC_ARENA_MAX": "3"})
    assert environ["MALLOC_ARENA_MAX"] == "3"
    assert malloc == {"arena_max": "3", "keep_freed_memory": True}


def test_serve_help_says_it_tunes_its_own_allocator(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tunes glibc's malloc of its own process" in text
    assert "MALLOC_ARENA_MAX=1" in text and '"malloc" entry' in text


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("67108864", 2**26),
        ("64MiB", 2**26),
        ("64 mib", 2**26),
        ("8GB", 8 * 10**9),
        ("1.5GiB", 3 * 2**29),
    ],
)
def test_sizes_on_the_command_line_take_units(text: str, value: int) -> None:
    from flightq.cli import parse_bytes

    assert parse_bytes(text) == value


def test_serve_takes_its_budget_with_a_unit_and_refuses_a_size_it_cannot_read() -> None:
    with cli_server("--memory-budget", "1MiB") as (location, _), flightq.connect(location) as c:
        c.create_partition("p", TEXT)
        with pytest.raises(flightq.ResourceExhaustedError, match="memory budget of 1048576 bytes"):
            c.put("p", ["big"], {"input_ids": [np.arange(300_000, dtype=np.int64)]}, timeout=1)
    bad = subprocess.run(
        [sys.executable, "-m", "flightq.cli", "serve", "--port", "0", "--memory-budget", "64Mo"],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=TIMEOUT,
    )
    assert bad.returncode == 2
    assert (
        "expected a size in bytes such as 67108864, 64MiB, 8GB or 1.5GiB, got '64Mo'" in bad.stderr
    )
