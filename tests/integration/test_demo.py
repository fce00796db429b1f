"""`flightq demo` runs the W1 write-back pattern end to end and verifies every byte."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_three_processes_and_verifies_every_byte() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flightq.cli", "demo", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "generator step 0: 128 rows" in out
    assert "trainer   step 0: 128 rows" in out
    assert "1 steps in" in out and "every byte verified" in out
