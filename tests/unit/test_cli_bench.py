"""``flightq bench`` runs the harness of a source checkout, and says how to get one."""

from __future__ import annotations

import subprocess
import sys

import flightq.cli


def test_bench_without_the_harness_says_where_it_lives(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(flightq.cli, "_BENCH_DIR", tmp_path / "benchmarks")
    assert flightq.cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "runs from a source checkout" in err and "make bench" in err


def test_bench_from_a_checkout_finds_its_harness():
    out = subprocess.run(
        [sys.executable, "-m", "flightq.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: flightq bench" in out.stdout and "--quick" in out.stdout
