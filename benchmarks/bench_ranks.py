"""``flightq bench --ranks``: trainer rank processes claiming from one real server.

Plain tests (no timing decides anything). On the CPU (``device="cpu"``) the orchestration
runs whole: a ``flightq serve`` process, rank processes claiming whole groups until the
step is drained, the check that every row was claimed exactly once, and each rank's NUMA
placement read from a sysfs tree the test builds (two nodes, each rank reporting the CPU
affinity it ended up with). With a CUDA device the same runs into ``cuda:i % count``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from flightq_bench.cli import main
from flightq_bench.rank import rank_device
from flightq_bench.ranks import _verify, run_ranks


def _two_node_sysfs(root: Path) -> tuple[Path, list[str], list[set[int]]]:
    """Two NUMA nodes splitting this process's CPUs, and a GPU on each."""
    allowed = sorted(os.sched_getaffinity(0))
    halves = [set(allowed[: len(allowed) // 2]), set(allowed[len(allowed) // 2 :])]
    pci = ["0000:19:00.0", "0000:9a:00.0"]
    for i, cpus in enumerate(halves):
        d = root / "devices" / "system" / "node" / f"node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(",".join(map(str, sorted(cpus))) + "\n")
        g = root / "bus" / "pci" / "devices" / pci[i]
        g.mkdir(parents=True)
        (g / "numa_node").write_text(f"{i}\n")
    return root, pci, halves


def test_ranks_is_each_row_once_and_each_rank_on_its_gpus_node(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to split into two NUMA nodes")
    root, pci, halves = _two_node_sysfs(tmp_path)
    doc = run_ranks([2], workload="W1", device="cpu", reps=1, steps=1, sysfs=str(root), pci=pci)
    assert [r["ranks"] for r in doc["rows"]] == [1, 2]  # one rank is added as the reference
    for r in doc["rows"]:
        assert r["gbps"]["median"] > 0 and r["vs_one"]["n"] == 1
        assert r["bytes"] == r["ranks"] * doc["step_bytes"]
        assert r["claims"] == r["ranks"] * 8  # W1: 8 groups per step, one group a claim
        assert r["server_cpu_s_per_gb"]["median"] >= 0
    for i, p in enumerate(doc["placements"]):
        assert p["applied"] and p["node"] == i % 2 and p["pci"] == pci[i % 2]
        assert set(p["cpus"]) == halves[i % 2]  # what the rank process read back


def test_a_single_node_host_leaves_the_ranks_alone(tmp_path: Path) -> None:
    d = tmp_path / "devices" / "system" / "node" / "node0"
    d.mkdir(parents=True)
    (d / "cpulist").write_text("0-1023\n")
    doc = run_ranks(
        [1], workload="W1", device="cpu", reps=1, steps=1, sysfs=str(tmp_path), pci=["0000:00:06.0"]
    )
    (p,) = doc["placements"]
    assert not p["applied"] and "1 NUMA node(s)" in p["reason"]
    assert tuple(p["cpus"]) == tuple(sorted(os.sched_getaffinity(0)))


def test_a_lost_or_twice_claimed_row_fails_the_run() -> None:
    want = {"a", "b", "c"}
    _verify([{"keys": ["a", "b"]}, {"keys": ["c"]}], want, "ok")
    with pytest.raises(AssertionError, match=r"1 row\(s\) lost .*'c'"):
        _verify([{"keys": ["a", "b"]}, {"keys": []}], want, "lost")
    with pytest.raises(AssertionError, match=r"1 claimed twice .*'b'"):
        _verify([{"keys": ["a", "b"]}, {"keys": ["b", "c"]}], want, "twice")


def test_rank_i_takes_gpu_i_mod_count() -> None:
    assert [rank_device(i, "cuda", 3) for i in range(5)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:0",
        "cuda:1",
    ]
    assert rank_device(7, "cpu", 0) is None
    with pytest.raises(ValueError, match="no CUDA device"):
        rank_device(0, "cuda", 0)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ranks", "0"], "--ranks takes counts"),
        (["--ranks", "two"], "--ranks takes counts"),
        (["--ranks", "2", "--workloads", "W3"], "--ranks runs W1, W1-bf16 or W2"),
        (["--ranks", "2", "--rank-steps", "0"], "--rank-steps must be at least 1"),
    ],
)
def test_bad_rank_options_are_refused(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", *argv]) == 2
    assert says in capsys.readouterr().err


def test_the_cli_writes_the_ranks_tables(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--ranks", "1", "--rank-steps", "1", "--reps", "1"]
    assert main([*argv, "--no-numa", "--out", str(out)]) == 0
    md = (out / "ranks.md").read_text()
    assert "| ranks | GPUs | aggregate GB/s" in md and "not pinned (--no-numa)" in md
    assert (out / "ranks.json").is_file()


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() == 0, reason="needs torch with a CUDA device")
def test_ranks_claim_into_their_devices() -> None:
    n = _cuda_count()
    doc = run_ranks([2], workload="W1-bf16", device="cuda", reps=1, steps=1)
    assert [p["device"] for p in doc["placements"]] == [f"cuda:{i % n}" for i in range(2)]
    assert doc["rows"][-1]["limit_gbps"] > 0 and doc["rows"][-1]["pinned_held_max"] > 0
