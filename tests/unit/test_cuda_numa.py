"""NUMA placement of a rank's staging memory, on sysfs trees the tests build.

The decision (which node, which CPUs, or why nothing) is checked on directory trees laid
out as Linux's sysfs; applying it to a real process is covered by the ranks benchmark's
test (``benchmarks/bench_ranks.py``), whose rank processes report their affinity.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from flightq.cuda.numa import gpu_node, node_cpus, nodes, parse_cpulist, place_on_gpu_node


def sysfs(root: Path, cpulists: list[str], gpus: dict[str, int]) -> Path:
    """A sysfs tree: one ``nodeN/cpulist`` per entry, a ``numa_node`` per PCI device."""
    for i, cpus in enumerate(cpulists):
        d = root / "devices" / "system" / "node" / f"node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (root / "devices" / "system" / "node" / "possible").parent.mkdir(parents=True, exist_ok=True)
    (root / "devices" / "system" / "node" / "possible").write_text("0\n")
    for pci, node in gpus.items():
        d = root / "bus" / "pci" / "devices" / pci
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, set[int]]] = []

    def __call__(self, pid: int, cpus: Any) -> None:
        self.calls.append((pid, set(cpus)))


def test_cpulists_parse_ranges_and_singles() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()


def test_nodes_cpus_and_a_gpus_node_are_read_from_the_tree(tmp_path: Path) -> None:
    root = sysfs(tmp_path, ["0-7", "8-15"], {"0000:19:00.0": 1, "0000:3b:00.0": -1})
    assert nodes(root) == [0, 1]  # 'possible' and other entries are not nodes
    assert node_cpus(1, root) == set(range(8, 16))
    assert node_cpus(5, root) == set()
    # nvidia-smi's 8-digit domain and upper case name the same device as sysfs
    assert gpu_node("00000000:19:00.0", root) == 1
    assert gpu_node("0000:19:00.0", root) == 1
    assert gpu_node("0000:3b:00.0", root) is None  # sysfs's -1: no node known
    assert gpu_node("0000:aa:00.0", root) is None
    assert gpu_node("not an address", root) is None


def test_one_node_is_a_no_op_that_says_why(tmp_path: Path) -> None:
    rec = Recorder()
    root = sysfs(tmp_path, ["0-15"], {"0000:00:06.0": -1})
    p = place_on_gpu_node("0000:00:06.0", root, setaffinity=rec)
    assert not p.applied and rec.calls == []
    assert "1 NUMA node(s)" in p.reason
    assert p.cpus == tuple(sorted(os.sched_getaffinity(0)))
    p = place_on_gpu_node("0000:00:06.0", tmp_path / "absent", setaffinity=rec)
    assert not p.applied and "no NUMA node" in p.reason and rec.calls == []


def test_several_nodes_pin_to_the_gpus_node_within_the_allowed_cpus(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    other = max(allowed) + 1  # a CPU this process may not use
    first = ",".join(str(c) for c in allowed[:1])
    rest = ",".join(str(c) for c in [*allowed[1:], other])
    root = sysfs(tmp_path, [first, rest], {"0000:19:00.0": 0, "0000:9a:00.0": 1})
    rec = Recorder()
    p = place_on_gpu_node("0000:19:00.0", root, setaffinity=rec)
    assert p.applied and p.node == 0 and p.cpus == tuple(allowed[:1])
    assert rec.calls == [(0, set(allowed[:1]))]
    p = place_on_gpu_node("0000:9a:00.0", root, setaffinity=rec)
    if len(allowed) > 1:
        assert p.applied and p.node == 1 and set(p.cpus) == set(allowed[1:])  # not `other`
    else:
        assert not p.applied and "none of node 1's CPUs" in p.reason
    rec.calls.clear()
    p = place_on_gpu_node("0000:77:00.0", root, setaffinity=rec)
    assert not p.applied and "not known" in p.reason and rec.calls == []
    p = place_on_gpu_node(None, root, setaffinity=rec)
    assert not p.applied and rec.calls == []


@pytest.mark.parametrize("bad", ["", "0-", "a"])
def test_a_malformed_cpulist_is_an_error_not_a_guess(bad: str) -> None:
    if bad == "":
        assert parse_cpulist(bad) == set()
        return
    with pytest.raises(ValueError):
        parse_cpulist(bad)
